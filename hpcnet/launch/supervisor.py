"""Automatic restart: run an hpcnet job and, when it fails restartably, run it again from its newest checkpoint.

    python -m hpcnet.launch [--max-restarts 3] [--backoff-s 1] [--exclude-failed-hosts] -- \\
        mpirun -np 64 python -m mpi4py -m hpcnet.train run.name=big checkpoint.every_s=600 ...

Why a supervisor process outside MPI, not recovery inside the job: Open MPI 4
has no ULFM (user-level failure mitigation), so when one rank dies the
communicator is unusable and mpirun tears the whole job down within about a
second; a hung rank is worse: MPI never notices it, so the heartbeat monitor
ends the job itself (status 75).  Either way the only recovery is a fresh job,
and something that outlives the job must start it: this small process, which
holds no MPI state, imports no torch, and sits in front of the launcher.

This module runs the attempts: each in a process group of its own, its output
teed (a launcher's line about a dead rank is recorded), whatever is left of it
killed when the launcher ends (``reap``: every process whose environment holds
the attempt's tag, ``HPCNET_PROCESS_TAG``, not the process group, because
Open MPI's mpirun gives every rank a process group of its own; nor a session
of its own, which a kernel with ``sched_autogroup`` schedules as one group
against ours and can leave this process unscheduled for seconds while the
ranks spin: docs/fault-tolerance.md), stop signals forwarded
(``hpcnet.launch.forward``: whenever one comes, no attempt starts after it),
and ``launch.json`` written.
What each attempt runs is ``hpcnet.launch.command``; whether to run another,
``hpcnet.launch.restarts``; which hosts to leave out, ``hpcnet.launch.hosts``.
docs/fault-tolerance.md describes the behaviour and the exit status.
"""

import argparse
import concurrent.futures
import contextlib
import ctypes
import functools
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpcnet.ckpt.fence import Fence, write_fence
from hpcnet.config import MAX_DURATION_S
from hpcnet.config.load import command_line_config, parse_command_line
from hpcnet.errors import ConfigError, ExitCode
from hpcnet.launch.command import (
    LAUNCHER_KINDS,
    attempt_command,
    is_openmpi,
    launcher_env,
    launcher_kind,
    restart_args,
    restart_from,
    train_args_start,
)
from hpcnet.launch.elastic import (
    PROBE_EVERY_S,
    PROBE_TIMEOUT_S,
    ElasticError,
    HostWatch,
    check_template,
    elastic_ranks,
    host_names,
    known_kind,
    lost_entries,
    place,
    probe_command,
    probe_hosts,
    ranks_of,
)
from hpcnet.launch.forward import Forwarder, ranks_ready, ranks_started, stop_status
from hpcnet.launch.hosts import RESOLVE_TIMEOUT_S, resolve_all, slurm_allocation
from hpcnet.launch.park import RELEASE_SIGNAL
from hpcnet.launch.restarts import (
    RestartBudget,
    backoff_s,
    committed_checkpoints,
    declared,
    describe_failure,
    describe_loss,
    describe_status,
    failed_where,
    failure_from_line,
    host_loss_from_line,
    is_abort_line,
    is_restartable,
    lost_host,
    merge_host_loss,
    new_checkpoints,
    normalise_status,
    read_failure,
    read_rank_hosts,
    read_rank_places,
)
from hpcnet.launch.standby import (
    IMPORTED_FILE,
    PARK_WAIT_S,
    TRIGGER,
    TRIGGER_TIMEOUT_S,
    clear_reports,
    fingerprint,
    fingerprint_changes,
    imported_changes,
    parked_ranks,
    standby_command,
)
from hpcnet.launch.stop import READY
from hpcnet.paths import (
    ATTEMPT_ENV,
    FAILURE_FILE,
    FENCE_NAME,
    LAUNCH_FILE,
    LAUNCH_ID_ENV,
    READY_ENV,
    STANDBY_ENV,
    STANDBY_OWNER_ENV,
    attempt_dir,
    checkpoint_dir,
    ready_dir,
    run_dir_path,
)


@dataclass(slots=True)
class Attempt:
    """One run of the job, as written to launch.json."""

    attempt: int
    command: list[str]
    run_dir: str | None
    start_unix: float
    end_unix: float = 0.0
    duration_s: float = 0.0
    status: int = -1
    cause: str = ""
    restartable: bool = False
    failure: dict[str, Any] | None = None
    """failure.json of the run (heartbeat monitor), else the launcher's report of a dead rank."""
    launcher_report_unix: float | None = None
    """When the launcher printed that a rank died (how fast the death was noticed)."""
    excluded_hosts: list[str] = field(default_factory=list)
    signal_received: int = 0
    new_checkpoints: list[str] = field(default_factory=list)
    """Checkpoints this attempt committed (progress: the restart budget starts again)."""
    reaped: list[int] = field(default_factory=list)
    """Processes of the attempt still running after the launcher ended, killed before going on."""
    survivors: list[int] = field(default_factory=list)
    """Processes that would not die (SIGKILL in an uninterruptible wait): nothing more is started."""
    standby: bool = False
    """Run by a warm standby: started during the previous attempt, parked, released at its failure."""
    standby_note: str = ""
    """Why no standby was used (none was ready, or it was discarded and why)."""
    standby_started_unix: float | None = None
    """When the standby that ran this attempt was started."""
    declared_unix: float | None = None
    """When the job declared its failure (its failure.json appeared, or the launcher reported an MPI_Abort)."""
    launcher_ended: bool = False
    """The launcher had not exited ``launcher_grace_s`` after the declared failure: the supervisor ended it."""
    start_timed_out: bool = False
    """Its ranks had not all started ``--start-timeout-s`` after the launcher did: the supervisor ended it."""
    launcher_loss: dict[str, Any] | None = None
    """What the launcher printed about a lost daemon or node (``hpcnet.launch.restarts.host_loss_from_line``)."""
    lost_host: dict[str, Any] | None = None
    """The host the attempt lost and how that is known (``hpcnet.launch.restarts.lost_host``); None if none was."""
    ranks: int | None = None
    """The ranks its command asks for (``-np``, ``-n``; None when it names none)."""
    grow: list[str] = field(default_factory=list)
    """Excluded hosts that answered again while it ran: it was asked to save and stop to let them back in."""
    grow_unix: float | None = None
    """When it was asked to save and stop for them."""


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


TAG_ENV = "HPCNET_PROCESS_TAG"
"""In the environment of every process an attempt starts on this host (inherited, so its launcher's children and
theirs carry it whatever session or process group they move to): what ``reap`` finds them by."""


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


def reap_session(sid: int, timeout_s: float = 30.0) -> tuple[list[int], list[int]]:
    """``reap`` the processes of session ``sid`` (a probe's: ``hpcnet.launch.elastic.run_probe``).  The kernel does
    not hand out a session's id as a new pid while the session has members, so the scan cannot pick up an
    unrelated process."""
    return reap(functools.partial(session_members, sid), timeout_s)


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


LAUNCHER_GRACE_S = 30.0
START_TIMEOUT_S = 300.0
"""``--start-timeout-s``: every rank of an attempt reports ready (``hpcnet.launch.stop``) within this many seconds of
the launcher's start, or the attempt is ended and restarted.  Generous: imports from a shared file system at many
ranks per node take minutes."""
"""Default of ``--launcher-grace-s``: how long a launcher may take to exit once the job declared its failure. Open
MPI's mpirun tears a job down within a second or two when it can reach every daemon; one that waits longer is
waiting for a daemon it cannot reach (a partitioned host), which it would do for ever."""


def written_since(path: Path, since_unix: float) -> float | None:
    """When ``path`` was last written, if it exists and was written at or after ``since_unix`` (a file left by an
    earlier run in a reused directory does not count); else None."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    return mtime if mtime >= since_unix - 1.0 else None


def end_launcher(started: "_Started", grace_s: float) -> None:
    """End a launcher that outlived its grace after a declared failure: it and everything it started here (the
    ranks and daemons, the rsh/ssh agents that reach the other hosts) get SIGKILL.  Daemons on a host it cannot
    reach are beyond any signal from here; Open MPI's orted ends itself when it loses its connection to mpirun,
    and a cut-off rank ends itself when its heartbeats stop (docs/fault-tolerance.md)."""
    _say(f"the job declared its failure {grace_s:g} s ago and the launcher (pid {started.proc.pid}) is still "
         "running (a daemon it cannot reach?): ending it and every process it started here (--launcher-grace-s)")
    killed, alive = started.reap(timeout_s=10.0)
    if alive:
        _say(f"processes {alive[:10]} that the launcher started are still alive after SIGKILL")
    elif killed:
        _say(f"killed {len(killed)} process(es) that the launcher started")


def _tee(stream: Any, out: TextIO, on_line: Any) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        out.write(line)
        out.flush()
        on_line(line)
    stream.close()


class _Started:
    """A launcher process in a process group of its own, tagged, its output teed to ours as it comes."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        # Its own process group, in our session: a Ctrl-C on the terminal reaches the job once, through us (so
        # its stdin is not the terminal, which a background group may not read); every process it starts here
        # is found by its tag afterwards (reap).
        self.tag = f"{os.getpid()}.{secrets.token_hex(6)}"
        self.proc = subprocess.Popen(command, env={**env, TAG_ENV: self.tag}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                                     preexec_fn=_die_with_parent)
        self.on_line: Any = None
        self.threads = [threading.Thread(target=_tee, args=(self.proc.stdout, sys.stdout, self._line), daemon=True),
                        threading.Thread(target=_tee, args=(self.proc.stderr, sys.stderr, self._line), daemon=True)]
        for thread in self.threads:
            thread.start()

    def reap(self, timeout_s: float = 30.0) -> tuple[list[int], list[int]]:
        """SIGKILL the launcher and everything it started here (``reap`` of its ``tagged_processes``)."""
        return reap(functools.partial(tagged_processes, self.tag), timeout_s)

    def _line(self, line: str) -> None:
        hook = self.on_line
        if hook is not None:
            hook(line)


def run_attempt(command: list[str], env: dict[str, str], forwarder: Forwarder, record: Attempt,
                started: "_Started | None" = None, on_line: Any = None, ready: Callable[[], bool] | None = None,
                launcher_grace_s: float = LAUNCHER_GRACE_S, on_declared: Callable[[], None] | None = None,
                poll: Callable[[subprocess.Popen], None] | None = None, start_timeout_s: float = 0.0,
                started_ranks: Callable[[], bool] | None = None) -> None:
    """Run one attempt to its end (``started``: already running, a released standby), teeing its output; fill in
    ``record``. ``ready``: whether its ranks handle stop signals yet (None: pass them on at once).

    Once the job has declared its failure (``failure.json`` in ``record.run_dir``, or an MPI_Abort the launcher
    reports), ``on_declared`` is called and the launcher gets ``launcher_grace_s`` to exit; then it and every
    process it started are killed (``end_launcher``).  ``poll(launcher)`` is called about once a second.
    When ``started_ranks`` is still false ``start_timeout_s`` (> 0) after the start, the launcher and what
    it started are killed too (``record.start_timed_out``): a launcher waiting for a daemon that never came up
    waits for ever.
    """
    def seen(line: str) -> None:
        if record.launcher_report_unix is None:
            found = failure_from_line(line)
            if found:
                record.launcher_report_unix = time.time()
                record.failure = record.failure or found
        if record.declared_unix is None and is_abort_line(line):
            record.declared_unix = time.time()
        loss = host_loss_from_line(line)
        if loss is not None:
            record.launcher_loss = merge_host_loss(record.launcher_loss, loss)
        if on_line is not None:
            on_line(line)

    record.start_unix = time.time()
    t0 = time.monotonic()
    if started is None:
        try:
            started = _Started(command, env)
        except OSError as exc:
            print(f"hpcnet.launch: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
            record.status, record.end_unix = 127, time.time()
            record.cause = f"cannot run {command[0]!r}"
            return
    started.on_line = seen
    proc = started.proc
    forwarder.attach(proc, ready)
    failure_path = Path(record.run_dir) / FAILURE_FILE if record.run_dir else None
    while True:
        try:
            returncode = proc.wait(timeout=0.05 if forwarder.pending else min(1.0, max(launcher_grace_s, 0.05)))
            break
        except subprocess.TimeoutExpired:
            forwarder.pass_on()  # a signal held until the ranks are ready
        if poll is not None:
            poll(proc)
        if (start_timeout_s > 0 and started_ranks is not None and not record.start_timed_out
                and time.monotonic() - t0 > start_timeout_s and not started_ranks()):
            record.start_timed_out = True
            _say(f"the ranks have not all started {start_timeout_s:g} s after the launcher (pid {proc.pid}) did (a "
                 "host that does not answer, a daemon that died?): ending it and every process it started here "
                 "(--start-timeout-s)")
            started.reap(timeout_s=10.0)
        if record.declared_unix is None and failure_path is not None:
            record.declared_unix = written_since(failure_path, record.start_unix)
        if record.declared_unix is not None and on_declared is not None:
            on_declared()
            on_declared = None
        if (record.declared_unix is not None and not record.launcher_ended
                and time.time() - record.declared_unix >= launcher_grace_s):
            record.launcher_ended = True
            end_launcher(started, launcher_grace_s)
    record.end_unix = time.time()
    record.duration_s = time.monotonic() - t0
    forwarder.detach()
    record.reaped, record.survivors = started.reap()  # before the tees: survivors hold the pipes
    if record.reaped:
        _say(f"killed {len(record.reaped)} process(es) the attempt left running: {record.reaped[:10]}")
    for thread in started.threads:
        thread.join(timeout=5)
    record.status = normalise_status(returncode)


class Standby:
    """The next attempt's processes, started ahead and parked before MPI initialisation (``hpcnet.launch.standby``).

    Args:
        attempt: the attempt it would run.
        command: that attempt's command; ``launcher`` and ``openmpi`` say how to make it a standby's.
        env: that attempt's environment.
        directory: where its ranks report that they are parked, and rank 0 what it imported.
        fingerprint: what must be unchanged for it to be used (``hpcnet.launch.standby.fingerprint``).
    """

    def __init__(self, attempt: int, command: list[str], env: dict[str, str], directory: Path,
                 fingerprint: dict[str, Any], *, launcher: str, openmpi: bool) -> None:
        self.attempt, self.directory, self.fingerprint = attempt, directory, fingerprint
        directory.mkdir(parents=True, exist_ok=True)
        clear_reports(directory, "parked.*", IMPORTED_FILE)
        if env.get(READY_ENV):  # its ranks report there as those of a cold start of the attempt would
            clear_reports(Path(env[READY_ENV]), f"{READY}.*")
        command = standby_command(command, launcher)
        if openmpi and launcher == "mpirun":
            command = [command[0], "-x", STANDBY_ENV, "-x", STANDBY_OWNER_ENV, *command[1:]]  # other nodes too
        self.command = command
        self.started_unix = time.time()
        owner = f"{socket.gethostname()} {os.getpid()}"
        self.started = _Started(command, {**env, STANDBY_ENV: str(directory), STANDBY_OWNER_ENV: owner})

    def alive(self) -> bool:
        return self.started.proc.poll() is None

    def parked(self) -> str:
        """'N/M ranks parked' (M unknown before rank 0 has parked)."""
        count, size = parked_ranks(self.directory)
        return f"{count}/{size if size is not None else '?'} ranks parked"

    def wait_parked(self, timeout_s: float, stopping: Any = None) -> bool:
        """Wait until every rank has parked (rank 0 reports how many there are); False if the standby ended,
        ``stopping()`` became true or ``timeout_s`` passed first. A release must not come sooner: a rank that
        has not yet imported hpcnet (which blocks the release signal) would be ended by it."""
        deadline = time.monotonic() + timeout_s
        while True:
            count, size = parked_ranks(self.directory)
            if size is not None and count >= size:
                return True
            if not self.alive() or time.monotonic() >= deadline or (stopping is not None and stopping()):
                return False
            time.sleep(0.01)

    def imported_changes(self) -> str:
        """What changed, in words, in the code and packages that its rank 0 imported before it parked ('' if
        nothing; ``hpcnet.launch.standby.imported_changes``)."""
        try:
            return imported_changes(json.loads((self.directory / IMPORTED_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"its rank 0 did not record what it imported ({self.directory / IMPORTED_FILE})"

    def release(self) -> None:
        """Let its ranks go on (the launcher forwards the signal to every rank)."""
        os.kill(self.started.proc.pid, RELEASE_SIGNAL)

    def discard(self) -> None:
        """End every process of the standby and wait for them."""
        self.started.reap(timeout_s=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.started.proc.wait(timeout=10)
        for thread in self.started.threads:
            thread.join(timeout=2)


@dataclass(slots=True)
class _Job:
    """What the attempts of one supervised command share."""

    command: list[str]
    """The user's command."""
    base: list[str]
    """The command with the failed hosts left out."""
    openmpi: bool
    train_start: int | None
    """Where hpcnet.train's arguments begin; None when the command does not run hpcnet.train."""
    launch_dir: Path
    checkpoint_dir: Path | None
    allocation: list[tuple[str, int]] | None
    excluded: list[str] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    launcher: str = ""
    config_file: str | None = None
    resume: str = ""
    """The user's ``checkpoint.resume``: where the first attempt starts ('' fresh, 'auto', a checkpoint)."""
    own: bool = True
    """Every checkpoint in the checkpoint directory is this run's: it held none at the start, or an attempt has
    committed since (``hpcnet.launch.command.restart_args``)."""
    launch_id: str = field(default_factory=lambda: secrets.token_hex(8))
    """This supervisor's token: with the attempt number, what the checkpoint directory's fence names."""
    launcher_grace_s: float = LAUNCHER_GRACE_S
    start_timeout_s: float = 0.0
    """``--start-timeout-s``: how long the ranks of an attempt may take to start (0: for ever)."""
    standby_on: bool = False
    standby: Standby | None = None
    """The standby for the next attempt, once started (by the attempt's watcher thread)."""
    min_ranks: int | None = None
    """``--min-ranks``: run on fewer ranks when hosts are lost (elastic), never fewer than this; None: keep ``-np``."""
    ranks: int = 0
    """The ranks the user's command runs (elastic only): what a grow goes back to."""
    probe_template: str | None = None
    probe_every_s: float = PROBE_EVERY_S
    probe_timeout_s: float = PROBE_TIMEOUT_S
    probe_env: dict[str, str] | None = None
    watch: HostWatch | None = None
    """Asks whether an excluded host answers again (elastic only, while hosts are excluded)."""
    spawner: Any = None
    """The one thread that starts standbys, alive as long as the supervisor: Linux sends the parent-death signal
    (``_die_with_parent``) when the *thread* that started a child ends, so a short-lived thread would kill its
    standby as soon as it returned."""


def _prepare(command: list[str], environ: dict[str, str], kind: str = "") -> "_Job | int":
    """The launcher (of ``kind`` if declared: ``--launcher-kind``) and the launch and checkpoint directories of
    ``command``; a status when its options are bad."""
    kind = launcher_kind(command, kind)
    openmpi = kind == "mpirun" and is_openmpi(command[0])
    start = train_args_start(command)
    job = _Job(command, list(command), openmpi, start, Path.cwd(), None, slurm_allocation(environ), launcher=kind)
    if start is not None:
        parsed = parse_command_line(command[start:])
        job.config_file = parsed.config
        if parsed.help or parsed.print_config:  # runs once, nothing to supervise
            job.train_start = None
        else:
            try:
                cfg = command_line_config(parsed)
            except ConfigError as exc:
                _say(f"error: {exc}")
                return ExitCode.USAGE_ERROR
            job.launch_dir = run_dir_path(cfg.run.dir, cfg.run.name, exact=cfg.run.dir_exact).absolute()
            job.checkpoint_dir = checkpoint_dir(cfg.run.dir, cfg.run.name, cfg.checkpoint.dir).absolute()
            job.resume, job.own = cfg.checkpoint.resume, not committed_checkpoints(job.checkpoint_dir)
    if job.train_start is None:
        _say("the command does not run hpcnet.train: run directories are not pinned, failure.json is not read")
        return job
    try:
        job.launch_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _say(f"error: run.dir: cannot create the launch directory {job.launch_dir}: {exc.strerror or exc}")
        return ExitCode.USAGE_ERROR
    _say(f"launch directory {job.launch_dir}; checkpoints in {job.checkpoint_dir}")
    return job


def _attempt_plan(job: _Job, attempt: int, environ: dict[str, str]) -> tuple[list[str], dict[str, str], str | None]:
    """The command, environment and run directory of attempt ``attempt`` as things stand."""
    run_dir = str(attempt_dir(job.launch_dir, attempt)) if job.train_start is not None else None
    pinned = [f"run.dir={run_dir}", "run.dir_exact=true", f"checkpoint.dir={job.checkpoint_dir}"] if run_dir else []
    cmd = attempt_command(job.base, attempt, train_start=job.train_start, pinned=pinned, openmpi=job.openmpi,
                          restart=restart_args(job.resume, own=job.own), kind=job.launcher)
    env = {**launcher_env(environ, job.openmpi), ATTEMPT_ENV: str(attempt)}
    if run_dir:
        env[READY_ENV] = str(ready_dir(job.launch_dir, attempt))
        env[LAUNCH_ID_ENV] = job.launch_id
    return cmd, env, run_dir


def _take_standby(job: _Job, attempt: int, cmd: list[str], env: dict[str, str], record: Attempt,
                  stopping: Callable[[], bool]) -> Standby | None:
    """The standby for ``attempt`` if it is alive, what it runs is what a cold start would run now and its ranks
    have all parked (waiting for them up to ``PARK_WAIT_S``: they are further on than a cold start would be);
    else it is discarded and ``record`` says why. None too when ``stopping()`` (a stop signal) becomes true."""
    standby, job.standby = job.standby, None
    if standby is None:
        if job.standby_on and attempt > 1:
            record.standby_note = "no standby was ready (the previous attempt ended before its start-up was over)"
        return None
    note = ""
    if standby.attempt != attempt:
        note = f"it was made for attempt {standby.attempt}"
    elif changes := fingerprint_changes(standby.fingerprint, fingerprint(cmd, env, job.config_file)):
        note = f"{changes} since it started"
    else:
        if not stopping() and not standby.wait_parked(0.0):
            _say(f"waiting for the standby's ranks to park ({standby.parked()})")
        if not standby.wait_parked(PARK_WAIT_S, stopping):
            if not standby.alive():
                note = f"it ended with status {normalise_status(standby.started.proc.returncode)}"
            elif stopping():
                note = "a stop signal came while its ranks were parking"
            else:
                note = f"its ranks had not all parked within {PARK_WAIT_S:.0f} s ({standby.parked()})"
        elif changes := standby.imported_changes():
            note = f"{changes} since its ranks imported it"
    if note:
        standby.discard()
        record.standby_note = f"standby discarded: {note}{'' if stopping() else '; cold start'}"
        _say(record.standby_note)
        return None
    record.standby, record.standby_started_unix = True, standby.started_unix
    record.standby_note = f"released with {standby.parked()} after {time.time() - standby.started_unix:.1f} s"
    return standby


def _standby_watcher(job: _Job, attempt: int, environ: dict[str, str], started: threading.Event,
                     ended: threading.Event, stopping: Callable[[], bool]) -> None:
    """Start the standby for attempt ``attempt`` + 1 once this attempt's start-up is over (``TRIGGER``), unless
    the attempt ended or a stop signal came (no attempt follows it)."""
    started.wait(TRIGGER_TIMEOUT_S)
    if ended.is_set() or stopping():
        return
    cmd, env, _ = _attempt_plan(job, attempt + 1, environ)
    try:
        job.standby = job.spawner.submit(
            Standby, attempt + 1, cmd, env, job.launch_dir / f"standby-{attempt + 1}",
            fingerprint(cmd, env, job.config_file), launcher=job.launcher, openmpi=job.openmpi).result()
    except OSError as exc:
        _say(f"cannot start a standby for attempt {attempt + 1}: {exc.strerror or exc}")
        return
    _say(f"standby for attempt {attempt + 1} started (pid {job.standby.started.proc.pid}); it parks before MPI "
         "starts")


def _run_next(job: _Job, budget: RestartBudget, forwarder: Forwarder, environ: dict[str, str]) -> Attempt | None:
    """Run the next attempt of ``job`` (through its standby when one is ready) and record it in launch.json; None
    when a stop signal came first (before it, or while its standby's ranks were parking): none is started."""
    attempt = len(job.attempts) + 1
    cmd, env, run_dir = _attempt_plan(job, attempt, environ)
    record = Attempt(attempt=attempt, command=cmd, run_dir=run_dir, start_unix=time.time(),
                     excluded_hosts=list(job.excluded))
    with contextlib.suppress(ElasticError):
        record.ranks = ranks_of(cmd, job.launcher)

    def stopping() -> bool:
        return bool(forwarder.received)

    standby = None if stopping() else _take_standby(job, attempt, cmd, env, record, stopping)
    if stopping():
        if standby is not None:
            standby.discard()
        return None
    job.attempts.append(record)
    if run_dir and job.checkpoint_dir is not None:
        try:  # before any of its processes runs (a standby's ranks are parked before MPI starts)
            write_fence(job.checkpoint_dir, Fence(job.launch_id, attempt), launch_dir=str(job.launch_dir))
        except OSError as exc:
            if standby is not None:
                standby.discard()
            record.status, record.end_unix = ExitCode.USAGE_ERROR, time.time()
            record.cause = (f"cannot write {job.checkpoint_dir / FENCE_NAME} (checkpoint.dir): {exc.strerror or exc}; "
                            "not starting an attempt that the ones before it could still commit over")
            _say(f"error: {record.cause}")
            _write_json(job, None, "")
            return record
    _say(f"attempt {attempt}/{budget.last_attempt(attempt)}{' (warm standby)' if standby else ''}: {shlex.join(cmd)}")
    before = committed_checkpoints(job.checkpoint_dir)
    started_up, ended = threading.Event(), threading.Event()
    ready = None
    if run_dir:
        reports = ready_dir(job.launch_dir, attempt)
        if standby is None:
            clear_reports(reports, f"{READY}.*")  # those of a discarded standby's ranks, which are gone
        ready = functools.partial(ranks_ready, reports, started_up)
    watcher = None
    if job.standby_on:
        watcher = threading.Thread(target=_standby_watcher, args=(job, attempt, environ, started_up, ended, stopping),
                                   daemon=True)
        watcher.start()

    def on_line(line: str) -> None:
        if TRIGGER.match(line):
            started_up.set()

    grow_since: list[float] = []

    def poll(proc: subprocess.Popen) -> None:
        if (job.watch is None or not job.watch.answered.is_set() or record.grow or forwarder.received
                or record.declared_unix is not None or (ready is not None and not ready())
                or (watcher is not None and watcher.is_alive())):
            return
        _grow_step(job, attempt, record, proc, environ, grow_since)

    if standby is not None:
        standby.release()
    all_started = False
    try:
        run_attempt(cmd, env, forwarder, record, started=standby.started if standby else None, on_line=on_line,
                    ready=ready, launcher_grace_s=job.launcher_grace_s,
                    on_declared=lambda: _close_fence(job, attempt, "it declared its failure"), poll=poll,
                    start_timeout_s=job.start_timeout_s,
                    started_ranks=functools.partial(ranks_started, reports, started_up) if run_dir else None)
        all_started = started_up.is_set() or (ready is not None and ready())
    finally:
        ended.set()
        started_up.set()
        if watcher is not None:
            watcher.join()
    _close_fence(job, attempt, f"its launcher ended with status {record.status}")
    record.new_checkpoints = new_checkpoints(before, committed_checkpoints(job.checkpoint_dir))
    job.own = job.own or bool(record.new_checkpoints)
    record.failure = read_failure(run_dir) or record.failure
    record.signal_received = forwarder.received
    if record.status:
        rank_hosts = read_rank_hosts(ready_dir(job.launch_dir, attempt), READY) if run_dir else {}
        record.lost_host = lost_host(record.failure, record.launcher_loss, rank_hosts, started=all_started)
    if record.start_timed_out and record.status:
        record.status = ExitCode.RESTARTABLE  # the supervisor's verdict: the launch failed, not the job
    record.restartable = is_restartable(record.status, declared=declared(record.failure) or record.launcher_ended,
                                        host_lost=record.lost_host is not None)
    record.cause = describe_failure(record.failure) if record.status else ""
    if record.start_timed_out and record.status:
        count, size = parked_ranks(ready_dir(job.launch_dir, attempt), READY)
        hosts = sorted(set(read_rank_hosts(ready_dir(job.launch_dir, attempt), READY).values()))
        record.cause = "; ".join(c for c in (record.cause, (
            f"{count} of {size if size is not None else 'its'} rank(s) had started "
            f"{'on ' + ', '.join(hosts) + ' ' if hosts else ''}{job.start_timeout_s:g} s after the launcher did")) if c)
    if record.lost_host is not None:
        record.cause = "; ".join(c for c in (record.cause, describe_loss(record.lost_host)) if c)
    if record.launcher_ended:
        record.cause = "; ".join(c for c in (record.cause, f"the launcher was ended {job.launcher_grace_s:g} s after "
                                                           "the declared failure") if c)
    _say(f"attempt {attempt} ended with status {record.status}: {describe_status(record.status)}{_cause(record)} "
         f"after {record.duration_s:.1f} s")
    _write_json(job, None, "")
    return record


def _close_fence(job: _Job, attempt: int, why: str) -> None:
    """Hand the checkpoint directory's fence on from ``attempt`` (``hpcnet.ckpt.fence``) once it declared its failure
    or its launcher ended: a rank of it that is still running (cut off) commits nothing from then on, whether or not
    another attempt follows.  A fence that cannot be written is only reported here: the next attempt's start writes
    it again and does not start without it."""
    if job.train_start is None or job.checkpoint_dir is None:
        return
    try:
        write_fence(job.checkpoint_dir, Fence(job.launch_id, attempt + 1), launch_dir=str(job.launch_dir),
                    closed=attempt, why=f"attempt {attempt}: {why}")
    except OSError as exc:
        _say(f"cannot write {job.checkpoint_dir / FENCE_NAME}: {exc.strerror or exc}")


def _cause(record: Attempt) -> str:
    return f" ({record.cause})" if record.cause else ""


def _why_final(record: Attempt, received: int) -> str | None:
    """Why no attempt may follow ``record`` ('' when it succeeded); None when a restart may."""
    if record.survivors:
        return (f"processes {record.survivors[:10]} of attempt {record.attempt} are still alive after SIGKILL "
                "(an uninterruptible wait?): not starting another attempt beside them")
    if record.status == 0:
        return ""
    if received:
        return f"stopped by {signal.Signals(received).name}: not restarting"
    if not record.restartable:
        return f"status {record.status} is not restartable: {describe_status(record.status)}{_cause(record)}"
    return None


def _exclude_failed_hosts(job: _Job, record: Attempt) -> str | None:
    """Leave the hosts that ``record``'s failure names out of the next attempts: the entries of the launcher's host
    list that are them (by what their ranks reported, in every attempt's ready reports) and do not answer the
    launcher's probe (``hpcnet.launch.elastic.lost_entries``).  Returns why no attempt may follow (a host that does
    not answer and that the command cannot leave out; elastic: the hosts left hold fewer than ``--min-ranks``),
    else None."""
    lost = [record.lost_host["host"]] if record.lost_host and record.lost_host.get("host") else []
    named = list(dict.fromkeys([*lost, *failed_where(record.failure)[1]]))
    if not named:
        return None
    places = [place for a in job.attempts if a.run_dir
              for place in read_rank_places(ready_dir(job.launch_dir, a.attempt), READY).values()]
    entries = host_names(job.command, allocation=job.allocation, read_file=lambda p: Path(p).read_text(),
                         kind=job.launcher)
    probe = functools.partial(probe_hosts, make=functools.partial(_probe_for, job), timeout_s=job.probe_timeout_s,
                              env=job.probe_env, reap=_reap_probe)
    hosts, said, final = lost_entries(named, entries, places, excluded=job.excluded, probe=probe,
                                      resolve=functools.partial(resolve_all, timeout_s=RESOLVE_TIMEOUT_S))
    if said:
        _say(said)
    if final is not None or not hosts:
        return final
    return _place(job, [*job.excluded, *hosts])


def _probe_for(job: _Job, host: str) -> list[str] | None:
    return probe_command(job.command, host, job.probe_template, job.launcher)


def _reap_probe(sid: int) -> None:
    reap_session(sid, timeout_s=5.0)


def _place(job: _Job, excluded: list[str]) -> str | None:
    """Set the next attempts' command to the user's without ``excluded`` (``hpcnet.launch.elastic.place``) and say
    so.  Returns why no attempt may follow (the command cannot leave them out; elastic: too few slots left), else
    None: an exclusion is said only once the next attempts' command carries it."""
    placed = place(job.command, excluded, allocation=job.allocation, min_ranks=job.min_ranks, ranks=job.ranks,
                   ranks_now=ranks_of(job.base, job.launcher) if job.min_ranks is not None else None,
                   read_file=lambda p: Path(p).read_text(),
                   hostfile_path=str(job.launch_dir / f"hostfile.attempt-{len(job.attempts) + 1}"), kind=job.launcher)
    if placed.error:
        return placed.error
    if placed.hostfile is not None and placed.hostfile_path is not None:
        Path(placed.hostfile_path).write_text(placed.hostfile)
    job.base, job.excluded = placed.command, placed.excluded
    _say(placed.note)
    return None


def _watch_excluded(job: _Job) -> None:
    """Elastic: (re)start asking whether the excluded hosts answer again; stop when none is excluded."""
    if job.watch is not None and (not job.excluded or sorted(job.watch.hosts) != sorted(job.excluded)):
        job.watch.stop()
        job.watch = None
    if job.min_ranks is None or not job.excluded or job.watch is not None:
        return
    if _probe_for(job, job.excluded[0]) is None:
        _say("no probe for this launcher (--probe-command): the excluded hosts stay out")
        return
    job.watch = HostWatch(list(job.excluded), functools.partial(_probe_for, job), every_s=job.probe_every_s,
                          timeout_s=job.probe_timeout_s, env=job.probe_env, reap=_reap_probe).start()
    _say(f"asking every {job.probe_every_s:g} s whether {', '.join(job.excluded)} answer(s) again")


def _grow(job: _Job) -> str | None:
    """Let the hosts that answered again back in (nothing when they are in already)."""
    back = job.watch.back if job.watch is not None else []
    remaining = [h for h in job.excluded if h not in back]
    if remaining == job.excluded:
        return None
    return _place(job, remaining)


def _grow_step(job: _Job, attempt: int, record: Attempt, proc: subprocess.Popen, environ: dict[str, str],
               since: list[float]) -> None:
    """An excluded host answers again while ``attempt`` runs: ask it to save and stop (SIGUSR2, which the launcher
    passes on to the ranks) so that the next attempt runs with the host.  With standbys on, first start one for
    that next attempt (the command with the host back) and wait, up to ``PARK_WAIT_S``, for its ranks to park, so
    that the attempt after the stop is warm; ``since`` holds when that standby was started."""
    if job.standby_on and not since:
        since.append(time.time())
        _grow(job)  # the next attempt's command, with the host back
        if job.standby is not None:
            job.standby.discard()
            job.standby = None
        cmd, env, _ = _attempt_plan(job, attempt + 1, environ)
        try:
            job.standby = job.spawner.submit(
                Standby, attempt + 1, cmd, env, job.launch_dir / f"standby-{attempt + 1}",
                fingerprint(cmd, env, job.config_file), launcher=job.launcher, openmpi=job.openmpi).result()
            _say(f"excluded host {', '.join(job.watch.back)} answers again: starting a standby for attempt "
                 f"{attempt + 1} with it; attempt {attempt} saves and stops once the standby's ranks have parked")
            return
        except OSError as exc:
            _say(f"cannot start a standby for attempt {attempt + 1}: {exc.strerror or exc}")
    if since and job.standby is not None and job.standby.alive() and not job.standby.wait_parked(0.0) \
            and time.time() - since[0] < PARK_WAIT_S:
        return
    record.grow, record.grow_unix = list(job.watch.back), time.time()
    _say(f"excluded host {', '.join(record.grow)} answers again: asking attempt {attempt} to save and stop "
         "(SIGUSR2) so that the next one runs with it")
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR2)


def _elastic_setup(job: _Job, min_ranks: int | None) -> str | None:
    """Check ``--exclude-failed-hosts`` and ``--min-ranks`` (None: not given) against the command (a launcher whose
    options the supervisor can rewrite, ``hpcnet.launch.elastic.elastic_ranks``); why it cannot run so, else None."""
    try:
        known_kind(job.command, job.launcher, "--exclude-failed-hosts", "it rewrites the host list or --exclude")
        if min_ranks is not None:
            job.ranks = elastic_ranks(job.command, min_ranks, allocation=job.allocation,
                                      read_file=lambda p: Path(p).read_text(), kind=job.launcher)
    except ElasticError as exc:
        return str(exc)
    job.min_ranks = min_ranks
    return None


def supervise(command: list[str], *, max_restarts: int = 3, backoff_base_s: float = 1.0,
              backoff_cap_s: float = 60.0, exclude_failed_hosts: bool = False, standby: str = "auto",
              launcher_grace_s: float = LAUNCHER_GRACE_S, environ: dict[str, str] | None = None,
              keep_signal_handlers: bool = False, min_ranks: int | None = None, probe_template: str | None = None,
              probe_every_s: float = PROBE_EVERY_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
              start_timeout_s: float = START_TIMEOUT_S, launcher: str = "") -> int:
    """Run ``command`` until it succeeds, fails for good, or uses up ``max_restarts``; return its status.

    ``standby``: 'auto' (a warm standby when the launcher is mpirun or srun, the command runs hpcnet.train and a
    restart is allowed), 'on' (the same, an error where it cannot be), 'off'. ``keep_signal_handlers``: leave the
    stop-signal handlers installed on return (``python -m hpcnet.launch``: a signal as it exits then changes
    nothing, where the default action would end it with a death by signal instead of the job's status).
    ``min_ranks`` (with ``exclude_failed_hosts``): elastic shrink and grow (``hpcnet.launch.elastic``), the
    excluded hosts probed with ``probe_template`` (or the launcher's own probe) every ``probe_every_s``.
    ``launcher``: its kind, 'mpirun' or 'srun', for a wrapper that takes their options (``--launcher-kind``; '':
    by its name).
    """
    environ = dict(os.environ if environ is None else environ)
    job = _prepare(command, environ, launcher)
    if isinstance(job, int):
        return job
    job.launcher_grace_s, job.start_timeout_s = launcher_grace_s, start_timeout_s
    job.probe_template, job.probe_every_s, job.probe_timeout_s = probe_template, probe_every_s, probe_timeout_s
    job.probe_env = launcher_env(environ, job.openmpi)
    if exclude_failed_hosts and (error := _elastic_setup(job, min_ranks)) is not None:
        _say(f"error: {error}")
        return ExitCode.USAGE_ERROR
    possible = job.launcher in LAUNCHER_KINDS and job.train_start is not None and max_restarts > 0
    if standby == "on" and not possible:
        _say("error: --standby on needs an mpirun or srun command that runs hpcnet.train, and --max-restarts > 0")
        return ExitCode.USAGE_ERROR
    job.standby_on = standby != "off" and possible
    if job.standby_on:
        job.spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcnet-standby")
    forwarder = Forwarder(mpirun=job.openmpi).install()
    budget = RestartBudget(max_restarts)
    since = " since the last new checkpoint" if job.checkpoint_dir else ""
    status, message = ExitCode.CODE_ERROR, ""
    try:
        while True:
            record = _run_next(job, budget, forwarder, environ)
            if record is None:
                name = signal.Signals(forwarder.received).name
                status = stop_status(forwarder.received)
                message = (f"stopped by {name} before restarting" if job.attempts
                           else f"stopped by {name} before the first attempt: nothing was started")
                return status
            status = record.status
            if record.grow and status == ExitCode.PREEMPTED and not forwarder.received and not record.survivors:
                _say(f"attempt {record.attempt} saved and stopped for {', '.join(record.grow)}: restarting with it")
                if (final := _grow(job)) is not None:
                    message = final
                    return status
                _watch_excluded(job)
                continue  # no failure: no restart used, no backoff
            final = _why_final(record, forwarder.received)
            if final is not None:
                message = final
                return status
            if record.new_checkpoints and budget.progress():
                _say(f"attempt {record.attempt} committed {record.new_checkpoints[-1]}: progress, so the restart "
                     f"budget starts again ({max_restarts} restart(s))")
            restart = budget.take()
            if restart is None:
                break
            if exclude_failed_hosts:
                final = _grow(job) if job.watch is not None and job.watch.answered.is_set() else None
                final = final or _exclude_failed_hosts(job, record)
                if final is not None:
                    message = final
                    return status
                _watch_excluded(job)
            delay = backoff_s(restart, backoff_base_s, backoff_cap_s)
            _say(f"restarting {restart_from(job.resume, own=job.own)} in {delay:.1f} s (restart {restart} of "
                 f"{max_restarts}{since})")
            forwarder.wake.wait(delay)  # a stop signal ends it: the next _run_next starts nothing
        message = (f"giving up after {len(job.attempts)} attempts ({max_restarts} restarts"
                   f"{' without a new checkpoint' if job.checkpoint_dir else ''}): last status {status}, "
                   f"{describe_status(status)}{_cause(record)}")
        return status
    finally:
        if job.watch is not None:
            job.watch.stop()
        if job.standby is not None:  # not needed: its processes end with us
            job.standby.discard()
            job.standby = None
        if job.spawner is not None:
            job.spawner.shutdown(wait=True)
        if not keep_signal_handlers:
            forwarder.restore()
        if message:
            _say(message)
        _write_json(job, status, message)


def _write_json(job: _Job, final: int | None, message: str) -> None:
    record = {"command": job.command, "launch_dir": str(job.launch_dir),
              "attempts": [asdict(a) for a in job.attempts], "final_status": final, "message": message}
    path = job.launch_dir / LAUNCH_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        _say(f"cannot write {path}: {exc.strerror or exc}")


def _say(message: str) -> None:
    print(f"hpcnet.launch: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.launch``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hpcnet.launch",
        description="Run an hpcnet job; on a restartable failure run it again with --resume auto.",
        epilog="example: python -m hpcnet.launch --max-restarts 3 -- mpirun -np 4 python -m mpi4py -m "
               "hpcnet.train run.name=x checkpoint.every_steps=100")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after the first attempt (default 3)")
    parser.add_argument("--backoff-s", type=float, default=1.0,
                        help="wait before the first restart, doubled for each further one (default 1)")
    parser.add_argument("--max-backoff-s", type=float, default=60.0, help="longest wait (default 60)")
    parser.add_argument("--exclude-failed-hosts", action="store_true",
                        help="leave a host that a failure is pinned to out of the next attempts (mpirun, srun)")
    parser.add_argument("--min-ranks", type=int, default=None, metavar="N",
                        help="with --exclude-failed-hosts: when the hosts left hold fewer slots than the command's "
                             "ranks, run on them with fewer ranks (at least N; else give up), and go back to the "
                             "full size once an excluded host answers again (elastic shrink and grow)")
    parser.add_argument("--launcher-kind", choices=LAUNCHER_KINDS, default="",
                        help="the options the launcher takes, for a site's wrapper of mpirun or srun that "
                             "--exclude-failed-hosts, --min-ranks and the standby rewrite (default: by its name: "
                             "mpirun, mpiexec, orterun, prterun, srun)")
    parser.add_argument("--probe-command", default=None, metavar="CMD",
                        help="how to ask whether a host answers (with --min-ranks, and to tell which side of a "
                             "partition was lost): a command line with {host}, status 0 when it does (default: "
                             "the launcher's own: mpirun <its options> --host {host}:1 -np 1 true; srun -w {host} "
                             "-N1 -n1 true)")
    parser.add_argument("--probe-every-s", type=float, default=PROBE_EVERY_S,
                        help="how often an excluded host is probed (default %(default)g)")
    parser.add_argument("--probe-timeout-s", type=float, default=PROBE_TIMEOUT_S,
                        help="how long one probe may take before the host counts as unreachable "
                             "(default %(default)g)")
    parser.add_argument("--standby", choices=("auto", "on", "off"), default="auto",
                        help="warm standby: start the next attempt ahead, parked before MPI starts, and release it "
                             "at a failure (auto: with mpirun or srun; default auto)")
    parser.add_argument("--launcher-grace-s", type=float, default=LAUNCHER_GRACE_S,
                        help="once the job declared a failure (failure.json, MPI_Abort), how long the launcher may "
                             "take to exit before it and its processes are killed (default %(default)g)")
    parser.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S,
                        help="how long the ranks of an attempt may take to start (each reports ready as the first "
                             "thing hpcnet.train does) before the launcher and its processes are killed and the "
                             "attempt counts as a restartable failure; 0: no limit (default %(default)g)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python -m hpcnet.launch [options] -- mpirun ... python -m mpi4py -m hpcnet.train ...")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    for flag, seconds in (("--backoff-s", args.backoff_s), ("--max-backoff-s", args.max_backoff_s),
                          ("--launcher-grace-s", args.launcher_grace_s), ("--start-timeout-s", args.start_timeout_s)):
        if not 0 <= seconds <= MAX_DURATION_S:  # nan too; a longer wait overflows the clock it waits on
            parser.error(f"{flag} must be a number of seconds in [0, {MAX_DURATION_S}] (30 days), got {seconds:g}")
    for flag, seconds in (("--probe-every-s", args.probe_every_s), ("--probe-timeout-s", args.probe_timeout_s)):
        if not 0 < seconds <= MAX_DURATION_S:
            parser.error(f"{flag} must be a number of seconds in (0, {MAX_DURATION_S}], got {seconds:g}")
    if args.min_ranks is not None:
        if args.min_ranks < 1:
            parser.error(f"--min-ranks must be at least 1, got {args.min_ranks}")
        if not args.exclude_failed_hosts:
            parser.error("--min-ranks needs --exclude-failed-hosts (it runs on the hosts left after excluding one)")
    if args.probe_command is not None:
        try:
            check_template(args.probe_command)
        except ElasticError as exc:
            parser.error(str(exc))
    return supervise(command, max_restarts=args.max_restarts, backoff_base_s=args.backoff_s,
                     backoff_cap_s=args.max_backoff_s, exclude_failed_hosts=args.exclude_failed_hosts,
                     standby=args.standby, launcher_grace_s=args.launcher_grace_s, keep_signal_handlers=True,
                     min_ranks=args.min_ranks, probe_template=args.probe_command, probe_every_s=args.probe_every_s,
                     probe_timeout_s=args.probe_timeout_s, start_timeout_s=args.start_timeout_s,
                     launcher=args.launcher_kind)
