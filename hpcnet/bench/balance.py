"""Heterogeneous ranks: samples/s of the default job with one slow rank, data.balance=auto against off, same run.

Run (not under mpirun: it starts mpirun for each contender)::

    python -m hpcnet.bench balance [--np 2] [--slow-ms 5] [--rounds 3] [--steps 60] [--every 10] [--json out.json]

The last rank is made slower with ``fault.slow_per_sample_s`` (a sleep per sample in its forward, as a slower
device would take). Each round trains the same job twice, ``data.balance=off`` and ``auto``, in alternating order,
with no checkpoints and no evaluation; the steady rate is the samples of the log intervals after the first two
balancing windows over their time (rank 0's metrics). The ratio auto/off is taken per round (paired), and the
median and range over rounds are printed with the load average, and the final losses: both contenders train on
the same global batches, so without batch-dependent layers they differ only by summation order (the default
model has BatchNorm, which normalises over each rank's slice, so slices of other sizes change its statistics).
"""

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from hpcnet.bench.common import load_average, summarize, table, write_json
from hpcnet.paths import CONFIG_FILE, SUMMARY_FILE, metrics_file

CONTENDERS = ("off", "auto")


def steady_rate(metrics: Path, global_batch: int, after_step: int) -> float:
    """Samples per second over the log intervals that start at or after ``after_step``."""
    samples = seconds = 0.0
    previous = None
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "samples_per_s" not in record:
            continue
        step = record["step"]
        if previous is not None and previous >= after_step and record["samples_per_s"] > 0:
            n = (step - previous) * global_batch
            samples += n
            seconds += n / record["samples_per_s"]
        previous = step
    if seconds == 0:
        raise RuntimeError(f"{metrics}: no log interval after step {after_step}; raise --steps")
    return samples / seconds


def train_once(out_dir: Path, name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = out_dir / name
    command = ["mpirun", "-np", str(args.np), sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
               f"run.dir={run_dir}", "run.dir_exact=true", f"checkpoint.dir={out_dir / 'ckpt' / name}",
               f"data.dir={Path(args.data_dir).absolute()}", f"train.steps={args.steps}", "train.eval_every=0",
               "checkpoint.every_steps=0", "checkpoint.at_end=false", f"run.log_every={args.log_every}",
               f"data.balance={mode}", f"data.balance_every={args.every}",
               f"fault.slow_per_sample_s={args.slow_ms / 1e3}", *args.train_args]
    t0 = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: status {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    train = tomllib.loads((run_dir / CONFIG_FILE).read_text())["train"]  # the resolved config of the run
    global_batch = train["batch_size"] * train["grad_accumulation"] * args.np
    rate = steady_rate(run_dir / metrics_file(0), global_batch, after_step=2 * args.every)
    balance = summary.get("balance", {})
    return {"mode": mode, "samples_per_s": rate, "wall_s": wall, "final_loss": summary["final_loss"],
            "sizes": balance.get("sizes"), "history": balance.get("history")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench balance", description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--slow-ms", type=float, default=5.0,
                        help="the last rank's extra milliseconds per sample (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    parser.add_argument("--every", type=int, default=10, help="data.balance_every (default 10)")
    parser.add_argument("--log-every", type=int, default=5, help="run.log_every (default 5)")
    parser.add_argument("--timeout-s", type=float, default=900, help="per run (default 900)")
    parser.add_argument("--dir", default="", help="where runs go (default: a new directory under /tmp)")
    parser.add_argument("--data-dir", default="data", help="data.dir with the synthetic dataset (default data)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("train_args", nargs="*", help="extra hpcnet.train options, e.g. model.name=mlp")
    args = parser.parse_args(argv)
    if args.np < 2:
        parser.error("--np must be at least 2: balancing needs ranks to balance")
    if args.rounds < 1 or args.slow_ms < 0 or args.steps < 3 * args.every + args.log_every:
        parser.error("need --rounds >= 1, --slow-ms >= 0 and --steps >= 3 x --every + --log-every")
    out_dir = Path(args.dir) if args.dir else Path(f"/tmp/hpcnet-balance-{os.getpid()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = load_average()
    rounds: list[dict[str, dict[str, Any]]] = []
    for k in range(args.rounds):
        order = CONTENDERS if k % 2 == 0 else CONTENDERS[::-1]
        rounds.append({mode: train_once(out_dir, f"r{k}-{mode}", mode, args) for mode in order})
        r = rounds[-1]
        print(f"round {k + 1}: off {r['off']['samples_per_s']:.1f}, auto {r['auto']['samples_per_s']:.1f} samples/s "
              f"(auto sizes {r['auto']['sizes']})", flush=True)
    ratios = [r["auto"]["samples_per_s"] / r["off"]["samples_per_s"] for r in rounds]
    rows = []
    for mode in CONTENDERS:
        s = summarize([r[mode]["samples_per_s"] for r in rounds])
        rows.append([mode, f"{s['median']:.1f}", f"{s['min']:.1f}-{s['max']:.1f}",
                     f"{rounds[-1][mode]['final_loss']:.6f}"])
    ratio = summarize(ratios)
    print(f"\nbalance benchmark: {args.np} ranks, the last one {args.slow_ms:g} ms/sample slower, "
          f"{args.rounds} paired rounds, {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.2f}' for x in load_start)} at start, "
          f"{', '.join(f'{x:.2f}' for x in load_average())} at end; runs in {out_dir}")
    print(table(["data.balance", "samples/s (median)", "range", "final loss (last round)"], rows))
    print(f"auto/off: {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}), paired by round")
    history = rounds[-1]["auto"]["history"] or []
    if history:
        last = history[-1]
        print(f"auto's last decision (step {last['step']}): sizes {last['sizes']}, measured "
              f"{', '.join(f'{1e3 * t:.2f}' for t in last['seconds_per_sample'])} ms per sample")
    payload = {"np": args.np, "slow_ms": args.slow_ms, "rounds": rounds, "ratio_auto_over_off": ratios,
               "load_average_start": load_start, "load_average_end": load_average()}
    if args.json:
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
