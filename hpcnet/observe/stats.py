"""Step-time statistics, defined once: the seed's "latency jitter" and the straggler figures that ``summary.json``,
``bench architectures`` and ``python -m hpcnet.report`` print (docs/outputs.md). Pure Python.

- **jitter** (the seed's "±x%"): half the p5-p95 range of step times over their median,
  ``100 * (p95 - p5) / (2 * p50)``; robust to the odd slow step (a checkpoint), which p99 shows instead.
- **CV**: standard deviation over mean, in percent.
- **slowest rank**: the rank with the largest median step time; ``slowest_over_median`` is its median over the
  median of the ranks' medians.
- **straggler share**: how much of a step the ranks wait for the slowest, on average: ``(max_r c_r - mean_r c_r)
  / step`` where ``c_r`` is rank r's median step time without its exposed communication (the wait) and ``step``
  the median step time.
"""

import statistics
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def jitter_pct(values: list[float]) -> float:
    """The seed's latency jitter of step times, ``±x%``: ``100 * (p95 - p5) / (2 * p50)``."""
    p50 = percentile(values, 50)
    return 100 * (percentile(values, 95) - percentile(values, 5)) / (2 * p50) if p50 > 0 else 0.0


def cv_pct(values: list[float]) -> float:
    """Coefficient of variation in percent: population standard deviation over mean."""
    mean = statistics.fmean(values)
    return 100 * statistics.pstdev(values) / mean if mean > 0 else 0.0


def rank_step_stats(step_s: list[float], phases_s: dict[str, float]) -> dict[str, Any]:
    """One rank's step-time figures (``step_s``: its step times; ``phases_s``: its phase totals)."""
    if not step_s:
        return {"steps": 0, "phases_s": phases_s}
    total = sum(step_s)
    return {"steps": len(step_s), "median_s": percentile(step_s, 50), "p95_s": percentile(step_s, 95),
            "p99_s": percentile(step_s, 99), "cv_pct": cv_pct(step_s), "jitter_pct": jitter_pct(step_s),
            "phases_s": phases_s,
            # The rank's median step without its share of exposed communication: what it computes.
            "compute_median_s": percentile(step_s, 50) * (1 - phases_s.get("comm", 0.0) / total if total else 1)}


def job_step_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures from every rank's ``rank_step_stats``, rank by rank."""
    timed = [(r, s) for r, s in enumerate(per_rank) if s.get("steps")]
    out: dict[str, Any] = {"per_rank": [{"rank": r, **s} for r, s in enumerate(per_rank)]}
    if not timed:
        return out
    medians = [s["median_s"] for _, s in timed]
    slowest_rank, slowest = max(timed, key=lambda item: (item[1]["median_s"], -item[0]))
    middle = statistics.median(medians)
    compute = [s["compute_median_s"] for _, s in timed]
    out.update(slowest_rank=slowest_rank, slowest_median_s=slowest["median_s"],
               slowest_over_median=slowest["median_s"] / middle if middle > 0 else 1.0,
               straggler_share=(max(compute) - statistics.fmean(compute)) / middle if middle > 0 else 0.0,
               median_s=middle, jitter_pct=per_rank[timed[0][0]]["jitter_pct"],
               cv_pct=per_rank[timed[0][0]]["cv_pct"])
    return out
