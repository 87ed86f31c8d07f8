"""bench recovery's faulted runs under the supervisor: a rank killed (-9) or stopped (SIGSTOP) after a step in the
first attempt of ``python -m hpcnet.launch -- mpirun ... hpcnet.train``, and the phases of its restart, read from
the time stamps the processes write anyway (the ranks' logs, their metrics, the supervisor's launch.json).

The bench's job (``job_options``) is the mlp on the synthetic images, a checkpoint every ``--every-steps``; the steps
since the newest checkpoint are computed again after the restart.
"""

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcnet.bench.common import step_times
from hpcnet.paths import FAILURE_FILE, LAUNCH_FILE, attempt_dir, metrics_file, rank_log

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank (\d+) (\w+) ([\w.]+): (.*)$")
KILLED = r"kills itself \(SIGKILL\)"
"""The victim's log line as it kills itself (``fault.kill_at_step``)."""


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
               timeout_s: float, standby: str = "off", launcher: tuple[str, ...] = ("mpirun",)
               ) -> tuple[int, float, Path]:
    command = [sys.executable, "-m", "hpcnet.launch", "--max-restarts", "1", "--backoff-s", str(args.backoff_s),
               "--standby", standby, "--", *launcher, "-np", str(args.np), sys.executable, "-m", "mpi4py",
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
        "fault_unix": fault_time,
        "steps_recomputed": fault_step - resume_step,
        "step_time_before_s": step_gap_s(step_times(attempt_dir(launch_dir, 1) / metrics_file(0)), fault_step),
    }
    return phases


def _standby_used(record: dict[str, Any]) -> dict[str, Any]:
    second = record["attempts"][1] if len(record["attempts"]) > 1 else {}
    return {"standby_used": bool(second.get("standby")), "standby_note": second.get("standby_note", "")}


def _faulted_run(out_dir: Path, name: str, train_args: list[str], args: argparse.Namespace, standby: str,
                 fault: str, event: str, launcher: tuple[str, ...] = ("mpirun",)
                 ) -> tuple[int, float, Path, dict[str, Any], tuple[float, re.Match] | None]:
    """A run under the supervisor whose last rank has ``fault`` (``fault.kill_at_step``, ...) at ``--kill-at`` in
    the first attempt only: its status, wall time, launch directory and launch.json, and the victim's first log
    ``event``. ``launcher``: the mpirun command before ``-np`` (the local cluster's options, say)."""
    status, wall, launch_dir = _supervise(out_dir, name, [*train_args, f"{fault}={args.kill_at}",
                                                         "fault.only_attempt=1"], args, timeout_s=600, standby=standby,
                                          launcher=launcher)
    record = json.loads((launch_dir / LAUNCH_FILE).read_text())
    victim = args.np - 1
    return status, wall, launch_dir, record, first_event(
        log_events(attempt_dir(launch_dir, 1) / rank_log(victim)), event)


def measure_kill(out_dir: Path, train_args: list[str], args: argparse.Namespace, *, name: str = "kill",
                 standby: str = "off", launcher: tuple[str, ...] = ("mpirun",)) -> dict[str, Any]:
    """The last rank killed (-9) after ``--kill-at`` under the supervisor: the phases to the first step after the
    restart. RuntimeError when the run did not restart once and end with 0."""
    status, wall, launch_dir, record, killed = _faulted_run(out_dir, name, train_args, args, standby,
                                                            "fault.kill_at_step", KILLED, launcher)
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


def step_gap_s(times: dict[int, float], before_step: int) -> float | None:
    """The median time between two consecutive steps logged before ``before_step`` (``step_times``), from step 2 on
    (the first step's gap holds the start-up); None without two such steps."""
    gaps = [times[s] - times[s - 1] for s in range(2, before_step) if s in times and s - 1 in times]
    return statistics.median(gaps) if gaps else None


def job_options(args: argparse.Namespace, settle: bool = True) -> list[str]:
    """The hpcnet.train options of every run; ``settle``: with the sleep at step 2 (``--settle-s``) that lets a
    standby park before the fault."""
    return [f"data.dir={Path(args.data_dir).absolute()}", "model.name=mlp", "train.batch_size=16",
            f"train.steps={args.steps}", "train.eval_every=0", "run.log_every=1",
            f"checkpoint.every_steps={args.every_steps}",
            "checkpoint.move_aside=true",  # a rerun with the same --dir: set the last run's checkpoints aside
            *(["fault.sleep_at_step=2", f"fault.sleep_s={args.settle_s}"] if settle and args.settle_s > 0 else []),
            *args.train_args]


