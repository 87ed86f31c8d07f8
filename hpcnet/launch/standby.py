"""Warm standby, the supervisor's side (docs/fault-tolerance.md): when to start one, what makes one stale, its
processes (``Standby``), and the one the supervisor holds for its next attempt (``Standbys``). The ranks' side is
``hpcnet.launch.park``.

A cold restart spends most of its seconds starting: the launcher, the interpreters, importing torch and h5py,
and, on a real cluster, all of that from a parallel file system on every node at once. A standby does it while the
current attempt trains: it is the next attempt's own command (same launcher, hosts, arguments, ``--resume auto``)
whose ranks park before MPI initialisation. When the attempt fails, the supervisor releases it (SIGUSR1 to the
launcher, which forwards it to every rank) and starts the next standby. A standby is used only if what it would
run is what a cold restart would run now. The supervisor compares (``fingerprint``, ``fingerprint_changes``) the
command, the environment, the host files (named in the command, ``--hostfile=PATH`` too, or by environment
variables such as ``OMPI_MCA_orte_default_hostfile``, ``SLURM_HOSTFILE``, ``PBS_NODEFILE``), hpcnet's code and the
``--config`` file as they were when the standby started with how they are now; and what the standby's ranks
imported before they parked, as rank 0 recorded it (``hpcnet.launch.park.imported_manifest``,
``imported_changes``): the file of every module from outside the standard library and site-packages (the model
and dataset factories' modules, hpcnet itself in a checkout) and the version of every package installed on their
``sys.path`` (torch among them).
"""

import concurrent.futures
import contextlib
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hpcnet
from hpcnet.launch.attempt import Attempt
from hpcnet.launch.command import MPIRUN_HOSTFILES, launcher_options
from hpcnet.launch.park import IMPORTED_FILE, PARKED, RELEASE_SIGNAL, file_stat, installed_packages
from hpcnet.launch.processes import LauncherProcess, say
from hpcnet.launch.restarts import normalise_status
from hpcnet.launch.stop import READY, clear_reports, reported_ranks
from hpcnet.paths import READY_ENV, STANDBY_ENV, STANDBY_OWNER_ENV

TRIGGER = re.compile(r"^step\s+\d+/\d+ \|")
"""The attempt's first step line (rank 0's log): its start-up, imports, checkpoint load and first steps, is over,
and the standby starts then, so the two do not compete for the CPU (started at the earlier ``gradients:`` line,
the standby's imports slow down the load and first step of the attempt it is made beside)."""
TRIGGER_TIMEOUT_S = 60.0
"""... or this long after the attempt started, whichever comes first."""
PARK_WAIT_S = 60.0
"""At a failure, how long the supervisor waits for a standby's ranks still importing to park before it releases
them (a release before a rank has blocked the signal would end it); past it the standby is discarded."""
HOSTFILE_OPTIONS = (*MPIRUN_HOSTFILES, "--nodefile")
"""Launcher options that name a host file (mpirun's, srun's ``--nodefile``)."""
HOSTFILE_ENV = re.compile(r"(host|node|machine)_?file$", re.IGNORECASE)
"""Environment variables that name a host file a launcher reads: ``OMPI_MCA_orte_default_hostfile``,
``PRTE_MCA_prte_default_hostfile``, ``HYDRA_HOST_FILE``, ``SLURM_HOSTFILE``, ``PBS_NODEFILE``."""
def standby_command(command: list[str], launcher: str) -> list[str]:
    """The next attempt's command as a standby runs it: under srun a step that may share the allocation's CPUs
    with the running one (``--overlap``)."""
    if launcher == "srun" and "--overlap" not in command:
        return [command[0], "--overlap", *command[1:]]
    return list(command)


def code_stat() -> list[tuple[str, list[int] | None]]:
    """Hpcnet's source files with their modification times and sizes."""
    root = Path(hpcnet.__file__).parent
    return [(str(p.relative_to(root)), file_stat(p)) for p in sorted(root.rglob("*.py"))]


def hostfile_paths(command: list[str], env: dict[str, str]) -> list[str]:
    """The host files that ``command`` names (``--hostfile PATH`` or ``--hostfile=PATH``), then those that
    environment variables name (``HOSTFILE_ENV``)."""
    paths = [value for _, _, value in launcher_options(command, HOSTFILE_OPTIONS)]
    paths += [value for name, value in sorted(env.items()) if value and HOSTFILE_ENV.search(name)]
    return paths


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def fingerprint(command: list[str], env: dict[str, str], config_file: str | None) -> dict[str, Any]:
    """What a standby must share with the attempt it stands in for: command, environment, host files' contents,
    hpcnet's code and the config file (compared by ``fingerprint_changes``)."""
    return {"command": list(command), "env": dict(env),
            "hostfiles": {path: _read(path) for path in hostfile_paths(command, env)},
            "code": dict(code_stat()),
            "config": {config_file: file_stat(Path(config_file))} if config_file else {}}


def _names(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


_ABSENT = object()


def _changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The keys whose values differ, or that only one of the two has."""
    return sorted(key for key in old.keys() | new.keys() if old.get(key, _ABSENT) != new.get(key, _ABSENT))


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two ``fingerprint`` records, in words ('' if nothing): which environment variables
    (names only: values may be secrets), host files, hpcnet files, config file."""
    changes = []
    if old["command"] != new["command"]:
        changes.append("the command changed")
    if names := _changed_keys(old["env"], new["env"]):
        changes.append(f"the environment changed ({_names(names)})")
    if names := _changed_keys(old["hostfiles"], new["hostfiles"]):
        changes.append(f"the host file changed ({_names(names)})")
    if names := _changed_keys(old["code"], new["code"]):
        changes.append(f"hpcnet's code changed ({_names(names)})")
    if names := _changed_keys(old["config"], new["config"]):
        changes.append(f"the config file changed ({_names(names)})")
    return "; ".join(changes)


def imported_changes(recorded: dict[str, Any], packages: Any = None) -> str:
    """What changed since a standby recorded ``recorded`` (``hpcnet.launch.park.imported_manifest``), in words; ''
    if nothing.

    ``packages``: reads the versions installed on a ``sys.path`` now (default ``installed_packages``).
    """
    changes = []
    edited = [path for path, stat in recorded["modules"].items() if file_stat(Path(path)) != stat]
    if edited:
        changes.append(f"code it imported changed ({_names(edited)})")
    before, now = recorded["packages"], (packages or installed_packages)(recorded["path"])
    versions = [f"{name} {before.get(name, 'not installed')} -> {now.get(name, 'removed')}"
                for name in sorted(before.keys() | now.keys()) if before.get(name) != now.get(name)]
    if versions:
        changes.append(f"installed packages changed ({_names(versions)})")
    return "; ".join(changes)


class Standby:
    """The next attempt's processes, started ahead and parked before MPI initialisation (``hpcnet.launch.park``).

    Args:
        attempt: the attempt it would run.
        command: that attempt's command; ``launcher`` and ``openmpi`` say how to make it a standby's.
        env: that attempt's environment.
        directory: where its ranks report that they are parked, and rank 0 what it imported.
        fingerprint: what must be unchanged for it to be used (``fingerprint``).
    """

    def __init__(self, attempt: int, command: list[str], env: dict[str, str], directory: Path,
                 fingerprint: dict[str, Any], *, launcher: str, openmpi: bool) -> None:
        self.attempt, self.directory, self.fingerprint = attempt, directory, fingerprint
        directory.mkdir(parents=True, exist_ok=True)
        clear_reports(directory, f"{PARKED}.*", IMPORTED_FILE)
        if env.get(READY_ENV):  # its ranks report there as those of a cold start of the attempt would
            clear_reports(Path(env[READY_ENV]), f"{READY}.*")
        command = standby_command(command, launcher)
        if openmpi and launcher == "mpirun":
            command = [command[0], "-x", STANDBY_ENV, "-x", STANDBY_OWNER_ENV, *command[1:]]  # other nodes too
        self.command = command
        self.started_unix = time.time()
        owner = f"{socket.gethostname()} {os.getpid()}"
        self.process = LauncherProcess(command, {**env, STANDBY_ENV: str(directory), STANDBY_OWNER_ENV: owner})

    def alive(self) -> bool:
        return self.process.proc.poll() is None

    def parked(self) -> str:
        """'N/M ranks parked' (M unknown before rank 0 has parked)."""
        count, size = reported_ranks(self.directory, PARKED)
        return f"{count}/{size if size is not None else '?'} ranks parked"

    def wait_parked(self, timeout_s: float, stopping: Callable[[], bool] | None = None) -> bool:
        """Wait until every rank has parked (rank 0 reports how many there are); False if the standby ended,
        ``stopping()`` became true or ``timeout_s`` passed first. A release must not come sooner: a rank that
        has not yet imported hpcnet (which blocks the release signal) would be ended by it."""
        deadline = time.monotonic() + timeout_s
        while True:
            count, size = reported_ranks(self.directory, PARKED)
            if size is not None and count >= size:
                return True
            if not self.alive() or time.monotonic() >= deadline or (stopping is not None and stopping()):
                return False
            time.sleep(0.01)

    def imported_changes(self) -> str:
        """What changed, in words, in the code and packages that its rank 0 imported before it parked ('' if
        nothing; ``imported_changes``)."""
        try:
            return imported_changes(json.loads((self.directory / IMPORTED_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"its rank 0 did not record what it imported ({self.directory / IMPORTED_FILE})"

    def release(self) -> None:
        """Let its ranks go on (the launcher forwards the signal to every rank)."""
        os.kill(self.process.proc.pid, RELEASE_SIGNAL)

    def discard(self) -> None:
        """End every process of the standby and wait for them."""
        self.process.reap(timeout_s=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.proc.wait(timeout=10)
        self.process.join_output(timeout_s=2)


class Standbys:
    """The standby the supervisor holds for its next attempt: started once the running attempt's start-up is over
    (``start_when_up``) or for a grow (``start``), taken at the next attempt's start if it is still what a cold
    start would run (``take``), else discarded.

    Standbys are started by one thread that lives as long as the supervisor: Linux sends the parent-death signal
    (``hpcnet.launch.processes``) when the *thread* that started a child ends, so a short-lived thread would kill
    its standby as soon as it returned.

    Args:
        launch_dir: where each standby's directory goes (``standby-<attempt>``).
        config_file: the run's ``--config`` file, part of what must be unchanged (``fingerprint``).
        launcher: the launcher's kind; ``openmpi``: whether it is Open MPI's mpirun.
    """

    def __init__(self, launch_dir: Path, config_file: str | None, *, launcher: str, openmpi: bool) -> None:
        self.launch_dir, self.config_file, self.launcher, self.openmpi = launch_dir, config_file, launcher, openmpi
        self.current: Standby | None = None
        """The standby for the next attempt, once started."""
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcnet-standby")

    def start(self, attempt: int, command: list[str], env: dict[str, str]) -> Standby:
        """Start a standby for ``attempt`` (the one held before is discarded); ``OSError`` when it cannot start."""
        self.discard()
        self.current = self._spawner.submit(
            Standby, attempt, command, env, self.launch_dir / f"standby-{attempt}",
            fingerprint(command, env, self.config_file), launcher=self.launcher, openmpi=self.openmpi).result()
        return self.current

    def start_when_up(self, attempt: int, setup: Callable[[int], tuple[list[str], dict[str, str], Any]],
                      started_up: threading.Event, ended: threading.Event,
                      stopping: Callable[[], bool]) -> threading.Thread:
        """A thread that starts the standby for ``attempt`` + 1 (its command and environment: ``setup``) once this
        attempt's start-up is over (``TRIGGER``, or ``TRIGGER_TIMEOUT_S``), unless the attempt ended or a stop
        signal came (no attempt follows it)."""
        thread = threading.Thread(target=self._start_when_up, args=(attempt, setup, started_up, ended, stopping),
                                  daemon=True)
        thread.start()
        return thread

    def _start_when_up(self, attempt: int, setup: Callable[[int], tuple[list[str], dict[str, str], Any]],
                       started_up: threading.Event, ended: threading.Event, stopping: Callable[[], bool]) -> None:
        started_up.wait(TRIGGER_TIMEOUT_S)
        if ended.is_set() or stopping():
            return
        cmd, env, _ = setup(attempt + 1)
        try:
            standby = self.start(attempt + 1, cmd, env)
        except OSError as exc:
            say(f"cannot start a standby for attempt {attempt + 1}: {exc.strerror or exc}")
            return
        say(f"standby for attempt {attempt + 1} started (pid {standby.process.proc.pid}); it parks before MPI "
            "starts")

    def take(self, attempt: int, cmd: list[str], env: dict[str, str], record: Attempt,
             stopping: Callable[[], bool]) -> Standby | None:
        """The standby for ``attempt`` if it is alive, what it runs is what a cold start would run now (``cmd``,
        ``env``) and its ranks have all parked (waiting for them up to ``PARK_WAIT_S``: they are further on than a
        cold start would be); else it is discarded and ``record`` says why. None too when ``stopping()`` (a stop
        signal) becomes true."""
        standby, self.current = self.current, None
        if standby is None:
            if attempt > 1:
                record.standby_note = "no standby was ready (the previous attempt ended before its start-up was over)"
            return None
        note = self._stale(standby, attempt, cmd, env, stopping)
        if note:
            standby.discard()
            record.standby_note = f"standby discarded: {note}{'' if stopping() else '; cold start'}"
            say(record.standby_note)
            return None
        record.standby, record.standby_started_unix = True, standby.started_unix
        record.standby_note = f"released with {standby.parked()} after {time.time() - standby.started_unix:.1f} s"
        return standby

    def _stale(self, standby: Standby, attempt: int, cmd: list[str], env: dict[str, str],
               stopping: Callable[[], bool]) -> str:
        """Why ``standby`` may not run ``attempt``, in words ('' when it may), once its ranks have parked."""
        if standby.attempt != attempt:
            return f"it was made for attempt {standby.attempt}"
        if changes := fingerprint_changes(standby.fingerprint, fingerprint(cmd, env, self.config_file)):
            return f"{changes} since it started"
        if not stopping() and not standby.wait_parked(0.0):
            say(f"waiting for the standby's ranks to park ({standby.parked()})")
        if not standby.wait_parked(PARK_WAIT_S, stopping):
            if not standby.alive():
                return f"it ended with status {normalise_status(standby.process.proc.returncode)}"
            if stopping():
                return "a stop signal came while its ranks were parking"
            return f"its ranks had not all parked within {PARK_WAIT_S:.0f} s ({standby.parked()})"
        if changes := standby.imported_changes():
            return f"{changes} since its ranks imported it"
        return ""

    def discard(self) -> None:
        """End the standby held, if any."""
        if self.current is not None:
            self.current.discard()
            self.current = None

    def close(self) -> None:
        """Discard the standby held and end the thread that starts them."""
        self.discard()
        self._spawner.shutdown(wait=True)
