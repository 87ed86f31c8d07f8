"""Restart decisions (pure): which statuses restart, the restart budget, the backoff, what a failure was.

Why these statuses and not others, and how the budget counts, is in
docs/fault-tolerance.md.  Nothing here runs a process; ``hpcnet.launch.attempt`` does.
"""

import contextlib
import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcnet.errors import ExitCode
from hpcnet.launch.hosts import RankPlace
from hpcnet.paths import CKPT_NAME_RE, FAILURE_FILE

RESTART_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)
"""A rank (or the launcher) that died of one of these may have been killed by
the OOM killer or a failing node, or crashed in a driver: worth a restart.
SIGINT and SIGTERM are requests to stop; a deterministic crash just uses up
the restarts."""

# What the launcher prints when a rank dies: rank, host, signal.
_DEATH_LINES = (
    re.compile(r"mpirun noticed that process rank (?P<rank>\d+) with PID \d+ on node (?P<host>\S+) "
               r"exited on signal (?P<signal>\d+)"),
    re.compile(r"srun: error: (?P<host>[^:\s]+): tasks? (?P<rank>[\d,\-]+): (?P<what>.+)"),
)


# What a launcher prints when it loses a host: Open MPI's mpirun (help-errmgr-base.txt and help-plm-base.txt; Open
# MPI 5's PRRTE says PRTE, and names the host of a daemon that failed to report on a line "Remote host: H") when one
# of its daemons dies or cannot be reached, srun when the controller declares a node failed.  "start": a daemon that
# failed to start or report, which means a lost host only once the attempt's ranks were all running.  Open MPI 5's
# prterun may end with status 0 after such a message: ``hpcnet.launch.attempt.unfinished`` does not take that for
# a finished run.
_LOSS_LINES = (
    (re.compile(r"\b(?:ORTE|PRTE) has lost communication with a remote daemon"), "daemon lost"),
    (re.compile(r"\bAn (?:ORTE|PRTE) daemon has unexpectedly failed"), "start"),
    (re.compile(r"\b(?:ORTE|PRTE) was unable to reliably start one or more daemons"), "start"),
    (re.compile(r"\bA daemon failed to report back after being spawned"), "start"),
    (re.compile(r"\bA daemon died unexpectedly (?:with status|on signal)"), "start"),
    (re.compile(r"^\s*Remote daemon\s*:\s*\S+ on node (?P<host>\S+)"), ""),
    (re.compile(r"^\s*Remote host\s*:\s*(?P<host>\S+)\s*$"), ""),
    (re.compile(r"srun: error: Node failure on (?P<host>\S+)"), "node failure"),
    (re.compile(r"srun: error: .*\b[Ll]ost (?:connection|communication|contact)\b.*?\bnode (?P<host>[^\s:,;]+)"),
     "node lost"),
)
_ABORT_LINE = re.compile(r"MPI_ABORT was invoked on rank (?P<rank>\d+) in communicator")
"""Open MPI's report of an MPI_Abort (the monitor ends a job it declared failed with MPI_Abort(75))."""

JOB_VERDICTS = frozenset({ExitCode.OK, ExitCode.USAGE_ERROR, ExitCode.DIVERGED, ExitCode.PREEMPTED,
                          ExitCode.INTERRUPTED})
"""Statuses that are the job's own decision: a lost host or a declared failure does not make them restartable."""


def normalise_status(returncode: int) -> int:
    """A Popen return code as a shell would report it: -N (killed by signal N) becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def is_restartable(status: int, *, declared: bool = False, host_lost: bool = False) -> bool:
    """Whether running the job again may succeed (see ``RESTART_SIGNALS`` and ``ExitCode``).

    The status alone decides for 75 and the restart signals, and for the job's own verdicts (``JOB_VERDICTS``).
    Any other status is the launcher's (Open MPI's mpirun ends with 9 or 205 when it loses a daemon, whatever
    the ranks did, or is killed by a signal): restartable when the attempt lost a host (``lost_host``; not for
    the stop signals, ``STOP_SIGNALS``), or, except for status 1 (an exception in the job) and the signals,
    when the monitor had declared a failure (``declared``: it wrote ``failure.json``).
    """
    if status == ExitCode.RESTARTABLE:
        return True
    if status in JOB_VERDICTS:
        return False
    if status > 128 and _is_signal(status - 128):
        return status - 128 in {int(s) for s in RESTART_SIGNALS} or (host_lost and status - 128 not in STOP_SIGNALS)
    return host_lost or (declared and status != ExitCode.CODE_ERROR)


STOP_SIGNALS = frozenset({int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGHUP), int(signal.SIGQUIT)})
"""Requests to stop: a launcher killed by one of these is not restarted, lost host or not."""


def _is_signal(number: int) -> bool:
    """Whether ``number`` is a signal of this system (a status above 128 may be a launcher's own: mpirun ends with
    205 when it loses a daemon to a host that died)."""
    return 0 < number < signal.NSIG


def declared(failure: dict[str, Any] | None) -> bool:
    """Whether ``failure`` is a report of the job's monitor (``failure.json``), not a launcher's line."""
    return failure is not None and bool(failure) and failure.get("source") != "launcher"


def is_abort_line(line: str) -> bool:
    """Whether ``line`` is Open MPI's report of an MPI_Abort: the job has declared its failure."""
    return _ABORT_LINE.search(line) is not None


def host_loss_from_line(line: str) -> dict[str, Any] | None:
    """What a launcher's line says about a lost host: ``{"what": ...}`` and/or ``{"host": ...}``; None if nothing.

    Open MPI names the host on a line of its own after the message ("Remote daemon: [[...],1] on node hostB"),
    so the lines of one message are merged with ``merge_host_loss``.
    """
    for pattern, what in _LOSS_LINES:
        match = pattern.search(line)
        if match:
            found: dict[str, Any] = {"what": what} if what else {}
            if match.groupdict().get("host"):
                found["host"] = match.group("host").rstrip(".")
            if what:
                found["line"] = line.strip()[:300]
            return found
    return None


def merge_host_loss(notes: dict[str, Any] | None, found: dict[str, Any]) -> dict[str, Any]:
    """``notes`` (what the launcher said so far about a lost host) with ``found`` added; the first of each kept."""
    merged = dict(notes or {})
    for key, value in found.items():
        merged.setdefault(key, value)
    if found.get("what") == "daemon lost" or found.get("what", "").startswith("node"):
        merged["what"] = found["what"]  # a loss after start-up outranks a start-up message
    return merged


def read_rank_places(directory: Path | None, kind: str) -> dict[int, RankPlace]:
    """Rank -> where it ran, from the ranks' reports ``<kind>.<rank>`` in ``directory``
    (``hpcnet.launch.stop.report_rank``: "<size> <pid> <time> <host> <addresses> <node>", the last two absent in
    the reports of an earlier hpcnet); {} when there are none."""
    found: dict[int, RankPlace] = {}
    if directory is None:
        return found
    try:
        paths = list(directory.glob(f"{kind}.*"))
    except OSError:
        return found
    for path in paths:
        rank = path.name.rpartition(".")[2]
        try:
            fields = path.read_text().rstrip("\n").split(" ")
        except OSError:
            continue
        if rank.isdigit() and len(fields) >= 4 and fields[3]:
            addresses, node = (fields + ["-", "-"])[4:6]
            found[int(rank)] = RankPlace(fields[3], tuple(a for a in addresses.split(",") if a not in ("", "-")),
                                         "" if node == "-" else node)
    return found


def read_rank_hosts(directory: Path | None, kind: str) -> dict[int, str]:
    """Rank -> host from the ranks' reports (``read_rank_places``); {} when there are none."""
    return {rank: place.host for rank, place in read_rank_places(directory, kind).items()}


def lost_host(failure: dict[str, Any] | None, launcher: dict[str, Any] | None, rank_hosts: dict[int, str], *,
              started: bool) -> dict[str, Any] | None:
    """The host an attempt lost, and how that is known; None when nothing says a host was lost (pure).

    Args:
        failure: the monitor's ``failure.json`` (or a launcher's line about a dead rank).
        launcher: what the launcher printed about a lost daemon or node (``host_loss_from_line``, merged).
        rank_hosts: rank -> host, from the ranks' ready reports (and ``failure.json``'s own list, where it has one).
        started: whether every rank of the attempt had started (reported ready, or logged a step).

    Returns ``{"host": name or None, "ranks": [...], "evidence": words}``.  Evidence, in order:
    ``failure.json`` when every rank it names is on one host and it names every rank known to be there (a
    heartbeat report naming one host other than the detector's, when the ranks' hosts are unknown); the
    launcher's message of a lost daemon or node at any time; its message of a daemon that failed or could not be
    reached once the attempt had started (before that, the same message is a launch that failed: not a lost host).
    """
    hosts_of = dict(rank_hosts)
    if failure and declared(failure):
        for entry in failure.get("ranks", []) if isinstance(failure.get("ranks"), list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("rank"), int) and isinstance(entry.get("host"), str):
                hosts_of.setdefault(entry["rank"], entry["host"])
        ranks, hosts = failed_where(failure)
        if len(hosts) == 1 and ranks:
            there = {r for r, h in hosts_of.items() if h == hosts[0]}
            whole = bool(there) and there <= set(ranks)
            if whole or (not there and failure.get("kind") == "heartbeat" and failure.get("detected_host") not in
                         (None, hosts[0])):
                return {"host": hosts[0], "ranks": sorted(set(ranks) | there),
                        "evidence": f"{FAILURE_FILE}: every rank on {hosts[0]} went silent"}
    what = (launcher or {}).get("what")
    if what is None or (what == "start" and not started):
        return None
    host = (launcher or {}).get("host")
    if host is None and failure:
        named = failed_where(failure)[1]
        host = named[0] if len(named) == 1 else None
    words = {"daemon lost": "the launcher lost its daemon there",
             "node failure": "the launcher reported a node failure", "node lost": "the launcher lost the node",
             "start": "a launcher daemon failed after the ranks had started"}
    return {"host": host, "ranks": sorted(r for r, h in hosts_of.items() if host is not None and h == host),
            "evidence": f"{words[what]}: {(launcher or {}).get('line', '')}".rstrip(": ")}


def describe_loss(loss: dict[str, Any]) -> str:
    """A lost host in words."""
    ranks = f" (ranks {', '.join(map(str, loss['ranks']))})" if loss.get("ranks") else ""
    return f"host {loss['host'] or '(the launcher did not say which)'} lost{ranks}: {loss['evidence']}"


def describe_status(status: int) -> str:
    """A status in words."""
    names: dict[int, str] = {
        ExitCode.OK: "finished", ExitCode.CODE_ERROR: "error (a bug, or a launcher failure)",
        ExitCode.USAGE_ERROR: "bad input (option, data, path, full disk)",
        ExitCode.DIVERGED: "diverged (non-finite loss, gradients or state; nothing of it saved)",
        ExitCode.RESTARTABLE: "restartable failure (peer died or hung, communication failed)",
        ExitCode.PREEMPTED: "preempted after saving", ExitCode.INTERRUPTED: "interrupted"}
    if status in names:
        return names[status]
    if status > 128 and _is_signal(status - 128):
        return f"killed by {_signal_words(status - 128)}"
    return f"failed with status {status}"


def _signal_words(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def backoff_s(restart: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): doubling from ``base_s``, at most ``cap_s``."""
    if restart < 1:
        raise ValueError("restart must be at least 1")
    return min(cap_s, base_s * 2 ** min(restart - 1, 62))


@dataclass(slots=True)
class RestartBudget:
    """At most ``max_restarts`` restarts in a row without progress; an attempt that committed a checkpoint resets the
    count."""

    max_restarts: int
    used: int = 0
    """Restarts since the last progress."""

    def last_attempt(self, attempt: int) -> int:
        """The number of the last attempt while attempt ``attempt`` runs (later, if one makes progress)."""
        return attempt + self.max_restarts - self.used

    def progress(self) -> bool:
        """An attempt committed a new checkpoint: the count starts again.  Whether any restart had been used."""
        used, self.used = self.used, 0
        return used > 0

    def take(self) -> int | None:
        """Use a restart: its number since the last progress (1, 2, ...), or None when none is left."""
        if self.used >= self.max_restarts:
            return None
        self.used += 1
        return self.used


def committed_checkpoints(directory: Path | None) -> dict[str, tuple[int, int]]:
    """The committed checkpoint files in ``directory``: name -> (size, mtime in ns); {} when there is none.

    Only committed names count (a save in flight has the temporary suffix),
    read from the directory listing alone: the supervisor imports neither torch nor h5py.
    """
    found: dict[str, tuple[int, int]] = {}
    if directory is None:
        return found
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        if CKPT_NAME_RE.match(entry.name):
            with contextlib.suppress(FileNotFoundError):  # removed by retention meanwhile
                info = entry.stat()
                found[entry.name] = (info.st_size, info.st_mtime_ns)
    return found


def new_checkpoints(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """Checkpoints committed between two listings (new names, or names written again), sorted."""
    return sorted(name for name, stat in after.items() if before.get(name) != stat)


def read_failure(run_dir: str | None) -> dict[str, Any] | None:
    """The monitor's report in an attempt's run directory; None when it wrote none."""
    if not run_dir:
        return None
    path = Path(run_dir) / FAILURE_FILE
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"kind": f"unreadable {FAILURE_FILE}", "error": str(exc)}
    return found if isinstance(found, dict) else {"kind": f"unreadable {FAILURE_FILE}"}


def failure_from_line(line: str) -> dict[str, Any] | None:
    """A launcher's report of a dead rank (mpirun or srun) as {rank, host, signal/what}; None if not one."""
    for pattern in _DEATH_LINES:
        match = pattern.search(line)
        if match:
            found: dict[str, Any] = {"kind": "rank died", "source": "launcher", **match.groupdict()}
            if str(found.get("rank", "")).isdigit():
                found["rank"] = int(found["rank"])
            if found.get("signal"):
                found["signal"] = int(found["signal"])
            return found
    return None


def failed_where(failure: dict[str, Any] | None) -> tuple[list[int], list[str]]:
    """The failed ranks and their hosts named by a report: ``{rank, host}`` or ``{failed: [{rank, host}, ...]}``."""
    if not failure:
        return [], []
    entries = failure.get("failed")
    if not isinstance(entries, list):
        entries = [failure]
    ranks = [e["rank"] for e in entries if isinstance(e, dict) and isinstance(e.get("rank"), int)]
    hosts = [e["host"] for e in entries if isinstance(e, dict) and isinstance(e.get("host"), str) and e["host"]]
    return ranks, list(dict.fromkeys(hosts))


def describe_failure(failure: dict[str, Any] | None) -> str:
    """A failure report (the monitor's failure.json, or a launcher's line about a dead rank) in words."""
    if not failure:
        return ""
    ranks, hosts = failed_where(failure)
    who = " ".join(part for part in (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "",
        f"on {', '.join(hosts)}" if hosts else "") if part)
    if failure.get("source") == "launcher":
        sig = failure.get("signal")
        how = f"died of {_signal_words(sig)}" if sig else f"failed: {failure.get('what', '')}".rstrip(": ")
        return f"{who or 'a rank'} {how}"
    first = failure["failed"][0] if isinstance(failure.get("failed"), list) and failure["failed"] else {}
    step = failure.get("step", first.get("last_step") if isinstance(first, dict) else None)
    collective = failure.get("collective") or (first.get("collective") if isinstance(first, dict) else None)
    parts = [f"{failure.get('kind') or 'failure'}:", who or "rank unknown"]
    if step is not None:
        parts.append(f"at step {step}")
    if collective:
        parts.append(f"in {collective}")
    if failure.get("detail"):
        parts.append(f"({failure['detail']})")
    return " ".join(parts)
