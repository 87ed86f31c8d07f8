"""Restart decisions (pure): which statuses restart, the restart budget, the backoff, what a failure was.

Why these statuses and not others, and how the budget counts, is in
docs/fault-tolerance.md.  Nothing here runs a process; ``hpcnet.launch.supervisor`` does.
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


def normalise_status(returncode: int) -> int:
    """A Popen return code as a shell would report it: -N (killed by signal N) becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def is_restartable(status: int) -> bool:
    """Whether running the job again may succeed (see ``RESTART_SIGNALS`` and ``ExitCode``)."""
    if status == ExitCode.RESTARTABLE:
        return True
    return status > 128 and status - 128 in {int(s) for s in RESTART_SIGNALS}


def describe_status(status: int) -> str:
    """A status in words."""
    names = {ExitCode.OK: "finished", ExitCode.CODE_ERROR: "error (a bug, or a launcher failure)",
             ExitCode.USAGE_ERROR: "bad input (option, data, path, full disk)",
             ExitCode.DIVERGED: "diverged (non-finite loss, gradients or state; nothing of it saved)",
             ExitCode.RESTARTABLE: "restartable failure (peer died or hung, communication failed)",
             ExitCode.PREEMPTED: "preempted after saving", ExitCode.INTERRUPTED: "interrupted"}
    if status in names:
        return names[status]
    if status > 128:
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
