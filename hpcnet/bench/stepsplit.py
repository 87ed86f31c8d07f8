"""The instrumented block of ``bench train``: a training step's time split into compute, exposed communication
and optimizer, and how much of hpcnet's communication hides behind backward (benchmarks/README.md).
"""

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU), so a clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_block(contender: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], first: int, steps: int,
                  comm: Any, device: torch.device) -> dict[str, Any]:
    """Median per-step split in ms: forward+backward, exposed communication, optimizer (collective).

    ``contender`` is a ``hpcnet.bench.train_contenders.Contender``.

    For hpcnet, ``Reducer.finish`` (the exposed wait) and, on the MPI
    transport, the worker's all-reduce call (when each bucket is on the wire)
    are wrapped for the duration of this block only, to measure how much
    communication hides behind backward.  For DDP, the exposed wait is part
    of backward; compare with ``local``.
    """
    reducer = contender.dp.reducer if contender.dp is not None else None
    rows: dict[str, list[float]] = {}
    with _instrumented(reducer) as (marks, spans):
        comm.Barrier()
        for i in range(first, first + steps):
            spans.clear()
            sync_device(device)
            t0 = time.perf_counter()
            loss = contender.forward_backward(*batches[i % len(batches)])
            sync_device(device)
            t1 = time.perf_counter()
            contender.update()
            loss.item()
            sync_device(device)
            t2 = time.perf_counter()
            step = {"step": t2 - t0, "optimizer": t2 - t1}
            step.update(_comm_split(t0, marks, spans) if reducer is not None else {"forward_backward": t1 - t0})
            for key, seconds in step.items():
                rows.setdefault(key, []).append(seconds * 1e3)
    out: dict[str, Any] = {f"{k}_ms": statistics.median(v) for k, v in rows.items()}
    if reducer is not None:
        out["buckets_mib"] = [round(b.nbytes / 2**20, 2) for b in reducer.buckets]
    return out


@contextlib.contextmanager
def _instrumented(reducer: Any) -> Iterator[tuple[dict[str, float], list[tuple[float, float]]]]:
    """Wrap ``reducer.finish`` (marks: finish_start/end) and an MPI worker's all-reduce (spans: start, end per
    bucket) while the block runs; no reducer (DDP, local): nothing is wrapped."""
    transport = reducer.transport if reducer is not None else None
    spans: list[tuple[float, float]] = []
    marks: dict[str, float] = {}
    if reducer is not None:
        finish = reducer.finish

        def timed_finish() -> None:
            marks["finish_start"] = time.perf_counter()
            finish()
            marks["finish_end"] = time.perf_counter()

        reducer.finish = timed_finish
    inner = getattr(transport, "_allreduce", None)
    if inner is not None:
        def timed_allreduce(flat: torch.Tensor) -> None:
            t0 = time.perf_counter()
            inner(flat)
            spans.append((t0, time.perf_counter()))

        transport._allreduce = timed_allreduce
    try:
        yield marks, spans
    finally:
        if reducer is not None:
            del reducer.finish  # the instance attribute: the class method shows through again
        if inner is not None:
            del transport._allreduce


def _comm_split(t0: float, marks: dict[str, float], spans: list[tuple[float, float]]) -> dict[str, float]:
    """One hpcnet step's seconds: compute, the exposed wait and, with wire spans, how much of them hid."""
    split = {"forward_backward": marks["finish_start"] - t0,
             "exposed_comm": marks["finish_end"] - marks["finish_start"]}
    if spans:
        end_of_backward = marks["finish_start"]
        split["comm_busy"] = sum(e - s for s, e in spans)
        # Wire time before backward ended ran behind compute (hidden).
        split["comm_hidden"] = sum(max(0.0, min(e, end_of_backward) - s) for s, e in spans)
        split["first_launch_after"] = min(s for s, _ in spans) - t0
        split["last_done_after_backward"] = max(e for _, e in spans) - end_of_backward
    return split
