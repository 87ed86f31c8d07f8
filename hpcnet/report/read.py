"""Reading a run directory, or a ``hpcnet.launch`` directory and its attempts, for the report (pure, stdlib only).

Everything here tolerates a run that is still being written or that died:
a ``.jsonl`` line that is not complete (no newline yet, or cut by a crash) is
skipped, a missing or unreadable JSON file is None, and a log line from before
a field existed simply lacks it.  Nothing imports torch, mpi4py or matplotlib.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcnet.paths import CONFIG_FILE, FAILURE_FILE, LAUNCH_FILE, OWNERS_FILE, SUMMARY_FILE, TRACE_FILE, attempt_dir

TOPOLOGY_FILE = "topology.json"
"""Written by the trainer at start-up (docs/outputs.md); its ``size``, and its per-host figures for the report."""
_METRICS_RE = re.compile(r"^metrics\.rank(\d+)\.jsonl$")
_ATTEMPT_RE = re.compile(r"^attempt-(\d+)$")


@dataclass(slots=True)
class Run:
    """One run directory: its metrics lines per rank and its JSON files (None when absent)."""

    path: Path
    lines: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Rank -> its log lines (those with a ``loss``), in file order."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's (or the lowest rank's) evaluation lines."""
    skipped_lines: int = 0
    """Incomplete or unreadable lines left out (a partial last line of a running or crashed run)."""
    summary: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    topology: dict[str, Any] | None = None
    extras: list[str] = field(default_factory=list)
    """Files worth a link: config.toml, trace.json, owners.json, topology.json, stall dumps, rank logs."""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.lines)

    @property
    def world_size(self) -> int | None:
        """From summary.json, else topology.json; None when neither says."""
        for size in ((self.summary or {}).get("world_size"), (self.topology or {}).get("size")):
            if isinstance(size, int) and size > 0:
                return size
        return None

    @property
    def main_lines(self) -> list[dict[str, Any]]:
        """The lowest rank's log lines (rank 0 unless only others wrote metrics)."""
        return self.lines[self.ranks[0]] if self.lines else []

    @property
    def last_step(self) -> int | None:
        steps = [line["step"] for line in self.main_lines if isinstance(line.get("step"), int)]
        return steps[-1] if steps else None

    @property
    def last_time(self) -> float | None:
        times = [line["time"] for line in [*self.main_lines, *self.evals] if _number(line.get("time"))]
        return max(times) if times else None

    def first_step(self) -> tuple[int, float] | None:
        """(step, unix time) of the first step this run completed, from its first log line.

        The line is written after the interval's last step: the steps after the
        first are taken off its time when the line has their ``step_s``; an
        older line without them gives the time of the first logged step.
        """
        for line in self.main_lines:
            if not (isinstance(line.get("step"), int) and _number(line.get("time"))):
                continue
            step_s = line.get("step_s")
            if isinstance(step_s, list) and step_s and all(_number(s) for s in step_s):
                return line["step"] - len(step_s) + 1, line["time"] - sum(step_s[1:])
            return line["step"], line["time"]
        return None


@dataclass(slots=True)
class Attempt:
    """One attempt of a launch: what launch.json recorded (empty while it runs) and its run directory."""

    number: int
    record: dict[str, Any]
    run: Run | None

    @property
    def status(self) -> int | None:
        status = self.record.get("status")
        return status if isinstance(status, int) and status >= 0 else None


@dataclass(slots=True)
class Launch:
    """A ``hpcnet.launch`` directory: launch.json and every attempt found."""

    path: Path
    record: dict[str, Any]
    attempts: list[Attempt]

    @property
    def runs(self) -> list[tuple[str, Run]]:
        """(label, run) of every attempt that has a run directory."""
        return [(f"attempt {a.number}", a.run) for a in self.attempts if a.run is not None]


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON-lines file and how many lines were left out.

    A last line without its newline is still being written (or was cut by a
    crash): it is left out, as is any line that is not one JSON object.
    """
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return [], 0
    lines = text.split("\n")
    skipped = 1 if lines[-1].strip() else 0  # no newline after it: incomplete
    records = []
    for line in lines[:-1]:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file; None when it is absent, unreadable or not an object (being rewritten)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def read_run(path: Path) -> Run:
    """Everything the report uses from run directory ``path``."""
    run = Run(path)
    metrics = sorted((int(m.group(1)), p) for p in _listdir(path) if (m := _METRICS_RE.match(p.name)))
    for rank, file in metrics:
        records, skipped = read_jsonl(file)
        run.skipped_lines += skipped
        run.lines[rank] = [r for r in records if "loss" in r or "global_loss" in r]
        if not run.evals:
            run.evals = [r for r in records if "eval_loss" in r]
    run.summary = read_json(path / SUMMARY_FILE)
    run.failure = read_json(path / FAILURE_FILE)
    run.topology = read_json(path / TOPOLOGY_FILE)
    names = {p.name for p in _listdir(path)}
    run.extras = [n for n in (CONFIG_FILE, TRACE_FILE, OWNERS_FILE, TOPOLOGY_FILE, FAILURE_FILE) if n in names]
    run.extras += sorted(n for n in names if n.startswith(("stall.rank", "memory.rank")) and n.endswith(".txt"))
    return run


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like a run directory (what the trainer writes first, or its metrics)."""
    return any((path / name).exists() for name in (CONFIG_FILE, SUMMARY_FILE, "rank0.log")) or any(
        _METRICS_RE.match(p.name) for p in _listdir(path))


def is_launch_dir(path: Path) -> bool:
    """Whether ``path`` is a ``hpcnet.launch`` directory: launch.json, or an attempt-1/ while the first attempt runs."""
    return (path / LAUNCH_FILE).exists() or attempt_dir(path, 1).is_dir()


def read_launch(path: Path) -> Launch:
    """launch.json and the attempts' run directories; an attempt running now has a directory but no record yet."""
    record = read_json(path / LAUNCH_FILE) or {}
    recorded = {a["attempt"]: a for a in record.get("attempts", []) if isinstance(a, dict)
                and isinstance(a.get("attempt"), int)}
    found = {int(m.group(1)) for p in _listdir(path) if p.is_dir() and (m := _ATTEMPT_RE.match(p.name))}
    attempts = []
    for number in sorted(found | set(recorded)):
        rec = recorded.get(number, {})
        run_path = Path(rec["run_dir"]) if rec.get("run_dir") else attempt_dir(path, number)
        if not run_path.is_dir():  # launch.json names an absolute path: the directory may have moved
            run_path = attempt_dir(path, number)
        attempts.append(Attempt(number, rec, read_run(run_path) if run_path.is_dir() else None))
    return Launch(path, record, attempts)


def recovery_s(failed: Attempt, following: Attempt) -> float | None:
    """Seconds from the end of a failed attempt to the first step of the next; None when either is unknown."""
    end = failed.record.get("end_unix")
    first = following.run.first_step() if following.run is not None else None
    if not _number(end) or not end or first is None:
        return None
    return first[1] - end


def _listdir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
