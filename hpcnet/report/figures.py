"""The report's plots: one PNG each, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Every ``draw_*`` takes the runs to show, as (label, Run) pairs (one pair with
an empty label for a plain run directory; one per attempt for a launch
directory) and the output folder, and returns a ``Plot``: its file, or why it
was not drawn.  Only ``hpcnet.report.build`` imports this module, after it has
checked that matplotlib is installed.
"""

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hpcnet.observe.phases import PHASES
from hpcnet.observe.stats import jitter_pct
from hpcnet.report.read import Launch, Run, recovery_s

MAX_RANKS_SHOWN = 32
"""Per-rank plots of bigger jobs show the 16 slowest and the 16 fastest ranks (by median step)."""
METRICS_ALL = "run with run.metrics=all to get every rank"

Runs = list[tuple[str, Run]]


@dataclass(slots=True)
class Plot:
    """One plot of the report: drawn to ``file``, or not drawn because of ``why_not``."""

    name: str
    title: str
    file: str | None = None
    why_not: str = ""
    notes: list[str] = field(default_factory=list)


def _figure(width: float = 8.0, height: float = 4.5, rows: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]
    return fig, list(axes)


def _save(fig: Figure, out: Path, plot: Plot) -> Plot:
    plot.file = f"{plot.name}.png"
    fig.savefig(out / plot.file, dpi=100)
    return plot


def _label(run_label: str, what: str = "") -> str:
    return " ".join(part for part in (run_label, what) if part)


def _series(lines: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(line["step"], line[key]) for line in lines
              if isinstance(line.get("step"), int) and isinstance(line.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _coverage_note(runs: Runs, ranks: set[int]) -> list[str]:
    """A note when fewer ranks than the job had are shown."""
    sizes = [run.world_size for _, run in runs if run.world_size]
    size = max(sizes) if sizes else None
    if size and len(ranks) < size:
        shown = ", ".join(map(str, sorted(ranks)[:8])) + (", ..." if len(ranks) > 8 else "")
        return [f"only rank{'s' if len(ranks) > 1 else ''} {shown} of {size} wrote metrics: {METRICS_ALL}"]
    return []


def _pick_ranks(medians: dict[int, float]) -> tuple[list[int], list[str]]:
    """The ranks a per-rank plot shows (all, or the slowest and fastest of a big job) and a note."""
    ranks = sorted(medians)
    if len(ranks) <= MAX_RANKS_SHOWN:
        return ranks, []
    by_median = sorted(ranks, key=lambda r: medians[r])
    half = MAX_RANKS_SHOWN // 2
    shown = sorted(by_median[:half] + by_median[-half:])
    return shown, [f"{len(ranks)} ranks: the {half} fastest and the {half} slowest (by median step) are shown"]


def draw_loss(runs: Runs, out: Path) -> Plot:
    """Training loss (the global loss, every rank's mean) and evaluation loss and accuracy against the step."""
    plot = Plot("loss", "Loss and evaluation")
    has_eval = any(run.evals for _, run in runs)
    has_accuracy = any("eval_accuracy" in e for _, run in runs for e in run.evals)
    if not any(run.main_lines for _, run in runs) and not has_eval:
        plot.why_not = "loss: no log lines yet (no metrics.rank<r>.jsonl, or run.metrics=none)"
        return plot
    fig, axes = _figure(rows=2 if has_accuracy else 1, height=6.0 if has_accuracy else 4.5)
    for label, run in runs:
        key = "global_loss" if any("global_loss" in line for line in run.main_lines) else "loss"
        steps, values = _series(run.main_lines, key)
        if steps:
            (line,) = axes[0].plot(steps, values, linewidth=1.2, label=_label(label, "train"))
            color = line.get_color()
        else:
            color = None
        steps, values = _series(run.evals, "eval_loss")
        if steps:
            axes[0].plot(steps, values, "o--", color=color, markersize=4, label=_label(label, "eval"))
        steps, values = _series(run.evals, "eval_accuracy")
        if steps and has_accuracy:
            axes[1].plot(steps, [100 * v for v in values], "o--", color=color, markersize=4,
                         label=_label(label, "eval"))
    axes[0].set_ylabel("loss")
    axes[0].legend(fontsize="small")
    axes[0].grid(alpha=0.3)
    if has_accuracy:
        axes[1].set_ylabel("eval accuracy (%)")
        axes[1].grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle("Loss (train: mean over ranks) and evaluation")
    if not has_eval:
        plot.notes.append("no evaluation lines (train.eval_every=0, or no evaluation yet)")
    return _save(fig, out, plot)


def draw_throughput(runs: Runs, out: Path) -> Plot:
    """Samples per second of each log interval against the step."""
    plot = Plot("samples_per_s", "Throughput")
    fig, axes = _figure()
    drawn = False
    for label, run in runs:
        steps, values = _series(run.main_lines, "samples_per_s")
        if steps:
            axes[0].plot(steps, values, linewidth=1.2, label=label or None)
            drawn = True
        rate = (run.summary or {}).get("samples_per_s")
        if isinstance(rate, (int, float)):
            axes[0].axhline(rate, linestyle=":", color="gray",
                            label=_label(label, f"run mean {rate:.0f}"))
    if not drawn:
        plot.why_not = "samples/s: no log lines with samples_per_s yet"
        return plot
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("samples/s (global batch)")
    axes[0].grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize="small")
    fig.suptitle("Throughput per log interval")
    return _save(fig, out, plot)


def step_times(runs: Runs) -> dict[int, list[float]]:
    """Every rank's step times over all runs, each run's first step (lazy initialisation) left out."""
    per_rank: dict[int, list[float]] = {}
    for _, run in runs:
        for rank, lines in run.lines.items():
            values = [s for line in lines if isinstance(line.get("step_s"), list)
                      for s in line["step_s"] if isinstance(s, (int, float))]
            per_rank.setdefault(rank, []).extend(values[1:] if len(values) > 1 else values)
    return {rank: values for rank, values in per_rank.items() if values}


def draw_step_times(runs: Runs, out: Path) -> Plot:
    """A box plot of each rank's step times, with its jitter."""
    plot = Plot("step_times", "Step time per rank")
    per_rank = step_times(runs)
    if not per_rank:
        plot.why_not = ("step times: the metrics lines have no step_s (a run from before per-step timings, "
                        "or no log line yet)")
        return plot
    medians = {r: statistics.median(v) for r, v in per_rank.items()}
    ranks, plot.notes = _pick_ranks(medians)
    plot.notes += _coverage_note(runs, set(per_rank))
    fig, axes = _figure(width=min(16.0, max(6.0, 4.0 + 0.45 * len(ranks))))
    ax = axes[0]
    ax.boxplot([[1000 * s for s in per_rank[r]] for r in ranks], showfliers=True, whis=(5, 95),
               flierprops={"markersize": 3})
    ax.set_xticks(range(1, len(ranks) + 1),
                  [f"{r}\n±{jitter_pct(per_rank[r]):.0f}%" for r in ranks], fontsize="small")
    slowest = max(ranks, key=lambda r: medians[r])
    ax.get_xticklabels()[ranks.index(slowest)].set_color("tab:red")
    ax.set_xlabel("rank (jitter: (p95 - p5) / (2 x median); slowest in red)")
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Step time per rank (box: quartiles, whiskers: p5-p95)")
    return _save(fig, out, plot)


def phase_means(runs: Runs) -> tuple[dict[int, dict[str, float]], str]:
    """Per rank, the mean seconds per step of each phase, and where they come from.

    From the metrics lines (every run, every rank that wrote them); from the
    last summary.json's ``step_stats`` when that covers more ranks (it has
    every rank's totals even with run.metrics=rank0).
    """
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for _, run in runs:
        for rank, lines in run.lines.items():
            for line in lines:
                phases = line.get("phases_s")
                if not isinstance(phases, dict):
                    continue
                totals = sums.setdefault(rank, {})
                for name, seconds in phases.items():
                    if isinstance(seconds, (int, float)):
                        totals[name] = totals.get(name, 0.0) + seconds
                steps = line.get("steps")
                counts[rank] = counts.get(rank, 0) + (steps if isinstance(steps, int) and steps > 0 else
                                                      len(line.get("step_s") or []) or 1)
    from_metrics = {r: {k: v / counts[r] for k, v in totals.items()} for r, totals in sums.items()}
    summaries = [run.summary for _, run in runs if run.summary]
    stats = (summaries[-1] if summaries else {}).get("step_stats") or {}
    per_rank = [p for p in stats.get("per_rank", []) if isinstance(p, dict) and isinstance(p.get("phases_s"), dict)]
    steps = summaries[-1].get("steps", 0) - summaries[-1].get("start_step", 0) if summaries else 0
    if len(per_rank) > len(from_metrics) and isinstance(steps, int) and steps > 0:
        return ({p.get("rank", i): {k: v / steps for k, v in p["phases_s"].items() if isinstance(v, (int, float))}
                 for i, p in enumerate(per_rank)}, "summary.json step_stats (whole run)")
    return from_metrics, "metrics lines"


def draw_phases(runs: Runs, out: Path) -> Plot:
    """Stacked bars: where each rank's mean step goes."""
    plot = Plot("phases", "Phase breakdown per rank")
    means, source = phase_means(runs)
    if not means:
        plot.why_not = ("phases: no phases_s in the metrics or summary.json (a run from before per-step phases, "
                        "or no log line yet)")
        return plot
    ranks, plot.notes = _pick_ranks({r: sum(m.values()) for r, m in means.items()})
    plot.notes += _coverage_note(runs, set(means))
    plot.notes.append(f"source: {source}")
    names = [p for p in PHASES if any(p in means[r] for r in ranks)]
    names += sorted({k for r in ranks for k in means[r]} - set(names))
    fig, axes = _figure(width=min(16.0, max(7.0, 5.0 + 0.45 * len(ranks))))
    ax = axes[0]
    bottom = [0.0] * len(ranks)
    positions = list(range(len(ranks)))
    for name in names:
        heights = [1000 * means[r].get(name, 0.0) for r in ranks]
        ax.bar(positions, heights, bottom=bottom, label=name, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(positions, [str(r) for r in ranks], fontsize="small")
    ax.set_xlabel("rank")
    ax.set_ylabel("mean time per step (ms)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Where each rank's step goes (comm: exposed communication)")
    return _save(fig, out, plot)


def draw_memory(runs: Runs, out: Path) -> Plot:
    """Resident memory (and CUDA peak allocation, on GPU) of each rank against the step."""
    plot = Plot("memory", "Memory per rank")
    has_rss = any("rss_mb" in line for _, run in runs for lines in run.lines.values() for line in lines)
    has_cuda = any("cuda_mb" in line for _, run in runs for lines in run.lines.values() for line in lines)
    if not (has_rss or has_cuda):
        plot.why_not = "memory: the metrics lines have no rss_mb (a run from before memory was logged)"
        return plot
    keys = [k for k, present in (("rss_mb", has_rss), ("cuda_mb", has_cuda)) if present]
    fig, axes = _figure(rows=len(keys), height=3.5 * len(keys) + 1)
    ranks = sorted({r for _, run in runs for r in run.lines})
    colors = {r: f"C{i % 10}" for i, r in enumerate(ranks)}
    for ax, key in zip(axes, keys):
        labelled: set[int] = set()  # one legend entry per rank, not one per attempt
        for _, run in runs:
            for rank, lines in sorted(run.lines.items()):
                steps, values = _series(lines, key)
                if steps:
                    ax.plot(steps, values, color=colors[rank], linewidth=1,
                            label=f"rank {rank}" if rank not in labelled and len(ranks) <= 16 else None)
                    labelled.add(rank)
        ax.set_ylabel({"rss_mb": "resident (MiB)", "cuda_mb": "CUDA max allocated (MiB)"}[key])
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("step")
    fig.suptitle("Memory per rank at each log line")
    plot.notes += _coverage_note(runs, set(ranks))
    return _save(fig, out, plot)


def bus_factor(world_size: int) -> float:
    """nccl-tests' busbw / algbw for an all-reduce over ``world_size`` ranks: 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


def bucket_busbw(runs: Runs) -> tuple[dict[int, dict[int, list[float]]], dict[int, int], int | None]:
    """Per bucket, per rank, the busbw (GB/s) of every log interval; each bucket's bytes; the world size used."""
    sizes = [run.world_size for _, run in runs if run.world_size]
    world = max(sizes) if sizes else None
    if world is None:
        ranks = {r for _, run in runs for r in run.lines}
        world = len(ranks) if len(ranks) > 1 else None
    factor = bus_factor(world) if world else 1.0
    busbw: dict[int, dict[int, list[float]]] = {}
    nbytes: dict[int, int] = {}
    for _, run in runs:
        for rank, lines in run.lines.items():
            for line in lines:
                for bucket in line.get("buckets") or []:
                    if not isinstance(bucket, dict):
                        continue
                    index, size, seconds = bucket.get("bucket"), bucket.get("bytes"), bucket.get("seconds")
                    if not (isinstance(index, int) and isinstance(size, int) and isinstance(seconds, (int, float))
                            and seconds > 0):
                        continue
                    nbytes[index] = size
                    busbw.setdefault(index, {}).setdefault(rank, []).append(size / seconds * factor / 1e9)
    return busbw, nbytes, world


def draw_busbw(runs: Runs, out: Path) -> Plot:
    """Bars: each gradient bucket's bus bandwidth (median over ranks, whiskers: the ranks' range)."""
    plot = Plot("busbw", "Communication: bus bandwidth per gradient bucket")
    sizes = [run.world_size for _, run in runs if run.world_size]
    if sizes and max(sizes) == 1:
        plot.why_not = "busbw: one rank, no gradient communication"
        return plot
    busbw, nbytes, world = bucket_busbw(runs)
    if not busbw:
        plot.why_not = ("busbw: no bucket timings in the metrics (a run from before per-bucket timings, "
                        "or no gradient all-reduce in a log interval yet)")
        return plot
    buckets = sorted(busbw)
    per_rank = [{r: statistics.median(v) for r, v in busbw[b].items()} for b in buckets]
    middle = [statistics.median(m.values()) for m in per_rank]
    low = [mid - min(m.values()) for mid, m in zip(middle, per_rank)]
    high = [max(m.values()) - mid for mid, m in zip(middle, per_rank)]
    fig, axes = _figure(width=min(16.0, max(7.0, 4.0 + 0.5 * len(buckets))))
    ax = axes[0]
    ax.bar(range(len(buckets)), middle, yerr=[low, high], capsize=3, color="tab:blue", width=0.7)
    ax.set_xticks(range(len(buckets)), [f"{b}\n{nbytes[b] / 2**20:.1f} MiB" for b in buckets], fontsize="small")
    ax.set_xlabel("gradient bucket (bytes)")
    ax.set_ylabel("busbw (GB/s)" if world else "algbw (GB/s)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Bus bandwidth per bucket{f', {world} ranks' if world else ''} (median over log intervals)")
    plot.notes.append("seconds are from a bucket's launch to its completion: a bucket launched early in backward "
                      "waits for the others, so this is a lower bound of the link's bandwidth")
    if not world:
        plot.notes.append("world size unknown (no summary.json or topology.json): algbw (bytes / seconds) shown")
    plot.notes += _coverage_note(runs, {r for m in per_rank for r in m})
    return _save(fig, out, plot)


def attempt_rows(launch: Launch) -> list[dict[str, Any]]:
    """One row per attempt: times relative to the launch's first start, status, cause, recovery (for tables too)."""
    starts = [a.record["start_unix"] for a in launch.attempts if isinstance(a.record.get("start_unix"), (int, float))]
    origin = min(starts) if starts else None
    rows = []
    for i, attempt in enumerate(launch.attempts):
        rec = attempt.record
        first = attempt.run.first_step() if attempt.run is not None else None
        row: dict[str, Any] = {"attempt": attempt.number, "status": attempt.status, "cause": rec.get("cause") or "",
                               "start_s": None, "end_s": None, "first_step": None, "first_step_s": None,
                               "last_step": attempt.run.last_step if attempt.run else None, "recovery_s": None}
        if origin is None and first is not None:
            origin = first[1]
        if origin is not None:
            if isinstance(rec.get("start_unix"), (int, float)):
                row["start_s"] = rec["start_unix"] - origin
            if isinstance(rec.get("end_unix"), (int, float)) and rec["end_unix"] and attempt.status is not None:
                row["end_s"] = rec["end_unix"] - origin
            elif attempt.run is not None and attempt.run.last_time is not None:
                row["end_s"] = attempt.run.last_time - origin  # running, or ended without a record yet
            if first is not None:
                row["first_step"], row["first_step_s"] = first[0], first[1] - origin
        if i > 0 and launch.attempts[i - 1].status:
            row["recovery_s"] = recovery_s(launch.attempts[i - 1], attempt)
        rows.append(row)
    return rows


def draw_attempts(launch: Launch, out: Path) -> Plot:
    """A timeline of the attempts: each attempt's span, its first step, status and cause, and the recoveries."""
    plot = Plot("attempts", "Attempts")
    rows = attempt_rows(launch)
    if not rows or all(r["start_s"] is None and r["first_step_s"] is None for r in rows):
        plot.why_not = "attempts: launch.json records no attempt yet and no attempt has logged a step"
        return plot
    fig, axes = _figure(width=10.0, height=1.6 + 0.8 * len(rows))
    ax = axes[0]
    ends = []
    for row in rows:
        y = row["attempt"]
        start = row["start_s"] if row["start_s"] is not None else row["first_step_s"]
        end = row["end_s"] if row["end_s"] is not None else start
        ends.append(end)
        status = row["status"]
        color = "tab:gray" if status is None else "tab:green" if status == 0 else "tab:red"
        ax.barh(y, max(end - start, 1e-3), left=start, height=0.5, color=color, alpha=0.7)
        if row["first_step_s"] is not None:
            ax.plot([row["first_step_s"]], [y], "k|", markersize=14)
        words = "running (no record yet)" if status is None else f"status {status}"
        words += f": {row['cause']}" if row["cause"] else ": finished" if status == 0 else ""
        # The y axis runs downwards (attempt 1 on top): y - 0.3 is just above the bar.
        ax.annotate(_shorten(words, 90), (start, y - 0.3), fontsize="small", va="bottom")
        previous = next((r for r in rows if r["attempt"] == row["attempt"] - 1), None)
        if row["recovery_s"] is not None and previous is not None and previous["end_s"] is not None:
            ax.annotate("", xy=(previous["end_s"] + row["recovery_s"], y), xytext=(previous["end_s"], y - 1),
                        arrowprops={"arrowstyle": "->", "color": "tab:blue"})
            ax.annotate(f"recovery {row['recovery_s']:.1f} s", (previous["end_s"] + row["recovery_s"] / 2, y - 0.5),
                        fontsize="small", color="tab:blue", ha="left", va="center")
    ax.set_yticks([r["attempt"] for r in rows], [f"attempt {r['attempt']}" for r in rows])
    ax.set_ylim(max(r["attempt"] for r in rows) + 0.6, min(r["attempt"] for r in rows) - 0.8)
    ax.set_xlabel("seconds since the first attempt started ( | : first step; green: finished, red: failed, "
                  "gray: running)")
    ax.grid(alpha=0.3, axis="x")
    fig.suptitle("Attempts of the launch (recovery: end of a failed attempt -> first step of the next)")
    return _save(fig, out, plot)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
