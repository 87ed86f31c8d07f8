"""One attempt of a supervised job: its record in launch.json (``Attempt``), running it to its end, and how it ended.

``run_attempt`` starts the launcher (``hpcnet.launch.processes``), or takes over a released standby, tees its
output (a launcher's line about a dead rank, an MPI_Abort or a lost daemon is recorded), passes stop signals on
once the ranks can take them (``hpcnet.launch.forward``), ends a launcher that outlives a declared failure or
whose ranks never all start, and kills whatever is left once it ended.  ``settle`` then says what the ending
means: the failure, the host it lost, whether a restart may help (``hpcnet.launch.restarts``).
"""

import json
import subprocess
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcnet.errors import ExitCode
from hpcnet.launch.forward import Forwarder
from hpcnet.launch.processes import LauncherProcess, end_launcher, say
from hpcnet.launch.restarts import (
    declared,
    describe_failure,
    describe_loss,
    failure_from_line,
    host_loss_from_line,
    is_abort_line,
    is_restartable,
    lost_host,
    merge_host_loss,
    normalise_status,
    read_failure,
    read_rank_hosts,
)
from hpcnet.launch.stop import READY, reported_ranks
from hpcnet.paths import CONFIG_FILE, FAILURE_FILE, SUMMARY_FILE

LAUNCHER_GRACE_S = 30.0
"""Default of ``--launcher-grace-s``: how long a launcher may take to exit once the job declared its failure. Open
MPI's mpirun tears a job down within a second or two when it can reach every daemon; one that waits longer is
waiting for a daemon it cannot reach (a partitioned host), which it would do for ever."""
START_TIMEOUT_S = 300.0
"""``--start-timeout-s``: every rank of an attempt reports ready (``hpcnet.launch.stop``) within this many seconds of
the launcher's start, or the attempt is ended and restarted.  Generous: imports from a shared file system at many
ranks per node take minutes."""


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

    def note_line(self, line: str) -> None:
        """Record what a line of the launcher's output says: a dead rank, an MPI_Abort, a lost daemon or node."""
        if self.launcher_report_unix is None:
            found = failure_from_line(line)
            if found:
                self.launcher_report_unix = time.time()
                self.failure = self.failure or found
        if self.declared_unix is None and is_abort_line(line):
            self.declared_unix = time.time()
        loss = host_loss_from_line(line)
        if loss is not None:
            self.launcher_loss = merge_host_loss(self.launcher_loss, loss)

    def in_brackets(self) -> str:
        """Its cause as the supervisor appends it to a line: ' (cause)', or '' when it has none."""
        return f" ({self.cause})" if self.cause else ""


def written_since(path: Path, since_unix: float) -> float | None:
    """When ``path`` was last written, if it exists and was written at or after ``since_unix`` (a file left by an
    earlier run in a reused directory does not count); else None."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    return mtime if mtime >= since_unix - 1.0 else None


def run_attempt(command: list[str], env: dict[str, str], forwarder: Forwarder, record: Attempt,
                started: LauncherProcess | None = None, on_line: Callable[[str], None] | None = None,
                ready: Callable[[], bool] | None = None, launcher_grace_s: float = LAUNCHER_GRACE_S,
                on_declared: Callable[[], None] | None = None,
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
        record.note_line(line)
        if on_line is not None:
            on_line(line)

    record.start_unix = time.time()
    t0 = time.monotonic()
    if started is None:
        try:
            started = LauncherProcess(command, env)
        except OSError as exc:
            say(f"cannot run {command[0]!r}: {exc.strerror or exc}")
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
        if start_timeout_s > 0 and started_ranks is not None:
            _end_if_not_started(record, started, time.monotonic() - t0, start_timeout_s, started_ranks)
        on_declared = _follow_declared(record, started, failure_path, launcher_grace_s, on_declared)
    record.end_unix = time.time()
    record.duration_s = time.monotonic() - t0
    forwarder.detach()
    record.reaped, record.survivors = started.reap()  # before the tees: survivors hold the pipes
    if record.reaped:
        say(f"killed {len(record.reaped)} process(es) the attempt left running: {record.reaped[:10]}")
    started.join_output(timeout_s=5)
    record.status = normalise_status(returncode)


def _end_if_not_started(record: Attempt, started: LauncherProcess, elapsed_s: float, timeout_s: float,
                        started_ranks: Callable[[], bool]) -> None:
    """``--start-timeout-s``: end the launcher and what it started once ``timeout_s`` passed without every rank
    started."""
    if record.start_timed_out or elapsed_s <= timeout_s or started_ranks():
        return
    record.start_timed_out = True
    say(f"the ranks have not all started {timeout_s:g} s after the launcher (pid {started.proc.pid}) did (a "
        "host that does not answer, a daemon that died?): ending it and every process it started here "
        "(--start-timeout-s)")
    started.reap(timeout_s=10.0)


def _follow_declared(record: Attempt, started: LauncherProcess, failure_path: Path | None, grace_s: float,
                     on_declared: Callable[[], None] | None) -> Callable[[], None] | None:
    """Notice a declared failure (``failure.json`` written): call ``on_declared`` once, and end the launcher once
    it has outlived ``grace_s`` after it.  Returns ``on_declared`` until it has been called."""
    if record.declared_unix is None and failure_path is not None:
        record.declared_unix = written_since(failure_path, record.start_unix)
    if record.declared_unix is None:
        return on_declared
    if on_declared is not None:
        on_declared()
    if not record.launcher_ended and time.time() - record.declared_unix >= grace_s:
        record.launcher_ended = True
        end_launcher(started, grace_s)
    return None


def settle(record: Attempt, reports: Path | None, *, all_started: bool, start_timeout_s: float,
           launcher_grace_s: float) -> None:
    """Fill in what ``record``'s ending means once its launcher ended: its failure, the host it lost, whether a
    restart may help, the cause in words.  ``reports``: where its ranks reported ready (None: it does not run
    hpcnet.train); ``all_started``: whether they all had."""
    record.failure = read_failure(record.run_dir) or record.failure
    not_finished = unfinished(record) if record.status == 0 else ""
    if not_finished:
        record.status = ExitCode.RESTARTABLE  # the supervisor's verdict: the launcher's 0 is not the run's
    elif record.status and record.run_dir is not None and not unfinished(record):
        # The run wrote its complete summary.json: it finished, whatever the launcher's status (Open MPI 5's
        # prterun ends with 137 once a replacement it spawned was killed, hpcnet.fault.grow).
        say(f"the launcher ended with status {record.status} after the run had finished (its {SUMMARY_FILE}): "
            "taken as finished")
        record.status = 0
    if record.status:
        rank_hosts = read_rank_hosts(reports, READY) if reports is not None else {}
        record.lost_host = lost_host(record.failure, record.launcher_loss, rank_hosts, started=all_started)
    if record.start_timed_out and record.status:
        record.status = ExitCode.RESTARTABLE  # the supervisor's verdict: the launch failed, not the job
    record.restartable = is_restartable(record.status, declared=declared(record.failure) or record.launcher_ended,
                                        host_lost=record.lost_host is not None)
    causes = [describe_failure(record.failure) if record.status else ""]
    if record.start_timed_out and record.status and reports is not None:
        causes.append(_not_started(reports, start_timeout_s))
    if not_finished:
        causes.append(f"the launcher ended with status 0, but {not_finished}")
    if record.lost_host is not None:
        causes.append(describe_loss(record.lost_host))
    if record.launcher_ended:
        causes.append(f"the launcher was ended {launcher_grace_s:g} s after the declared failure")
    record.cause = "; ".join(c for c in causes if c)


def unfinished(record: Attempt) -> str:
    """Why an attempt whose launcher ended with status 0 did not finish its run, in words; '' when it did.

    Open MPI 5's prterun ends with 0 when it loses a daemon.  A run of hpcnet.train finished when it wrote its
    ``summary.json`` since the attempt began, with as many steps as its ``train.steps`` (its ``config.toml``); its
    summary decides, whatever the launcher printed.  Another command finished unless its launcher reported a lost
    daemon or node (``Attempt.launcher_loss``).
    """
    if record.run_dir is None:
        line = (record.launcher_loss or {}).get("line")
        return f"it reported a lost daemon or node ({line})" if line else ""
    summary_path = Path(record.run_dir) / SUMMARY_FILE
    if written_since(summary_path, record.start_unix) is None:
        return f"the run wrote no {SUMMARY_FILE}: it did not finish"
    try:
        steps = json.loads(summary_path.read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {SUMMARY_FILE} cannot be read"
    total = _train_steps(Path(record.run_dir) / CONFIG_FILE)
    if total is not None and steps < total:
        return f"the run stopped after step {steps} of {total} ({SUMMARY_FILE})"
    return ""


def _train_steps(config: Path) -> int | None:
    """``train.steps`` of a run's resolved config; None when it cannot be read."""
    try:
        steps = tomllib.loads(config.read_text())["train"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return steps if isinstance(steps, int) else None


def _not_started(reports: Path, timeout_s: float) -> str:
    """How many ranks had started, and where, when ``--start-timeout-s`` ended the attempt."""
    count, size = reported_ranks(reports, READY)
    hosts = sorted(set(read_rank_hosts(reports, READY).values()))
    return (f"{count} of {size if size is not None else 'its'} rank(s) had started "
            f"{'on ' + ', '.join(hosts) + ' ' if hosts else ''}{timeout_s:g} s after the launcher did")
