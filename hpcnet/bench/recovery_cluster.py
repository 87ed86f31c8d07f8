"""Elastic recovery on the local cluster (``python -m hpcnet.bench recovery --cluster``): a host lost -> the first
step on the survivors, and the host back -> the first step at the full size.

Each trial runs ``python -m hpcnet.launch --exclude-failed-hosts --min-ranks 1 -- mpirun $(scripts/cluster.sh env)
-np N ... hpcnet.train`` on the running local cluster (``scripts/cluster.sh start``, with the same
``HPCNET_CLUSTER_*`` variables), cuts the last host off (``cluster.sh partition``: a host that is gone, where
``fail`` only kills its processes and leaves it answering) mid-training, and heals it once the shrunk attempt is
training.  The phases come from launch.json, failure.json and the ranks' metrics:

    shrink: cut -> declared (failure.json) -> launcher ended -> next attempt started (the probe that tells which side
            was lost runs in between) -> its first step on the survivors
    grow:   heal -> the probe answered and the attempt was asked to save and stop -> it ended -> the next attempt
            started -> its first step at the full size

cold: ``--standby off``; warm: ``--standby on`` (a standby is made for the command as it stands, so it is discarded
when the host list changes; launch.json says so, and the table counts the attempts a standby ran).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcnet.bench.common import Watched, load_average, step_times, summarize, table
from hpcnet.paths import FAILURE_FILE, LAUNCH_FILE, attempt_dir, metrics_file

CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"


def cluster_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=120)


def cluster_hosts() -> list[str] | str:
    """The running cluster's host names, or why there is none."""
    if not CLUSTER.exists():
        return f"{CLUSTER} is missing (a source checkout is needed)"
    status = cluster_cli("status")
    if status.returncode != 0:
        return ("needs a running local cluster: scripts/cluster.sh start --hosts 2 (root; with the same "
                "HPCNET_CLUSTER_PREFIX/NET/DIR as here), docs/testing.md")
    hosts = cluster_cli("hosts").stdout.split("\n")
    return [line.split()[0] for line in hosts if line.strip()]


def _first_step(launch_dir: Path, attempt: int) -> float | None:
    """When ``attempt``'s first training step was logged (unix time); None before it."""
    times = step_times(attempt_dir(launch_dir, attempt) / metrics_file(0))
    return times[min(times)] if times else None


def measure(out_dir: Path, trial: str, hosts: list[str], args: argparse.Namespace, standby: str) -> dict[str, Any]:
    """One shrink-and-grow run; its phases in seconds."""
    runs = out_dir / trial
    runs.mkdir(parents=True, exist_ok=True)
    victim = hosts[-1]
    env_opts = cluster_cli("env").stdout.split()
    train = [f"data.dir={Path(args.data_dir).absolute()}", f"run.dir={runs}", "run.name=x", "model.name=mlp",
             "train.batch_size=16", f"train.steps={args.steps}", "train.eval_every=0", "run.log_every=1",
             f"checkpoint.every_steps={args.every_steps}", "dist.probe=false", "monitor.heartbeat_interval_s=1",
             "monitor.heartbeat_misses=3", f"fault.slow_s={args.slow_s}", "fault.rank=0", *args.train_args]
    command = [sys.executable, "-m", "hpcnet.launch", "--max-restarts", "2", "--standby", standby, "--backoff-s", "0",
               "--launcher-grace-s", f"{args.grace_s:g}", "--exclude-failed-hosts", "--min-ranks", "1",
               "--probe-every-s", f"{args.probe_every_s:g}", "--probe-timeout-s", f"{args.probe_timeout_s:g}", "--",
               "mpirun", *env_opts, "-np", str(args.np), sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", *train]
    job = Watched(command, runs)
    healed = False
    try:
        job.wait_for(rf"step +{args.kill_at}/{args.steps}", 0, 300)
        cut = time.time()
        cluster_cli("partition", victim)
        second = job.wait_for(r"hpcnet.launch: attempt 2/", cut, 300)
        job.wait_for(rf"step +\d+/{args.steps}", second, 300)
        time.sleep(args.settle_s)  # a standby for the next attempt may park meanwhile
        heal = time.time()
        cluster_cli("heal", victim)
        healed = True
        status = job.proc.wait(timeout=600)
    finally:
        if not healed:
            cluster_cli("heal", victim)
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
    job.reader.join(10)
    (launch_json,) = runs.glob(f"x-*/{LAUNCH_FILE}")
    launch_dir = launch_json.parent
    attempts = json.loads(launch_json.read_text())["attempts"]
    if status != 0 or len(attempts) != 3 or not attempts[1].get("grow"):
        raise RuntimeError(f"{trial}: status {status}, {len(attempts)} attempt(s), see {launch_dir}")
    first, shrunk, full = attempts
    failure_path = attempt_dir(launch_dir, 1) / FAILURE_FILE
    failure = json.loads(failure_path.read_text()) if failure_path.exists() else {}
    declared = failure.get("detected_wall") or first.get("declared_unix") or first["end_unix"]
    on_survivors, at_full = _first_step(launch_dir, 2), _first_step(launch_dir, 3)
    if on_survivors is None or at_full is None:
        raise RuntimeError(f"{trial}: no first step in attempt 2 or 3 ({launch_dir})")
    return {
        "launch_dir": str(launch_dir), "ranks": [a.get("ranks") for a in attempts],
        "standby_used": [bool(a.get("standby")) for a in attempts[1:]],
        "standby_notes": [a.get("standby_note", "") for a in attempts[1:]],
        "lost_declared_s": declared - cut, "lost_launcher_ended_s": first["end_unix"] - declared,
        "lost_decided_s": shrunk["start_unix"] - first["end_unix"],
        "lost_start_to_step_s": on_survivors - shrunk["start_unix"],
        "lost_total_s": on_survivors - cut,
        "back_asked_s": (shrunk["grow_unix"] or heal) - heal, "back_saved_s": shrunk["end_unix"] - shrunk["grow_unix"],
        "back_restart_s": full["start_unix"] - shrunk["end_unix"],
        "back_start_to_step_s": at_full - full["start_unix"], "back_total_s": at_full - heal,
    }


ROWS = [("lost_declared_s", "lost: declared", "the cut -> failure.json (3 missed heartbeats)"),
        ("lost_launcher_ended_s", "lost: launcher ended", "-> mpirun ended (--launcher-grace-s)"),
        ("lost_decided_s", "lost: probed, placed", "-> the next attempt starts (probe of the named hosts)"),
        ("lost_start_to_step_s", "lost: start -> step", "-> its first step on the survivors (start-up, load)"),
        ("lost_total_s", "= host lost -> step", "the cut -> the first step on the survivors"),
        ("back_asked_s", "back: probe answered", "the heal -> the attempt is asked to save and stop"),
        ("back_saved_s", "back: saved, stopped", "-> it saved a checkpoint and ended (status 76)"),
        ("back_restart_s", "back: restart", "-> the next attempt starts"),
        ("back_start_to_step_s", "back: start -> step", "-> its first step at the full size"),
        ("back_total_s", "= host back -> step", "the heal -> the first step at the full size")]


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    modes = list(results)
    header = ["phase"] + [f"{m} (n={len([r for r in results[m] if 'back_total_s' in r])})" for m in modes] + ["what"]
    rows = []
    for key, label, what in ROWS:
        cells = []
        for mode in modes:
            values = [r[key] for r in results[mode] if key in r]
            s = summarize(values) if values else None
            cells.append(f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" if s else "-")
        rows.append([label, *cells, what])
    lines = [table(header, rows)]
    for mode in modes:
        used = [r["standby_used"] for r in results[mode] if "standby_used" in r]
        if mode == "warm" and used:
            lines.append(f"warm: a standby ran the shrunk attempt in {sum(u[0] for u in used)}/{len(used)} trials "
                         f"and the full-size one in {sum(u[1] for u in used)}/{len(used)}; notes: "
                         f"{sorted({n for r in results[mode] for n in r.get('standby_notes', []) if n})}")
        failed = [r["error"] for r in results[mode] if "error" in r]
        if failed:
            lines.append(f"{mode}: {len(failed)} trial(s) failed: {[f[-200:] for f in failed]}")
    return "\n".join(lines)


def main_cluster(args: argparse.Namespace) -> int:
    hosts = cluster_hosts()
    if isinstance(hosts, str):
        print(f"bench recovery --cluster: {hosts}", file=sys.stderr)
        return 2
    if len(hosts) < 2:
        print("bench recovery --cluster: needs a cluster of at least 2 hosts", file=sys.stderr)
        return 2
    out_dir = Path(args.dir) if args.dir else Path(f"/tmp/hpcnet-recovery-cluster-{os.getpid()}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    load_start = load_average()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for trial in range(args.trials):
        for mode in (modes if trial % 2 == 0 else modes[::-1]):
            try:
                result = measure(out_dir, f"{mode}-{trial}", hosts, args, "on" if mode == "warm" else "off")
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                result = {"error": str(exc)[-1500:]}
            results[mode].append(result)
            print(f"trial {trial + 1} {mode}: " + (f"host lost -> step {result['lost_total_s']:.2f} s, host back -> "
                  f"step {result['back_total_s']:.2f} s, ranks {result['ranks']}" if "error" not in result
                  else result["error"][-600:]), flush=True)
    print(f"\nelastic recovery on the local cluster: hosts {', '.join(hosts)}, {args.np} ranks, the last host cut off "
          f"at step {args.kill_at} and healed {args.settle_s:g} s after the shrunk attempt's first step; "
          f"{os.cpu_count()} cores, load average {', '.join(f'{x:.2f}' for x in load_start)} at start, "
          f"{', '.join(f'{x:.2f}' for x in load_average())} at end; runs in {out_dir}\n")
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"hosts": hosts, "np": args.np, "load_average_start": load_start,
                                               "load_average_end": load_average(), "results": results}, indent=2))
    return 0
