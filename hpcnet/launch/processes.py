"""The supervisor's processes: a launcher started in a process group of its own with its output teed to ours, found
again through /proc, and killed with everything it started here.

What is left of an attempt once its launcher ended is found by a tag in the environment (``HPCNET_PROCESS_TAG``)
that every process it starts on this host inherits, not by the process group, because Open MPI's mpirun gives
every rank a process group of its own; nor by a session of its own, which a kernel with ``sched_autogroup``
schedules as one group against ours and can leave the supervisor unscheduled for seconds while the ranks spin
(docs/fault-tolerance.md).  A probe, which may leave a launcher waiting for a daemon it cannot reach, runs in a
session of its own and is found by it (``reap_session``).
"""

import contextlib
import ctypes
import functools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

TAG_ENV = "HPCNET_PROCESS_TAG"
"""In the environment of every process an attempt starts on this host (inherited, so its launcher's children and
theirs carry it whatever session or process group they move to): what ``reap`` finds them by."""


def say(message: str) -> None:
    """One line from the supervisor on stderr, as ``hpcnet.launch: message``."""
    print(f"hpcnet.launch: {message}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the supervisor dies (Linux), so a job never outlives its supervisor."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the process group still gets signals
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _live_processes(proc_dir: Path) -> Iterator[tuple[Path, list[str]]]:
    """Each live process (zombies left out) in ``proc_dir``: its /proc directory and the fields of its ``stat``
    after the command name (which may hold spaces): state, ppid, pgrp, session, ...  Nothing where there is no
    /proc."""
    try:
        entries = list(os.scandir(proc_dir))
    except FileNotFoundError:
        return
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields and fields[0] != "Z":
            yield Path(entry.path), fields


def session_members(sid: int, proc_dir: Path = Path("/proc")) -> list[int]:
    """Live processes of session ``sid``, from /proc (Linux; elsewhere none are found)."""
    return [int(path.name) for path, fields in _live_processes(proc_dir) if int(fields[3]) == sid]


def tagged_processes(tag: str, proc_dir: Path = Path("/proc")) -> list[int]:
    """Live processes whose environment holds ``HPCNET_PROCESS_TAG=tag``, from /proc (Linux; elsewhere none are
    found).  Processes of other users, whose environment cannot be read, are never members; a tag is never used
    twice (it holds our pid and 48 random bits), so no unrelated process is."""
    needle = b"\0" + f"{TAG_ENV}={tag}".encode() + b"\0"
    members = []
    for path, _ in _live_processes(proc_dir):
        try:
            if needle in b"\0" + (path / "environ").read_bytes():
                members.append(int(path.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return members


def reap(find: Callable[[], list[int]], timeout_s: float = 30.0) -> tuple[list[int], list[int]]:
    """SIGKILL every process ``find()`` lists until it lists none; return (killed, still alive after timeout_s).

    The attempt is over (its launcher ended): what is left of it would only
    race the next attempt, so it gets no grace period.  A checkpoint it was
    writing is never committed halfway (commits are a rename).
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        members = find()
        if not members or time.monotonic() > deadline:
            return killed, members
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.05)


def reap_session(sid: int, timeout_s: float = 30.0) -> tuple[list[int], list[int]]:
    """``reap`` the processes of session ``sid`` (a probe's: ``hpcnet.launch.elastic.run_probe``).  The kernel does
    not hand out a session's id as a new pid while the session has members, so the scan cannot pick up an
    unrelated process."""
    return reap(functools.partial(session_members, sid), timeout_s)


def _tee(stream: Any, out: TextIO, on_line: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        out.write(line)
        out.flush()
        on_line(line)
    stream.close()


class LauncherProcess:
    """A launcher process in a process group of its own, tagged, its output teed to ours as it comes; ``on_line``,
    once set, is called with each line."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        # Its own process group, in our session: a Ctrl-C on the terminal reaches the job once, through us (so
        # its stdin is not the terminal, which a background group may not read); every process it starts here
        # is found by its tag afterwards (reap).
        self.tag = f"{os.getpid()}.{secrets.token_hex(6)}"
        self.proc = subprocess.Popen(command, env={**env, TAG_ENV: self.tag}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                                     preexec_fn=_die_with_parent)
        self.on_line: Callable[[str], None] | None = None
        self.threads = [threading.Thread(target=_tee, args=(self.proc.stdout, sys.stdout, self._line), daemon=True),
                        threading.Thread(target=_tee, args=(self.proc.stderr, sys.stderr, self._line), daemon=True)]
        for thread in self.threads:
            thread.start()

    def reap(self, timeout_s: float = 30.0) -> tuple[list[int], list[int]]:
        """SIGKILL the launcher and everything it started here (``reap`` of its ``tagged_processes``)."""
        return reap(functools.partial(tagged_processes, self.tag), timeout_s)

    def join_output(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for each stream of its output to be teed to the end."""
        for thread in self.threads:
            thread.join(timeout=timeout_s)

    def _line(self, line: str) -> None:
        hook = self.on_line
        if hook is not None:
            hook(line)


def end_launcher(launcher: LauncherProcess, grace_s: float) -> None:
    """End a launcher that outlived its grace after a declared failure: it and everything it started here (the
    ranks and daemons, the rsh/ssh agents that reach the other hosts) get SIGKILL.  Daemons on a host it cannot
    reach are beyond any signal from here; Open MPI's orted ends itself when it loses its connection to mpirun,
    and a cut-off rank ends itself when its heartbeats stop (docs/fault-tolerance.md)."""
    say(f"the job declared its failure {grace_s:g} s ago and the launcher (pid {launcher.proc.pid}) is still "
        "running (a daemon it cannot reach?): ending it and every process it started here (--launcher-grace-s)")
    killed, alive = launcher.reap(timeout_s=10.0)
    if alive:
        say(f"processes {alive[:10]} that the launcher started are still alive after SIGKILL")
    elif killed:
        say(f"killed {len(killed)} process(es) that the launcher started")
