"""Where each step's time goes on this rank: a clock that the loop marks at phase boundaries (docs/outputs.md
writes).

A step runs from one ``start_step`` to the next and is cut by ``mark(phase)`` calls into consecutive pieces, each
charged to the phase named at its end, so the phases of a step add up to the step exactly:

- ``data``: waiting for the batch read ahead, and moving it to the device;
- ``forward``, ``backward``: the micro-batches' forward and backward passes;
- ``comm``: exposed communication: what is left of the gradient reduction after backward (``Reducer.finish``), the
  buffer broadcast, the parameter broadcast of ``dist.zero``, and the step-boundary agreement;
- ``optimizer``: clipping and the update;
- ``checkpoint``: the part of a save the step waits for (the snapshot, when saving in the background);
- ``eval``: evaluation;
- ``mirror``: ``fault.replicas=1``'s copy of the state and its exchange with the keeper (``hpcnet.fault.mirror``);
- ``other``: the rest (logging, heartbeats, fault injection, balancing).

Marks cost a clock read and a dict update, about a microsecond; nothing is synchronised (on CUDA the phases are the
host's view: kernels are queued, and a phase that waits for the GPU, ``comm`` or the loss read at log steps, shows
the wait). ``tracing`` also keeps every piece with its start time, for ``hpcnet.observe.trace``.
"""

import time
from typing import Any

PHASES = ("data", "forward", "backward", "comm", "optimizer", "checkpoint", "eval", "mirror", "other")


class PhaseClock:
    """Per-phase time sums of this rank's steps: per log interval (``take_interval``) and for the whole run.

    ``split`` ends the step in progress at a log point and begins the next one there, so an interval's phase
    sums equal its step times exactly: what a log step does after its log line (evaluation, the boundary, a
    save) is charged to the step after it.
    """

    def __init__(self) -> None:
        self._step_start: float | None = None
        self._last = 0.0
        self._split = False
        self.interval = dict.fromkeys(PHASES, 0.0)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.interval_steps: list[float] = []
        self.step_s: list[float] = []
        """Every completed step's wall seconds, in order."""
        self.tracing = False
        self.pieces: list[tuple[str, float, float]] = []
        """With ``tracing``: (phase, start perf_counter, seconds) of every piece."""

    @property
    def step_start(self) -> float | None:
        """``perf_counter`` at which the step in progress began (None between steps)."""
        return self._step_start

    def start_step(self) -> None:
        """A step begins: the previous one (if any) ends here, its remainder charged to ``other``; after ``split``
        the step has begun already."""
        if self._split:
            self._split = False
            return
        self._begin(time.perf_counter())

    def split(self) -> None:
        """End the step in progress now and begin the next one here (at a log point)."""
        self._begin(time.perf_counter())
        self._split = True

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or the step's start) was spent in ``phase``."""
        if self._step_start is not None:
            self._charge(phase, time.perf_counter())

    def end(self) -> None:
        """The last step ends (the loop is over); what followed its log point (``split``) is added to it."""
        if self._step_start is not None:
            now = time.perf_counter()
            self._charge("other", now)
            if self._split and self.step_s:
                self.step_s[-1] += now - self._step_start
            else:
                self._finish(now)
        self._step_start, self._split = None, False

    def take_interval(self) -> tuple[list[float], dict[str, float]]:
        """The steps completed and their phase sums since the last call."""
        steps, phases = self.interval_steps, self.interval
        self.interval_steps, self.interval = [], dict.fromkeys(PHASES, 0.0)
        return steps, phases

    def _begin(self, now: float) -> None:
        if self._step_start is not None:
            self._charge("other", now)
            self._finish(now)
        self._step_start = self._last = now

    def _finish(self, now: float) -> None:
        assert self._step_start is not None
        seconds = now - self._step_start
        self.interval_steps.append(seconds)
        self.step_s.append(seconds)

    def _charge(self, phase: str, now: float) -> None:
        seconds = now - self._last
        self.interval[phase] += seconds
        self.totals[phase] += seconds
        if self.tracing:
            self.pieces.append((phase, self._last, seconds))
        self._last = now


def overhead_s(marks: int = 100_000) -> float:
    """Seconds one ``mark`` costs on this machine, measured now (the phase clock's overhead)."""
    clock = PhaseClock()
    clock.start_step()
    t0 = time.perf_counter()
    for _ in range(marks):
        clock.mark("other")
    return (time.perf_counter() - t0) / marks


def rss_mib() -> float:
    """This process's resident memory in MiB (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    import resource

    return pages * resource.getpagesize() / 2**20


def bucket_times(entries: list[Any], since_step: int) -> list[dict[str, Any]]:
    """Per gradient bucket, its bytes and the median seconds from launch to completion, over the flight recorder's
    completed ``allreduce.bucket`` entries of the steps after step ``since_step`` (an entry's ``step`` counts the
    steps completed when it started: a bucket of step k has ``step == k - 1``)."""
    spans: dict[int, list[float]] = {}
    sizes: dict[int, int] = {}
    for entry in entries:
        if entry.op != "allreduce.bucket" or entry.end is None or entry.step < since_step:
            continue
        spans.setdefault(entry.bucket, []).append(entry.end - entry.start)
        sizes[entry.bucket] = entry.nbytes
    out = []
    for bucket in sorted(spans):
        ordered = sorted(spans[bucket])
        out.append({"bucket": bucket, "bytes": sizes[bucket], "seconds": ordered[len(ordered) // 2]})
    return out
