"""Recovery time: kill -9 one rank mid-run (and SIGSTOP one) under hpcnet.launch; how long until training resumes.

Run (not under mpirun: it starts the supervisor, which starts mpirun)::

    python -m hpcnet.bench recovery [--np 2] [--steps 40] [--every-steps 10] [--kill-at 25] [--json out.json]

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

``--startup`` (default on) also times the pieces of a process start on their
own (mpirun, python, import torch, MPI init, torch._dynamo, which the first
optimizer constructor imports), to show what the restart phase is made of.
"""

import argparse
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcnet.bench.common import load_average, step_times, summarize, table, write_json
from hpcnet.paths import FAILURE_FILE, LAUNCH_FILE, attempt_dir, metrics_file, rank_log

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank (\d+) (\w+) ([\w.]+): (.*)$")


def log_events(path: Path) -> list[tuple[float, str]]:
    """(unix time, message) of every record in a rank log (local-time stamps with milliseconds)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        match = _LOG_TIME.match(line)
        if match:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            events.append((stamp, match.group(5)))
    return events


def first_event(events: list[tuple[float, str]], pattern: str) -> tuple[float, re.Match] | None:
    """The first event whose message matches ``pattern``."""
    regex = re.compile(pattern)
    for stamp, message in events:
        match = regex.search(message)
        if match:
            return stamp, match
    return None


def _supervise(out_dir: Path, name: str, train_args: list[str], args: argparse.Namespace,
               timeout_s: float, standby: str = "off") -> tuple[int, float, Path]:
    command = [sys.executable, "-m", "hpcnet.launch", "--max-restarts", "1", "--backoff-s", str(args.backoff_s),
               "--standby", standby, "--", "mpirun", "-np", str(args.np), sys.executable, "-m", "mpi4py",
               "-m", "hpcnet.train",
               f"run.dir={out_dir}", f"run.name={name}", *train_args]
    t0 = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - t0
    launch_dirs = sorted(out_dir.glob(f"{name}-*/{LAUNCH_FILE}"))
    if not launch_dirs:
        raise RuntimeError(f"{name}: no launch.json (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode, wall, launch_dirs[-1].parent


def _restart_phases(launch_dir: Path, record: dict[str, Any], fault_step: int, fault_time: float,
                    detected: float | None) -> dict[str, Any]:
    """The phases from the fault to the first step after the restart, and the recomputation."""
    first, second = record["attempts"][0], record["attempts"][1]
    events = log_events(attempt_dir(launch_dir, 2) / rank_log(0))
    setup = events[0][0] if events else None
    probe = first_event(events, r"^topology: ")
    plane = first_event(events, r"^torch\.distributed ")
    model = first_event(events, r"^model ")
    resumed = first_event(events, r"^resumed from .* at step (\d+)")
    if model is None or resumed is None or setup is None:
        raise RuntimeError(f"attempt 2 in {launch_dir} did not resume (see its rank0.log)")
    resume_step = int(resumed[1].group(1))
    steps = step_times(attempt_dir(launch_dir, 2) / metrics_file(0))
    t_first = steps[resume_step + 1]
    t_caught = steps.get(fault_step)
    before = step_times(attempt_dir(launch_dir, 1) / metrics_file(0))
    gaps = [before[s] - before[s - 1] for s in range(2, fault_step) if s in before and s - 1 in before]
    phases = {
        "detection_s": (detected or first["end_unix"]) - fault_time,
        "teardown_s": first["end_unix"] - (detected or first["end_unix"]),
        "backoff_s": second["start_unix"] - first["end_unix"],
        "restart_s": model[0] - second["start_unix"],
        "restart_split": {
            "process_start_to_first_log_s": setup - second["start_unix"],
            "topology_probe_s": (probe[0] - setup) if probe else 0.0,
            "torch_distributed_s": plane[0] - (probe[0] if probe else setup) if plane else 0.0,
            "dataset_model_optimizer_s": model[0] - (plane[0] if plane else probe[0] if probe else setup),
        },
        "load_s": resumed[0] - model[0],
        "first_step_s": t_first - resumed[0],
        "total_to_first_step_s": t_first - fault_time,
        "recompute_s": (t_caught - resumed[0]) if t_caught else None,
        "total_to_caught_up_s": (t_caught - fault_time) if t_caught else None,
        "resumed_at_step": resume_step,
        "fault_step": fault_step,
        "steps_recomputed": fault_step - resume_step,
        "step_time_before_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
    }
    return phases


def _standby_used(record: dict[str, Any]) -> dict[str, Any]:
    second = record["attempts"][1] if len(record["attempts"]) > 1 else {}
    return {"standby_used": bool(second.get("standby")), "standby_note": second.get("standby_note", "")}


def _faulted_run(out_dir: Path, name: str, train_args: list[str], args: argparse.Namespace, standby: str,
                 fault: str, event: str) -> tuple[int, float, Path, dict[str, Any], tuple[float, re.Match] | None]:
    """A run under the supervisor whose last rank has ``fault`` (``fault.kill_at_step``, ...) at ``--kill-at`` in
    the first attempt only: its status, wall time, launch directory and launch.json, and the victim's first log
    ``event``."""
    status, wall, launch_dir = _supervise(out_dir, name, [*train_args, f"{fault}={args.kill_at}",
                                                         "fault.only_attempt=1"], args, timeout_s=600, standby=standby)
    record = json.loads((launch_dir / LAUNCH_FILE).read_text())
    victim = args.np - 1
    return status, wall, launch_dir, record, first_event(
        log_events(attempt_dir(launch_dir, 1) / rank_log(victim)), event)


def measure_kill(out_dir: Path, train_args: list[str], args: argparse.Namespace, *, name: str = "kill",
                 standby: str = "off") -> dict[str, Any]:
    status, wall, launch_dir, record, killed = _faulted_run(out_dir, name, train_args, args, standby,
                                                            "fault.kill_at_step", r"kills itself \(SIGKILL\)")
    if status != 0 or killed is None or len(record["attempts"]) != 2:
        raise RuntimeError(f"kill run: status {status}, {len(record['attempts'])} attempt(s) in {launch_dir}")
    phases = _restart_phases(launch_dir, record, args.kill_at, killed[0], record["attempts"][0]["launcher_report_unix"])
    return {"status": status, "wall_s": wall, "launch_dir": str(launch_dir),
            "first_attempt_status": record["attempts"][0]["status"], "cause": record["attempts"][0]["cause"],
            **_standby_used(record), **phases}


def measure_hang(out_dir: Path, train_args: list[str], args: argparse.Namespace, *, name: str = "hang",
                 standby: str = "off") -> dict[str, Any]:
    status, wall, launch_dir, record, stopped = _faulted_run(out_dir, name, train_args, args, standby,
                                                             "fault.hang_at_step", r"stops itself \(SIGSTOP\)")
    failure_path = attempt_dir(launch_dir, 1) / FAILURE_FILE
    failure = json.loads(failure_path.read_text()) if failure_path.exists() else {}
    detected = failure.get("detected_wall") or (failure_path.stat().st_mtime if failure_path.exists() else None)
    out: dict[str, Any] = {"status": status, "wall_s": wall, "launch_dir": str(launch_dir),
                           "first_attempt_status": record["attempts"][0]["status"],
                           "cause": record["attempts"][0]["cause"], "failure_kind": failure.get("kind"),
                           **_standby_used(record)}
    if stopped is None or detected is None:
        out["error"] = "no SIGSTOP record or no failure.json: the hang was not detected"
        return out
    out["hang_detection_s"] = detected - stopped[0]
    if status == 0 and len(record["attempts"]) == 2:
        out.update(_restart_phases(launch_dir, record, args.kill_at, stopped[0], detected))
    return out


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
    parser.add_argument("--np", type=int, default=None, help="ranks (default 2; --cluster: 4)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 40; --cluster 80)")
    parser.add_argument("--every-steps", type=int, default=10, help="checkpoint.every_steps (default 10)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="step after which the rank is killed/stopped (--cluster: the host cut off; default 25, "
                             "--cluster 13)")
    parser.add_argument("--backoff-s", type=float, default=0.0, help="hpcnet.launch --backoff-s (default 0)")
    parser.add_argument("--trials", type=int, default=None, help="trials of each fault and mode (default 5; "
                                                                 "--cluster 2)")
    parser.add_argument("--modes", default="cold,warm",
                        help="cold (hpcnet.launch --standby off), warm (--standby on), or both (default cold,warm)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="the first attempt sleeps this long at step 2, so its standby has parked before the "
                             "fault (default 10; a real failure comes long after the start); --cluster: the wait "
                             "between the shrunk attempt's first step and the heal (default 3)")
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


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Fill in the defaults that depend on ``--cluster``; the modes of ``--modes``.  ``parser.error`` (status 2)
    on a bad option."""
    defaults = (("np", 2, 4), ("steps", 40, 80), ("kill_at", 25, 13), ("trials", 5, 2), ("settle_s", 10.0, 3.0))
    for name, default, cluster in defaults:
        if getattr(args, name) is None:
            setattr(args, name, cluster if args.cluster else default)
    if not 2 < args.every_steps < args.kill_at < args.steps:
        parser.error("need 2 < --every-steps < --kill-at < --steps")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"cold", "warm"} or args.trials < 1:
        parser.error("--modes takes cold, warm or both; --trials must be at least 1")
    return modes


def _train_args(args: argparse.Namespace) -> list[str]:
    """The hpcnet.train options of every run."""
    return [f"data.dir={Path(args.data_dir).absolute()}", "model.name=mlp", "train.batch_size=16",
            f"train.steps={args.steps}", "train.eval_every=0", "run.log_every=1",
            f"checkpoint.every_steps={args.every_steps}",
            "checkpoint.move_aside=true",  # a rerun with the same --dir: set the last run's checkpoints aside
            *(["fault.sleep_at_step=2", f"fault.sleep_s={args.settle_s}"] if args.settle_s > 0 else []),
            *args.train_args]


def _trials(out_dir: Path, train_args: list[str], args: argparse.Namespace, faults: list[str],
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
                    result = measure(out_dir, train_args, args, name=name, standby="on" if mode == "warm" else "off")
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
        from hpcnet.bench.recovery_cluster import main_cluster

        return main_cluster(args)
    out_dir = Path(args.dir) if args.dir else Path(f"/tmp/hpcnet-recovery-{os.getpid()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    train_args = _train_args(args)
    hang_ok = not args.no_hang and importlib.util.find_spec("hpcnet.fault.monitor") is not None
    faults = ["kill"] + (["hang"] if hang_ok else [])
    load_start = load_average()
    trials = _trials(out_dir, train_args, args, faults, modes)
    startup = None if args.no_startup else measure_startup(args)
    print(f"\nrecovery benchmark: {args.np} ranks, model mlp, {args.trials} trial(s) per fault and mode, "
          f"{os.cpu_count()} cores, load average {', '.join(f'{x:.2f}' for x in load_start)} at start, "
          f"{', '.join(f'{x:.2f}' for x in load_average())} at end; runs in {out_dir}\n")
    print(report(trials, startup))
    payload = {"np": args.np, "train_args": train_args, "load_average_start": load_start,
               "load_average_end": load_average(), "trials": trials, "startup": startup}
    if args.json:
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
