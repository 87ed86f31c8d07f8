"""torch.distributed process groups (NCCL on GPUs, gloo on CPUs): the gradients' all-reduce, and stage 3's gathers
as broadcasts or sends and receives."""

import datetime
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hpcnet.comm.transport.base import WANTS_NOTHING, CommFailure, Done, GroupGather, Handle, Transport


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


class TorchTransport(Transport):
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


class TorchGroupGather(GroupGather):
    """Gather rounds over the default torch.distributed group, in stream order: where every rank wants the same
    group (the common round), one broadcast a unit from its owner; else point-to-point sends and receives."""

    name = "torch.distributed"

    def send_and_receive(self, wants: Sequence[int]) -> "_Works":
        import torch.distributed as dist

        want = wants[self.rank]
        g = self.groups[want] if want != WANTS_NOTHING else None
        if g is not None and (np.asarray(wants) == want).all():
            return _Works([dist.broadcast(place, src=self.owner[k], async_op=True)
                           for k, place in zip(g.units, g.places)])
        ops = []
        for r, w in enumerate(wants):
            if w == WANTS_NOTHING or r == self.rank:
                continue
            ops += [dist.P2POp(dist.isend, self.tensors[k].detach(), r) for k in self.groups[w].units
                    if self.owner[k] == self.rank]
        if g is not None:
            ops += [dist.P2POp(dist.irecv, place, self.owner[k]) for k, place in zip(g.units, g.places)
                    if self.owner[k] != self.rank]
        return _Works(dist.batch_isend_irecv(ops) if ops else [])

    def close(self, collective: bool) -> None:
        """Nothing to free: the default group is the job's."""


class _Works:
    """A round's torch.distributed works in flight."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
