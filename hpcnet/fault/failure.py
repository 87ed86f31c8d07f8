"""What a rank that detected a failure writes: the report (``failure.json``), its stacks dump, the stacks signal.

The reports are pure functions of what the monitor saw; docs/fault-tolerance.md
lists their fields.  A hung rank's own stacks: each rank registers
``faulthandler`` for ``DUMP_SIGNAL`` (SIGRTMIN+4), which prints every thread's
stack to stderr from a C signal handler, so it works even when a thread holds
the GIL in C code (the case where the monitor thread itself cannot run).  The
handler stays registered until the process exits: unregistered, the signal's
default action would kill the process.  SIGUSR1 is left to NCCL and SIGUSR2 to
preemption notices (``hpcnet.launch.stop.StopRequest``); real-time signals are used by
neither nor by Open MPI.  A SIGSTOPped rank cannot run any handler: its stack
is not available, the report says where it was from its last beat.
"""

import contextlib
import faulthandler
import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpcnet.errors import ExitCode
from hpcnet.fault.flightrec import FlightRecorder, analyze_stall, describe_op, format_entries
from hpcnet.fault.watchdog import STARTUP_PHASES, Deadlines, Guard, analyze_io, analyze_phase
from hpcnet.paths import FAILURE_FILE, FAILURE_LOCK

DUMP_SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGXCPU) + (4 if hasattr(signal, "SIGRTMIN") else 0)
"""The signal that makes a rank print every thread's stack to stderr."""


def where(beat: dict[str, Any] | None, last_step: int | None = None) -> str:
    """Where a rank was, from its last beat: ``last seen at step 12, in allreduce.bucket[2] (#842) for 0.3 s``.

    ``last_step`` is a better lower bound of its steps when one is known (see ``heartbeat_report``).
    """
    if beat is None:
        return "never heard from (it failed before its first beat)"
    if beat["open_seq"] > 0:
        doing = (f"in {describe_op(beat['open_op'], beat['open_bucket'], beat['open_seq'])} "
                 f"for {beat['open_s']:.1f} s")
    else:
        doing = f"not in a collective (last: {describe_op(beat['op'], beat['bucket'], beat['seq'])})"
    if beat["guard"] != "none":
        doing += f", in {beat['guard']} for {beat['guard_s']:.1f} s"
    if last_step is not None and last_step > beat["step"]:
        return f"it completed step {last_step} (its last beat, at step {beat['step']}: {doing})"
    return f"last seen at step {beat['step']}, {doing}"


def heartbeat_report(silent: dict[int, tuple[float, dict[str, Any] | None]], hostnames: tuple[str, ...], *,
                     detector: int, interval_s: float, misses: int, detector_step: int = 0) -> dict[str, Any]:
    """The report of ranks that stopped beating (pure).

    Args:
        silent: per failed rank, (seconds since it was last heard, its last beat or None).
        hostnames: host of every rank.
        detector: the rank that noticed.
        detector_step: steps the detector completed.  A step needs every
            rank, so a silent rank completed at least one step fewer; its
            last beat, up to an interval old, may say less.
    """
    failed = []
    lines = []
    for rank, (silent_s, beat) in sorted(silent.items()):
        last_step = max(beat["step"] if beat else 0, detector_step - 1) if beat or detector_step > 1 else None
        failed.append({
            "rank": rank, "host": hostnames[rank], "silent_s": round(silent_s, 2),
            "last_step": last_step, "last_beat_step": beat["step"] if beat else None,
            "collective": (describe_op(beat["open_op"], beat["open_bucket"], beat["open_seq"]) if beat and
                           beat["open_seq"] > 0 else None),
            "last_collective": describe_op(beat["op"], beat["bucket"], beat["seq"]) if beat and beat["seq"] else None,
            "pid": beat["pid"] if beat else None,
            "guard": beat["guard"] if beat and beat["guard"] != "none" else None,
        })
        lines.append(f"rank {rank} on {hostnames[rank]} missed {misses} heartbeats (silent for {silent_s:.1f} s; "
                     f"interval {interval_s:g} s): {where(beat, last_step)}")
    message = ("; ".join(lines) + f". Declared failed by rank {detector} on {hostnames[detector]}; "
               f"ending the job with status {int(ExitCode.RESTARTABLE)} (restartable).")
    # Silent past a checkpoint deadline it announced: its checkpoint I/O, not the rank, is what hung.
    in_io = all(beat is not None and beat["guard_left_s"] > 0 for _, beat in silent.values())
    return {"kind": "checkpoint" if in_io else "heartbeat", "failed": failed, "message": message}


def stall_report(kind: str, detail: str, states: dict[int, dict[str, Any] | None], hostnames: tuple[str, ...], *,
                 detector: int, mismatched: tuple[int, ...] = (), phase: str = "") -> dict[str, Any]:
    """The report of a stall or desync from every rank's answer (pure).

    ``mismatched``: ranks already known to disagree (the pair a desync was seen between); ``phase``: the expired
    guard's name, for a start-up phase (``watchdog.STARTUP_PHASES``).
    """
    if kind == "startup" and phase in STARTUP_PHASES:
        analysis = analyze_phase(states, phase, hostnames)
    elif kind == "checkpoint":
        analysis = analyze_io(states)
    else:
        analysis = analyze_stall(states, mismatched)
    if kind == "startup" and phase not in STARTUP_PHASES and not (
            analysis["behind"] or analysis["mismatched"] or analysis["silent"]):
        analysis["lines"][-1] = ("no rank is behind in the recorded collectives: the ranks wait for each other "
                                 "elsewhere (see the stacks)")
    suspects = analysis["mismatched"] or analysis["behind"] or analysis["silent"]
    if phase in STARTUP_PHASES:
        suspects = sorted(analysis["behind"] + analysis["silent"])  # the ranks that never arrived
    failed = [{"rank": r, "host": hostnames[r],
               "last_step": states[r]["step"] if states[r] else None,
               "why": ("mismatched" if r in analysis["mismatched"] else "behind" if r in analysis["behind"]
                       else "silent")} for r in suspects]
    what = {"checkpoint": "checkpoint I/O past its deadline", "startup": "start-up past its deadline"}.get(kind, kind)
    if kind == "startup" and phase in STARTUP_PHASES:
        what = f"start-up phase {phase} past its deadline"
    message = (f"{what} detected by rank {detector} on {hostnames[detector]}: {detail}\n  "
               + "\n  ".join(analysis["lines"])
               + f"\n  stacks and flight recorders: stall.rank<r>.txt in the run directory; "
                 f"ending the job with status {int(ExitCode.RESTARTABLE)} (restartable).")
    ranks = [{"rank": r, "host": hostnames[r], **(s or {"answered": False})} for r, s in sorted(states.items())]
    report = {"kind": kind, "detail": detail, "failed": failed, "ranks": ranks, "message": message}
    if phase:
        report["phase"] = phase
    return report


def merge_reports(earlier: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """What ``failure.json`` says when a second rank reports after a first (pure).

    The first report stands; a second one of the same kind adds the ranks it
    names (two watchers of two adjacent failed ranks each see a different
    part), one of another kind is dropped: it describes the aftermath (a
    stopped rank continued by ``mpirun`` for its teardown, say).
    """
    if earlier.get("kind") != report["kind"]:
        return earlier
    named = {f["rank"] for f in earlier["failed"]}
    failed = earlier["failed"] + [f for f in report["failed"] if f["rank"] not in named]
    also = sorted(set(earlier.get("also_detected_by", [])) | {report["detected_by"]})
    return {**earlier, "failed": sorted(failed, key=lambda f: f["rank"]), "also_detected_by": also}


def write_failure(run_dir: Path, report: dict[str, Any]) -> Path:
    """Write (or, when another rank was first, merge into) ``failure.json``, atomically, under ``FAILURE_LOCK``
    (ranks on several hosts lock it too where the shared file system supports ``flock``, as NFSv4 and Lustre do)."""
    path = run_dir / FAILURE_FILE
    with open(run_dir / FAILURE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError, KeyError):
            report = merge_reports(json.loads(path.read_text()), report)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)
    return path


def native_report(guard: Guard, *, rank: int, host: str, step: int, grace_s: float) -> tuple[str, dict[str, Any]]:
    """The line and the report the native watchdog leaves when ``guard`` outlived its deadline by ``grace_s`` (pure)."""
    message = (f"hpcnet: rank {rank} on {host}: {guard.what} did not finish within "
               f"{guard.timeout_s:.0f} s ({guard.option}) and no Python code could run on this rank to "
               f"report it (a thread holds the GIL in a C call that does not return: HDF5 or MPI-IO waiting "
               f"for the file system, or for a rank that does); its stacks follow. Ending the job with "
               f"status {int(ExitCode.RESTARTABLE)} (restartable).")
    report = {"kind": guard.kind, "detail": f"{guard.what} did not finish within {guard.timeout_s:.0f} s "
                                            f"({guard.option}); the native watchdog ended the job",
              "failed": [{"rank": rank, "host": host, "last_step": step, "why": "blocked"}],
              "message": message, "exit_code": int(ExitCode.RESTARTABLE), "detected_by": rank,
              "detected_host": host, "native": True,
              "detected_wall": time.time() + guard.deadline + grace_s - time.monotonic()}
    return message, report


def write_dump(path: Path, header: str, recorder: FlightRecorder, deadlines: Deadlines | Any) -> None:
    """Write a rank's flight recorder, guarded waits, threads and Python stacks to ``path``."""
    with open(path, "w") as f:
        f.write(f"{header}\n\n== flight recorder (oldest first; started = seconds before this dump) ==\n")
        now = time.monotonic()
        f.write(format_entries(recorder.entries()[-64:], now) + "\n\n")
        f.write("== guarded waits (hpcnet.fault.watchdog), oldest first ==\n" + "".join(
            f"{g.what}: {g.elapsed_s(now):.1f} s of {g.deadline - g.started:.0f} s ({g.option})\n"
            for g in sorted(deadlines.guards(), key=lambda g: g.started)) + "\n")
        names = {t.ident: t.name for t in threading.enumerate()}
        f.write("== threads ==\n" + "".join(f"0x{i:x} {n}\n" for i, n in names.items()) + "\n")
        f.write("== Python stacks (faulthandler) ==\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)


def register_dump_signal() -> None:
    """Print every thread's stack to stderr on ``DUMP_SIGNAL`` (when stderr is a real file)."""
    stream = sys.__stderr__
    try:
        if stream is None:
            return
        stream.fileno()
    except (OSError, ValueError):
        return
    faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
