"""A stop signal to hpcnet.launch at any moment of a job's life ends with the documented status and loses nothing:
76 (SIGTERM, SIGUSR2, SIGHUP) or 130 (SIGINT) while there is something left to train, 0 once training finished;
no attempt is started after it, and no process is left.

Each moment is reached by waiting for a marker, not for a time: a slow step of the job (``sitecustomize`` in the
job's ``PYTHONPATH``: a rank's interpreter that starts slowly or exits slowly; a fake ``mpirun --version`` that
answers slowly; a model module that a standby imports slowly) writes a file, and the signal is sent while the job
is inside that step. The sweep over the times of the report (0.5 to 9 s after the start) waits first for the
supervisor to take charge of SIGUSR2, which it does on its first line: before it, no Python code can.
"""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcnet.errors import ExitCode
from hpcnet.launch.park import PARKED
from hpcnet.launch.stop import reported_ranks
from tests.helpers.launch import ROOT, clean_env
from tests.launch.test_standby import _none_left, _record
from tests.launch.test_supervisor import _serial_only, _train_command

SITECUSTOMIZE = '''
import atexit, os, pathlib, time
rank = os.environ.get("OMPI_COMM_WORLD_RANK")
if rank is not None and os.environ.get("TEST_SLOW_START_S"):  # before any line of hpcnet.train
    pathlib.Path(f"starting.{rank}").write_text("")
    time.sleep(float(os.environ["TEST_SLOW_START_S"]))
if rank is not None and os.environ.get("TEST_SLOW_EXIT_S"):  # after the last line of hpcnet.train

    def slow_exit():
        pathlib.Path(f"exiting.{rank}").write_text("")
        time.sleep(float(os.environ["TEST_SLOW_EXIT_S"]))

    atexit.register(slow_exit)
'''


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The job's environment, with ``sitecustomize`` (and so ``TEST_*``) and ``tmp_path``'s modules importable."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return clean_env(PYTHONPATH=f"{site}:{tmp_path}:{ROOT}", **extra)


def _start(tmp_path: Path, command: list[str], env: dict[str, str], *options: str) -> subprocess.Popen:
    with open(tmp_path / "err.txt", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", *options, "--", *command],
                                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)


def _wait_for(proc: subprocess.Popen, tmp_path: Path, ready, timeout_s: float = 200.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the job ended first ({proc.returncode}):\n{_err(tmp_path)}"
        assert time.monotonic() < deadline, f"timed out:\n{_err(tmp_path)}"
        time.sleep(0.05)


def _err(tmp_path: Path) -> str:
    """The supervisor's and the job's stderr, whole: the supervisor's first lines come before the job prints its
    resolved configuration, which grows with every option."""
    return (tmp_path / "err.txt").read_text()


def _finish(proc: subprocess.Popen, timeout_s: float = 150.0) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        proc.kill()


def _checkpoints(tmp_path: Path, name: str) -> list[str]:
    return sorted(p.name for p in (tmp_path / "runs" / f"{name}.ckpt").glob("ckpt-*.h5"))


STOPS = [(signal.SIGUSR2, ExitCode.PREEMPTED), (signal.SIGTERM, ExitCode.PREEMPTED),
         (signal.SIGHUP, ExitCode.PREEMPTED), (signal.SIGINT, ExitCode.INTERRUPTED)]


@pytest.mark.launch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, status", STOPS, ids=[s.name for s, _ in STOPS])
def test_a_stop_signal_while_the_supervisor_starts_ends_it_before_any_attempt(tmp_path, sig, status):
    """The signal comes while the supervisor asks the launcher for its version, before its handlers are installed
    (it was killed by the signal): it is held, and no attempt starts after it."""
    _serial_only()
    fake = tmp_path / "bin" / "mpirun"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then touch "{tmp_path}/asked"; sleep 6; '
                    f'echo "mpirun (Open MPI) 4.1.4"; exit 0; fi\nexec {shutil.which("mpirun")} "$@"\n')
    fake.chmod(0o755)
    command = _train_command(tmp_path, "early")
    proc = _start(tmp_path, [str(fake), *command[1:]], _env(tmp_path))
    _wait_for(proc, tmp_path, (tmp_path / "asked").exists)
    proc.send_signal(sig)
    assert _finish(proc) == status, _err(tmp_path)
    record = _record(tmp_path, "early")
    assert record["attempts"] == [] and record["final_status"] == status
    assert f"stopped by {sig.name} before the first attempt: nothing was started" in _err(tmp_path)
    assert _checkpoints(tmp_path, "early") == []


@pytest.mark.launch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM], ids=["SIGUSR2", "SIGTERM"])
def test_a_stop_signal_while_the_ranks_start_reaches_them_once_they_handle_it(tmp_path, sig):
    """The ranks' interpreters are starting, before the first line of hpcnet.train (they died of the signal
    passed on at once): the supervisor holds it until every rank has reported its handler, then the ranks save
    after their first step and the job ends with 76."""
    _serial_only()
    command = _train_command(tmp_path, "starting", "train.steps=100000", "checkpoint.every_steps=0")
    proc = _start(tmp_path, command, _env(tmp_path, TEST_SLOW_START_S="8"), "--standby", "off")
    _wait_for(proc, tmp_path, lambda: (tmp_path / "starting.0").exists() and (tmp_path / "starting.1").exists())
    proc.send_signal(sig)
    assert _finish(proc) == ExitCode.PREEMPTED, _err(tmp_path)
    err = _err(tmp_path)
    assert f"got {sig.name}; the job's ranks are still starting" in err
    assert "stopping after step 1/100000 on SIGUSR2 (checkpoint saved)" in err
    assert _checkpoints(tmp_path, "starting") == ["ckpt-0000000001.h5"]
    assert [a["status"] for a in _record(tmp_path, "starting")["attempts"]] == [ExitCode.PREEMPTED]


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_a_stop_signal_after_training_finished_and_committed_leaves_status_0(tmp_path):
    """Every step done, the last checkpoint committed, the ranks on their way out (after hpcnet.train's last
    line; they put back the default action and died of the signal): the job is complete, status 0."""
    _serial_only()
    command = _train_command(tmp_path, "finished", "train.steps=6")
    proc = _start(tmp_path, command, _env(tmp_path, TEST_SLOW_EXIT_S="5"), "--standby", "off")
    _wait_for(proc, tmp_path, lambda: (tmp_path / "exiting.0").exists() and (tmp_path / "exiting.1").exists())
    assert _checkpoints(tmp_path, "finished")[-1] == "ckpt-0000000006.h5"
    proc.send_signal(signal.SIGUSR2)
    assert _finish(proc) == 0, _err(tmp_path)
    record = _record(tmp_path, "finished")
    assert [a["status"] for a in record["attempts"]] == [0] and record["final_status"] == 0
    assert _checkpoints(tmp_path, "finished")[-1] == "ckpt-0000000006.h5"


def _takes_charge_of_sigusr2(pid: int) -> bool:
    """Whether process ``pid`` blocks or catches SIGUSR2 (``/proc/<pid>/status``): before that, in the first
    milliseconds of an interpreter, no Python code can keep a signal from killing it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigBlk:", "SigCgt:"))]
    return any(mask >> (signal.SIGUSR2 - 1) & 1 for mask in masks)


@pytest.mark.launch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("after_s", [0.5, 1.0, 2.0, 3.0, 4.5, 9.0])
def test_a_stop_signal_at_any_time_ends_with_76_and_loses_nothing(tmp_path, after_s):
    """The times of the report (140 at 0.5, 1, 2 and 4.5 s, 0 at 3 s): whatever the job is doing then (the
    supervisor preparing, mpirun starting, the ranks importing, MPI starting, training), it ends with 76 and either
    nothing was started or the one attempt saved the step it stopped after."""
    _serial_only()
    # 50 ms a step (fault.slow_s, the last rank; the other waits for it in the step's all-reduce): the job trains
    # until the signal all the same, without both cores busy (at full speed the 9 s point took 15 s of CPU, 8.5 s so).
    command = _train_command(tmp_path, "sweep", "train.steps=100000", "checkpoint.every_steps=0", "fault.slow_s=0.05")
    t0 = time.monotonic()
    proc = _start(tmp_path, command, _env(tmp_path), "--standby", "off")
    _wait_for(proc, tmp_path, lambda: _takes_charge_of_sigusr2(proc.pid), timeout_s=30)
    time.sleep(max(0.0, after_s - (time.monotonic() - t0)))
    proc.send_signal(signal.SIGUSR2)
    assert _finish(proc) == ExitCode.PREEMPTED, _err(tmp_path)
    attempts = _record(tmp_path, "sweep")["attempts"]
    saved = _checkpoints(tmp_path, "sweep")
    if not attempts:
        assert saved == [] and "before the first attempt: nothing was started" in _err(tmp_path)
    else:
        assert [a["status"] for a in attempts] == [ExitCode.PREEMPTED], attempts
        step = int(_err(tmp_path).split("stopping after step ")[1].split("/")[0])
        assert saved == [f"ckpt-{step:010d}.h5"]


SLOW_IMPORT = '''
import os, time, torch
if os.environ.get("HPCNET_STANDBY"):
    time.sleep(40)  # a standby's ranks import this slowly: they are not parked when attempt 1 fails


def build(info, hidden=()):  # model.options.hidden of the common test command
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, info.num_classes))
'''


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_stop_signal_while_the_supervisor_waits_for_its_standby_starts_no_attempt(tmp_path):
    """Attempt 1 failed restartably; the supervisor waits for its standby's ranks to park (a new attempt was
    started after the signal and passed it on at once: status 140): no attempt 2, the standby ended, 76."""
    _serial_only()
    (tmp_path / "slowimport.py").write_text(SLOW_IMPORT)
    command = _train_command(tmp_path, "waiting", "model.factory=slowimport:build", "fault.kill_at_step=3",
                             "fault.only_attempt=1")
    proc = _start(tmp_path, command, _env(tmp_path), "--standby", "on")
    _wait_for(proc, tmp_path, lambda: "attempt 1 ended with status 137" in _err(tmp_path))
    waiting = "waiting for the standby's ranks to park"
    deadline = time.monotonic() + 10  # it says so at once (an earlier supervisor waited without a word)
    while waiting not in _err(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    assert _finish(proc) == ExitCode.PREEMPTED, _err(tmp_path)
    err = _err(tmp_path)
    assert "attempt 2/" not in err and "stopped by SIGUSR2 before restarting" in err
    assert waiting in err and "standby discarded: a stop signal came while its ranks were parking\n" in err
    record = _record(tmp_path, "waiting")
    assert [a["status"] for a in record["attempts"]] == [137] and record["final_status"] == ExitCode.PREEMPTED
    assert _none_left(str(tmp_path)) == []


USER_MODEL = '''
import os, pathlib, time, torch


class Net(torch.nn.Module):
    calls = 0

    def __init__(self, classes):
        super().__init__()
        self.lin = torch.nn.Linear(64, classes)

    def forward(self, x):
        Net.calls += 1
        if Net.calls == 3 and os.environ.get("HPCNET_ATTEMPT") == "1":
            while not pathlib.Path("go").exists():  # the test edits this file meanwhile
                time.sleep(0.05)
        return self.lin(x.flatten(1))


def build(info, hidden=()):  # model.options.hidden of the common test command
    {mark}
    return Net(info.num_classes)
'''


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_an_edited_model_module_discards_the_standby_and_the_restart_runs_the_new_code(tmp_path):
    """The standby imported the user's model module and parked; the module is edited; a rank is killed: the
    standby is discarded (launch.json says which file changed) and attempt 2 builds the model with the new code."""
    _serial_only()
    module = tmp_path / "usermodel.py"
    module.write_text(USER_MODEL.format(mark="pass"))
    command = _train_command(tmp_path, "edited", "model.factory=usermodel:build", "fault.kill_at_step=6",
                             "fault.only_attempt=1", "monitor.stall_timeout_s=600")
    proc = _start(tmp_path, command, _env(tmp_path), "--standby", "on")
    _wait_for(proc, tmp_path, lambda: reported_ranks(next((tmp_path / "runs").glob("edited-*"), tmp_path)
                                                     / "standby-2", PARKED) == (2, 2), timeout_s=300)
    module.write_text(USER_MODEL.format(
        mark='pathlib.Path(f"built-new-code.{os.environ[\'HPCNET_ATTEMPT\']}.{os.environ[\'OMPI_COMM_WORLD_RANK\']}")'
             '.write_text("")'))
    (tmp_path / "go").write_text("")
    assert _finish(proc, 300) == 0, _err(tmp_path)
    attempts = _record(tmp_path, "edited")["attempts"]
    assert [a["status"] for a in attempts] == [137, 0] and not attempts[1]["standby"], attempts
    note = attempts[1]["standby_note"]
    assert note.startswith("standby discarded: code it imported changed") and str(module) in note, note
    assert sorted(p.name for p in tmp_path.glob("built-new-code.*")) == ["built-new-code.2.0", "built-new-code.2.1"]
    assert _none_left(str(tmp_path)) == []
