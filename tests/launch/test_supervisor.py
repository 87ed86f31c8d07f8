"""The restart supervisor, hpcnet.launch: forwarding signals, and running jobs and real recoveries under mpirun."""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcnet.errors import ExitCode
from hpcnet.launch.forward import Forwarder
from hpcnet.launch.restarts import failed_where
from tests.helpers.dirs import made_once
from tests.helpers.launch import PROGRAMS, clean_env


def test_forwarder_turns_sigterm_into_sigusr2_for_mpirun():
    """Open MPI's mpirun kills the ranks a second after SIGTERM, but forwards SIGUSR2 (they save and stop)."""
    forwarder = Forwarder(mpirun=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        forwarder.proc = proc
        forwarder._handle(signal.SIGTERM, None)
        assert proc.wait(timeout=20) == -signal.SIGUSR2 and forwarder.received == signal.SIGTERM
    finally:
        proc.kill()


def test_forwarder_holds_a_first_signal_until_the_ranks_handle_it_and_passes_a_second_at_once():
    """Before the ranks have installed their handler (``ready``), a stop signal's default action would kill them:
    a first signal waits for them; a second one means "now" (SIGTERM: mpirun ends the ranks)."""
    for second in (False, True):
        ready: list[bool] = []
        forwarder = Forwarder(mpirun=True)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            forwarder.attach(proc, lambda ready=ready: bool(ready))
            forwarder._handle(signal.SIGUSR2, None)
            assert forwarder.pending and forwarder.sent == 0 and proc.poll() is None
            forwarder.pass_on()
            assert forwarder.pending and forwarder.sent == 0
            if second:
                forwarder._handle(signal.SIGUSR2, None)
                assert proc.wait(timeout=20) == -signal.SIGTERM
            else:
                ready.append(True)
                forwarder.pass_on()
                assert proc.wait(timeout=20) == -signal.SIGUSR2
            assert not forwarder.pending and forwarder.received == signal.SIGUSR2
        finally:
            proc.kill()


# --- the supervisor running jobs ----------------------------------------------------------

def _serial_only():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial pass")


def _supervise(tmp_path, command, *options, timeout=120):
    return subprocess.run([sys.executable, "-m", "hpcnet.launch", *options, "--", *command], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.launch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exit_with, attempts, final", [
    ("exit:75", 3, 75),
    ("sigkill", 3, 137),
    ("exit:2", 1, 2),
    ("exit:76", 1, 76),
    ("succeed-at:2", 2, 0),
])
def test_restarts_until_success_or_exhausted(tmp_path, exit_with, attempts, final):
    _serial_only()
    out = _supervise(tmp_path, [sys.executable, str(PROGRAMS / "restart_job.py"), exit_with], "--max-restarts", "2",
                     "--backoff-s", "0")
    assert out.returncode == final, out.stderr
    assert (tmp_path / "attempts").read_text().split() == [str(k) for k in range(1, attempts + 1)]
    record = json.loads((tmp_path / "launch.json").read_text())
    assert [a["status"] for a in record["attempts"]][-1] == final and record["final_status"] == final
    assert len(record["attempts"]) == attempts
    if final == 75 or final == 137:
        assert f"giving up after 3 attempts (2 restarts): last status {final}" in out.stderr
    elif final:
        assert "is not restartable" in out.stderr


@pytest.mark.launch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP])
def test_stop_signals_are_forwarded_and_end_the_restarts(tmp_path, sig):
    """SIGHUP (the terminal went away) too: passed on as SIGTERM, on which the job saves; not left to kill us."""
    _serial_only()
    proc = subprocess.Popen([sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", "--", sys.executable,
                             str(PROGRAMS / "stop_job.py")], cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 40
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert f"stopped by {sig.name}: not restarting" in err
    assert len(json.loads((tmp_path / "launch.json").read_text())["attempts"]) == 1


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_new_checkpoint_resets_the_restart_budget(tmp_path):
    _serial_only()
    script = tmp_path / "fake" / "hpcnet" / "train.py"  # read as hpcnet.train: directories are pinned
    script.parent.mkdir(parents=True)
    shutil.copy(PROGRAMS / "fake_train.py", script)
    out = _supervise(tmp_path, [sys.executable, str(script), f"run.dir={tmp_path / 'runs'}", "run.name=budget"],
                     "--max-restarts", "1", "--backoff-s", "0")
    assert out.returncode == 75, out.stderr
    record = json.loads(next((tmp_path / "runs").glob("budget-*/launch.json")).read_text())
    assert [a["new_checkpoints"] for a in record["attempts"]] == [
        ["ckpt-0000000010.h5"], ["ckpt-0000000020.h5"], []]
    assert "attempt 2 committed ckpt-0000000020.h5: progress, so the restart budget starts again" in out.stderr
    assert "giving up after 3 attempts (1 restarts without a new checkpoint)" in out.stderr


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_the_ranks_of_a_killed_mpirun_are_gone_before_the_next_attempt(tmp_path):
    """Open MPI gives every rank its own process group, a rank may leave its session: the processes that carry the
    attempt's tag are what is reaped.  The job runs in the supervisor's session, not one of its own (which a kernel
    with sched_autogroup would schedule against the supervisor)."""
    _serial_only()
    script = PROGRAMS / "orphaned_ranks.py"
    try:
        out = _supervise(tmp_path, ["mpirun", "-np", "2", sys.executable, str(script), str(tmp_path)],
                         "--max-restarts", "1", "--backoff-s", "0", timeout=100)
        assert out.returncode == 0, out.stderr
        assert "attempt 1 ended with status 137" in out.stderr
        assert [(tmp_path / f"alive.{r}").read_text() for r in (0, 1)] == ["", ""]  # none left in attempt 2
        record = json.loads((tmp_path / "launch.json").read_text())
        old = {int(p.read_text()) for p in tmp_path.glob("pid.*")}
        assert set(record["attempts"][0]["reaped"]) == old and record["attempts"][0]["survivors"] == []
        assert [int((tmp_path / f"sid.{r}").read_text()) for r in (0, 1)] == [os.getsid(0)] * 2
    finally:
        for p in tmp_path.glob("pid.*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_the_processes_of_an_attempt_are_found_by_their_tag_alone():
    from hpcnet.launch.processes import TAG_ENV, tagged_processes

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleep, env={**os.environ, TAG_ENV: "t.1"}, start_new_session=True)
    other = subprocess.Popen(sleep, env={**os.environ, TAG_ENV: "t.10"})  # a tag that starts like ours
    untagged = subprocess.Popen(sleep, env={k: v for k, v in os.environ.items() if k != TAG_ENV})
    done = subprocess.Popen(["true"], env={**os.environ, TAG_ENV: "t.1"})
    try:
        while Path(f"/proc/{done.pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z":
            time.sleep(0.01)  # a zombie (not yet waited for) is not a member
        assert tagged_processes("t.1") == [ours.pid]
        assert tagged_processes("t.10") == [other.pid] and tagged_processes("t.") == []
    finally:
        for proc in (ours, other, untagged, done):
            proc.kill()
            proc.wait()
    assert tagged_processes("t.1") == []


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_an_uncreatable_launch_directory_is_a_clear_error(tmp_path):
    _serial_only()
    out = _supervise(tmp_path, [sys.executable, "-m", "hpcnet.train", "run.dir=/proc/hpcnet-cannot-create"])
    assert out.returncode == ExitCode.USAGE_ERROR, out.stderr
    assert "hpcnet.launch: error: run.dir: cannot create the launch directory /proc/hpcnet-cannot-create/" in out.stderr
    assert "Traceback" not in out.stderr


# --- real recoveries: mpirun, hpcnet.train, injected faults --------------------------------

def _train_command(tmp_path, name, *extra):
    from hpcnet.data.synthetic import generate_images

    dataset = tmp_path / "tiny.h5"
    if not dataset.exists():
        generate_images(dataset, num_train=256, num_eval=32, shape=(1, 8, 8), num_classes=4, seed=11)
    return ["mpirun", "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", f"data.dataset={dataset}",
            f"run.dir={tmp_path / 'runs'}", f"run.name={name}", "model.name=mlp", "model.options.hidden=[32]",
            "train.steps=10", "train.batch_size=8", "train.eval_every=0", "run.log_every=1",
            "checkpoint.every_steps=4", "dist.probe=false",
            # synchronous saves: under load an asynchronous save may not be committed before the kill
            "checkpoint.async_save=false", *extra]


def _final_tensors(tmp_path, name):
    from hpcnet.ckpt.load import load_checkpoint

    loaded = load_checkpoint(MPI.COMM_SELF, "auto", tmp_path / "runs" / f"{name}.ckpt")
    assert loaded.step == 10
    return loaded.tensors


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """A run without faults (``ref``, checkpoints at steps 4, 8 and 10), in the directory returned: one run for this
    file's tests and tests/launch/test_standby.py's, on whichever worker comes first (``made_once``)."""
    _serial_only()

    def make(tmp_path):
        out = _supervise(tmp_path, _train_command(tmp_path, "ref"), "--max-restarts", "0", timeout=150)
        assert out.returncode == 0, out.stderr

    return made_once(tmp_path_factory, "supervised-reference", make)


@pytest.fixture(scope="module")
def reference(reference_dir):
    """The reference run's final checkpoint: what every recovered run must end with."""
    return _final_tensors(reference_dir, "ref")


def _assert_same(tensors, reference):
    from hpcnet.ckpt.schema import join_pieces

    tensors = join_pieces(tensors)  # dist.zero=2 saves a cut parameter's state in row pieces
    assert sorted(tensors) == sorted(reference)
    for name, value in reference.items():
        assert torch.equal(tensors[name], value), name


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_killed_rank_is_restarted_and_ends_identical(tmp_path, reference):
    out = _supervise(tmp_path, _train_command(tmp_path, "kill", "fault.kill_at_step=6", "fault.only_attempt=1"),
                     "--max-restarts", "2", "--backoff-s", "0.1", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "fault injection: rank 1 kills itself (SIGKILL) at step 6" in out.stderr
    assert "attempt 1 ended with status 137" in out.stderr and "rank 1 on" in out.stderr
    assert "ckpt-0000000004.h5 at step 4" in out.stderr  # steps 5 and 6 are recomputed
    record = json.loads(next((tmp_path / "runs").glob("kill-*/launch.json")).read_text())
    assert [a["status"] for a in record["attempts"]] == [137, 0]
    second = record["attempts"][1]["command"]
    assert second.count("--resume") == 1 and second[-2:] == ["--resume", "auto"]
    assert record["attempts"][0]["failure"]["rank"] == 1 and record["attempts"][0]["launcher_report_unix"]
    _assert_same(_final_tensors(tmp_path, "kill"), reference)


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_restart_of_a_run_that_began_from_another_runs_checkpoint_begins_there_again(tmp_path, reference_dir,
                                                                                       reference):
    """A run resumed from the reference's step-4 checkpoint (``--resume PATH``; its own seed differs, so a start
    from fresh weights cannot pass for it) is killed at step 6, before it commits a checkpoint of its own: the
    restart resumes from PATH again, and the run ends as the reference does, bit for bit."""
    start = reference_dir / "runs" / "ref.ckpt" / "ckpt-0000000004.h5"
    out = _supervise(tmp_path, _train_command(tmp_path, "from", "run.seed=5", "fault.kill_at_step=6",
                                              "fault.only_attempt=1", "--resume", str(start)),
                     "--max-restarts", "2", "--backoff-s", "0.1", "--standby", "off", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "attempt 1 ended with status 137" in out.stderr, out.stderr
    _assert_same(_final_tensors(tmp_path, "from"), reference)
    assert f"restarting from the newest checkpoint, else from {start}" in out.stderr, out.stderr
    record = json.loads(next((tmp_path / "runs").glob("from-*/launch.json")).read_text())
    assert record["attempts"][1]["command"][-3:] == ["--resume", "auto", f'checkpoint.resume_else="{start}"']
    second = (Path(record["attempts"][1]["run_dir"]) / "rank0.log").read_text()
    assert f"resuming from {start} (checkpoint.resume_else)" in second and "at step 4" in second, second


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_killed_rank_at_zero_2_ends_as_the_unsharded_run(tmp_path, reference):
    """dist.zero=2: each owner writes its optimizer state into the checkpoint and reads it back after the kill;
    at 2 ranks the sharded run's final model and optimizer state are the unsharded reference's, bit for bit."""
    # No standby (a cold restart): what is tested is the sharded state read back, the same either way; a restart
    # through the standby is test_killed_rank_is_restarted_and_ends_identical's and tests/launch/test_standby.py's.
    # A standby is 2 more ranks, and 2 more for the attempt after that never comes (1.5-3 s of CPU a rank).
    out = _supervise(tmp_path, _train_command(tmp_path, "kill0", "dist.zero=2", "fault.kill_at_step=6",
                                              "fault.only_attempt=1"),
                     "--max-restarts", "2", "--backoff-s", "0.1", "--standby", "off", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "attempt 1 ended with status 137" in out.stderr and "ckpt-0000000004.h5 at step 4" in out.stderr
    _assert_same(_final_tensors(tmp_path, "kill0"), reference)


def _monitor_missing() -> str:
    train = Path(__file__).resolve().parents[2] / "hpcnet" / "train.py"
    if importlib.util.find_spec("hpcnet.fault.monitor") is None or "monitor" not in train.read_text():
        return "the heartbeat monitor (hpcnet/monitor.py, wired into train.py) is not there yet"
    return ""


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.skipif(bool(_monitor_missing()), reason=_monitor_missing() or "-")
def test_hung_rank_is_detected_then_restarted_and_ends_identical(tmp_path, reference):
    # A stall timeout of 8 s rather than the floor's 30 s: the detection is what is tested, not its default.
    # No standby, as in test_killed_rank_at_zero_2_ends_as_the_unsharded_run: the detection is what is tested.
    out = _supervise(tmp_path, _train_command(tmp_path, "hang", "fault.hang_at_step=6", "fault.only_attempt=1",
                                              "monitor.stall_timeout_s=8"),
                     "--max-restarts", "2", "--backoff-s", "0.1", "--standby", "off", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "attempt 1 ended with status 75" in out.stderr
    record = json.loads(next((tmp_path / "runs").glob("hang-*/launch.json")).read_text())
    assert [a["status"] for a in record["attempts"]] == [75, 0]
    failure = record["attempts"][0]["failure"]
    assert failed_where(failure)[0] == [1], failure  # the monitor's failure.json names the stopped rank
    assert "rank 1" in record["attempts"][0]["cause"]
    _assert_same(_final_tensors(tmp_path, "hang"), reference)


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_sigterm_to_the_supervisor_saves_and_stops_the_job(tmp_path):
    """Mpirun would kill the ranks a second after SIGTERM; the supervisor sends SIGUSR2, so they save and exit 76."""
    _serial_only()
    command = _train_command(tmp_path, "term", "train.steps=100000", "checkpoint.every_steps=0")
    # stderr goes to a file, as a terminal or a batch log would take it: a pipe nobody reads fills up at 64 KiB
    # (a line a step here) and blocks the job's logging until the signal finds it frozen.
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        # No standby: no restart follows (tests/launch/test_standby.py ends one with SIGTERM).
        proc = subprocess.Popen([sys.executable, "-m", "hpcnet.launch", "--standby", "off", "--", *command],
                                cwd=tmp_path, env=clean_env(), stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 150
            metrics = tmp_path / "runs"
            while time.monotonic() < deadline and not list(metrics.glob("term-*/attempt-1/metrics.rank0.jsonl")):
                time.sleep(0.5)
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            proc.kill()
        err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert "got SIGTERM, sent SIGUSR2 to the job" in err and "stopped by SIGTERM: not restarting" in err
    saved = list((tmp_path / "runs" / "term.ckpt").glob("ckpt-*.h5"))
    assert len(saved) == 1, err  # the checkpoint written on the way out


# --- a lost host, a launcher that does not exit, the fence ---------------------------------------------------------

def _lost_host_job(tmp_path, mode, *options, timeout=60):
    script = tmp_path / "fake" / "hpcnet" / "train.py"  # read as hpcnet.train: directories are pinned
    script.parent.mkdir(parents=True)
    shutil.copy(PROGRAMS / "lost_host_job.py", script)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", *options, "--", sys.executable,
                          str(script), f"run.dir={tmp_path / 'runs' / 'job'}", "run.dir_exact=true", "run.name=job"],
                         cwd=tmp_path, env=clean_env(FAKE_MODE=mode), capture_output=True, text=True, timeout=timeout)
    record = json.loads((tmp_path / "runs" / "job" / "launch.json").read_text())
    seen = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    return out, record, seen, time.monotonic() - t0


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_launcher_that_hangs_after_a_declared_failure_is_ended_within_its_grace_and_the_job_restarts(tmp_path):
    """A partition: the monitor wrote failure.json, mpirun waits for ever for a daemon it cannot reach. After
    --launcher-grace-s it and everything it started (here a child that ignores SIGTERM) are killed; attempt 2 runs,
    and each attempt ran holding the checkpoint directory's fence."""
    _serial_only()
    out, record, seen, took = _lost_host_job(tmp_path, "hang", "--launcher-grace-s", "2")
    assert out.returncode == 0, out.stderr
    first = record["attempts"][0]
    assert first["launcher_ended"] and first["restartable"] and first["status"] == 137, first
    assert first["end_unix"] - first["declared_unix"] < 2 + 5, first  # the grace, the kill, a poll
    assert first["lost_host"]["host"] == "hostB" and first["lost_host"]["ranks"] == [2, 3]
    assert "still running (a daemon it cannot reach?): ending it" in out.stderr
    child = int((tmp_path / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] == "Z"
    assert [s["fence"] for s in seen] == [[seen[0]["launch_id"], 1], [seen[0]["launch_id"], 2]]
    fence = json.loads((tmp_path / "runs" / "job" / "job.ckpt" / "fence").read_text())
    assert (fence["attempt"], fence["closed"]) == (3, 2)  # attempt 2 ended: none of its ranks commits any more
    assert took < 40


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_ranks_that_never_all_start_end_the_attempt_after_the_start_timeout_and_the_job_restarts(tmp_path):
    """Open MPI's mpirun waits for ever for a daemon that died as it started (two of four ranks ready, nothing
    declared, since the ranks are not up): --start-timeout-s ends it and everything it started, the attempt is
    restartable (75), its cause names what had started, and attempt 2 runs."""
    _serial_only()
    out, record, seen, took = _lost_host_job(tmp_path, "halfstart", "--start-timeout-s", "3")
    assert out.returncode == 0, out.stderr
    first = record["attempts"][0]
    assert first["start_timed_out"] and first["restartable"] and first["status"] == 75, first
    assert "2 of 4 rank(s) had started on hostA 3 s after the launcher did" in first["cause"], first
    assert 3 <= first["duration_s"] < 3 + 5, first
    assert "have not all started 3 s after the launcher" in out.stderr and len(seen) == 2, out.stderr
    assert took < 30


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_launcher_that_ends_0_after_losing_a_daemon_is_a_lost_host_and_the_job_restarts(tmp_path):
    """Open MPI 5's prterun ends with status 0 when a host dies with its daemon: the run wrote no summary.json,
    so attempt 1 is a lost host (hostB, from prterun's message), restartable, and attempt 2 runs and finishes."""
    _serial_only()
    out, record, seen, _ = _lost_host_job(tmp_path, "prte0", "--max-restarts", "1")
    assert out.returncode == 0 and len(seen) == 2, out.stderr
    first = record["attempts"][0]
    assert first["status"] == 75 and first["restartable"] and first["lost_host"]["host"] == "hostB", first
    assert "the launcher ended with status 0, but the run wrote no summary.json" in out.stderr
    assert record["attempts"][1]["status"] == 0 and record["final_status"] == 0


def test_the_start_timeout_must_be_a_number_of_seconds():
    out = subprocess.run([sys.executable, "-m", "hpcnet.launch", "--start-timeout-s", "-1", "--", "true"],
                         capture_output=True, text=True, env=clean_env(), timeout=30)
    assert out.returncode == 2 and "--start-timeout-s must be a number of seconds" in out.stderr, out.stderr


@pytest.mark.launch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["lost", "started", "unstarted"])
def test_a_lost_host_is_restartable_whatever_status_the_launcher_returns(tmp_path, mode):
    """Open MPI's mpirun ends with status 9 when a daemon dies: restartable once the ranks had all started (the host
    named by mpirun's message where it names one), final before (a launch that failed, as any other status 9)."""
    _serial_only()
    out, record, seen, _ = _lost_host_job(tmp_path, mode, "--max-restarts", "1")
    first = record["attempts"][0]
    assert first["status"] == 9 and first["launcher_loss"]["what"] == ("daemon lost" if mode == "lost" else "start")
    if mode == "lost":
        assert out.returncode == 0 and len(seen) == 2, out.stderr
        assert first["restartable"] and first["lost_host"]["host"] == "hostB" and first["lost_host"]["ranks"] == [2, 3]
        assert "attempt 1 ended with status 9: failed with status 9 (host hostB lost (ranks 2, 3)" in out.stderr
    elif mode == "started":
        assert out.returncode == 0 and len(seen) == 2, out.stderr
        assert first["restartable"] and first["lost_host"]["host"] is None
        assert "host (the launcher did not say which) lost: a launcher daemon failed after the ranks" in out.stderr
    else:
        assert out.returncode == 9 and len(seen) == 1, out.stderr
        assert not first["restartable"] and first["lost_host"] is None
        assert "status 9 is not restartable" in out.stderr
