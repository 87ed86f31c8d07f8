"""The text of ``report.md``: the run's state and summary figures, per-rank and per-attempt tables, the plots (pure)."""

import os
import time
from pathlib import Path
from typing import Any

from hpcnet.launch.restarts import describe_failure, describe_status
from hpcnet.observe.stats import cv_pct, jitter_pct, percentile
from hpcnet.report.read import Launch, Run

MAX_TABLE_RANKS = 64
"""A bigger job's per-rank table lists the slowest ranks only."""


def _ms(seconds: Any) -> str:
    return f"{1000 * seconds:.1f} ms" if isinstance(seconds, (int, float)) else "-"


def _num(value: Any, spec: str = ".4f", suffix: str = "") -> str:
    return f"{value:{spec}}{suffix}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def run_state(run: Run, now: float, status: int | None = None) -> str:
    """Finished, failed or still running, in one line (``status``: the exit status a launch recorded)."""
    if run.summary is not None:
        summary = run.summary
        if summary.get("diverged"):
            return f"diverged: {summary['diverged']}"
        if summary.get("stopped_by_signal"):
            return f"stopped by signal {summary['stopped_by_signal']} at step {summary.get('steps')}"
        return f"finished: {summary.get('steps')} steps"
    last = run.last_step
    since = (f"; its last line was written {_duration(now - run.last_time)} ago"
             if run.last_time and status is None and run.failure is None else "")
    where = f"last logged step {last}{since}" if last is not None else "no step logged yet"
    if run.failure is not None:
        return f"failed ({where}): {describe_failure(run.failure)}"
    if status is not None:
        return f"ended with status {status}, {describe_status(status)} ({where})"
    return f"no summary.json: still running, or it ended without one ({where})"


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """The summary figures of a run: from summary.json when it has one, else from the metrics lines so far."""
    s = run.summary or {}
    stats = s.get("step_stats") or {}
    lines = run.main_lines
    last = lines[-1] if lines else {}
    rows = [("steps", str(s.get("steps", run.last_step if run.last_step is not None else "-"))),
            ("final loss" if s else "last loss", _num(s.get("final_loss", last.get("global_loss", last.get("loss")))))]
    for key, value in (s.get("eval") or (run.evals[-1] if run.evals else {})).items():
        if key.startswith("eval_"):
            rows.append((key.replace("_", " "), _num(value)))
    rows += [("samples/s", _num(s.get("samples_per_s", last.get("samples_per_s")), ".1f")),
             ("wall time", _duration(s["wall_s"]) if isinstance(s.get("wall_s"), (int, float)) else "-"),
             ("world size", str(run.world_size or "-"))]
    if stats.get("median_s") is not None:
        rows += [("median step (median rank)", _ms(stats.get("median_s"))),
                 ("slowest rank", f"{stats.get('slowest_rank')} ({_ms(stats.get('slowest_median_s'))}, "
                                  f"x{_num(stats.get('slowest_over_median'), '.3f')} the median rank)"),
                 ("straggler share", _num(100 * stats["straggler_share"], ".1f", " %")
                  if isinstance(stats.get("straggler_share"), (int, float)) else "-"),
                 ("jitter (rank 0)", "±" + _num(stats.get("jitter_pct"), ".1f", " %")),
                 ("CV (rank 0)", _num(stats.get("cv_pct"), ".1f", " %"))]
    if s.get("skipped_steps"):
        rows.append(("skipped steps (non-finite)", str(s["skipped_steps"])))
    comm = s.get("comm") or {}
    if comm.get("backend"):
        fallbacks = f", fallbacks: {comm['fallbacks']}" if comm.get("fallbacks") else ""
        rows.append(("gradient backend", f"{comm['backend']}{fallbacks}"))
    return rows


def rank_rows(runs: list[tuple[str, Run]], step_times: dict[int, list[float]]) -> tuple[list[list[str]], str]:
    """Per rank: median, p95, CV, jitter of its step time; from summary.json (the last run that has one) when
    its step_stats covers every rank, else computed from the metrics lines."""
    summaries = [run.summary for _, run in runs if run.summary and (run.summary.get("step_stats") or {})
                 .get("per_rank")]
    per_rank = summaries[-1]["step_stats"]["per_rank"] if summaries else []
    timed = [p for p in per_rank if isinstance(p, dict) and p.get("median_s") is not None]
    if timed and len(timed) >= len(step_times):
        source = "summary.json step_stats" + (" (last attempt)" if len(runs) > 1 else "")
        rows = [(p["median_s"], [str(p.get("rank")), _ms(p["median_s"]), _ms(p.get("p95_s")),
                                 _num(p.get("cv_pct"), ".1f", " %"), "±" + _num(p.get("jitter_pct"), ".1f", " %")])
                for p in timed]
    else:
        source = "metrics lines (first step of each run left out)"
        rows = [(percentile(v, 50), [str(r), _ms(percentile(v, 50)), _ms(percentile(v, 95)),
                                     _num(cv_pct(v), ".1f", " %"), "±" + _num(jitter_pct(v), ".1f", " %")])
                for r, v in sorted(step_times.items())]
    if len(rows) > MAX_TABLE_RANKS:
        rows = sorted(rows, key=lambda item: -item[0])[:MAX_TABLE_RANKS // 2]
        source += f"; the {len(rows)} slowest ranks"
    return [cells for _, cells in rows], source


def _gbit(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _us(value: Any) -> str:
    return _num(value, ".1f", " us")


def _ranks(ranks: Any) -> str:
    if not isinstance(ranks, list) or not ranks:
        return "-"
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def topology_section(topology: dict[str, Any] | None) -> list[str]:
    """The "Hosts and links" section from topology.json (empty without one): per host its ranks, the interface
    it uses towards rank 0, its measured intra- and inter-host link, and the probe's warnings (a slow host)."""
    if not isinstance(topology, dict):
        return []
    md = ["## Hosts and links", ""]
    summary = topology.get("summary") or {}
    md.append(f"From topology.json: {topology.get('size', '-')} rank(s) on {topology.get('num_nodes', '-')} "
              f"node(s); median intra-node {_us(summary.get('intra_latency_us'))}, "
              f"{_gbit(summary.get('intra_bandwidth_gbps'))} Gbit/s; inter-node "
              f"{_us(summary.get('inter_latency_us'))}, {_gbit(summary.get('inter_bandwidth_gbps'))} Gbit/s.")
    hosts = topology.get("hosts")
    if not isinstance(hosts, list):
        return md + ["", "No per-host figures (topology.json from an older hpcnet).", ""]
    md += ["", "Send / receive: the host's best one-way bandwidth towards / from another host; link: the lower "
               "of the two (docs/topology.md).", ""]
    rows = []
    for h in hosts[:MAX_TABLE_RANKS]:
        iface = h.get("interface") or {}
        where = f"{iface.get('name')} {iface.get('address')}" if iface else "-"
        rows.append([str(h.get("name", h.get("host", "-"))), _ranks(h.get("ranks")), where,
                     _us(h.get("intra_latency_us")), _gbit(h.get("intra_bandwidth_gbps")),
                     _us(h.get("inter_latency_us")), _gbit(h.get("send_gbps")), _gbit(h.get("receive_gbps")),
                     _gbit(h.get("link_gbps"))])
    md += _table(["host", "ranks", "interface", "intra latency", "intra Gbit/s", "inter latency",
                  "send Gbit/s", "receive Gbit/s", "link Gbit/s"], rows)
    if len(hosts) > MAX_TABLE_RANKS:
        md += ["", f"The first {MAX_TABLE_RANKS} of {len(hosts)} hosts; topology.json has them all."]
    warnings = [w for w in topology.get("warnings") or [] if isinstance(w, str)]
    if warnings:
        md += [""] + [f"- **warning:** {w}" for w in warnings]
    elif len(hosts) > 2:
        md += ["", "No host's link is far below the others'."]
    elif len(hosts) == 2:
        md += ["", "Two hosts share their one measured link: a slow host cannot be told from its peer "
                   "(docs/topology.md)."]
    return md + [""]


def attempt_table(launch: Launch, rows: list[dict[str, Any]]) -> list[str]:
    out = ["| attempt | start (s) | end (s) | status | cause | first step (at s) | last logged step | "
           "recovery (s) |", "|---|---|---|---|---|---|---|---|"]
    for attempt, row in zip(launch.attempts, rows):
        status = row["status"]
        words = "running" if status is None else f"{status} ({describe_status(status)})"
        cause = row["cause"] or (describe_failure(attempt.record.get("failure")) if status else "")
        first = f"{row['first_step']} (at {row['first_step_s']:.1f})" if row["first_step"] is not None else "-"
        out.append(f"| {attempt.number} | {_num(row['start_s'], '.1f')} | {_num(row['end_s'], '.1f')} | {words} | "
                   f"{_cell(cause) or '-'} | {first} | {row['last_step'] if row['last_step'] is not None else '-'} | "
                   f"{_num(row['recovery_s'], '.1f')} |")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _link(out: Path, target: Path) -> str:
    return os.path.relpath(target, out).replace(os.sep, "/")


def render(source: Path, out: Path, runs: list[tuple[str, Run]], plots: list[Any], launch: Launch | None,
           attempts: list[dict[str, Any]], step_times: dict[int, list[float]]) -> str:
    """report.md for ``runs`` (one, or a launch's attempts) with ``plots`` (``figures.Plot``) drawn into ``out``."""
    now = time.time()
    md = [f"# hpcnet report: {source.name}", "",
          f"`{source}`, made {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(now))} by "
          f"`python -m hpcnet.report`. Plots are PNG files beside this page.", ""]
    if launch is not None:
        final = launch.record.get("final_status")
        md += ["## Launch", "",
               f"{len(launch.attempts)} attempt(s); " + (
                   f"final status {final} ({describe_status(final)})" if isinstance(final, int) else
                   "no final status yet (the supervisor is running, or it was killed)")
               + (f": {launch.record['message']}" if launch.record.get("message") else "") + ".", ""]
        md += attempt_table(launch, attempts)
        md += ["", "Recovery: from the end of a failed attempt (launch.json `end_unix`) to the first step the next "
                   "attempt completed (its first log line, less the time of the later steps in that line).", ""]
        for attempt in launch.attempts:
            if attempt.run is not None:
                md.append(f"- attempt {attempt.number}: {run_state(attempt.run, now, attempt.status)}")
        md.append("")
    summarised = [(label, run) for label, run in runs if run.summary] or runs[-1:]
    if summarised:
        label, run = summarised[-1]
        md += [f"## Summary{f' ({label})' if label else ''}", ""]
        if launch is None:
            md += [f"State: {run_state(run, now)}.", ""]
        md += _table(["figure", "value"], [[k, v] for k, v in summary_rows(run)])
        if run.failure is not None and run.failure.get("message"):
            md += ["", "failure.json:", "", "```", str(run.failure["message"]).strip(), "```"]
        if run.skipped_lines:
            md += ["", f"{run.skipped_lines} incomplete metrics line(s) left out (a line still being written, or "
                       "cut by a crash)."]
        md.append("")
    topologies = [run.topology for _, run in runs if run.topology]
    md += topology_section(topologies[-1] if topologies else None)
    rows, where = rank_rows(runs, step_times)
    if rows:
        md += ["## Step time per rank", "", f"From {where}. Jitter: `100 * (p95 - p5) / (2 * p50)` of the step "
               "times (hpcnet/observe/stats.py); CV: standard deviation over mean.", ""]
        md += _table(["rank", "median", "p95", "CV", "jitter"], rows) + [""]
    md += ["## Plots", ""]
    for plot in plots:
        if plot.file:
            md += [f"### {plot.title}", "", f"![{plot.title}]({plot.file})", ""]
            md += [f"- {note}" for note in plot.notes] + ([""] if plot.notes else [])
    skipped = [plot for plot in plots if not plot.file]
    if skipped:
        md += ["### Not drawn", ""] + [f"- {plot.why_not}" for plot in skipped] + [""]
    files = [(label, name, run.path / name) for label, run in runs for name in run.extras]
    if files:
        md += ["## Files", ""]
        for label, name, path in files:
            what = " (open in https://ui.perfetto.dev or chrome://tracing)" if name == "trace.json" else ""
            md.append(f"- {label + ': ' if label else ''}[{name}]({_link(out, path)}){what}")
        md.append("")
    return "\n".join(md)

