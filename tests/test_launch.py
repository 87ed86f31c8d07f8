"""The restart supervisor, hpcnet.launch: its decisions (pure) and real recoveries under mpirun."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcnet.fault import inject as faults
from hpcnet.launch import supervisor as launch
from hpcnet.config import load_config
from hpcnet.errors import ExitCode
from hpcnet.launch.supervisor import (attempt_command, backoff_s, default_checkpoint_dir, describe_failure,
                                      exclude_hosts, expand_nodelist, expand_tasks_per_node, failed_where,
                                      failure_from_line, is_restartable, normalise_status, resume_args,
                                      slurm_allocation, train_args_start)
from hpcnet.ckpt.state import checkpoint_dir

TRAIN = ["mpirun", "-np", "2", "python", "-m", "mpi4py", "-m", "hpcnet.train"]


# --- decisions (pure) ---------------------------------------------------------------------

@pytest.mark.parametrize("status, restart", [
    (0, False), (1, False), (2, False), (75, True), (76, False), (130, False), (143, False), (127, False),
    (137, True), (139, True), (135, True), (134, True),  # SIGKILL, SIGSEGV, SIGBUS, SIGABRT
])
def test_which_statuses_restart(status, restart):
    assert is_restartable(status) is restart


def test_signal_deaths_of_the_launcher_read_like_a_shell():
    assert normalise_status(-9) == 137 and normalise_status(75) == 75
    assert is_restartable(normalise_status(-signal.SIGKILL)) and not is_restartable(normalise_status(-signal.SIGINT))


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_s(k, 1.0, 10.0) for k in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert backoff_s(100, 0.5, 60) == 60 and backoff_s(3, 0.0, 60) == 0
    with pytest.raises(ValueError):
        backoff_s(0, 1, 1)


def test_resume_flag_is_added_once_from_the_second_attempt():
    base = [*TRAIN, "run.name=x", "train.steps=5"]
    pinned = ["run.dir=/r/attempt-2", "run.dir_exact=true", "checkpoint.dir=/r/x.ckpt"]
    first = attempt_command(base, 1, train_start=len(TRAIN), pinned=pinned, openmpi=False)
    assert first == base + pinned
    second = attempt_command(base, 2, train_start=len(TRAIN), pinned=pinned, openmpi=False)
    assert second == base + pinned + ["--resume", "auto"]
    assert resume_args(second[len(TRAIN):]) == []  # a third attempt adds nothing more
    for already in (["--resume", "auto"], ["--resume=auto"], ["checkpoint.resume=auto"]):
        cmd = attempt_command(base + already, 3, train_start=len(TRAIN), pinned=[], openmpi=False)
        assert cmd == base + already
    # an explicit checkpoint is where the *first* attempt starts; restarts take the newest one
    explicit = attempt_command(base + ["--resume", "/c/ckpt-5.h5"], 2, train_start=len(TRAIN), pinned=[],
                               openmpi=False)
    assert explicit[-2:] == ["--resume", "auto"]


def test_attempt_number_is_exported_to_remote_ranks_by_open_mpi_only():
    cmd = attempt_command(TRAIN, 1, train_start=len(TRAIN), pinned=[], openmpi=True)
    assert cmd[:3] == ["mpirun", "-x", "HPCNET_ATTEMPT"] and cmd[3:] == TRAIN[1:]
    srun = ["srun", "-n", "2", "python", "-m", "hpcnet.train"]
    assert attempt_command(srun, 1, train_start=len(srun), pinned=[], openmpi=True) == srun
    assert launch.ATTEMPT_ENV == faults.ATTEMPT_ENV


def test_open_mpi_ends_a_failed_job_without_grace_period():
    assert launch.launcher_env({"A": "1"}, openmpi=True) == {"A": "1", launch.SIGKILL_TIMEOUT_ENV: "0"}
    assert launch.launcher_env({launch.SIGKILL_TIMEOUT_ENV: "3"}, openmpi=True)[launch.SIGKILL_TIMEOUT_ENV] == "3"
    assert launch.launcher_env({"A": "1"}, openmpi=False) == {"A": "1"}


def test_where_train_arguments_start():
    assert train_args_start([*TRAIN, "a=1"]) == len(TRAIN)
    assert train_args_start(["srun", "hpcnet-train", "a=1"]) == 2
    assert train_args_start(["mpirun", "python", "myscript.py"]) is None


@pytest.mark.parametrize("overrides", [["run.name=x"], ["run.name=y", "run.dir=/a/b"],
                                       ["checkpoint.dir=/c/d", "run.name=z"]])
def test_checkpoint_dir_is_resolved_as_the_trainer_does(overrides):
    cfg = load_config(overrides=overrides)
    assert default_checkpoint_dir(cfg.run.dir, cfg.run.name, cfg.checkpoint.dir) == checkpoint_dir(cfg)


def test_launcher_reports_of_dead_ranks():
    found = failure_from_line("mpirun noticed that process rank 3 with PID 0 on node n17 exited on signal 9 (Killed).")
    assert (found["rank"], found["host"], found["signal"]) == (3, "n17", 9)
    assert describe_failure(found) == "rank 3 on n17 died of signal 9 (SIGKILL)"
    found = failure_from_line("srun: error: n04: task 5: Killed")
    assert (found["rank"], found["host"]) == (5, "n04") and "Killed" in describe_failure(found)
    assert failure_from_line("step 3/10 | loss 2.1") is None
    report = {"kind": "heartbeat", "rank": 1, "host": "n2", "step": 7, "collective": "allreduce #12"}
    assert describe_failure(report) == "heartbeat: rank 1 on n2 at step 7 in allreduce #12"
    report = {"kind": "stall", "detail": "loss.allreduce (#29) at step 6 has not finished after 30.0 s",
              "failed": [{"rank": 1, "host": "n2"}, {"rank": 2, "host": "n2"}]}
    assert failed_where(report) == ([1, 2], ["n2"])
    assert describe_failure(report).startswith("stall: ranks 1, 2 on n2 (loss.allreduce (#29) at step 6")


def test_slurm_host_lists():
    assert expand_nodelist("n[01-03,07],gpu5") == ["n01", "n02", "n03", "n07", "gpu5"]
    assert expand_nodelist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "4(x3)"}
    assert slurm_allocation(env) == [("n1", 4), ("n2", 4), ("n3", 4)]
    assert slurm_allocation({}) is None


def test_exclude_a_host_with_srun():
    cmd = ["srun", "-N", "2", "python", "-m", "hpcnet.train"]
    assert exclude_hosts(cmd, ["n3"]).command == ["srun", "--exclude=n3", *cmd[1:]]
    merged = exclude_hosts(["srun", "--exclude=n1", "-N", "2", "x"], ["n3"]).command
    assert merged == ["srun", "--exclude=n1,n3", "-N", "2", "x"]
    assert exclude_hosts(["srun", "-x", "n1", "x"], ["n2"]).command == ["srun", "-x", "n1,n2", "x"]


def test_exclude_a_host_with_mpirun():
    cmd = ["mpirun", "-np", "4", "--host", "n1:2,n2:2,n3:2", "python", "t.py"]
    assert exclude_hosts(cmd, ["n2"]).command == ["mpirun", "-np", "4", "--host", "n1:2,n3:2", "python", "t.py"]
    assert exclude_hosts(["mpirun", "-H", "n1.cluster,n2", "x"], ["n1"]).command == ["mpirun", "-H", "n2", "x"]
    alone = exclude_hosts(["mpirun", "--host", "n1:4", "x"], ["n1"])
    assert alone.command == ["mpirun", "--host", "n1:4", "x"] and "no host would be left" in alone.note
    # a hostfile: filtered into a new file
    files = {"hosts.txt": "# nodes\nn1 slots=2\nn2 slots=2\nn3 slots=2\n"}
    out = exclude_hosts(["mpirun", "--hostfile", "hosts.txt", "x"], ["n2"], read_file=files.__getitem__,
                        hostfile_path="/l/hostfile.attempt-2")
    assert out.command == ["mpirun", "--hostfile", "/l/hostfile.attempt-2", "x"]
    assert out.hostfile == "# nodes\nn1 slots=2\nn3 slots=2\n"
    # no host list: the SLURM allocation, less the failed host
    out = exclude_hosts(["mpirun", "-np", "4", "x"], ["n2"], allocation=[("n1", 2), ("n2", 2), ("n3", 2)])
    assert out.command == ["mpirun", "--host", "n1:2,n3:2", "-np", "4", "x"]
    nothing = exclude_hosts(["mpirun", "-np", "4", "x"], ["n2"])
    assert nothing.command == ["mpirun", "-np", "4", "x"] and "no --host" in nothing.note
    assert "not mpirun or srun" in exclude_hosts(["aprun", "x"], ["n2"]).note


def test_forwarder_turns_sigterm_into_sigusr2_for_mpirun():
    """Open MPI's mpirun kills the ranks a second after SIGTERM, but forwards SIGUSR2 (they save and stop)."""
    forwarder = launch._Forwarder(mpirun=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        forwarder.proc = proc
        forwarder._handle(signal.SIGTERM, None)
        assert proc.wait(timeout=20) == -signal.SIGUSR2 and forwarder.received == signal.SIGTERM
    finally:
        proc.kill()


# --- the supervisor running jobs ----------------------------------------------------------

def _serial_only():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial pass")


def _supervise(tmp_path, command, *options, timeout=120):
    from tests.helpers import clean_env

    return subprocess.run([sys.executable, "-m", "hpcnet.launch", *options, "--", *command], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=timeout)


JOB = ("import os, sys, pathlib; "
       "pathlib.Path('attempts').open('a').write(os.environ.get('HPCNET_ATTEMPT', '?') + '\\n'); ")


@pytest.mark.launch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exit_with, attempts, final", [
    ("sys.exit(75)", 3, 75),
    ("os.kill(os.getpid(), 9)", 3, 137),
    ("sys.exit(2)", 1, 2),
    ("sys.exit(76)", 1, 76),
    ("sys.exit(int(os.environ['HPCNET_ATTEMPT']) != 2 and 75)", 2, 0),
])
def test_restarts_until_success_or_exhausted(tmp_path, exit_with, attempts, final):
    _serial_only()
    out = _supervise(tmp_path, [sys.executable, "-c", JOB + exit_with], "--max-restarts", "2", "--backoff-s", "0")
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
    from tests.helpers import clean_env

    job = ("import signal, sys, time, pathlib; "
           "[signal.signal(s, lambda n, f: sys.exit(76)) for s in (signal.SIGTERM, signal.SIGUSR2)]; "
           "pathlib.Path('ready').write_text('1'); time.sleep(50); sys.exit(75)")
    proc = subprocess.Popen([sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", "--", sys.executable, "-c",
                             job], cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE, text=True)
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


def test_committed_checkpoints_and_what_is_new(tmp_path):
    assert launch.committed_checkpoints(tmp_path / "missing") == {} and launch.committed_checkpoints(None) == {}
    for name in ("ckpt-0000000010.h5", "ckpt-0000000020.h5.tmp", "latest", "ckpt-12.h5", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    before = launch.committed_checkpoints(tmp_path)
    assert sorted(before) == ["ckpt-0000000010.h5"]  # a save in flight, `latest` and strays do not count
    assert launch.new_checkpoints(before, before) == []
    (tmp_path / "ckpt-0000000030.h5").write_bytes(b"xy")
    os.utime(tmp_path / "ckpt-0000000010.h5", ns=(1, 1))  # written again
    after = launch.committed_checkpoints(tmp_path)
    assert launch.new_checkpoints(before, after) == ["ckpt-0000000010.h5", "ckpt-0000000030.h5"]
    (tmp_path / "ckpt-0000000010.h5").unlink()  # retention removed one: not progress by itself
    assert launch.new_checkpoints(after, launch.committed_checkpoints(tmp_path)) == []


FAKE_TRAIN = """
import os, pathlib, sys
options = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
ckpt = pathlib.Path(options["checkpoint.dir"])
ckpt.mkdir(parents=True, exist_ok=True)
attempt = int(os.environ["HPCNET_ATTEMPT"])
if attempt <= 2:  # the first two attempts each commit a checkpoint before failing; the third does not
    (ckpt / f"ckpt-{attempt * 10:010d}.h5").write_bytes(b"committed")
    (ckpt / f"ckpt-{attempt * 10 + 5:010d}.h5.tmp").write_bytes(b"in flight")
sys.exit(75)
"""


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_new_checkpoint_resets_the_restart_budget(tmp_path):
    _serial_only()
    script = tmp_path / "fake" / "hpcnet" / "train.py"  # read as hpcnet.train: directories are pinned
    script.parent.mkdir(parents=True)
    script.write_text(FAKE_TRAIN)
    out = _supervise(tmp_path, [sys.executable, str(script), f"run.dir={tmp_path / 'runs'}", "run.name=budget"],
                     "--max-restarts", "1", "--backoff-s", "0")
    assert out.returncode == 75, out.stderr
    record = json.loads(next((tmp_path / "runs").glob("budget-*/launch.json")).read_text())
    assert [a["new_checkpoints"] for a in record["attempts"]] == [
        ["ckpt-0000000010.h5"], ["ckpt-0000000020.h5"], []]
    assert "attempt 2 committed ckpt-0000000020.h5: progress, so the restart budget starts again" in out.stderr
    assert "giving up after 3 attempts (1 restarts without a new checkpoint)" in out.stderr


RANK = """
import os, pathlib, signal, sys, time
here, rank = pathlib.Path(sys.argv[1]), os.environ["OMPI_COMM_WORLD_RANK"]
def alive(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False
if os.environ["HPCNET_ATTEMPT"] == "1":
    (here / f"pid.{rank}").write_text(str(os.getpid()))
    if rank == "1":
        while len(list(here.glob("pid.*"))) < 2:
            time.sleep(0.05)
        os.kill(os.getppid(), signal.SIGKILL)  # mpirun dies (OOM killer); its ranks live on, orphaned
    time.sleep(120)
else:
    old = [int(p.read_text()) for p in here.glob("pid.*")]
    (here / f"alive.{rank}").write_text(" ".join(str(pid) for pid in old if alive(pid)))
"""


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_the_ranks_of_a_killed_mpirun_are_gone_before_the_next_attempt(tmp_path):
    """Open MPI gives every rank its own process group: the attempt's session is what is reaped."""
    _serial_only()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    try:
        out = _supervise(tmp_path, ["mpirun", "-np", "2", sys.executable, str(script), str(tmp_path)],
                         "--max-restarts", "1", "--backoff-s", "0", timeout=100)
        assert out.returncode == 0, out.stderr
        assert "attempt 1 ended with status 137" in out.stderr
        assert [(tmp_path / f"alive.{r}").read_text() for r in (0, 1)] == ["", ""]  # none left in attempt 2
        record = json.loads((tmp_path / "launch.json").read_text())
        old = {int(p.read_text()) for p in tmp_path.glob("pid.*")}
        assert set(record["attempts"][0]["reaped"]) == old and record["attempts"][0]["survivors"] == []
    finally:
        for p in tmp_path.glob("pid.*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p.read_text()), signal.SIGKILL)


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
    from hpcnet.data.loader import generate_images

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
def reference(tmp_path_factory):
    """A run without faults: its final checkpoint is what every recovered run must end with."""
    _serial_only()
    tmp_path = tmp_path_factory.mktemp("reference")
    out = _supervise(tmp_path, _train_command(tmp_path, "ref"), "--max-restarts", "0", timeout=150)
    assert out.returncode == 0, out.stderr
    return _final_tensors(tmp_path, "ref")


def _assert_same(tensors, reference):
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


def _monitor_missing() -> str:
    train = Path(__file__).resolve().parents[1] / "hpcnet" / "train.py"
    if importlib.util.find_spec("hpcnet.fault.monitor") is None or "monitor" not in train.read_text():
        return "the heartbeat monitor (hpcnet/monitor.py, wired into train.py) is not there yet"
    return ""


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.skipif(bool(_monitor_missing()), reason=_monitor_missing() or "-")
def test_hung_rank_is_detected_then_restarted_and_ends_identical(tmp_path, reference):
    out = _supervise(tmp_path, _train_command(tmp_path, "hang", "fault.hang_at_step=6", "fault.only_attempt=1"),
                     "--max-restarts", "2", "--backoff-s", "0.1", timeout=240)
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
    """mpirun would kill the ranks a second after SIGTERM; the supervisor sends SIGUSR2, so they save and exit 76."""
    _serial_only()
    from tests.helpers import clean_env

    command = _train_command(tmp_path, "term", "train.steps=100000", "checkpoint.every_steps=0")
    proc = subprocess.Popen([sys.executable, "-m", "hpcnet.launch", "--", *command], cwd=tmp_path, env=clean_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        metrics = tmp_path / "runs"
        while time.monotonic() < deadline and not list(metrics.glob("term-*/attempt-1/metrics.rank0.jsonl")):
            time.sleep(0.5)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert "got SIGTERM, sent SIGUSR2 to the job" in err and "stopped by SIGTERM: not restarting" in err
    saved = list((tmp_path / "runs" / "term.ckpt").glob("ckpt-*.h5"))
    assert len(saved) == 1, err  # the checkpoint written on the way out
