"""Recovery time: kill -9 one rank mid-run (and SIGSTOP one) under hpcnet.launch; how long until training resumes.

Run (not under mpirun: it starts the supervisor, which starts mpirun)::

    python -m hpcnet.bench recovery [--np 2] [--steps 40] [--every-steps 10] [--kill-at 25] [--json out.json]
    python -m hpcnet.bench recovery --live [--rounds 3] [--json out.json]

Kill: ``python -m hpcnet.launch -- mpirun -np N ... hpcnet.train
fault.kill_at_step=K fault.only_attempt=1``: the last rank SIGKILLs itself
after step K; the supervisor restarts the job with ``--resume auto`` and it
recomputes the steps since the last checkpoint.  The phases come from the
timestamps the processes write anyway (log lines: milliseconds; metrics JSON
lines; the supervisor's launch.json):

    detection    the kill -> the launcher reports the dead rank
    teardown     -> the launcher has exited (every rank gone)
    back-off     -> the supervisor starts the next attempt (--backoff-s)
    restart      -> training is ready to load a checkpoint: process start,
                    imports, MPI init (first log line), topology probe,
                    torch.distributed, dataset + model + optimizer
    load         -> the checkpoint is read, verified and restored
    first step   -> the first step after the resume is done
    = kill -> first completed step after the restart (the headline figure);
    recompute    the steps since the checkpoint, until the step of the kill.

Hang: the same with ``fault.hang_at_step``: the rank SIGSTOPs itself, MPI
notices nothing, and the heartbeat monitor (``hpcnet.fault.monitor``) must declare
it failed (failure.json, status 75); detection is the SIGSTOP -> the time in
failure.json.

``--cluster``: elastic shrink and grow on the running local cluster instead (``hpcnet.bench.recovery_cluster``):
a host lost -> the first step on the survivors, the host back -> the first step at the full size.

``--live``: on the running local cluster, a rank lost and survived in the job (the survivors shrink, under a
fault-tolerant MPI; at stage 0 from their memory, at stage 2 from the mirrors of ``fault.replicas=1``) against warm and
cold restarts, in the same run (``hpcnet.bench.recovery_live``): kill -9 -> the next step on the survivors, the steps
computed again, the world size after; live recovery then grows back to the first size (``fault.grow=spawn``): the
survivors' pauses for the spawn and the join, the replacement's start -> ready; the failure-free step time under
each MPI, and at stage 2 with mirrors and without.

``--startup`` (default on) also times the pieces of a process start on their
own (mpirun, python, import torch, MPI init, torch._dynamo, which the first
optimizer constructor imports), to show what the restart phase is made of.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcnet.bench.common import load_average, summarize, table, write_json
from hpcnet.bench.recovery_cluster import main_cluster
from hpcnet.bench.recovery_live import GROW_AFTER_STEPS, main_live
from hpcnet.bench.recovery_restart import job_options, measure_hang, measure_kill


def _timed(command: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=300, env=env)
    return time.perf_counter() - t0


def measure_startup(args: argparse.Namespace) -> dict[str, float]:
    """Best of two: what one (re)start of an MPI + torch process costs, piece by piece."""
    py = sys.executable
    mpirun = ["mpirun", "-np", str(args.np)]
    probes = {
        "mpirun_python_s": [*mpirun, py, "-c", "pass"],
        "mpirun_python_mpi_init_s": [*mpirun, py, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"],
        "mpirun_import_torch_h5py_mpi_s": [*mpirun, py, "-c",
                                           "import torch, h5py; from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"],
        "mpirun_import_hpcnet_train_s": [*mpirun, py, "-c", "import hpcnet.train; from mpi4py import MPI; "
                                                            "MPI.COMM_WORLD.Barrier()"],
    }
    out = {name: min(_timed(cmd) for _ in range(2)) for name, cmd in probes.items()}
    code = ("import time, torch; t = time.perf_counter(); import torch._dynamo; "
            "print(time.perf_counter() - t)")
    out["torch_dynamo_import_s"] = min(
        float(subprocess.run([py, "-c", code], capture_output=True, text=True, check=True, timeout=300).stdout)
        for _ in range(2))
    return out


PHASES = [("detection_s", "detection", "the fault -> the launcher reports it (hang: failure.json)"),
          ("teardown_s", "teardown", "-> the launcher has exited"),
          ("backoff_s", "back-off", "-> the next attempt starts or its standby is released (--backoff-s)"),
          ("restart_s", "restart", "-> ready to load: cold, process start, imports, MPI init, set-up; warm, "
                                   "MPI init and set-up"),
          ("load_s", "checkpoint load", "read, verify, restore"),
          ("first_step_s", "first step", "the first step after the resume"),
          ("total_to_first_step_s", "= total", "the fault -> the first step after the restart")]


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    s = summarize(values)
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def report(trials: dict[str, dict[str, list[dict[str, Any]]]], startup: dict[str, float] | None) -> str:
    """Median (range) of every phase, cold beside warm, for each fault."""
    lines = []
    for fault, modes in trials.items():
        runs = {mode: [r for r in results if "total_to_first_step_s" in r] for mode, results in modes.items()}
        header = ["phase"] + [f"{mode} (n={len(runs[mode])})" for mode in modes] + ["what"]
        rows = []
        for key, label, what in PHASES:
            if fault == "hang" and key == "detection_s":
                key, what = "hang_detection_s", "SIGSTOP -> the monitor's failure.json"
            rows.append([label] + [_cell([r[key] for r in runs[mode] if r.get(key) is not None]) for mode in modes]
                        + [what])
        fault_step = next(iter(next(iter(runs.values()))), {}).get("fault_step", "?")
        lines.append(f"{fault} of the last rank at step {fault_step} (seconds, median and range over trials):")
        lines.append(table(header, rows))
        if "cold" in runs and "warm" in runs and runs["cold"] and runs["warm"]:
            cold = summarize([r["total_to_first_step_s"] for r in runs["cold"]])["median"]
            warm = summarize([r["total_to_first_step_s"] for r in runs["warm"]])["median"]
            used = sum(r.get("standby_used", False) for r in runs["warm"])
            lines.append(f"warm/cold total: {warm / cold:.2f} (the standby was used in {used} of "
                         f"{len(runs['warm'])} warm trials)")
            if fault == "hang":
                detect = summarize([r["hang_detection_s"] for r in runs["warm"]])["median"]
                lines.append(f"warm total - hang detection: {warm - detect:.2f} s")
        failed = [r for results in modes.values() for r in results if "total_to_first_step_s" not in r]
        if failed:
            reasons = [r.get("error") or r.get("status") for r in failed]
            lines.append(f"{len(failed)} trial(s) without a restart: {reasons}")
        lines.append("")
    if startup:
        rows = [[k.removesuffix("_s"), f"{v:.2f}"] for k, v in startup.items()]
        lines += ["start-up pieces (best of 2, separate processes):", table(["what", "seconds"], rows), ""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hpcnet.bench recovery``."""
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", action="store_true",
                        help="elastic shrink and grow on the running local cluster (scripts/cluster.sh): host lost "
                             "-> first step on the survivors, host back -> first step at full size")
    parser.add_argument("--live", action="store_true",
                        help="on the running local cluster, in the same run: live shrink (scripts/cluster.sh "
                             "ftmpirun; also at dist.zero=2 with fault.replicas=1), warm and cold restart "
                             "(hpcnet.launch) after a kill -9 of a rank of the second host -> the next step; live's "
                             "grow back to the first size (fault.grow=spawn): the survivors' pause; the "
                             "failure-free step time under both MPIs, and with mirrors / without")
    parser.add_argument("--np", type=int, default=None, help="ranks (default 2; --cluster, --live: 4)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 40; --cluster 80)")
    parser.add_argument("--every-steps", type=int, default=10, help="checkpoint.every_steps (default 10)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="step after which the rank is killed/stopped (--cluster: the host cut off; default 25, "
                             "--cluster 13)")
    parser.add_argument("--backoff-s", type=float, default=0.0, help="hpcnet.launch --backoff-s (default 0)")
    parser.add_argument("--trials", type=int, default=None, help="trials of each fault and mode (default 5; "
                                                                 "--cluster 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="--live: rounds, each running every contender once, the order alternating (default 3)")
    parser.add_argument("--modes", default=None,
                        help="cold (hpcnet.launch --standby off), warm (--standby on), or both (default cold,warm)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="the first attempt sleeps this long at step 2, so its standby has parked before the "
                             "fault (default 10; --live 20; a real failure comes long after the start); --cluster: "
                             "the wait between the shrunk attempt's first step and the heal (default 3)")
    parser.add_argument("--slow-s", type=float, default=0.2,
                        help="--cluster: rank 0 sleeps this long in every step, so the faults land mid-training "
                             "(default 0.2)")
    parser.add_argument("--grace-s", type=float, default=5.0, help="--cluster: hpcnet.launch --launcher-grace-s "
                                                                   "(default 5)")
    parser.add_argument("--probe-every-s", type=float, default=1.0, help="--cluster: hpcnet.launch "
                                                                         "--probe-every-s (default 1)")
    parser.add_argument("--probe-timeout-s", type=float, default=3.0, help="--cluster: hpcnet.launch "
                                                                           "--probe-timeout-s (default 3)")
    parser.add_argument("--dir", default="", help="where runs go (default: a new directory under /tmp)")
    parser.add_argument("--data-dir", default="data", help="data.dir with the synthetic dataset (default data)")
    parser.add_argument("--no-hang", action="store_true", help="skip the hang measurement")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up pieces")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("train_args", nargs="*", help="extra hpcnet.train options, e.g. dist.probe=false")
    return parser


DEFAULTS = {"np": (2, 4, 4), "steps": (40, 80, 40), "kill_at": (25, 13, 25), "trials": (5, 2, None),
            "rounds": (None, None, 3), "modes": ("cold,warm", "cold,warm", None), "settle_s": (10.0, 3.0, 20.0)}
"""The defaults that depend on the variant: (one host, ``--cluster``, ``--live``); None: not an option of it."""


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Fill in the defaults that depend on ``--cluster`` and ``--live``; the modes of ``--modes`` (none for
    ``--live``, which runs its own contenders).  ``parser.error`` (status 2) on a bad option."""
    if args.cluster and args.live:
        parser.error("--cluster and --live are two benchmarks: give one")
    variant = 1 if args.cluster else 2 if args.live else 0
    for option, defaults in DEFAULTS.items():
        default = defaults[variant]
        if default is None and getattr(args, option) is not None:
            flag = f"--{option.replace('_', '-')}"
            parser.error(f"{flag} is not an option of --live, which runs live, warm and cold in --rounds" if args.live
                         else f"{flag} is an option of --live only")
        if getattr(args, option) is None:
            setattr(args, option, default)
    if not 2 < args.every_steps < args.kill_at < args.steps:
        parser.error("need 2 < --every-steps < --kill-at < --steps")
    if args.live:
        if args.np < 2 or args.rounds < 1:
            parser.error("--live needs --np of at least 2 and --rounds of at least 1")
        if args.kill_at + GROW_AFTER_STEPS + 1 >= args.steps:  # the join after the step past the kill, then these
            parser.error(f"--live needs --kill-at + {GROW_AFTER_STEPS + 1} < --steps: the replacement joins "
                         f"{GROW_AFTER_STEPS + 1} steps after the kill")
        return []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"cold", "warm"} or args.trials < 1:
        parser.error("--modes takes cold, warm or both; --trials must be at least 1")
    return modes


def _trials(out_dir: Path, job: list[str], args: argparse.Namespace, faults: list[str],
            modes: list[str]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``--trials`` of each fault in each mode, the modes' order alternating; each printed as it ends."""
    trials: dict[str, dict[str, list[dict[str, Any]]]] = {f: {m: [] for m in modes} for f in faults}
    for trial in range(args.trials):
        order = modes if trial % 2 == 0 else modes[::-1]  # alternate, so drift in the load hits both
        for fault in faults:
            for mode in order:
                name = f"{fault}-{mode}-{trial}"
                measure = measure_kill if fault == "kill" else measure_hang
                try:
                    result = measure(out_dir, job, args, name=name, standby="on" if mode == "warm" else "off")
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    result = {"error": str(exc)[-500:]}
                trials[fault][mode].append(result)
                total = result.get("total_to_first_step_s")
                standby_note = ("" if mode == "cold" else " (standby used)" if result.get("standby_used")
                                else " (no standby)")
                print(f"trial {trial + 1} {fault} {mode}: "
                      f"{f'{total:.2f} s' if total is not None else result.get('error', 'no restart')}{standby_note}",
                      flush=True)
    return trials


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcnet.bench recovery``: the trials, the start-up pieces, the table."""
    parser = _parser()
    args = parser.parse_args(argv)
    modes = _checked(parser, args)
    if args.cluster:
        return main_cluster(args)
    if args.live:
        return main_live(args)
    out_dir = Path(args.dir) if args.dir else Path(f"/tmp/hpcnet-recovery-{os.getpid()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    job = job_options(args)
    hang_ok = not args.no_hang and importlib.util.find_spec("hpcnet.fault.monitor") is not None
    faults = ["kill"] + (["hang"] if hang_ok else [])
    load_start = load_average()
    trials = _trials(out_dir, job, args, faults, modes)
    startup = None if args.no_startup else measure_startup(args)
    print(f"\nrecovery benchmark: {args.np} ranks, model mlp, {args.trials} trial(s) per fault and mode, "
          f"{os.cpu_count()} cores, load average {', '.join(f'{x:.2f}' for x in load_start)} at start, "
          f"{', '.join(f'{x:.2f}' for x in load_average())} at end; runs in {out_dir}\n")
    print(report(trials, startup))
    payload = {"np": args.np, "train_args": job, "load_average_start": load_start,
               "load_average_end": load_average(), "trials": trials, "startup": startup}
    if args.json:
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
