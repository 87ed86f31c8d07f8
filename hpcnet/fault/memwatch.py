"""Memory-leak watch: resident memory (and GPU memory) sampled every N steps.

A leak shows as memory that keeps growing, sample after sample.  One jump
(a cache filled once, the allocator reserving a new segment) or a spike that
comes back down is not a leak, so the warning needs all three of:

- the last sample exceeds the first of the window by more than the threshold,
- the robust (Theil-Sen: median of pairwise) slope projects more than the
  threshold over the window, so a few outliers cannot fake or hide a trend,
- no single increase is more than half the growth: the growth is spread out.

The trend of the whole run (first, last, peak, least-squares slope per 1000
steps) goes into the run summary.
"""

import logging
import os
import statistics
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MB = 2**20


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / MB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of the slopes between every pair of points (robust to outliers)."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else 0.0


def steady_growth(xs: Sequence[float], ys: Sequence[float], threshold_mb: float) -> float | None:
    """The growth in MiB when ``ys`` grew steadily by more than ``threshold_mb``, else None (pure)."""
    if len(ys) < 3:
        return None
    growth = ys[-1] - ys[0]
    if growth <= threshold_mb:
        return None
    if theil_sen_slope(xs, ys) * (xs[-1] - xs[0]) <= threshold_mb:
        return None
    largest_rise = max(b - a for a, b in zip(ys, ys[1:]))
    if largest_rise > 0.5 * growth:
        return None  # one jump, not a trend
    return growth


class Series:
    """One memory quantity over the run: a sliding window and running least-squares sums."""

    def __init__(self, name: str, window: int) -> None:
        self.name = name
        self.window: deque[tuple[int, float]] = deque(maxlen=window)
        self.first: float | None = None
        self.last = 0.0
        self.peak = 0.0
        self._x0 = 0
        self._n = 0
        self._sums = [0.0, 0.0, 0.0, 0.0]  # x, y, xx, xy (x relative to the first step, for precision)

    def add(self, step: int, value_mb: float, threshold_mb: float) -> float | None:
        """Add a sample; return the growth when the window now shows a steady increase."""
        if self.first is None:
            self.first, self._x0 = value_mb, step
        self.last = value_mb
        self.peak = max(self.peak, value_mb)
        x = step - self._x0
        self._n += 1
        for i, v in enumerate((x, value_mb, x * x, x * value_mb)):
            self._sums[i] += v
        self.window.append((step, value_mb))
        if len(self.window) < self.window.maxlen:
            return None
        growth = steady_growth([s for s, _ in self.window], [v for _, v in self.window], threshold_mb)
        if growth is not None:
            self.window.clear()  # the next warning needs a whole new window of growth
        return growth

    def slope_per_1000_steps(self) -> float:
        n, (sx, sy, sxx, sxy) = self._n, self._sums
        denominator = n * sxx - sx * sx
        return 1000 * (n * sxy - sx * sy) / denominator if n > 1 and denominator > 0 else 0.0

    def trend(self) -> dict[str, Any]:
        return {"first_mb": round(self.first or 0.0, 1), "last_mb": round(self.last, 1),
                "peak_mb": round(self.peak, 1), "slope_mb_per_1000_steps": round(self.slope_per_1000_steps(), 2),
                "samples": self._n}


class MemoryWatch:
    """Sample this rank's memory every ``every_steps`` steps and warn on steady growth.

    Args:
        every_steps: ``monitor.memory_every_steps``; 0 disables the watch.
        window: ``monitor.memory_window``, samples per judgement.
        growth_mb: ``monitor.memory_growth_mb``.
        device: the training device; on CUDA the allocator's allocated and
            reserved memory are watched too.
        run_dir: where ``memory.rank<r>.txt`` (``torch.cuda.memory_summary``)
            goes on a GPU warning.
        rank: this rank, for messages and file names.
    """

    def __init__(self, every_steps: int, window: int, growth_mb: float, *, device: Any = None,
                 run_dir: Path | None = None, rank: int = 0) -> None:
        self.every_steps = every_steps
        self.growth_mb = growth_mb
        self.device = device if device is not None and getattr(device, "type", "cpu") == "cuda" else None
        self.run_dir = run_dir
        self.rank = rank
        names = ["rss"] + (["gpu_allocated", "gpu_reserved"] if self.device is not None else [])
        self.series = {name: Series(name, window) for name in names}
        self.warnings: list[dict[str, Any]] = []

    def maybe_sample(self, step: int) -> None:
        if self.every_steps > 0 and step % self.every_steps == 0:
            self.sample(step)

    def sample(self, step: int) -> None:
        values = {"rss": rss_mb()}
        if self.device is not None:
            import torch

            values["gpu_allocated"] = torch.cuda.memory_allocated(self.device) / MB
            values["gpu_reserved"] = torch.cuda.memory_reserved(self.device) / MB
        for name, value in values.items():
            series = self.series[name]
            growth = series.add(step, value, self.growth_mb)
            if growth is not None:
                self._warn(series, step, growth)

    def _warn(self, series: Series, step: int, growth: float) -> None:
        span = series.window.maxlen * self.every_steps
        self.warnings.append({"rank": self.rank, "memory": series.name, "step": step,
                              "growth_mb": round(growth, 1)})
        log.warning("rank %d: %s memory grew steadily by %.0f MiB over the last %d steps (now %.0f MiB, "
                    "%.1f MiB per 1000 steps over the run): a leak? (monitor.memory_growth_mb=%g)",
                    self.rank, series.name, growth, span, series.last, series.slope_per_1000_steps(),
                    self.growth_mb)
        if series.name.startswith("gpu") and self.run_dir is not None:
            import torch

            path = self.run_dir / f"memory.rank{self.rank}.txt"
            try:
                with open(path, "a") as f:
                    f.write(f"== step {step}: {series.name} grew by {growth:.0f} MiB ==\n")
                    f.write(torch.cuda.memory_summary(self.device) + "\n")
            except OSError as exc:  # best effort, as every descriptive file (hpcnet.observe.runlog): training goes on
                log.warning("rank %d: cannot write %s: %s", self.rank, path, exc.strerror or exc)
                return
            log.warning("rank %d: CUDA allocator summary written to %s", self.rank, path)

    def summary(self) -> dict[str, Any]:
        """This rank's trend per quantity, and its warnings."""
        return {"trend": {name: s.trend() for name, s in self.series.items() if s.first is not None},
                "warnings": self.warnings}


def merge_summaries(every: list[dict[str, Any]], every_steps: int) -> dict[str, Any]:
    """The ``monitor.memory`` part of summary.json from every rank's ``MemoryWatch.summary`` (rank 0)."""
    memory: dict[str, Any] = {"every_steps": every_steps, "warnings": []}
    for rank, entry in enumerate(every):
        for name, trend in entry["trend"].items():
            memory.setdefault(name, []).append({"rank": rank, **trend})
        memory["warnings"] += entry["warnings"]
    if memory["warnings"]:
        log.warning("memory grew steadily on rank(s) %s (see summary.json monitor.memory)",
                    sorted({w["rank"] for w in memory["warnings"]}))
    return memory
