"""A timeline of chosen steps on every rank, merged into one Chrome trace (``train.trace_steps = "START:END"``;
docs/outputs.md).

For the traced steps each rank keeps its steps, its phases (``hpcnet.observe.phases``), every collective of its flight
recorder (with bytes and bucket), the checkpoint timings of a save, and with ``train.trace_ops=true`` torch
profiler's operator events. After step END (or when the loop ends first) rank 0 gathers them and writes
``trace.json`` in the run directory: one process row per rank (threads: steps, phases, control collectives, one
row per gradient bucket, operators), which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Clocks: at start-up each rank's ``perf_counter`` is compared with rank 0's by ping-pong over MPI (8 rounds, the
one with the shortest round trip kept); every time stamp is moved to rank 0's clock, and the half round trip,
the bound on that estimate's error, is written to the trace's ``otherData``. On one node the clocks are the same
one (CLOCK_MONOTONIC), and the estimate says so to within microseconds.
"""

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcnet.observe.runlog import OptionalFile
from hpcnet.paths import TRACE_FILE

log = logging.getLogger(__name__)

ROUNDS = 8
_TID_STEPS, _TID_PHASES, _TID_CONTROL, _TID_OPS, _TID_BUCKETS = 0, 1, 2, 3, 10


def parse_steps(spec: str) -> tuple[int, int] | None:
    """``"START:END"`` (1-based, inclusive) -> (START, END); ``""`` -> None.

    Raises:
        ValueError: anything else, or END before START, or START below 1.
    """
    if not spec:
        return None
    parts = spec.split(":")
    try:
        start, end = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (None, None)
    except ValueError:
        start = end = None
    if start is None or end is None or start < 1 or end < start:
        raise ValueError(f"expected 'START:END' with 1 <= START <= END (steps, inclusive), got {spec!r}")
    return start, end


def clock_offsets(comm: Any) -> tuple[float, float]:
    """This rank's ``perf_counter`` minus rank 0's, and the bound on that estimate's error, in seconds (collective).

    Rank 0 plays ping-pong with each rank in turn: it sends, the rank answers with its clock, and the midpoint of
    rank 0's send and receive times is taken as the moment of the answer.
    """
    comm = comm.Dup()  # its own message space: no other message can match these tags
    try:
        return _ping_pong(comm)
    finally:
        comm.Free()


def _ping_pong(comm: Any) -> tuple[float, float]:
    rank, size = comm.Get_rank(), comm.Get_size()
    result = np.zeros(2)
    if rank == 0:
        table = np.zeros((size, 2))
        ping, pong = np.zeros(1), np.zeros(1)
        for peer in range(1, size):
            best = (float("inf"), 0.0)
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                comm.Send(ping, dest=peer, tag=71)
                comm.Recv(pong, source=peer, tag=72)
                t1 = time.perf_counter()
                if t1 - t0 < best[0]:
                    best = (t1 - t0, float(pong[0]) - (t0 + t1) / 2)
            table[peer] = (best[1], best[0] / 2)
        comm.Scatter(table, result, root=0)
    else:
        ping, pong = np.zeros(1), np.zeros(1)
        for _ in range(ROUNDS):
            comm.Recv(ping, source=0, tag=71)
            pong[0] = time.perf_counter()
            comm.Send(pong, dest=0, tag=72)
        comm.Scatter(None, result, root=0)
    return float(result[0]), float(result[1])


class StepTracer:
    """Collect the traced steps' events on this rank and merge every rank's into ``trace.json`` (collective).

    Args:
        comm: the ranks that train.
        steps: (START, END), 1-based and inclusive.
        clock: the loop's ``PhaseClock``.
        recorder: the flight recorder of the collectives.
        run_dir: where ``trace.json`` goes (rank 0).
        ops: also record torch profiler's operator events.
        device: where the model computes (CUDA kernels are profiled too).
    """

    def __init__(self, comm: Any, steps: tuple[int, int], clock: Any, recorder: Any, run_dir: Path, *,
                 ops: bool = False, device: Any = None) -> None:
        self.comm, self.clock, self.recorder, self.run_dir = comm, clock, recorder, run_dir
        self.start, self.end = steps
        self.rank = comm.Get_rank()
        self.offset_s, self.error_s = clock_offsets(comm)
        # The flight recorder stamps with time.monotonic(): the same clock on Linux, but do not rely on it.
        self.monotonic_minus_perf = time.monotonic() - time.perf_counter()
        self.ops, self.device = ops, device
        self.active = False
        self.done = False
        self._steps: list[tuple[int, float]] = []
        self._first_seq = 0
        self._events: list[dict[str, Any]] = []
        self._profiler: Any = None
        self._marker_pc = 0.0

    # -- during the loop -----------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run."""
        if self.done:
            return
        if step == self.start and not self.active:
            self.active = True
            self.clock.tracing = True
            self.clock.pieces.clear()
            self._first_seq = self.recorder.seq
            if self.ops:
                self._start_profiler()
        if self.active:
            begin = self.clock.step_start
            self._steps.append((step, begin if begin is not None else time.perf_counter()))

    def checkpoint(self, step: int, timings: dict[str, Any]) -> None:
        """A save's timings (``CheckpointManager.last_timings``), as an instant event."""
        if self.active:
            self._events.append({"name": f"checkpoint step {step}", "ph": "i", "s": "t", "pid": self.rank,
                                 "tid": _TID_PHASES, "ts": self._us(time.perf_counter()),
                                 "args": {k: v for k, v in timings.items() if isinstance(v, (int, float, str))}})

    def after_step(self, step: int) -> None:
        """Step ``step`` and its boundary are done: after END, merge (collective; every rank is at the same step)."""
        if self.active and step >= self.end:
            self.finish(step)

    def close(self, step: int) -> None:
        """The loop is over: merge what was traced if END was not reached (collective)."""
        if self.active:
            self.finish(step)

    # -- events ----------------------------------------------------------------------------
    def _us(self, perf_s: float) -> float:
        return round((perf_s - self.offset_s) * 1e6, 3)

    def _local_events(self, last_step: int) -> list[dict[str, Any]]:
        now = time.perf_counter()
        events = list(self._events)
        bounds = self._steps + [(last_step + 1, now)]
        for (step, begin), (_, finish) in zip(bounds, bounds[1:]):
            events.append({"name": f"step {step}", "ph": "X", "pid": self.rank, "tid": _TID_STEPS,
                           "ts": self._us(begin), "dur": round((finish - begin) * 1e6, 3), "cat": "step"})
        for phase, begin, seconds in self.clock.pieces:
            if seconds > 0:
                events.append({"name": phase, "ph": "X", "pid": self.rank, "tid": _TID_PHASES, "ts": self._us(begin),
                               "dur": round(seconds * 1e6, 3), "cat": "phase"})
        for entry in self.recorder.entries():
            if entry.seq <= self._first_seq or entry.end is None:
                continue
            bucket = entry.op == "allreduce.bucket"
            events.append({"name": f"{entry.op} {entry.bucket}" if bucket else entry.op, "ph": "X", "pid": self.rank,
                           "tid": _TID_BUCKETS + entry.bucket if bucket else _TID_CONTROL,
                           "ts": self._us(entry.start - self.monotonic_minus_perf),
                           "dur": round((entry.end - entry.start) * 1e6, 3), "cat": "collective",
                           "args": {"bytes": entry.nbytes, "bucket": entry.bucket, "step": entry.step + 1,
                                    "seq": entry.seq}})
        return events

    def _start_profiler(self) -> None:
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device is not None and getattr(self.device, "type", "") == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()
        # A marker whose perf_counter we know: the profiler's clock is its own.
        with torch.profiler.record_function("hpcnet.observe.trace.marker"):
            self._marker_pc = time.perf_counter()

    def _profiler_events(self) -> list[dict[str, Any]]:
        if self._profiler is None:
            return []
        self._profiler.stop()
        fd, name = tempfile.mkstemp(suffix=".json", prefix=f"hpcnet-trace-{self.rank}-")
        os.close(fd)
        try:
            self._profiler.export_chrome_trace(name)
            raw = json.loads(Path(name).read_text()).get("traceEvents", [])
        finally:
            Path(name).unlink(missing_ok=True)
            self._profiler = None
        marker = next((e for e in raw if e.get("name") == "hpcnet.observe.trace.marker"), None)
        if marker is None:
            log.warning("train.trace_ops: the profiler's trace has no marker; operator events left out")
            return []
        shift = self._us(self._marker_pc) - float(marker["ts"])
        events = []
        for e in raw:
            if e.get("ph") != "X" or "ts" not in e or e.get("name") == "hpcnet.observe.trace.marker":
                continue
            gpu = "cuda" in str(e.get("cat", "")).lower() or e.get("cat") == "kernel"
            events.append({"name": e.get("name", "?"), "ph": "X", "pid": self.rank, "tid": _TID_OPS + (1 if gpu else 0),
                           "ts": round(float(e["ts"]) + shift, 3), "dur": e.get("dur", 0),
                           "cat": "gpu" if gpu else "op"})
        return events

    # -- merging -----------------------------------------------------------------------------
    def finish(self, last_step: int) -> None:
        """Gather every rank's events and write ``trace.json`` on rank 0 (collective; best effort, the write: a
        failure is a warning on rank 0, which trains on with the others)."""
        self.active, self.done = False, True
        self.clock.tracing = False
        events = self._local_events(last_step) + self._profiler_events()
        self.clock.pieces.clear()
        host = os.uname().nodename
        every = self.comm.gather((host, self.offset_s, self.error_s, events), root=0)
        if every is None:
            return
        merged: list[dict[str, Any]] = []
        for rank, (node, _, _, rank_events) in enumerate(every):
            merged.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({node})"}})
            merged.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
            threads = {_TID_STEPS: "steps", _TID_PHASES: "phases", _TID_CONTROL: "control collectives",
                       _TID_OPS: "operators", _TID_OPS + 1: "GPU"}
            threads.update({e["tid"]: f"bucket {e['tid'] - _TID_BUCKETS}" for e in rank_events
                            if e.get("tid", 0) >= _TID_BUCKETS})
            merged.extend({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
                          for tid, name in threads.items())
            merged.extend(rank_events)
        payload = {"traceEvents": merged, "displayTimeUnit": "ms",
                   "otherData": {"steps": f"{self.start}:{min(self.end, last_step)}",
                                 "clock_offset_us": [round(o * 1e6, 3) for _, o, _, _ in every],
                                 "clock_error_us": [round(e * 1e6, 3) for _, _, e, _ in every],
                                 "clock": "perf_counter of rank 0, in microseconds"}}
        path = self.run_dir / TRACE_FILE
        if not OptionalFile(path).write_text(json.dumps(payload)):  # warned; the run goes on without it
            return
        log.info("trace of steps %d-%d written to %s (%d events from %d ranks; clocks aligned to within %.0f us)",
                 self.start, min(self.end, last_step), path, len(merged), len(every),
                 1e6 * max(e for _, _, e, _ in every))
