"""All-reduce over a torch.distributed process group: NCCL on GPUs, gloo on CPUs."""

import datetime
from typing import Any

import torch

from hpcnet.comm.transport.base import CommFailure, Done, Handle


class TorchHandle:
    """A torch.distributed work.

    ``stream_ordered`` (NCCL): ``wait`` makes the current CUDA stream wait
    for the work and returns at once, so what the caller enqueues next on
    that stream (dividing the bucket, copying it out) runs after the
    collective.  No CPU timeout: ``work.wait(timeout)`` on a NCCL work spins
    a CPU thread until the work is done; the timeout is the group's own
    (``dist.timeout_s``, given when the group is created), enforced by NCCL's
    watchdog, which aborts the communicator.
    """

    def __init__(self, work: Any, *, stream_ordered: bool = False, keep: tuple[Any, ...] = ()) -> None:
        self.work = work
        self.stream_ordered = stream_ordered
        self.keep = keep  # buffers the enqueued collectives still use

    def wait(self, timeout_s: float) -> None:
        if self.stream_ordered:
            try:
                self.work.wait()
            except RuntimeError as exc:  # the watchdog already saw it fail or time out
                raise CommFailure(f"all-reduce failed: {exc}") from exc
            return
        try:
            ok = self.work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo/NCCL errors and timeouts
            raise CommFailure(f"all-reduce failed: {exc}") from exc
        if ok is False:
            raise CommFailure(f"all-reduce did not finish within {timeout_s:.0f} s")


class TorchTransport:
    """All-reduce over a torch.distributed process group (NCCL on GPU, gloo on CPU)."""

    def __init__(self, group: Any, backend: str, size: int) -> None:
        self.group = group
        self.name = backend
        self.size = size
        self.synchronous = size == 1
        self.blocking_start = False  # gloo's threads, NCCL's stream

    def start(self, flat: torch.Tensor, key: Any = None) -> Handle:
        import torch.distributed as dist

        if self.size == 1:
            return Done()
        return TorchHandle(dist.all_reduce(flat, group=self.group, async_op=True),
                            stream_ordered=self.name == "nccl")

    def close(self) -> None:
        self.group = None
