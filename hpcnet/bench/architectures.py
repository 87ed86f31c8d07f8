"""The seed's architecture table here: one process, mpirun on N ranks, and SLURM; throughput, jitter, recovery.

Run (not under mpirun: it starts the runs itself; the SLURM row needs a SLURM,
e.g. ``scripts/slurm.sh start``, else it is reported as not run)::

    python -m hpcnet.bench architectures [--np 2] [--model resnet_tiny] [--steps 80] [--kill-at 60] [--json out.json]

The same model, data, per-rank batch, seed and checkpoint policy, trained three ways:

    single   ``python -m hpcnet.train`` (one process with one rank's share of the cores)
    mpirun   ``python -m hpcnet.launch -- mpirun -np N python -m mpi4py -m hpcnet.train``
    SLURM    ``sbatch -n N jobscripts/cpu.sbatch`` (``srun --mpi=pmix`` under hpcnet.launch)

The two multi-rank runs kill the last rank (SIGKILL, ``fault.kill_at_step``,
first attempt only) after step ``--kill-at``; hpcnet.launch restarts them from
the newest checkpoint.  From each run's own records (metrics time stamps with
``run.log_every=1``, rank logs):

- throughput: samples of the whole job per second over the steady steps
  (after ``--warmup`` steps, before the kill);
- jitter: the spread of those step times, as the seed reports it, ``±x%`` =
  half the p5-p95 range over the median (``hpcnet.observe.stats.jitter_pct``, the one
  definition); also p50, p99 and the coefficient of variation.  Checkpoint steps are included: they
  are part of training, and show in p99;
- recovery: the kill (the victim's log line) to the next completed step after
  the restart (``python -m hpcnet.bench recovery`` splits it into phases).

The seed's figures (ResNet-152, batch 256, 8 GPUs, Alibaba Cloud GN7) are printed
beside ours; the hardware differs (here: a few CPU cores), so compare the shape,
not the numbers.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcnet.bench.common import load_average, step_times, table, write_json
from hpcnet.bench.recovery_restart import first_event, log_events
from hpcnet.observe.stats import cv_pct, jitter_pct, percentile
from hpcnet.paths import LAUNCH_FILE, attempt_dir, metrics_file, rank_log

ROOT = Path(__file__).resolve().parents[2]

SEED = {
    "single": {"samples_per_s": 312, "jitter_pct": 2, "recovery_s": None},
    "mpirun": {"samples_per_s": 2408, "jitter_pct": 15, "recovery_s": 83},
    "slurm": {"samples_per_s": 1987, "jitter_pct": 8, "recovery_s": 17},
}
"""The seed article's table: 8-GPU throughput (images/s), latency jitter (±%), failure recovery (s)."""


def step_statistics(times: dict[int, float], first: int, last: int, global_batch: int) -> dict[str, float]:
    """Throughput and step-time spread over steps ``first+1 .. last`` from step -> completion time (pure).

    Args:
        times: unix time at which each step completed.
        first: the step whose completion starts the clock (the end of the warm-up).
        last: the last step counted.
        global_batch: samples per step, all ranks together.
    """
    if last - first < 2 or first not in times or last not in times:
        raise ValueError(f"need the completion times of steps {first}..{last}")
    durations = [times[s] - times[s - 1] for s in range(first + 1, last + 1) if s in times and s - 1 in times]
    p50, p99 = percentile(durations, 50), percentile(durations, 99)
    return {
        "steps": last - first,
        "samples_per_s": global_batch * (last - first) / (times[last] - times[first]),
        "step_p50_s": p50,
        "step_p99_s": p99,
        "jitter_pct": jitter_pct(durations),
        "cv_pct": cv_pct(durations),
    }


def recovery_time(launch_dir: Path, victim: int) -> dict[str, Any]:
    """Kill of ``victim`` in attempt 1 -> the first step completed by attempt 2 (from the runs' records)."""
    killed = first_event(log_events(attempt_dir(launch_dir, 1) / rank_log(victim)), r"kills itself \(SIGKILL\)")
    resumed = first_event(log_events(attempt_dir(launch_dir, 2) / rank_log(0)), r"^resumed from .* at step (\d+)")
    if killed is None or resumed is None:
        raise RuntimeError(f"{launch_dir}: no kill in attempt-1/rank{victim}.log or no resume in attempt-2/rank0.log")
    step = int(resumed[1].group(1))
    done = step_times(attempt_dir(launch_dir, 2) / metrics_file(0)).get(step + 1)
    if done is None:
        raise RuntimeError(f"{launch_dir}: attempt 2 completed no step after resuming at step {step}")
    return {"recovery_s": done - killed[0], "resumed_at_step": step}


def _child_env() -> dict[str, str]:
    """This environment without any MPI wiring of our own (we may have been started under one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_base_warn_component_unused="0")
    return env


def _run(command: list[str], cwd: Path, timeout_s: float) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=cwd, env=_child_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"status {proc.returncode}: {' '.join(command[:6])} ...\n{proc.stderr[-3000:]}")
    return time.monotonic() - t0


def measure_single(out: Path, train: list[str], args: argparse.Namespace) -> dict[str, Any]:
    run_dir = out / "single"
    # One worker with one rank's share of the cores, as the seed's single GPU is
    # one of its eight: N ranks should then approach N times its throughput.
    threads = f"train.threads={max(1, (os.cpu_count() or 1) // args.np)}"
    wall = _run([sys.executable, "-m", "hpcnet.train", f"run.dir={run_dir}", "run.dir_exact=true", threads, *train],
                out, timeout_s=1200)
    stats = step_statistics(step_times(run_dir / metrics_file(0)), args.warmup, args.steps, args.batch_size)
    return {"ranks": 1, "wall_s": wall, "run_dir": str(run_dir), **stats, "recovery_s": None}


def _measure_supervised(launch_dir: Path, wall: float, args: argparse.Namespace) -> dict[str, Any]:
    stats = step_statistics(step_times(attempt_dir(launch_dir, 1) / metrics_file(0)), args.warmup,
                            args.kill_at - 1, args.batch_size * args.np)
    return {"ranks": args.np, "wall_s": wall, "run_dir": str(launch_dir), **stats,
            **recovery_time(launch_dir, args.np - 1)}


def measure_mpirun(out: Path, train: list[str], args: argparse.Namespace) -> dict[str, Any]:
    wall = _run([sys.executable, "-m", "hpcnet.launch", "--max-restarts", "1", "--backoff-s", "0", "--",
                 "mpirun", "-np", str(args.np), sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
                 f"run.dir={out / 'mpirun'}", "run.name=mpirun", *train], out, timeout_s=1200)
    launch_dir = sorted((out / "mpirun").glob(f"mpirun-*/{LAUNCH_FILE}"))[-1].parent
    return _measure_supervised(launch_dir, wall, args)


def measure_slurm(out: Path, train: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Sbatch --wait the CPU job script; its hpcnet.launch restarts inside the allocation."""
    script = ROOT / "jobscripts" / "cpu.sbatch"
    probe = subprocess.run(["sinfo", "-h"], capture_output=True, text=True) if shutil.which("sinfo") else None
    if probe is None or probe.returncode != 0:
        return {"skipped": "no SLURM answers here (scripts/slurm.sh start runs a local one)"}
    slurm_dir = out / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    command = ["sbatch", "--wait", "--parsable", f"--ntasks={args.np}", "--job-name=arch", f"--chdir={slurm_dir}",
               f"--export=ALL,HPCNET_ROOT={ROOT},HPCNET_VENV={sys.prefix},HPCNET_MAX_RESTARTS=1",
               str(script), *train]
    t0 = time.monotonic()
    proc = subprocess.run(command, env=_child_env(), capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    job_id = proc.stdout.strip().split(";")[0]
    log = slurm_dir / f"slurm-arch-{job_id}.out"
    if proc.returncode != 0:
        tail = log.read_text()[-3000:] if log.exists() else proc.stderr
        raise RuntimeError(f"SLURM job {job_id}: sbatch --wait status {proc.returncode}\n{tail}")
    launch_dir = sorted((slurm_dir / "runs" / job_id).glob(f"arch-*/{LAUNCH_FILE}"))[-1].parent
    return {"job_id": job_id, **_measure_supervised(launch_dir, wall, args)}


def _cell(value: float | None, fmt: str) -> str:
    return "N/A" if value is None else fmt.format(value)


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The table: ours beside the seed's, one row per way of running."""
    rows = []
    names = {"single": "single process", "mpirun": f"mpirun, {args.np} ranks", "slurm": f"SLURM, {args.np} ranks"}
    for key, label in names.items():
        seed = SEED[key]
        seed_cells = [f"{seed['samples_per_s']}", f"±{seed['jitter_pct']}%", _cell(seed["recovery_s"], "{:.0f} s")]
        ours = results.get(key, {})
        if "samples_per_s" not in ours:
            rows.append([label, "-", "-", "-", "-", "-", ours.get("skipped") or ours.get("error", "not run"),
                         *seed_cells])
            continue
        rows.append([label, f"{ours['samples_per_s']:.0f}", f"±{ours['jitter_pct']:.1f}%",
                     f"{1000 * ours['step_p50_s']:.0f} / {1000 * ours['step_p99_s']:.0f}", f"{ours['cv_pct']:.1f}%",
                     _cell(ours["recovery_s"], "{:.1f} s"), f"{ours['wall_s']:.0f} s", *seed_cells])
    header = ["architecture", "samples/s", "jitter", "p50/p99 ms", "CV", "recovery", "wall",
              "seed imgs/s", "seed jitter", "seed recovery"]
    return table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench architectures", description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks of the mpirun and SLURM runs (default 2)")
    parser.add_argument("--model", default="resnet_tiny", help="model.name (default resnet_tiny)")
    parser.add_argument("--batch-size", type=int, default=32, help="train.batch_size, per rank (default 32)")
    parser.add_argument("--steps", type=int, default=80, help="training steps (default 80)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the statistics (default 10)")
    parser.add_argument("--kill-at", type=int, default=60, help="step after which the last rank is killed")
    parser.add_argument("--every-steps", type=int, default=20, help="checkpoint.every_steps (default 20)")
    parser.add_argument("--only", default="single,mpirun,slurm", help="comma-separated subset of the three")
    parser.add_argument("--dir", default="", help="where runs go (default: a new directory under /tmp)")
    parser.add_argument("--data-dir", default=str(ROOT / "data"), help="data.dir with the synthetic dataset")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("train_args", nargs="*", help="extra hpcnet.train options for every run")
    args = parser.parse_args(argv)
    if not (0 < args.warmup < args.kill_at - 2 and args.every_steps < args.kill_at < args.steps):
        parser.error("need 0 < --warmup < --kill-at - 2, --every-steps < --kill-at < --steps")
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    if not set(only) <= set(SEED):
        parser.error(f"--only: choose from {', '.join(SEED)}")
    out = Path(args.dir or f"/tmp/hpcnet-architectures-{os.getpid()}").absolute()
    out.mkdir(parents=True, exist_ok=True)
    # One checkpoint policy and one dataset for all three; every step logged for its time stamp.
    train = [f"data.dir={Path(args.data_dir).absolute()}", f"model.name={args.model}",
             f"train.batch_size={args.batch_size}", f"train.steps={args.steps}", "train.eval_every=0",
             "run.log_every=1", f"checkpoint.every_steps={args.every_steps}", "checkpoint.every_s=0",
             "checkpoint.move_aside=true",  # a rerun with the same --dir: set the last run's checkpoints aside
             *args.train_args]
    kill = [f"fault.kill_at_step={args.kill_at}", "fault.only_attempt=1"]
    measure = {"single": lambda: measure_single(out, train, args),
               "mpirun": lambda: measure_mpirun(out, [*train, *kill], args),
               "slurm": lambda: measure_slurm(out, [*train, *kill], args)}
    load_start = load_average()
    results: dict[str, dict[str, Any]] = {}
    for key in only:
        print(f"architectures: running {key} ...", file=sys.stderr, flush=True)
        try:
            results[key] = measure[key]()
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            results[key] = {"error": f"failed: {str(exc).splitlines()[0]}"}
            print(f"architectures: {key}: {exc}", file=sys.stderr)
    load_end = load_average()
    print(f"architectures: model {args.model}, batch {args.batch_size}/rank, {args.steps} steps (statistics over "
          f"steps {args.warmup + 1}..{args.kill_at - 1}), checkpoint every {args.every_steps} steps, kill -9 of "
          f"rank {args.np - 1} after step {args.kill_at}; {os.cpu_count()} cores; load average "
          f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end; runs in {out}\n")
    print(report(results, args))
    print("\njitter = ±half the p5-p95 range of step times over the median; CV = stdev/mean of step times; "
          "recovery = kill -9 -> next completed step.\nThe seed's figures are ResNet-152, batch 256, 8 GPUs "
          "(Alibaba Cloud GN7): other hardware, other model; compare the shape, not the numbers.")
    payload = {"args": vars(args), "train_args": train, "load_average_start": load_start,
               "load_average_end": load_end, "results": results, "seed": SEED}
    if args.json:
        write_json(args.json, payload)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
