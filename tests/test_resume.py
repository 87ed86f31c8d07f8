"""Checkpoints in the training loop: exact resume, resume at another world size, preemption."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcnet.errors import ExitCode
from hpcnet.train import run
from tests.helpers.data import shared_data_dir, tiny_images
from tests.helpers.launch import ROOT, clean_env
from tests.helpers.train import StopAfter, train_config


def _dataset(comm, tmp):
    return tiny_images(comm, tmp, "resume-images.h5", num_train=320, num_eval=32, seed=7)


def _cfg(tmp, dataset, name, *extra):
    return train_config(tmp, dataset, name, "run.name=resume", "train.steps=20", "checkpoint.every_steps=10", *extra)


def _state(result):
    params = [p.detach().clone() for p in result.model.parameters()]
    buffers = [b.detach().clone() for b in result.model.buffers()]
    opt = [t.clone() for s in result.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return params, buffers, opt


MODELS = {
    "resnet-sgd": ["model.name=resnet_tiny", "model.options.width=4", "optim.name=sgd"],
    "mlp-dropout-adamw": ["model.name=mlp", "model.options.hidden=[32]", "model.options.dropout=0.2",
                          "optim.name=adamw", "optim.lr=0.003"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("model", sorted(MODELS))
def test_stop_and_resume_is_bit_identical(comm, data_plane, mpi_tmp_path, model):
    dataset = _dataset(comm, mpi_tmp_path)
    straight = run(_cfg(mpi_tmp_path, dataset, f"straight-{model}", *MODELS[model]), comm, plane=data_plane)
    first = run(_cfg(mpi_tmp_path, dataset, f"split-{model}", *MODELS[model]), comm, plane=data_plane,
                stop=StopAfter(10))
    assert first.summary["steps"] == 10 and first.exit_code == ExitCode.PREEMPTED
    second = run(_cfg(mpi_tmp_path, dataset, f"split-{model}", *MODELS[model], "checkpoint.resume=auto"), comm,
                 plane=data_plane)
    assert second.summary["start_step"] == 10 and second.summary["steps"] == 20
    for a, b in zip(_state(straight), _state(second)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y)  # bit-identical, not merely close
    comm.Barrier()


@pytest.mark.mpi
def test_int8_error_feedback_resumes_bit_identical(comm, data_plane, mpi_tmp_path, monkeypatch):
    """dist.compression=int8 between (virtual) nodes: each rank's residuals go into the checkpoint and come back,
    so the resumed run is bit-identical to the straight one; a resume that lost them would not be."""
    from hpcnet.comm.quantize import ErrorFeedback
    from tests.helpers.comm import even_nodes

    monkeypatch.setenv("HPCNET_RANKS_PER_NODE", even_nodes(comm)["HPCNET_RANKS_PER_NODE"])
    dataset = _dataset(comm, mpi_tmp_path)
    extra = [*MODELS["mlp-dropout-adamw"], "dist.compression=int8", "dist.bucket_mb=0.004",
             "dist.first_bucket_mb=0.002"]
    straight = run(_cfg(mpi_tmp_path, dataset, "straight-int8", *extra), comm, plane=data_plane)
    nodes = comm.Get_size() // int(even_nodes(comm)["HPCNET_RANKS_PER_NODE"])
    assert straight.summary["comm"]["backend"] == ("hierarchical-mpi+gloo" if nodes > 1 else "mpi")
    first = run(_cfg(mpi_tmp_path, dataset, "split-int8", *extra), comm, plane=data_plane, stop=StopAfter(10))
    assert first.summary["steps"] == 10
    for name, drop in [("lost-int8", True), ("split-int8", False)]:
        with monkeypatch.context() as patch:
            if drop:  # the same checkpoint (the newest in split-int8's directory), its residuals left out
                patch.setattr(ErrorFeedback, "load_entries", lambda self, saved: self.clear())
            resume = f"checkpoint.resume={mpi_tmp_path / 'ckpt' / 'split-int8'}" if drop else "checkpoint.resume=auto"
            second = run(_cfg(mpi_tmp_path, dataset, name, *extra, resume), comm, plane=data_plane)
        assert second.summary["start_step"] == 10 and second.summary["steps"] == 20
        same = all(torch.equal(x, y) for a, b in zip(_state(straight), _state(second)) for x, y in zip(a, b))
        assert same == (not drop or nodes == 1)
    comm.Barrier()


@pytest.mark.mpi
def test_a_stop_at_the_last_step_is_a_finished_run(comm, data_plane, mpi_tmp_path):
    """Stopped after the last step, the run saved it and has nothing left to train: status 0, not 76 (a requeue
    would only find nothing to train); a stop one step sooner is a preemption."""
    dataset = _dataset(comm, mpi_tmp_path)
    extra = [*MODELS["mlp-dropout-adamw"][:2], "train.steps=6", "checkpoint.every_steps=0", "checkpoint.at_end=false"]
    last = run(_cfg(mpi_tmp_path, dataset, "stop-last", *extra), comm, plane=data_plane, stop=StopAfter(6))
    assert last.summary["steps"] == 6 and last.summary["stopped_by_signal"] == signal.SIGUSR2
    assert last.exit_code == ExitCode.OK
    sooner = run(_cfg(mpi_tmp_path, dataset, "stop-sooner", *extra), comm, plane=data_plane, stop=StopAfter(5))
    assert sooner.summary["steps"] == 5 and sooner.exit_code == ExitCode.PREEMPTED
    if comm.Get_rank() == 0:
        for name, step in (("stop-last", 6), ("stop-sooner", 5)):  # each saved where it stopped
            assert sorted(p.name for p in (mpi_tmp_path / "ckpt" / name).glob("ckpt-*.h5")) == [f"ckpt-{step:010d}.h5"]


@pytest.mark.mpi
def test_a_resume_with_nothing_to_train_writes_a_summary_strict_json_readers_take(comm, data_plane, mpi_tmp_path):
    """Issue 27, item 13: its final loss is not a number, which json.dumps wrote as a bare NaN."""
    dataset = _dataset(comm, mpi_tmp_path)
    cfg = _cfg(mpi_tmp_path, dataset, "nothing-to-train", "train.steps=10")
    assert run(cfg, comm, plane=data_plane).summary["steps"] == 10
    again = run(_cfg(mpi_tmp_path, dataset, "nothing-to-train", "train.steps=10", "checkpoint.resume=auto"), comm,
                plane=data_plane)
    assert again.summary["start_step"] == again.summary["steps"] == 10
    comm.Barrier()

    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    summary = json.loads((Path(cfg.run.dir) / "summary.json").read_text(), parse_constant=reject)
    assert summary["final_loss"] is None and summary["steps"] == 10
    assert "nothing to train" in (Path(cfg.run.dir) / "rank0.log").read_text()  # rank 0 says so
    comm.Barrier()


@pytest.mark.mpi
def test_resume_on_one_rank_what_n_ranks_saved(comm, data_plane, mpi_tmp_path):
    """N ranks save at step 10; every rank alone (batch N*B) resumes and matches the N-rank run."""
    size, rank = comm.Get_size(), comm.Get_rank()
    dataset = _dataset(comm, mpi_tmp_path)
    extra = MODELS["mlp-dropout-adamw"][:2] + ["optim.name=sgd"]
    straight = run(_cfg(mpi_tmp_path, dataset, "reshard-straight", *extra), comm, plane=data_plane)
    run(_cfg(mpi_tmp_path, dataset, "reshard", *extra, "train.steps=20"), comm, plane=data_plane, stop=StopAfter(10))
    comm.Barrier()
    alone = run(_cfg(mpi_tmp_path, dataset, "reshard", *extra, f"train.batch_size={4 * size}",
                     "checkpoint.resume=auto", f"run.dir={mpi_tmp_path / 'runs' / f'alone{rank}'}",
                     "checkpoint.at_end=false", "checkpoint.every_steps=0"), MPI.COMM_SELF)
    assert alone.summary["start_step"] == 10
    for x, y in zip(_state(straight)[0], _state(alone)[0]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    comm.Barrier()


@pytest.mark.mpi
def test_bad_resume_path_fails_on_every_rank(comm, data_plane, mpi_tmp_path):
    from hpcnet.errors import UsageError

    dataset = _dataset(comm, mpi_tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        run(_cfg(mpi_tmp_path, dataset, "bad", "model.name=mlp", f"checkpoint.resume={mpi_tmp_path}/nope.h5"),
            comm, plane=data_plane)
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_rng_state_that_fails_to_restore_on_one_rank_stops_every_rank(comm, data_plane, mpi_tmp_path, monkeypatch):
    """Each rank restores its own RNG state: a failure there is shared, not a hang of the others."""
    from hpcnet.ckpt import state as trainstate

    dataset = _dataset(comm, mpi_tmp_path)
    run(_cfg(mpi_tmp_path, dataset, "rng", "model.name=mlp", "train.steps=10"), comm, plane=data_plane)
    last = comm.Get_size() - 1

    def broken(state):
        if comm.Get_rank() == last:
            raise ValueError(f"rank {last}: RNG state of another torch build")

    monkeypatch.setattr(trainstate, "set_rng_state", broken)
    with pytest.raises(Exception, match=f"rank {last}: RNG state of another torch build"):
        run(_cfg(mpi_tmp_path, dataset, "rng", "model.name=mlp", "checkpoint.resume=auto"), comm, plane=data_plane)
    comm.Barrier()


@pytest.mark.launch
def test_sigterm_saves_then_resume_continues(tmp_path):
    common = [f"data.dir={shared_data_dir(tmp_path)}", f"run.dir={tmp_path / 'runs'}", "model.name=mlp",
              "train.batch_size=16", "train.eval_every=0", "run.log_every=1", "run.metrics=all",
              "checkpoint.every_s=0", "checkpoint.every_steps=0"]
    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", *common]
    proc = subprocess.Popen([*cmd, "train.steps=100000"], env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not list((tmp_path / "runs").glob("*/metrics.rank0.jsonl")):
            time.sleep(0.5)
        time.sleep(1.0)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(ranks[0]), signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, err
    saved = int(next(line for line in err.splitlines() if "checkpoint at step" in line).split("step ")[1].split(":")[0])
    committed = list((tmp_path / "runs" / "hpcnet.ckpt").glob("*.h5"))
    assert committed, err
    out = subprocess.run([*cmd, f"train.steps={saved + 3}", "--resume", "auto"], env=clean_env(),
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"at step {saved}" in out.stderr and f"step {saved + 3}/{saved + 3}" in out.stderr
    summary = json.loads(sorted((tmp_path / "runs").glob("hpcnet-*/summary.json"))[-1].read_text())
    assert (summary["start_step"], summary["steps"]) == (saved, saved + 3)


# --- sequences of runs into one checkpoint directory, as a user types them (issue 9) ---------

def _run_args(tmp_path, *extra):
    return [f"data.dir={shared_data_dir(tmp_path)}", f"run.dir={tmp_path / 'runs'}", "run.name=x", "model.name=mlp",
            "model.options.hidden=[32]", "train.batch_size=8", "train.eval_every=0", "checkpoint.every_s=0",
            "checkpoint.every_steps=10", "checkpoint.full_every=1", "checkpoint.keep=3", "dist.probe=false", *extra]


def _ckpts(directory):
    return sorted(p.name for p in directory.glob("ckpt-*.h5"))


def _used(comm, plane, tmp, dataset, name):
    """A run of 12 steps in ``tmp/ckpt/name`` with checkpoints at 8, 10 and 12 (every 2, keep 3)."""
    run(_cfg(tmp, dataset, name, "model.name=mlp", "train.steps=12", "checkpoint.every_steps=2",
             "checkpoint.full_every=1", "checkpoint.keep=3"), comm, plane=plane)
    comm.Barrier()
    return tmp / "ckpt" / name


@pytest.mark.mpi
def test_a_fresh_run_into_a_used_checkpoint_directory_refuses_and_loses_nothing(comm, data_plane, mpi_tmp_path):
    from hpcnet.errors import UsageError

    dataset = _dataset(comm, mpi_tmp_path)
    directory = _used(comm, data_plane, mpi_tmp_path, dataset, "used")
    used = ["ckpt-0000000008.h5", "ckpt-0000000010.h5", "ckpt-0000000012.h5"]
    assert _ckpts(directory) == used
    with pytest.raises(UsageError) as refused:  # no checkpoint.resume
        run(_cfg(mpi_tmp_path, dataset, "used", "model.name=mlp", "train.steps=6"), comm, plane=data_plane)
    for words in (str(directory), "step 12", "--resume auto", "run.name", "checkpoint.move_aside=true"):
        assert words in str(refused.value)
    comm.Barrier()
    assert _ckpts(directory) == used
    assert (directory / "latest").read_text().strip() == "ckpt-0000000012.h5"
    comm.Barrier()
    run(_cfg(mpi_tmp_path, dataset, "used", "model.name=mlp", "train.steps=6", "checkpoint.every_steps=2",
             "checkpoint.full_every=1", "checkpoint.move_aside=true"), comm, plane=data_plane)
    comm.Barrier()
    assert _ckpts(directory) == ["ckpt-0000000002.h5", "ckpt-0000000004.h5", "ckpt-0000000006.h5"]
    assert (directory / "latest").read_text().strip() == "ckpt-0000000006.h5"
    (aside,) = directory.glob("aside-*-fresh-run")
    assert _ckpts(aside) == used
    comm.Barrier()


@pytest.mark.mpi
def test_a_rollback_sticks_and_resume_auto_goes_by_commit_order(comm, data_plane, mpi_tmp_path):
    dataset = _dataset(comm, mpi_tmp_path)
    directory = _used(comm, data_plane, mpi_tmp_path, dataset, "rollback")  # checkpoints at 8, 10 and 12
    args = ["model.name=mlp", "checkpoint.every_steps=2", "checkpoint.full_every=1", "checkpoint.keep=10"]
    back = run(_cfg(mpi_tmp_path, dataset, "rollback", *args, "train.steps=10",
                    f"checkpoint.resume={directory / 'ckpt-0000000008.h5'}"), comm, plane=data_plane)
    assert back.summary["start_step"] == 8
    comm.Barrier()
    (aside,) = directory.glob("aside-*-rollback-to-step-8")  # the abandoned 10 and 12, out of resume auto's way
    assert _ckpts(aside) == ["ckpt-0000000010.h5", "ckpt-0000000012.h5"]
    on = run(_cfg(mpi_tmp_path, dataset, "rollback", *args, "train.steps=11", "checkpoint.resume=auto"), comm,
             plane=data_plane)
    assert on.summary["start_step"] == 10  # the rolled-back run's 10, not the abandoned 12
    comm.Barrier()
    assert _ckpts(directory)[-1] == "ckpt-0000000011.h5"
    comm.Barrier()


@pytest.mark.mpi
def test_resume_auto_with_every_checkpoint_damaged_stops_and_lists_them(comm, data_plane, mpi_tmp_path):
    from hpcnet.ckpt.damage import corrupt_newest
    from hpcnet.errors import UsageError

    dataset = _dataset(comm, mpi_tmp_path)
    run(_cfg(mpi_tmp_path, dataset, "damaged", "model.name=mlp", "checkpoint.full_every=1"), comm, plane=data_plane)
    directory = mpi_tmp_path / "ckpt" / "damaged"
    comm.Barrier()
    if comm.Get_rank() == 0:
        corrupt_newest(directory)  # step 20
        newest = directory / "ckpt-0000000010.h5"
        newest.write_bytes(newest.read_bytes()[:4096])  # step 10: cut short
    comm.Barrier()
    with pytest.raises(UsageError) as refused:
        run(_cfg(mpi_tmp_path, dataset, "damaged", "model.name=mlp", "train.steps=30", "checkpoint.resume=auto"),
            comm, plane=data_plane)
    message = str(refused.value)
    assert "none of the 2 committed checkpoint(s)" in message
    assert "ckpt-0000000020.h5 (step 20): dataset /tensors/" in message and "checksum mismatch" in message
    assert "ckpt-0000000010.h5 (step 10)" in message and "truncated" in message
    comm.Barrier()


@pytest.mark.mpi
# ENOSPC takes EDQUOT's path (tests/ckpt cover both errnos' statuses; fault.fill_disk_at_step a real full disk).
@pytest.mark.parametrize("code, status", [("EDQUOT", ExitCode.USAGE_ERROR), ("EIO", ExitCode.RESTARTABLE)])
def test_an_error_inside_the_checkpoint_write_gives_its_documented_status(comm, data_plane, mpi_tmp_path, code,
                                                                          status):
    from hpcnet.errors import exit_code_of

    dataset = _dataset(comm, mpi_tmp_path)
    with pytest.raises(Exception) as failed:
        run(_cfg(mpi_tmp_path, dataset, code, "model.name=mlp", "train.steps=30", f"fault.write_error={code}",
                 "fault.write_error_at_step=20", "checkpoint.full_every=1"), comm, plane=data_plane)
    assert exit_code_of(failed.value) == status, failed.value
    assert re.search(r"ckpt-0000000020\.h5\.[0-9a-f]{16}\.tmp", str(failed.value))
    assert os.strerror(getattr(__import__("errno"), code)) in str(failed.value)
    comm.Barrier()
    assert _ckpts(mpi_tmp_path / "ckpt" / code) == ["ckpt-0000000010.h5"]
    comm.Barrier()


@pytest.mark.launch
def test_an_io_error_in_a_save_is_restarted_by_the_supervisor(tmp_path):
    cmd = [sys.executable, "-m", "hpcnet.launch", "--max-restarts", "1", "--backoff-s", "0", "--standby", "off", "--",
           "mpirun", "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
           *_run_args(tmp_path, "train.steps=30", "fault.write_error=EIO", "fault.write_error_at_step=20",
                      "fault.only_attempt=1")]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "attempt 1 ended with status 75" in out.stderr and "Input/output error" in out.stderr
    assert "ckpt-0000000010.h5 at step 10" in out.stderr


@pytest.mark.launch
def test_the_default_command_twice_continues_and_loses_nothing(tmp_path):
    """scripts/train.sh (the README's default) run twice, the second time for more steps: the second run continues
    the first. (The same command again has nothing left to train:
    test_a_resume_with_nothing_to_train_writes_a_summary_strict_json_readers_take.)"""
    args = [f"run.dir={tmp_path / 'runs'}", f"data.dir={shared_data_dir(tmp_path)}", "train.steps=8",
            "train.eval_every=0", "model.name=mlp", "checkpoint.every_s=0", "dist.probe=false"]
    env = clean_env(HPCNET_VENV=str(Path(sys.executable).parents[1]))
    first = subprocess.run([ROOT / "scripts" / "train.sh", *args], env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    directory = tmp_path / "runs" / "hpcnet.ckpt"
    assert _ckpts(directory) == ["ckpt-0000000008.h5"]
    longer = subprocess.run([ROOT / "scripts" / "train.sh", *args[:2], "train.steps=12", *args[3:]], env=env,
                            capture_output=True, text=True, timeout=300)
    assert longer.returncode == 0, longer.stderr
    assert "at step 8" in longer.stderr and "step 12/12" in longer.stderr
    assert _ckpts(directory) == ["ckpt-0000000008.h5", "ckpt-0000000012.h5"]


@pytest.mark.launch
def test_a_node_local_checkpoint_directory_is_an_error_not_a_fresh_start(tmp_path):
    """Each rank in its own mount namespace with its own tmpfs there: what node-local /tmp looks like."""
    import shutil

    local = tmp_path / "node-local"
    local.mkdir()
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", str(local)],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"needs unshare and mount (root): {probe.stderr.strip() if probe else 'no unshare'}")
    train = " ".join([sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
                      *_run_args(tmp_path, "train.steps=10", f"checkpoint.dir={local}")])
    cmd = ["mpirun", "-np", "2", "unshare", "-m", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs tmpfs {local} && exec {train}"]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == ExitCode.USAGE_ERROR, out.stderr
    assert "is not the directory rank 0 writes to" in out.stderr and "ranks [1]" in out.stderr
@pytest.mark.mpi
@pytest.mark.parametrize("direction", ["more", "fewer"])
def test_resume_at_another_world_size(comm, mpi_tmp_path, direction):
    """N-1 ranks save and N resume ("more"), or N save and N-1 resume ("fewer"): the saved position is no whole
    number of the new global batches, the epoch goes on from it, and its tail is dropped where the new grid runs
    out (seen in the epoch each step logs)."""
    from hpcnet.data.sampler import GlobalBatchSampler

    size = comm.Get_size()
    if size < (2 if direction == "more" else 3):
        pytest.skip(f"{direction} ranks than saved needs {'2' if direction == 'more' else '3'} ranks or more "
                    "(a position that is no whole number of one rank's batches cannot be)")
    fewer = comm.Split(0 if comm.Get_rank() < size - 1 else MPI.UNDEFINED)
    saving, resuming = (fewer, comm) if direction == "more" else (comm, fewer)
    saved_ranks, resumed_ranks = (size - 1, size) if direction == "more" else (size, size - 1)
    dataset = tiny_images(comm, mpi_tmp_path, "reshard.h5", num_train=211, num_eval=16, seed=3)
    # MPI alone, between nodes too (dist.inter_node=primary): torch.distributed, which the session's data_plane
    # holds for the whole comm, is not started again on a sub-communicator.
    common = ["model.name=mlp", "model.options.hidden=[16]", "train.batch_size=8", "run.log_every=1",
              "checkpoint.every_steps=0", "dist.backend=mpi", "dist.fallback=none", "dist.inter_node=primary"]
    position = 5 * 8 * saved_ranks
    assert position % (8 * resumed_ranks)  # the case the old sampler refused
    resumed_steps = (211 - position) // (8 * resumed_ranks) + 1  # the epoch's last whole batch, then the next's first
    if saving != MPI.COMM_NULL:
        run(train_config(mpi_tmp_path, dataset, "first", *common, "train.steps=5",
                         f"checkpoint.dir={mpi_tmp_path / 'ckpt'}"), saving)
    comm.Barrier()
    if resuming != MPI.COMM_NULL:
        second = run(train_config(mpi_tmp_path, dataset, "second", *common, f"train.steps={5 + resumed_steps}",
                                  f"checkpoint.dir={mpi_tmp_path / 'ckpt'}", "checkpoint.resume=auto"), resuming)
        assert (second.summary["start_step"], second.summary["steps"], second.summary["world_size"]) == (
            5, 5 + resumed_steps, resumed_ranks)
    comm.Barrier()
    if fewer != MPI.COMM_NULL:
        fewer.Free()
    if comm.Get_rank() != 0:
        return
    logged = [json.loads(line) for line in
              (mpi_tmp_path / "runs" / "second" / "metrics.rank0.jsonl").read_text().splitlines()]
    sampler = GlobalBatchSampler(211, 8, rank=0, world_size=resumed_ranks)
    sampler.load_state_dict({"epoch": 0, "samples_consumed_in_epoch": position, "seed": 0})
    expected = []
    for _ in range(resumed_steps):
        sampler.next_indices()
        expected.append(sampler.epoch)
    assert [r["epoch"] for r in logged if "loss" in r] == expected
    assert expected[0] == 0 and expected[-1] == 1  # the resumed epoch ran out, the next one began


@pytest.mark.mpi
def test_a_torch_schedule_goes_on_from_its_saved_state_at_another_world_size_and_stage(comm, mpi_tmp_path):
    """StepLR computes each rate from the group's last one: saved by one rank fewer at dist.zero=1 (stopped
    after step 8, as a signal stops a run: it saves that step), resumed by every rank at dist.zero=2, the run's
    rates are the uninterrupted run's, taken from the checkpoint (no warning of a replay), though the optimizer is
    sharded otherwise. After kill -9: tests/comm/test_zero_optimizers.py's Muon run, whose schedule is StepLR
    too."""
    from hpcnet.config import OptimConfig
    from hpcnet.optim import Schedule

    if comm.Get_size() < 2:
        pytest.skip("saved by one rank fewer than resume it: needs 2 ranks or more")
    dataset = tiny_images(comm, mpi_tmp_path, "schedule.h5", num_train=96, num_eval=16, seed=3)
    schedule = ["optim.name=adamw", "optim.lr=0.01", "optim.schedule=StepLR", "optim.schedule_options.step_size=3",
                "optim.schedule_options.gamma=0.5"]
    # MPI alone (dist.inter_node=primary too): torch.distributed, which the session's data_plane holds for the
    # whole comm, is not started again on a sub-communicator.
    common = ["model.name=mlp", "model.options.hidden=[16]", "run.log_every=1", "checkpoint.every_steps=5",
              "checkpoint.at_end=false", "train.steps=12", f"checkpoint.dir={mpi_tmp_path / 'ckpt'}",
              "dist.backend=mpi", "dist.fallback=none", "dist.inter_node=primary", *schedule]
    fewer = comm.Split(0 if comm.Get_rank() < comm.Get_size() - 1 else MPI.UNDEFINED)
    if fewer != MPI.COMM_NULL:
        run(train_config(mpi_tmp_path, dataset, "first", *common, "dist.zero=1"), fewer, stop=StopAfter(8))
        fewer.Free()
    comm.Barrier()
    second = run(train_config(mpi_tmp_path, dataset, "second", *common, "dist.zero=2", "checkpoint.resume=auto"),
                 comm)
    assert second.summary["start_step"] == 8
    comm.Barrier()
    if comm.Get_rank() != 0:
        return
    assert "optim.schedule:" not in (mpi_tmp_path / "runs" / "second" / "rank0.log").read_text()
    logged = [json.loads(line) for line in
              (mpi_tmp_path / "runs" / "second" / "metrics.rank0.jsonl").read_text().splitlines()]
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.01)
    straight = Schedule(optimizer, OptimConfig(name="adamw", lr=0.01, schedule="StepLR",
                                               schedule_options={"step_size": 3, "gamma": 0.5}), 12)
    expected = []
    for step in range(12):
        straight.apply(optimizer, step)
        expected.append(optimizer.param_groups[0]["lr"])
    assert [(r["step"], r["lr"]) for r in logged if "loss" in r] == list(zip(range(9, 13), expected[8:]))


@pytest.mark.launch
def test_row_pieces_renamed_in_the_newest_checkpoint_make_resume_auto_take_the_one_before(launch, tmp_path):
    """Issue 27, item 7: a cut parameter's optimizer state whose piece names do not match their rows passed
    verification, resumed, and failed at the first step (status 1); it is damage: skipped, set aside."""
    import h5py
    import numpy as np

    from hpcnet.ckpt.schema import sha256_hex

    args = _run_args(tmp_path, "dist.zero=1", "optim.name=adamw", "model.options.hidden=[64]")
    assert launch(2, *args, "train.steps=20").returncode == 0
    newest = tmp_path / "runs" / "x.ckpt" / "ckpt-0000000020.h5"
    with h5py.File(newest, "r+") as f:
        index = json.loads(f["index"][()].tobytes())
        first, second = sorted((e for e in index if e["name"].startswith("optim/0/exp_avg:")),
                               key=lambda e: int(e["name"].split(":")[1].split("-")[0]))[:2]
        cut = first["shape"][0] + 4  # the boundary of the first two pieces moves 4 rows: their data do not
        for entry, new in [(first, f"optim/0/exp_avg:0-{cut}"),
                           (second, f"optim/0/exp_avg:{cut}-{cut - 4 + second['shape'][0]}")]:
            f.move(f"tensors/{entry['name']}", f"tensors/{new}")
            entry["name"] = new
        raw = json.dumps(index, separators=(",", ":")).encode()
        del f["index"]
        f["index"] = np.frombuffer(raw, np.uint8)
        f.attrs["index_sha256"] = sha256_hex(raw)
    out = launch(2, *args, "train.steps=25", "--resume", "auto")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"skipping checkpoint {newest}" in out.stderr and f"does not hold the rows 0 to {cut}" in out.stderr
    assert "ckpt-0000000010.h5 at step 10" in out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 1])
def test_a_checkpoint_of_other_shapes_under_the_same_names_is_a_usage_error(comm, data_plane, mpi_tmp_path, zero):
    """Issue 27, item 11: resuming a model of the same parameter names but other shapes stops every rank with a
    usage error (status 2, not 1), naming the checkpoint and the tensors; nothing is set aside."""
    from hpcnet.errors import UsageError

    dataset = _dataset(comm, mpi_tmp_path)
    args = [f"dist.zero={zero}", "optim.name=adamw", "model.name=mlp"]
    run(_cfg(mpi_tmp_path, dataset, "shapes", *args, "train.steps=10", "model.options.hidden=[64]"), comm,
        plane=data_plane)
    with pytest.raises(UsageError) as failed:
        run(_cfg(mpi_tmp_path, dataset, "shapes", *args, "model.options.hidden=[32]", "checkpoint.resume=auto"),
            comm, plane=data_plane)
    message = str(failed.value)
    assert "checkpoint '" in message and "ckpt-0000000010.h5' does not match the model" in message
    assert "1.weight is [64, 64] there, [32, 64] in the model" in message and "model.*" in message
    comm.Barrier()
    assert _ckpts(mpi_tmp_path / "ckpt" / "shapes") == ["ckpt-0000000010.h5"]
    comm.Barrier()
