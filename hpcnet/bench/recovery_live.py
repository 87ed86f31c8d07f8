"""Live recovery against restarts on the local cluster (``python -m hpcnet.bench recovery --live``): a kill -9 of one
rank -> the next step the survivors complete, the steps computed again, the world size after; for live recovery also
the grow back to the first size: the survivors' pauses and when the replacement was ready.

On the running local cluster (``scripts/cluster.sh start``), ``--np`` ranks (default 4: 2 hosts x 2), the bench's
mlp at ``dist.zero=0``, the last rank (on the second host) killing itself after step ``--kill-at``.  Every round runs
each contender once, the order alternating from round to round:

    live    scripts/cluster.sh ftmpirun (Open MPI 5, ULFM; ``fault.recovery=auto``): the survivors shrink the job and
            go on in their processes, with the state they hold; then they grow back (``fault.grow=spawn``): a
            replacement started at the first boundary after the loss joins ``GROW_AFTER_STEPS`` boundaries later
    mirrored  the same at ``dist.zero=2`` with ``fault.replicas=1``: the lost rank's shards from its keeper's memory
    warm    python -m hpcnet.launch --standby on -- mpirun $(scripts/cluster.sh env) (the system's Open MPI): the job
            ends and restarts on a parked standby from the newest checkpoint, at the first size (no grow back)
    cold    the same with --standby off

and the failure-free runs, the same job without the kill: under ``cluster.sh ftmpirun`` and ``cluster.sh mpirun`` (the
step time under each MPI), and under ``cluster.sh ftmpirun`` at ``dist.zero=2`` with mirrors and without (what the
mirrors cost a step, and their memory from summary.json).  The kill's time is the victim's own log line ("kills
itself"), the step's is rank 0's metrics line: one clock, the hosts being namespaces of one machine.  The grow's
figures are the survivors' record (summary.json's ``recovery.grows``): the pause for the spawn (``spawn_s``), the
replacement's start -> ready (``ready_s``) and the pause for the join (``pause_s``: merge, hand-over, rebuild).  The
spawn comes after the next step's log line and the join later still, so neither changes kill -> next step.
"""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hpcnet.bench.common import Watched, load_average, step_times, summarize, table, write_json
from hpcnet.bench.recovery_cluster import CLUSTER, cluster_cli, cluster_hosts
from hpcnet.bench.recovery_restart import KILLED, first_event, job_options, log_events, measure_kill, step_gap_s
from hpcnet.paths import SUMMARY_FILE, attempt_dir, metrics_file, rank_log

CONTENDERS = ("live", "mirrored", "warm", "cold")
MIRRORED = ("dist.zero=2", "fault.replicas=1")
"""The mirrored contender's options (and the failure-free run with mirrors)."""
FAILURE_FREE = {"ulfm": ("ftmpirun", ()), "ompi4": ("mpirun", ()), "plain2": ("ftmpirun", ("dist.zero=2",)),
                "mirrored2": ("ftmpirun", MIRRORED)}
"""The failure-free runs: the ``scripts/cluster.sh`` verb that launches each, and its options."""
RUN_TIMEOUT_S = 600
GROW_AFTER_STEPS = 2
GROW = ("fault.grow=spawn", f"fault.grow_after_steps={GROW_AFTER_STEPS}")
"""The live contenders grow back: a replacement started at the first boundary after the shrink (the one after the
step past the kill) is called in ``GROW_AFTER_STEPS`` boundaries later, the survivors waiting there until it is
ready (so the join comes at a known step, before the run's end: ``--kill-at`` + 3 < ``--steps``)."""
TARGETS = {"live_s": 0.5, "live_over_warm": 0.3, "ompi4_over_ulfm": 0.95, "mirrored_over_plain": 1.10,
           "grow_pause_s": 2.0}
"""Issue 46's targets: live shrink's kill -> next step at most 0.5 s (and no step computed again); live / warm
restart at most 0.3; the failure-free step time under Open MPI 4.1 over that under the fault-tolerant MPI at least
0.95 (ULFM's at most about 5% slower); the step time with mirrors over that without at most 1.10; the survivors'
pause when a replacement joins at most 2 s."""


JOB_ENVIRONMENT = {
    "OMPI_MCA_rmaps_base_oversubscribe": "1", "PRTE_MCA_rmaps_default_mapping_policy": "slot:oversubscribe",
    # 4 ranks on 2 shared cores: ranks that spin in MPI starve the others (the shrunk job's steps took 2 s instead of
    # 0.06 s without this; the tests' jobs set it too).
    "OMPI_MCA_mpi_yield_when_idle": "1"}
"""What every job of the bench runs under, where the user has not set it: more ranks than cores, mapped by slot
(Open MPI 5 maps by core, putting all ranks on the first host), a rank blocked in MPI giving its core up.  Both MPIs
run under the same settings."""


def job_environment() -> dict[str, str]:
    """Set ``JOB_ENVIRONMENT`` (and, as root, Open MPI's consent) in this process's environment for the jobs it
    starts, where the user has not set it; the values in force."""
    wanted = dict(JOB_ENVIRONMENT)
    if os.geteuid() == 0:
        wanted.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in wanted}


def versions() -> dict[str, str]:
    """The two MPIs' mpirun, torch and mpi4py, as the record names them."""
    def first_line(command: list[str]) -> str:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "?"

    return {"ftmpirun": first_line([str(CLUSTER.parent / "ftmpirun"), "--version"]),
            "mpirun": first_line(["mpirun", "--version"]),
            "torch": importlib.metadata.version("torch"), "mpi4py": importlib.metadata.version("mpi4py")}


def _launch(command: list[str], cwd: Path, what: str) -> str:
    """Run a job to its end: its output; RuntimeError with its last output unless it ended with 0 within
    RUN_TIMEOUT_S."""
    job = Watched(command, cwd)
    try:
        status = job.proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.stop()
        status = None
    job.reader.join(10)
    if status != 0:
        ended = f"status {status}" if status is not None else f"no end within {RUN_TIMEOUT_S} s"
        raise RuntimeError(f"{what}: {ended}:\n{job.output[-2000:]}")
    return job.output


def _train(out_dir: Path, name: str, verb: str, job: list[str], args: argparse.Namespace) -> Path:
    """``scripts/cluster.sh VERB -np N ... hpcnet.train``, run to its end: its run directory."""
    output = _launch([str(CLUSTER), verb, "-np", str(args.np), sys.executable, "-m", "mpi4py", "-m",
                      "hpcnet.train", f"run.dir={out_dir}", f"run.name={name}", *job], out_dir, name)
    runs = sorted(p for p in out_dir.glob(f"{name}-*") if (p / SUMMARY_FILE).exists())
    if not runs:  # Open MPI 5's prterun ends with 0 after losing a daemon, for one
        raise RuntimeError(f"{name}: status 0 and no {SUMMARY_FILE} under {out_dir}/{name}-*:\n{output[-2000:]}")
    return runs[-1]


def first_step_after(times: dict[int, float], step: int, at: float) -> tuple[int, float] | None:
    """The first step past ``step`` logged at ``at`` or later, and its time (``step_times``); None if none was."""
    later = [(s, t) for s, t in times.items() if s > step and t >= at]
    return min(later) if later else None


LOST = r"^lost rank"
"""Rank 0's line once the survivors have rebuilt the job (``hpcnet.fault.live``)."""


def live_figures(run: Path, kill_at: int, victim: int) -> dict[str, Any]:
    """A live run's figures from its directory: the victim's kill line, rank 0's line once the job was rebuilt and
    its metrics, the recovery's record in summary.json.  The failure was seen shrink + rebuild before the rebuilt
    line (the record's times run from then).  RuntimeError where one of them is missing."""
    killed = first_event(log_events(run / rank_log(victim)), KILLED)
    rebuilt = first_event(log_events(run / rank_log(0)), LOST)
    recoveries = json.loads((run / SUMMARY_FILE).read_text()).get("recovery", {}).get("recoveries", [])
    times = step_times(run / metrics_file(0))
    after = first_step_after(times, kill_at, killed[0]) if killed else None
    if killed is None or rebuilt is None or after is None or len(recoveries) != 1:
        raise RuntimeError(f"{run}: no kill logged, no rebuilt job, no step after it, or {len(recoveries)} "
                           "recoveries")
    record = recoveries[0]
    return {"run_dir": str(run), "kill_to_next_step_s": after[1] - killed[0], "next_step": after[0],
            "kill_to_new_step_s": after[1] - killed[0], "steps_recomputed": record["recomputed_steps"],
            "world_size_after": record["world_size"], "step_time_before_s": step_gap_s(times, kill_at),
            "seen_s": rebuilt[0] - record["shrink_s"] - record["rebuild_s"] - killed[0],
            "ready_to_step_s": after[1] - rebuilt[0], "lost": record["lost"], "state": record["state"],
            "shrink_s": record["shrink_s"], "rebuild_s": record["rebuild_s"],
            "rebuild_phases_s": record.get("rebuild_phases_s"), **mirror_figures(run)}


def mirror_figures(run: Path) -> dict[str, Any]:
    """A run's mirrors from its summary.json (its first world's, the largest rank's bytes; none without)."""
    mirror = json.loads((run / SUMMARY_FILE).read_text()).get("recovery", {}).get("mirror")
    if not mirror or not mirror["worlds"]:
        return {}
    first = mirror["worlds"][0]
    return {"snapshot_bytes": max(first["snapshot_bytes"]), "ward_bytes": max(first["ward_bytes"]),
            "capture_s": mirror["capture_s_median"]}


def grow_figures(run: Path, first_size: int) -> dict[str, Any]:
    """A live run's grow back from its summary.json (the last grow's record, the world size at the end).
    RuntimeError where the job did not grow back to ``first_size``."""
    summary = json.loads((run / SUMMARY_FILE).read_text())
    grows = summary.get("recovery", {}).get("grows", [])
    if not grows or summary.get("world_size") != first_size:
        raise RuntimeError(f"{run}: no grow back to {first_size} ranks ({len(grows)} grows, {summary.get('world_size')}"
                           " ranks at the end)")
    grow = grows[-1]
    return {"grow_pause_s": grow["pause_s"], "grow_spawn_s": grow["spawn_s"], "grow_ready_s": grow["ready_s"],
            "grow_step": grow["step"], "grow_hosts": grow.get("hosts", []), "world_size_end": summary["world_size"]}


def measure_live(out_dir: Path, name: str, job: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The job under ``cluster.sh ftmpirun``, its last rank killed after ``--kill-at`` and replaced (``GROW``):
    ``live_figures`` and ``grow_figures``."""
    run = _train(out_dir, name, "ftmpirun", [*job, f"fault.kill_at_step={args.kill_at}", "fault.only_attempt=1",
                                              *GROW], args)
    return {**live_figures(run, args.kill_at, args.np - 1), **grow_figures(run, args.np)}


def measure_restart(out_dir: Path, name: str, job: list[str], args: argparse.Namespace, standby: str,
                    launcher: tuple[str, ...]) -> dict[str, Any]:
    """The same kill under the supervisor over the cluster's mpirun (``recovery_restart.measure_kill``): its phases,
    kill -> the first step past the kill's step, the world size of the restarted attempt."""
    result = measure_kill(out_dir, job, args, name=name, standby=standby, launcher=launcher)
    second = attempt_dir(Path(result["launch_dir"]), 2)
    new_step = step_times(second / metrics_file(0)).get(args.kill_at + 1)
    return {**result, "kill_to_next_step_s": result["total_to_first_step_s"], "seen_s": result["detection_s"],
            "ready_to_step_s": result["first_step_s"], "next_step": result["resumed_at_step"] + 1,
            "kill_to_new_step_s": new_step - result["fault_unix"] if new_step is not None else None,
            "world_size_after": json.loads((second / SUMMARY_FILE).read_text())["world_size"]}


def measure_failure_free(out_dir: Path, name: str, verb: str, job: list[str], args: argparse.Namespace
                         ) -> dict[str, Any]:
    """The job without a fault under ``cluster.sh VERB``: the median time between its steps."""
    run = _train(out_dir, name, verb, job, args)
    return {"run_dir": str(run), "step_time_s": step_gap_s(step_times(run / metrics_file(0)), args.steps + 1),
            **mirror_figures(run)}


def _measure(contender: str, out_dir: Path, name: str, args: argparse.Namespace,
             launcher: tuple[str, ...]) -> dict[str, Any]:
    if contender in ("live", "mirrored"):
        return measure_live(out_dir, name, [*job_options(args, settle=False),
                                            *(MIRRORED if contender == "mirrored" else ())], args)
    if contender in ("warm", "cold"):
        return measure_restart(out_dir, name, job_options(args), args, "on" if contender == "warm" else "off",
                               launcher)
    verb, options = FAILURE_FREE[contender]
    return measure_failure_free(out_dir, name, verb, [*job_options(args, settle=False), *options], args)


def _rounds(out_dir: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``--rounds`` rounds of the contenders, then the failure-free runs, each in alternating order; every
    result carries its round, an error in place of figures where a run failed.  Printed as each ends."""
    launcher = ("mpirun", *cluster_cli("env").stdout.split())
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in (*CONTENDERS, *FAILURE_FREE)}
    for round_index in range(args.rounds):
        for group in (CONTENDERS, tuple(FAILURE_FREE)):
            for contender in (group if round_index % 2 == 0 else group[::-1]):  # drift in the load hits all alike
                try:
                    result = _measure(contender, out_dir, f"{contender}-{round_index}", args, launcher)
                except (RuntimeError, OSError, KeyError, ValueError, subprocess.TimeoutExpired) as exc:
                    result = {"error": str(exc)[-1500:]}
                results[contender].append({"round": round_index, **result})
                figure = result.get("kill_to_next_step_s", result.get("step_time_s"))
                print(f"round {round_index + 1} {contender}: "
                      + (f"{figure:.3f} s" if figure is not None else result.get("error", "?")[-600:]), flush=True)
    return results


ROWS = [("kill_to_next_step_s", "kill -> next step done (s)", 2, 1.0),
        ("seen_s", "  kill -> failure seen (s)", 2, 1.0),
        ("ready_to_step_s", "  ready -> next step done (s)", 2, 1.0),
        ("kill_to_new_step_s", "kill -> first step past the kill's (s)", 2, 1.0),
        ("steps_recomputed", "steps computed again", 0, 1.0),
        ("world_size_after", "world size after", 0, 1.0),
        ("step_time_before_s", "step time before the kill (ms)", 0, 1000.0),
        ("shrink_s", "shrink (s, the survivors' record)", 3, 1.0),
        ("rebuild_s", "rebuild (s, the survivors' record)", 2, 1.0),
        ("grow_pause_s", "grow back: the survivors' pause, join (s)", 2, 1.0),
        ("grow_spawn_s", "  the survivors' pause, spawn (s)", 2, 1.0),
        ("grow_ready_s", "  replacement started -> ready (s)", 2, 1.0),
        ("world_size_end", "world size at the end", 0, 1.0)]
"""The table's rows: a result's key, the label, the digits shown, the scale of the unit ('-' where a contender has
no such figure: the restarts do not grow back, they relaunch at the first size)."""


def _span(values: list[float], digits: int = 2, scale: float = 1.0) -> str:
    """Median (range) of per-round figures; one figure where all are equal; '-' for none."""
    if not values:
        return "-"
    s = summarize([v * scale for v in values])
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _figures(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in runs if "error" not in r and r.get(key) is not None]


def paired(results: dict[str, list[dict[str, Any]]], numerator: str, denominator: str, key: str
           ) -> dict[str, float] | None:
    """Median and range of ``numerator``'s figure over ``denominator``'s, round by round, over the rounds where both
    have it (the same minutes of load on both sides); None without such a round."""
    theirs = {r["round"]: r[key] for r in results.get(denominator, []) if "error" not in r and r.get(key)}
    ratios = [r[key] / theirs[r["round"]] for r in results.get(numerator, [])
              if "error" not in r and r.get(key) is not None and r["round"] in theirs]
    return summarize(ratios) if ratios else None


def ratios(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float] | None]:
    """The targets' ratios: live / warm (kill -> next step), Open MPI 4.1 / ULFM and with mirrors / without
    (failure-free step time)."""
    return {"live_over_warm": paired(results, "live", "warm", "kill_to_next_step_s"),
            "ompi4_over_ulfm": paired(results, "ompi4", "ulfm", "step_time_s"),
            "mirrored_over_plain": paired(results, "mirrored2", "plain2", "step_time_s")}


def _verdict(median: float | None, target: float, at_most: bool) -> str:
    if median is None:
        return "-"
    return "met" if (median <= target if at_most else median >= target) else "not met"


def _ratio(ratio: dict[str, float] | None) -> str:
    return "-" if ratio is None else f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"


def _target_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Issue 46's targets beside the figures: live kill -> next step, live / warm, Open MPI 4.1 / ULFM, the grow
    back's pause, the mirrors' step time."""
    live = _figures(results["live"], "kill_to_next_step_s")
    recomputed = _figures(results["live"], "steps_recomputed")
    met = _verdict(summarize(live)["median"] if live else None, TARGETS["live_s"], True)
    if met == "met" and max(recomputed, default=1) != 0:
        met = "not met"
    both = ratios(results)
    free = {name: _figures(results[name], "step_time_s") for name in ("ulfm", "ompi4")}
    ratio, step_ratio = both["live_over_warm"], both["ompi4_over_ulfm"]
    return [f"live, kill -> next step: target <= {TARGETS['live_s']} s and 0 steps computed again: {met}",
            f"live / warm, kill -> next step, paired by round: {_ratio(ratio)}; target <= "
            f"{TARGETS['live_over_warm']}: "
            f"{_verdict(ratio and ratio['median'], TARGETS['live_over_warm'], True)}",
            f"failure-free step time (ms), the same job without the kill: ULFM (cluster.sh ftmpirun) "
            f"{_span(free['ulfm'], 1, 1000)}, Open MPI 4.1 (cluster.sh mpirun) {_span(free['ompi4'], 1, 1000)}; "
            f"Open MPI 4.1 / ULFM, paired by round: {_ratio(step_ratio)}; target >= {TARGETS['ompi4_over_ulfm']}: "
            f"{_verdict(step_ratio and step_ratio['median'], TARGETS['ompi4_over_ulfm'], False)}",
            *_grow_lines(results), *_mirror_lines(results, both["mirrored_over_plain"])]


def _grow_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The grow back's target beside its figures: the survivors' pause at the join, each live contender's median
    (met where every one is within it), and the spawn's pause besides."""
    grown = [c for c in ("live", "mirrored") if c in results]
    pauses = {c: _figures(results[c], "grow_pause_s") for c in grown}
    medians = [summarize(v)["median"] for v in pauses.values() if v]
    met = _verdict(max(medians) if len(medians) == len(grown) else None, TARGETS["grow_pause_s"], True)
    spawn = "; ".join(f"{c} {_span(_figures(results[c], 'grow_spawn_s'))}" for c in grown)
    hosts = Counter(host for c in grown for r in results[c] if "error" not in r for host in r.get("grow_hosts", []))
    return [f"grow back, the survivors' pause at the join (s): "
            f"{'; '.join(f'{c} {_span(pauses[c])}' for c in grown)}; target <= {TARGETS['grow_pause_s']} s: {met} "
            f"(the pause for the spawn besides, s: {spawn}); the replacements ran on "
            f"{', '.join(f'{host} ({n})' for host, n in sorted(hosts.items())) or '-'}"]


def _mirror_lines(results: dict[str, list[dict[str, Any]]], ratio: dict[str, float] | None) -> list[str]:
    """The mirrors' target beside its figures: the step time with mirrors / without, their memory and capture."""
    if "mirrored2" not in results:
        return []
    free = {name: _figures(results[name], "step_time_s") for name in ("plain2", "mirrored2")}
    memory = [_span(_figures(results["mirrored2"], key), 2, 2**-20) for key in ("snapshot_bytes", "ward_bytes")]
    return [f"failure-free step time (ms) at dist.zero=2 under ULFM: without mirrors {_span(free['plain2'], 1, 1000)}, "
            f"with (fault.replicas=1) {_span(free['mirrored2'], 1, 1000)}; with / without, paired by round: "
            f"{_ratio(ratio)}; target <= {TARGETS['mirrored_over_plain']}: "
            f"{_verdict(ratio and ratio['median'], TARGETS['mirrored_over_plain'], True)}",
            f"mirrors' host memory a rank (the largest rank's, MiB): snapshot {memory[0]}, ward's shards "
            f"{memory[1]}; a capture (copy and exchange, rank 0's median) "
            f"{_span(_figures(results['mirrored2'], 'capture_s'), 1, 1000)} ms"]


def _one_line(error: str) -> str:
    """An error's first and last lines (its run's last output is in the JSON)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or ["?"]
    return lines[0] if len(lines) == 1 else f"{lines[0][:200]} ... {lines[-1][-200:]}"


def report(figures: dict[str, Any]) -> str:
    """The table: a column per contender, median (range) over the rounds; the targets beside their figures, the
    failure-free step times, the load; the runs that failed."""
    results = figures["results"]
    shown = [c for c in CONTENDERS if c in results]  # a record of before the mirrored contender has none
    runs = {c: [r for r in results[c] if "error" not in r] for c in shown}
    lost = next((r["lost"][0]["host"] for r in runs["live"] if r.get("lost")), "the last host")
    header = ["", *(f"{c} (n={len(runs[c])})" for c in shown)]
    rows = [[label, *(_span(_figures(runs[c], key), digits, scale) for c in shown)]
            for key, label, digits, scale in ROWS]
    rows.append(["standby used", *(f"{sum(bool(r.get('standby_used')) for r in runs[c])}/{len(runs[c])}"
                                   if c == "warm" else "-" for c in shown)])
    v = figures["versions"]
    load = [", ".join(f"{x:.2f}" for x in figures[key]) for key in ("load_average_start", "load_average_end")]
    lines = [f"live recovery against restarts on the local cluster ({', '.join(figures['hosts'])}): {figures['np']} "
             f"ranks, the mlp at dist.zero=0, rank {figures['np'] - 1} ({lost}) killed (-9) after step "
             f"{figures['kill_at']}, a checkpoint every {figures['every_steps']} steps; live grows back "
             f"({' '.join(GROW)}: a replacement started at the first boundary after the loss, called in "
             f"{GROW_AFTER_STEPS} steps later); {figures['rounds']} round(s), order alternating; median (range) over "
             "the rounds"
             + ("; mirrored: live at dist.zero=2 with fault.replicas=1" if "mirrored" in shown else ""),
             f"live: {v['ftmpirun']} (scripts/ftmpirun); warm, cold: hpcnet.launch over {v['mpirun']}; torch "
             f"{v['torch']}, mpi4py {v['mpi4py']}; {' '.join(f'{k}={x}' for k, x in figures['environment'].items())}",
             "", table(header, rows), "", *_target_lines(results),
             f"load average (1, 5, 15 min): {load[0]} at the start, {load[1]} at the end; runs in {figures['runs']}"]
    failed = [f"{name} round {r['round'] + 1}: {_one_line(r['error'])}" for name in results for r in results[name]
              if "error" in r]
    return "\n".join(lines + ([f"{len(failed)} run(s) failed:", *failed] if failed else []))


def _ready() -> tuple[list[str], dict[str, str]] | str:
    """The running cluster's hosts and the versions, or every reason why the bench cannot run."""
    hosts = cluster_hosts()
    problems = [hosts] if isinstance(hosts, str) else []
    if not problems and len(hosts) < 2:
        problems.append(f"needs a local cluster of at least 2 hosts, the running one has {len(hosts)}")
    ftmpirun = subprocess.run([str(CLUSTER.parent / "ftmpirun"), "--version"], capture_output=True, text=True,
                              timeout=60)
    if ftmpirun.returncode != 0:
        problems.append(f"no fault-tolerant MPI ({ftmpirun.stderr.strip() or f'status {ftmpirun.returncode}'})")
    return "; ".join(problems) if problems else (hosts, versions())


def main_live(args: argparse.Namespace) -> int:
    """``python -m hpcnet.bench recovery --live``: the rounds, the table, ``--json``. Status 2 where the cluster
    is not running or there is no fault-tolerant MPI."""
    ready = _ready()
    if isinstance(ready, str):
        print(f"bench recovery --live: {ready}", file=sys.stderr)
        return 2
    hosts, found = ready
    environment = job_environment()
    out_dir = Path(args.dir) if args.dir else Path(f"/tmp/hpcnet-recovery-live-{os.getpid()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = load_average()
    results = _rounds(out_dir, args)
    figures = {"hosts": hosts, "np": args.np, "steps": args.steps, "kill_at": args.kill_at,
               "every_steps": args.every_steps, "rounds": args.rounds, "versions": found, "environment": environment,
               "job": job_options(args), "load_average_start": load_start, "load_average_end": load_average(),
               "runs": str(out_dir), "results": results, "ratios": ratios(results)}
    print("\n" + report(figures))
    if args.json:
        write_json(args.json, figures)
    return 0
