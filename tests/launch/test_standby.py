"""Warm standby in hpcnet.launch: the next attempt parked before MPI starts, released at a failure; a changed
configuration discards it; no parked process outlives the supervisor, however it ends."""

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcnet.launch.attempt import Attempt
from hpcnet.launch.park import (
    ORPHAN_EXIT,
    PARKED,
    WATCH_S,
    imported_manifest,
    installed_packages,
    orphaned,
    user_module_files,
)
from hpcnet.launch.standby import (
    TRIGGER,
    Standby,
    Standbys,
    fingerprint,
    fingerprint_changes,
    imported_changes,
    standby_command,
)
from hpcnet.launch.stop import reported_ranks
from hpcnet.paths import STANDBY_ENV, STANDBY_OWNER_ENV
from tests.helpers.launch import clean_env
from tests.launch.test_supervisor import (  # noqa: F401
    _assert_same,
    _final_tensors,
    _serial_only,
    _train_command,
    reference,
    reference_dir,
)


# -- pure --------------------------------------------------------------------------------------------------------
def test_the_fingerprint_follows_command_environment_hostfile_and_config(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\n")
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 5\n")
    command = ["mpirun", "--hostfile", str(hosts), "python", "-m", "hpcnet.train", "--config", str(config)]
    env = {"A": "1"}
    base = fingerprint(command, env, str(config))
    assert fingerprint(list(command), dict(env), str(config)) == base
    assert fingerprint(command + ["train.steps=6"], env, str(config)) != base
    assert fingerprint(command, {"A": "2"}, str(config)) != base
    hosts.write_text("b slots=2\n")
    assert fingerprint(command, env, str(config)) != base
    base = fingerprint(command, env, str(config))
    time.sleep(0.01)
    config.write_text("[train]\nsteps = 7\n")
    assert fingerprint(command, env, str(config)) != base


def test_what_changed_names_the_host_file_in_either_form_or_the_environment(tmp_path):
    """``--hostfile=PATH`` and a host file named by the environment (Open MPI's default host file, SLURM's,
    PBS's) count as well as ``--hostfile PATH``; the reason names the file or the variable, never its value."""
    named, by_env = tmp_path / "named", tmp_path / "by-env"
    named.write_text("a slots=2\n")
    by_env.write_text("b slots=2\n")
    command = ["mpirun", f"--hostfile={named}", "python", "-m", "hpcnet.train"]
    env = {"OMPI_MCA_orte_default_hostfile": str(by_env), "SECRET": "s1"}
    base = fingerprint(command, env, None)
    assert fingerprint_changes(base, fingerprint(command, env, None)) == ""
    named.write_text("a slots=4\n")
    assert fingerprint_changes(base, fingerprint(command, env, None)) == f"the host file changed ({named})"
    named.write_text("a slots=2\n")
    by_env.write_text("c slots=2\n")
    assert fingerprint_changes(base, fingerprint(command, env, None)) == f"the host file changed ({by_env})"
    by_env.write_text("b slots=2\n")
    for variable in ("SLURM_HOSTFILE", "PBS_NODEFILE", "HYDRA_HOST_FILE"):
        assert fingerprint(command, {**env, variable: str(named)}, None)["hostfiles"][str(named)] == "a slots=2\n"
    changed = fingerprint_changes(base, fingerprint(command + ["train.steps=3"], {**env, "SECRET": "s2"}, None))
    assert changed == "the command changed; the environment changed (SECRET)" and "s2" not in changed


def test_user_module_files_leave_out_the_standard_library_and_site_packages(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import json as stdlib_module

    import mine

    files = user_module_files({"mine": mine, "json": stdlib_module, "torch": torch, "builtins": __builtins__})
    assert files == [str((tmp_path / "mine.py").resolve())]
    everything = user_module_files()  # this process: hpcnet of this checkout, the tests; no torch, no json
    assert str(Path(sys.modules["hpcnet.launch.standby"].__file__).resolve()) in everything
    assert not [f for f in everything if "site-packages" in f or f.startswith(sys.base_prefix)]


def test_what_a_standby_imported_changes_when_its_module_or_a_package_version_does(tmp_path, monkeypatch):
    module = tmp_path / "factory_module.py"
    module.write_text("def build(info):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("factory_module")
    recorded = json.loads(json.dumps(imported_manifest()))  # as the standby writes it and the supervisor reads it
    assert str(module.resolve()) in recorded["modules"] and recorded["path"] == sys.path
    assert recorded["packages"]["torch"] == installed_packages(sys.path)["torch"] == importlib.metadata.version("torch")
    assert imported_changes(recorded) == ""
    module.write_text("def build(info):\n    return 'new code'\n")
    assert imported_changes(recorded) == f"code it imported changed ({module.resolve()})"
    module.unlink()
    assert imported_changes(recorded) == f"code it imported changed ({module.resolve()})"
    del recorded["modules"][str(module.resolve())]

    def upgraded(path):
        assert path == recorded["path"]  # the standby's sys.path, which may not be the supervisor's
        return {**installed_packages(path), "torch": "99.0", "newpkg": "1.0"}

    assert imported_changes(recorded, packages=upgraded) == (
        f"installed packages changed (newpkg not installed -> 1.0, torch {recorded['packages']['torch']} -> 99.0)")


def test_a_standby_has_imported_what_training_imports_and_a_bare_import_has_not():
    """torch._dynamo (2 s of CPU, imported by every optimizer step) is paid by the parked standby, not after the
    release; importing hpcnet.train alone (--help, a bad option) does without it."""
    code = ("import sys; import hpcnet.train; before = 'torch._dynamo' in sys.modules; "
            "from hpcnet.launch.park import preimport; preimport(['train.steps=3']); "
            "print(before, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_standby_commands_parked_counts_and_the_trigger(tmp_path):
    assert standby_command(["srun", "-n", "2", "python"], "srun") == ["srun", "--overlap", "-n", "2", "python"]
    assert standby_command(["mpirun", "-np", "2"], "mpirun") == ["mpirun", "-np", "2"]
    assert reported_ranks(tmp_path, PARKED) == (0, None)
    (tmp_path / "parked.1").write_text(" 12 1.0\n")
    (tmp_path / "parked.0").write_text("2 11 1.0\n")
    assert reported_ranks(tmp_path, PARKED) == (2, 2)
    assert TRIGGER.match("step  5/10 | loss 1.0 | lr") and not TRIGGER.match("gradients: mpi all-reduce (inline)")
    assert not TRIGGER.match("model mlp: 1,000 parameters")


def test_launch_json_says_which_host_file_or_package_changed_since_the_standby_started(tmp_path, monkeypatch):
    """The supervisor's decision on a parked standby: a host file given as ``--hostfile=PATH`` edited since the
    standby started, or a package version changed since its rank 0 recorded them, discards it, and the attempt's
    record (launch.json's ``standby_note``) says which."""
    import hpcnet.launch.standby as standby_module

    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    manifest = tmp_path / "imported.json"
    manifest.write_text(json.dumps(imported_manifest()))
    # The standby's ranks as a shell plays them: rank 0 of 1 records what it imported and parks; the host file
    # option is only there for the fingerprint ($0 of the script).
    park = f'cp {manifest} "$HPCNET_STANDBY/imported.json"; echo "1 $$ 0" > "$HPCNET_STANDBY/parked.0"; sleep 60'
    cmd, env = ["sh", "-c", park, f"--hostfile={hosts}"], clean_env()

    def decide(name, change):
        standbys = Standbys(tmp_path, None, launcher="other", openmpi=False)
        standbys.current = Standby(2, cmd, env, tmp_path / f"standby-{name}", fingerprint(cmd, env, None),
                                   launcher="other", openmpi=False)
        change()
        record = Attempt(attempt=2, command=cmd, run_dir=None, start_unix=time.time())
        used = standbys.take(2, cmd, env, record, lambda: False)
        if used is not None:
            used.discard()
        standbys.close()
        return record.standby_note

    assert decide("unchanged", lambda: None).startswith("released with 1/1 ranks parked")
    assert decide("hosts", lambda: hosts.write_text("localhost slots=4\n")) == (
        f"standby discarded: the host file changed ({hosts}) since it started; cold start")
    torch_now = installed_packages(sys.path)["torch"]
    upgrade = lambda: monkeypatch.setattr(standby_module, "installed_packages",  # noqa: E731
                                          lambda path: {**installed_packages(path), "torch": "99.0"})
    assert decide("packages", upgrade) == (f"standby discarded: installed packages changed (torch {torch_now} -> 99.0)"
                                           " since its ranks imported it; cold start")


# -- under mpirun --------------------------------------------------------------------------------------------------
def test_a_standby_is_released_only_once_every_rank_has_parked(tmp_path):
    """At a failure the supervisor waits for the standby's ranks that still import (a release signal would end a
    rank that has not yet blocked it); a standby that ends or never parks is not waited for past its end or the
    timeout."""
    park_late = ('sleep 0.5; echo "2 1 0" > "$HPCNET_STANDBY/parked.0"; sleep 0.3; '
                 'echo "" > "$HPCNET_STANDBY/parked.1"; sleep 30')
    cases = {"late": (park_late, 20.0, True), "ends": ("exit 3", 20.0, False), "never": ("sleep 30", 0.5, False)}
    for name, (script, timeout_s, expected) in cases.items():
        standby = Standby(2, ["sh", "-c", script], clean_env(), tmp_path / name, "fp", launcher="other", openmpi=False)
        try:
            t0 = time.monotonic()
            assert standby.wait_parked(timeout_s) is expected, name
            assert time.monotonic() - t0 < (15 if expected else timeout_s + 5)
            if expected:
                assert standby.parked() == "2/2 ranks parked" and time.monotonic() - t0 >= 0.7
        finally:
            standby.discard()
    stopped = Standby(2, ["sh", "-c", "sleep 30"], clean_env(), tmp_path / "stop", "fp", launcher="other",
                      openmpi=False)
    try:
        assert stopped.wait_parked(60.0, stopping=lambda: True) is False
    finally:
        stopped.discard()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_parked_process_whose_supervisor_is_gone_leaves(tmp_path):
    """The supervisor named in the environment no longer lives: the parked process sees it at its next watch and
    exits, after it had parked."""
    host = socket.gethostname()
    assert not orphaned(0, f"{host} {os.getpid()}") and not orphaned(os.getppid(), "")
    assert orphaned(0, f"{host} {_dead_pid()}") and orphaned(os.getpid(), "")  # a parent it never had
    assert not orphaned(0, f"another-host {_dead_pid()}")  # only the supervisor's host can tell
    env = {**clean_env(), STANDBY_ENV: str(tmp_path / "sb"), STANDBY_OWNER_ENV: f"{host} {_dead_pid()}"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "from hpcnet.launch.park import park; park([])"], env=env,
                         timeout=60, capture_output=True, text=True)
    assert out.returncode == ORPHAN_EXIT, out.stderr
    assert list((tmp_path / "sb").glob("parked.*")) and time.monotonic() - t0 < 20 + WATCH_S


def test_a_standby_dies_with_its_launcher_even_before_it_parks(tmp_path):
    """Importing hpcnet in a standby asks for SIGKILL at its parent's death: a launcher killed while its ranks
    still import (before they park) leaves none of them behind."""
    child = ("import hpcnet, sys, time; print('imported', flush=True); time.sleep(120)")
    parent = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
              "stdout=subprocess.PIPE, text=True); p.stdout.readline(); print(p.pid, flush=True); "
              "os.kill(os.getpid(), 9)")
    env = {**clean_env(), STANDBY_ENV: str(tmp_path / "sb")}
    out = subprocess.run([sys.executable, "-c", parent, child], env=env, timeout=60, capture_output=True, text=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _standby_processes(marker: str) -> list[int]:
    """Processes whose environment names a standby directory under ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"HPCNET_STANDBY={marker}".encode() in environ:
            found.append(int(entry.name))
    return found


def _none_left(marker: str, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _standby_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _launch(tmp_path, name, *extra, options=(), stderr=None):
    # The first attempt pauses at step 2 (fault.sleep_*: its rank 1, the one that is killed later), so the standby
    # has started, and usually parked, before the fault; the numbers do not change.
    command = _train_command(tmp_path, name, "fault.sleep_at_step=2", "fault.sleep_s=8", *extra)
    return subprocess.Popen([sys.executable, "-m", "hpcnet.launch", "--backoff-s", "0", *options, "--", *command],
                            cwd=tmp_path, env=clean_env(), stderr=stderr, stdout=subprocess.DEVNULL, text=True)


def _record(tmp_path, name):
    return json.loads(next((tmp_path / "runs").glob(f"{name}-*/launch.json")).read_text())


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_killed_rank_restarts_from_the_standby_and_ends_identical(tmp_path, reference):  # noqa: F811
    with open(tmp_path / "err.txt", "w") as err:
        proc = _launch(tmp_path, "warm", "fault.kill_at_step=6", "fault.only_attempt=1", options=("--standby", "on"),
                       stderr=err)
        assert proc.wait(timeout=240) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    text = (tmp_path / "err.txt").read_text()
    assert "standby for attempt 2 started" in text and re.search(r"attempt 2/\d+ \(warm standby\)", text)
    attempts = _record(tmp_path, "warm")["attempts"]
    assert [a["status"] for a in attempts] == [137, 0]
    assert attempts[1]["standby"] and attempts[1]["standby_note"].startswith("released with"), attempts[1]
    assert not attempts[0]["standby"]
    _assert_same(_final_tensors(tmp_path, "warm"), reference)
    assert _none_left(str(tmp_path)) == []  # the standby made for attempt 3 is gone too


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_kill_just_after_the_standby_started_waits_for_it_to_park(tmp_path, reference):  # noqa: F811
    """The kill comes a step after the standby was started, while its ranks still import: the supervisor waits
    for them to park before the release (a release sooner ended them with SIGUSR1: status 138, seen once in
    the suite), and the run ends as the uninterrupted one."""
    with open(tmp_path / "err.txt", "w") as err:
        proc = _launch(tmp_path, "early", "fault.kill_at_step=2", "fault.only_attempt=1", "fault.sleep_at_step=0",
                       options=("--standby", "on"), stderr=err)
        assert proc.wait(timeout=240) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    attempts = _record(tmp_path, "early")["attempts"]
    assert [a["status"] for a in attempts] == [137, 0]
    assert attempts[1]["standby"] and attempts[1]["standby_note"].startswith("released with 2/2 ranks parked")
    _assert_same(_final_tensors(tmp_path, "early"), reference)
    assert _none_left(str(tmp_path)) == []


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_changed_config_file_discards_the_standby(tmp_path, reference):  # noqa: F811
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 10\n")
    with open(tmp_path / "err.txt", "w") as err:
        proc = _launch(tmp_path, "changed", "--config", str(config), "fault.kill_at_step=6", "fault.only_attempt=1",
                       stderr=err)
        deadline = time.monotonic() + 150
        while "standby for attempt 2 started" not in (tmp_path / "err.txt").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.2)
        config.write_text("[train]\nsteps = 10  # edited while the job runs\n")
        assert proc.wait(timeout=200) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    attempts = _record(tmp_path, "changed")["attempts"]
    assert [a["status"] for a in attempts] == [137, 0] and not attempts[1]["standby"]
    assert "config file changed" in attempts[1]["standby_note"]
    _assert_same(_final_tensors(tmp_path, "changed"), reference)
    assert _none_left(str(tmp_path)) == []


@pytest.mark.launch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "failure"])  # SIGINT takes SIGTERM's path (Forwarder)
def test_no_parked_process_outlives_the_supervisor(tmp_path, how):
    """However the supervisor ends (a stop signal, kill -9 of it, a failure it does not restart), the standby's
    processes end too: the supervisor reaps them, or the parent-death signal reaches them."""
    _serial_only()
    # A job that cannot end before the signal comes (10 ms a step). At 0.6 ms a step and a line each, mpirun's
    # output forwarding fell tens of thousands of lines behind, the ranks then ran at the speed of their log, and the
    # job outlived the test's wait although its ranks had stopped on the signal.
    extra = (["fault.write_error=EDQUOT", "fault.write_error_at_step=4"] if how == "failure"
             else ["train.steps=100000", "checkpoint.every_steps=0", "fault.slow_s=0.01"])
    extra.append("fault.sleep_at_step=0")  # no pause: the standby is made while the attempt runs on
    with open(tmp_path / "err.txt", "w") as err:
        proc = _launch(tmp_path, "left", *extra, stderr=err)
        try:
            deadline = time.monotonic() + 150
            while not _standby_processes(str(tmp_path)):
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
                time.sleep(0.2)
            if how != "failure":
                proc.send_signal(getattr(signal, how))
            proc.wait(timeout=120)
        finally:
            proc.kill()
    assert _none_left(str(tmp_path), 30.0) == [], (tmp_path / "err.txt").read_text()[-3000:]
    if how == "failure":
        assert proc.returncode == 2
