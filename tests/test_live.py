"""Live recovery (``fault.recovery=shrink``, hpcnet.fault.live) under a fault-tolerant MPI (``scripts/ftmpirun``):
a rank killed -9 mid-run is left behind, the survivors go on in the same processes at the same global batch, and
the run ends as the uninterrupted one does, within rounding (the sums run over fewer ranks and larger slices).

Each job is 3 ranks on this host (the 2-host case is in tests/test_cluster_live.py); the fault kills the last rank
after step ``KILL_AT``'s update, in the first world only.  Skipped where set-up could not install the MPI.
"""

import json
import sys

import pytest
from mpi4py import MPI

from tests.helpers.live import EVERY, KILL_AT, STEPS, assert_close, final_tensors, ftmpi, run_job, summary, train_args

pytestmark = [pytest.mark.launch, pytest.mark.timeout(240),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own jobs; serial pass")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hpcnet.data.synthetic import generate_images

    path = tmp_path_factory.mktemp("live-data") / "tiny.h5"
    generate_images(path, num_train=384, num_eval=24, shape=(1, 8, 8), num_classes=4, seed=11)
    return path


@pytest.fixture(scope="module")
def ft():
    return ftmpi()


@pytest.fixture(scope="module")
def reference(ft, data, tmp_path_factory):
    """The uninterrupted run on 3 ranks: what every shrunk run must end as."""
    tmp = tmp_path_factory.mktemp("live-reference")
    out = run_job([ft, "-np", "3"], train_args(data, tmp / "runs", "ref"), tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary(tmp / "runs", "ref")["recovery"]["mode"] == "shrink"
    return final_tensors(tmp / "runs", "ref")


def assert_shrunk(out, recovery, zero):
    """The job lost rank 2 at step ``KILL_AT`` and its 2 survivors went on: stage 0 from their memory at the step
    it reached; stages 2 and 3, whose lost rank took its shards, from the newest checkpoint (step 4), read
    in-process at 2 ranks."""
    assert f"fault injection: rank 2 kills itself (SIGKILL) at step {KILL_AT}" in out.stderr
    assert recovery["mode"] == "shrink" and recovery["mpi"]["active"], recovery
    [record] = recovery["recoveries"]
    from_memory = zero == 0
    assert record["lost"][0]["rank"] == 2 and record["world_size"] == 2 and record["step"] == KILL_AT, record
    assert record["state"] == ("memory" if from_memory else "checkpoint"), record
    assert record["resumed_step"] == (KILL_AT if from_memory else EVERY), record
    assert record["recomputed_steps"] == (0 if from_memory else KILL_AT - EVERY), record
    assert f"lost rank 2 ({record['lost'][0]['host']}) at step {KILL_AT}: the 2 survivors shrank the job" in out.stderr
    assert "global batch 24 kept" in out.stderr


# Stages 0 and 3 shrink the same way in the replacement test below, before the replacement joins.
@pytest.mark.parametrize("zero", [2])
def test_a_killed_rank_is_left_behind_and_the_survivors_end_as_the_uninterrupted_run(ft, data, reference,
                                                                                    tmp_path, zero):
    """No relaunch, status 0, the next saves commit and verify on the shrunk job, which ends at 2 ranks as the
    uninterrupted run (``assert_shrunk``)."""
    runs = tmp_path / "runs"
    out = run_job([ft, "-np", "3"], train_args(data, runs, "kill", f"dist.zero={zero}",
                                                  f"fault.kill_at_step={KILL_AT}", "fault.only_attempt=1"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_shrunk(out, summary(runs, "kill")["recovery"], zero)
    assert_close(final_tensors(runs, "kill"), reference)
    summary_steps = summary(runs, "kill")
    assert summary_steps["steps"] == STEPS and summary_steps["world_size"] == 2


def test_a_loss_after_the_last_step_s_update_still_ends_with_the_last_step_saved(ft, data, reference, tmp_path):
    """Stage 0, the last rank killed after step 12's update, before its checkpoint: the survivors hold step 12 in
    memory and save it, though no step is left to train."""
    runs = tmp_path / "runs"
    out = run_job([ft, "-np", "3"], train_args(data, runs, "last", f"fault.kill_at_step={STEPS}",
                                                  "fault.only_attempt=1"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    [record] = summary(runs, "last")["recovery"]["recoveries"]
    assert (record["step"], record["resumed_step"], record["state"]) == (STEPS, STEPS, "memory"), record
    assert_close(final_tensors(runs, "last"), reference)  # final_tensors reads the newest checkpoint: step 12


@pytest.mark.parametrize("zero", [0, 2])
def test_three_losses_in_a_row_leave_one_rank_that_ends_as_the_uninterrupted_run(ft, data, reference, tmp_path, zero):
    """4 ranks of 6 samples (the reference's global batch of 24) lose a rank after steps 3, 7 and 11
    (fault.kill_every_steps); the last survivor trains the whole global batch: no hang, no relaunch, the same
    model within the bound. Each time the survivors go on from the step they reached: stage 0 from their memory,
    stage 2 from the mirrors (fault.replicas=1: the lost rank's shards from its keeper, rank 0; the checkpoint path
    at stage 2 is the single loss's above), nothing computed again.

    At stage 0 the one lost is rank 0 each time, and replacements are started after each loss that are not called
    in before the run ends (fault.grow_after_steps=10): the rank 0 that started them is the next one lost, and the
    next survivor tells them to leave (one whose first message never reached rank 0 waited for good, and the job
    with it). Under the supervisor: Open MPI's launcher ends with 1 when a replacement leaves without
    MPI_Finalize, and the run's summary decides."""
    runs = tmp_path / "runs"
    launcher = [ft, "-np", "4"]
    extra = [f"fault.replicas={int(zero > 0)}"]
    if not zero:
        launcher = [sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", "--standby", "off", "--", *launcher]
        extra += ["fault.rank=0", "fault.grow=spawn", "fault.grow_after_steps=10"]
    out = run_job(launcher, [*train_args(data, runs, "series", f"dist.zero={zero}", "train.batch_size=6",
                                         "fault.kill_at_step=3", "fault.kill_every_steps=4", *extra)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    [done] = runs.glob("series-*/summary.json") if zero else runs.glob("series-*/attempt-*/summary.json")  # one attempt
    done = json.loads(done.read_text())
    recovery = done["recovery"]
    records = recovery["recoveries"]
    lost = [0, 0, 0] if not zero else [3, 2, 1]
    assert [(r["step"], r["world_size"], r["lost"][0]["rank"]) for r in records] == list(zip((3, 7, 11), (3, 2, 1),
                                                                                             lost))
    assert [(r["resumed_step"], r["recomputed_steps"], r["state"]) for r in records] == [
        (step, 0, "mirror" if zero else "memory") for step in (3, 7, 11)], records
    assert "the survivor shrank the job" in out.stderr and "global batch 24 kept" in out.stderr
    if zero:
        assert "training goes on at step 3 from the mirrors, global batch 24 kept" in out.stderr
        assert [w["keepers"] for w in recovery["mirror"]["worlds"]] == [[1, 2, 3, 0], [1, 2, 0], [1, 0]]
        assert "resume: reading" not in out.stderr
    else:
        assert "1 replacement(s) started after step 4" in out.stderr and "2 replacement(s) started after step 8" \
            in out.stderr and recovery["grows"] == []
    assert done["steps"] == STEPS
    assert_close(final_tensors(runs, "series"), reference)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_replacement_joins_the_running_job_and_the_run_ends_as_the_uninterrupted_one(ft, data, reference, tmp_path,
                                                                                       zero):
    """Killed after step 7, the 2 survivors go on (``assert_shrunk``: stage 0 from step 7, stage 3 from the step-4
    checkpoint) and start a replacement at the next boundary (fault.grow=spawn); it joins 2 steps later
    (fault.grow_after_steps=2) with its state handed over from the survivors' memory, never from disk, and the 3
    ranks end as the uninterrupted run. Status 0, no relaunch."""
    runs = tmp_path / "runs"
    out = run_job([ft, "-np", "3"], train_args(data, runs, "grow", f"dist.zero={zero}", f"fault.kill_at_step={KILL_AT}",
                                               "fault.only_attempt=1", "fault.grow=spawn", "fault.grow_after_steps=2"),
                  tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    recovery = summary(runs, "grow")["recovery"]
    assert_shrunk(out, recovery, zero)
    [grow] = recovery["grows"]
    resumed = KILL_AT if zero == 0 else EVERY
    assert (grow["joined"], grow["from_world_size"], grow["world_size"]) == (1, 2, 3), grow
    assert (grow["started_after_step"], grow["step"], grow["resumed_step"]) == (resumed + 1, resumed + 3,
                                                                                resumed + 3), grow
    assert grow["pause_s"] > 0 and grow["spawn_s"] > 0 and grow["ready_s"] > 0, grow
    assert "1 replacement(s) joined after step" in out.stderr and "the job is back to 3 ranks" in out.stderr
    assert zero or "resume: reading" not in out.stderr  # stage 0: the shrink and the grow from memory
    assert summary(runs, "grow")["world_size"] == 3
    assert_close(final_tensors(runs, "grow"), reference)


def test_replacements_that_are_killed_in_turn_keep_the_job_at_its_size(ft, data, reference, tmp_path):
    """Stage 2, 3 ranks under hpcnet.launch: the last rank is killed after steps 3, 6, 9 and 12 (each time before
    that step's checkpoint); each time the 2 survivors go on from the step before, start a replacement after their
    first step, and it (the last rank then) joins 1 step later with the sharded state handed over. One attempt,
    status 0 (Open MPI's launcher ends with 137 once a replacement it spawned was killed: the run's summary
    decides), the uninterrupted model."""
    runs = tmp_path / "runs"
    launch = [sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", "--standby", "off", "--", ft, "-np", "3"]
    out = run_job(launch, train_args(data, runs, "turns", "dist.zero=2", "fault.kill_at_step=3",
                                     "fault.kill_every_steps=3", "fault.grow=spawn", "fault.grow_after_steps=1",
                                     "checkpoint.every_steps=1"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = runs.glob("turns-*/attempt-*/summary.json")  # one attempt
    recovery = json.loads(run.read_text())["recovery"]
    assert [(r["step"], r["resumed_step"], r["world_size"]) for r in recovery["recoveries"]] == [
        (3, 2, 2), (6, 5, 2), (9, 8, 2), (12, 11, 2)], recovery
    assert [(g["step"], g["world_size"]) for g in recovery["grows"]] == [(4, 3), (7, 3), (10, 3)], recovery
    assert_close(final_tensors(runs, "turns"), reference)


def test_a_checkpoint_the_shrunk_job_wrote_resumes_at_another_size_under_the_system_mpi(ft, data, reference,
                                                                                        tmp_path):
    """Killed at step 7 of 8, the survivors commit step 8 at 2 ranks; the system's Open MPI resumes it at 3 ranks
    (restart mode) and ends as the uninterrupted run at the same global batch."""
    runs = tmp_path / "runs"
    first = run_job([ft, "-np", "3"], train_args(data, runs, "grow", "train.steps=8",
                                                    f"fault.kill_at_step={KILL_AT}", "fault.only_attempt=1"),
                    tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert summary(runs, "grow")["world_size"] == 2
    second = run_job(["mpirun", "-np", "3"], [*train_args(data, runs, "grow"), "--resume", "auto"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 8 (saved by 2 rank(s))" in second.stderr, second.stderr
    assert summary(runs, "grow")["recovery"]["mode"] == "restart"
    assert_close(final_tensors(runs, "grow"), reference)


def test_recovery_shrink_under_the_system_mpi_is_an_error_naming_the_option_on_every_rank(data, tmp_path):
    out = run_job(["mpirun", "-np", "2"], train_args(data, tmp_path / "runs", "x", "fault.recovery=shrink"),
                  tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "fault.recovery=shrink" in out.stderr and "scripts/ftmpirun" in out.stderr
    assert "Traceback" not in out.stderr
