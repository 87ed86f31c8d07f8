"""Bucketed gradient all-reduce, overlapped with the backward pass.

Parameters are packed, in reverse registration order (the last layers'
gradients are ready first), into flat buckets of about ``bucket_bytes`` (a
smaller first bucket starts communication early, as in DDP).  Each
parameter's ``.grad`` is a view into its bucket, so autograd accumulates
straight into the buffer that goes on the wire: no copies on the hot path.
A post-accumulate-grad hook counts the gradients each bucket still waits
for; when a bucket is complete it is handed to the transport at once, in
bucket order on every rank, while autograd goes on with earlier layers.

``finish()`` (before the optimizer step) agrees over the MPI control plane
that every rank launched the same buckets, waits for them, divides by the
world size, and agrees on the outcome: a failure on any rank raises
``CommFailure`` on every rank, so the trainer can switch transport and redo
the step.
"""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.comm.transport import CommFailure, FaultyTransport, Transport, wait_all
from hpcnet.agree import agreed

log = logging.getLogger(__name__)


def plan_buckets(sizes_bytes: list[int], bucket_bytes: int, first_bucket_bytes: int = 0) -> list[list[int]]:
    """Group tensor indices into buckets (pure logic).

    Tensors are taken in reverse order.  The first bucket holds at most
    ``first_bucket_bytes`` (when > 0), the others at most ``bucket_bytes``; a
    tensor larger than the cap gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be greater than 0")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(sizes_bytes))):
        size = sizes_bytes[index]
        cap = first_bucket_bytes if (not buckets and first_bucket_bytes > 0) else bucket_bytes
        if current and filled + size > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor
    offsets: list[int]
    pending: int = 0
    ready: list[bool] = field(default_factory=list)
    launched: bool = False
    handle: Any = None
    wire: torch.Tensor | None = None
    token: int = 0  # its entry in the flight recorder while it runs


@dataclass
class ReducerStats:
    """Counters shown in the run summary."""

    steps: int = 0
    bytes_reduced: int = 0
    fallbacks: list[dict[str, Any]] = field(default_factory=list)


class Reducer:
    """Average gradients across ranks, bucket by bucket, during backward.

    Args:
        named_params: the model's ``named_parameters()``.
        transport: how a bucket is summed across ranks.
        control: the MPI communicator of the same ranks (control plane).
        bucket_bytes: bucket size cap.
        first_bucket_bytes: cap of the first (last-layer) bucket; 0 = same as the others.
        compression: None, torch.float16 or torch.bfloat16 for the wire format.
        find_unused: treat parameters that get no gradient in a step as zero
            gradients instead of raising.
        timeout_s: how long ``finish`` waits for the collectives.
        recorder: the flight recorder (``hpcnet.fault.flightrec``) the collectives are logged to.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], transport: Transport, control: Any, *,
                 bucket_bytes: int = 25 * 2**20, first_bucket_bytes: int = 2**20,
                 compression: torch.dtype | None = None, find_unused: bool = False, timeout_s: float = 600.0,
                 recorder: Any = NULL_RECORDER):
        self.transport = transport
        self.recorder = recorder
        self.control = control
        self.world_size = control.Get_size()
        self.compression = compression
        self.find_unused = find_unused
        self.timeout_s = timeout_s
        self.stats = ReducerStats()
        self._sync = True
        self._next_launch = 0
        self._hooks: list[Any] = []
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        # One dtype/device per bucket: plan per (device, dtype) group.
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, (_, p) in enumerate(named):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self.buckets: list[_Bucket] = []
        for members in groups.values():
            sizes = [named[i][1].numel() * named[i][1].element_size() for i in members]
            for plan in plan_buckets(sizes, bucket_bytes, first_bucket_bytes):
                params = [named[members[j]][1] for j in plan]
                names = [named[members[j]][0] for j in plan]
                offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()
                buffer = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
                self.buckets.append(_Bucket(len(self.buckets), params, names, buffer, offsets))
        self._bucket_of: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        for bucket in self.buckets:
            for j, p in enumerate(bucket.params):
                self._bucket_of[p] = (bucket, j)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._attach_views()
        self._reset()

    # -- gradient views ------------------------------------------------------
    def _view(self, bucket: _Bucket, j: int) -> torch.Tensor:
        p = bucket.params[j]
        return bucket.buffer[bucket.offsets[j]:bucket.offsets[j + 1]].view_as(p)

    def _attach_views(self) -> None:
        for bucket in self.buckets:
            for j, p in enumerate(bucket.params):
                view = self._view(bucket, j)
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def zero_grad(self) -> None:
        """Zero every gradient, keeping them views into the buckets (use instead of optimizer.zero_grad)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
        self._attach_views()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.ready = [False] * len(bucket.params)
            bucket.launched = False
            bucket.handle = None
            self.recorder.end(bucket.token)  # no-op unless an error left it open
        self._next_launch = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the step after the block communicates."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True
            self._reset()

    # -- launching -----------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket, j = self._bucket_of[p]
        view = self._view(bucket, j)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # Someone replaced .grad (set_to_none, a custom hook): fold it back in.
            view.copy_(p.grad)
            p.grad = view
        if bucket.ready[j]:
            return  # the parameter is used twice in the graph: its hook fires once per use
        bucket.ready[j] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in bucket order, so every rank issues the same
        # collectives in the same sequence.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        bucket.token = self.recorder.start("allreduce.bucket", bucket.index,
                                           bucket.buffer.numel() * bucket.buffer.element_size())
        if self.compression is not None:
            # Pre-divide in full precision so the half-precision sum cannot overflow.
            bucket.wire = (bucket.buffer / self.world_size).to(self.compression)
            bucket.handle = self.transport.start(bucket.wire)
        else:
            bucket.handle = self.transport.start(bucket.buffer)

    # -- finishing -------------------------------------------------------------
    def finish(self) -> None:
        """Complete the reduction of this step (collective over the control plane).

        Raises:
            CommFailure: on every rank, when the transport failed on any rank.
            RuntimeError: on every rank, when parameters got no gradient and
                ``find_unused`` is off.
        """
        from mpi4py import MPI

        local_missing = np.array([not b.launched for b in self.buckets], dtype=np.int8)
        missing = np.empty_like(local_missing)
        with self.recorder.op("reducer.launched"):
            self.control.Allreduce(local_missing, missing, op=MPI.MAX)
        if missing.any():
            if not self.find_unused:
                self._raise_unused(missing)
            for bucket in self.buckets:
                if missing[bucket.index]:
                    bucket.pending = 0  # gradients not produced stay zero in the buffer
            self._launch_ready()
        error = wait_all([b.handle for b in self.buckets], self.timeout_s,
                         on_done=lambda i: self.recorder.end(self.buckets[i].token))
        with self.recorder.op("reducer.outcome"):
            failed = self.control.allreduce(error is not None, op=MPI.LOR)
        self.stats.steps += 1
        if failed:
            self._reset()
            raise agreed(CommFailure(f"{self.transport.name} all-reduce failed"
                                     + (f" here: {error}" if error else " on another rank")))
        for bucket in self.buckets:
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)
                bucket.wire = None
            else:
                bucket.buffer.div_(self.world_size)
            self.stats.bytes_reduced += bucket.buffer.numel() * bucket.buffer.element_size()
        self._reset()

    def _raise_unused(self, missing: np.ndarray) -> None:
        names = [name for b in self.buckets if missing[b.index] for name, ok in zip(b.names, b.ready) if not ok]
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        self._reset()
        raise agreed(RuntimeError(
            f"parameters received no gradient this step ({shown or 'on another rank'}); make every parameter "
            "take part in the loss, or set dist.find_unused=true"))

    # -- switching transport ---------------------------------------------------
    def switch(self, transport: Transport, cause: str, step: int) -> None:
        """Continue on another transport after an agreed failure (collective)."""
        old = self.transport
        self.transport = transport
        old.close()
        self.stats.fallbacks.append({"step": step, "from": old.name, "to": transport.name, "cause": cause})
        log.warning("step %d: %s failed (%s); continuing on %s", step, old.name, cause, transport.name)

    def arm_fault(self, armed: bool) -> None:
        """Fault injection: make the transport fail (on the chosen ranks) for this step."""
        if isinstance(self.transport, FaultyTransport):
            self.transport.armed = armed

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.transport.close()


def broadcast_module(module: nn.Module, comm: Any) -> None:
    """Make every rank's parameters and buffers bit-equal to rank 0's (collective, MPI)."""
    if comm.Get_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            host = tensor.detach().contiguous().cpu()
            comm.Bcast(host.view(-1).view(torch.uint8).numpy(), root=0)  # raw bytes: any dtype
            if host.data_ptr() != tensor.data_ptr():
                tensor.copy_(host)


def broadcast_buffers(module: nn.Module, comm: Any, *, group: Any = None) -> None:
    """Make every rank's buffers (BatchNorm statistics) equal to rank 0's (collective).

    As DDP does before each forward: replicas then stay bit-identical, so a
    checkpoint of rank 0's buffers restores every rank exactly.  All buffers
    travel as one flat byte tensor on their device: one broadcast in all,
    whatever their number and dtypes.

    Args:
        module: the replica.
        comm: the MPI communicator of the ranks.
        group: a NCCL process group over the same ranks, for buffers on a
            GPU: the broadcast is then enqueued on the device in stream order
            (``work.wait()`` is a stream wait) and nothing waits on the host.
            None: MPI, on the host (CPU buffers are broadcast in place; GPU
            buffers make one host round trip, for the flat tensor).
    """
    if comm.Get_size() == 1:
        return
    # Widest elements first: every buffer's offset in the byte tensor is then
    # a multiple of its element size (sizes are powers of two), as viewing
    # the bytes back as its dtype requires.
    bufs = sorted(module.buffers(), key=lambda b: -b.element_size())
    if not bufs:
        return
    with torch.no_grad():
        # Raw bytes: dtypes mix (float statistics, int64 counters, bool masks).
        flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in bufs])
        if group is not None:
            import torch.distributed as dist

            dist.broadcast(flat, src=0, group=group, async_op=True).wait()
        else:
            host = flat.cpu()  # no copy for CPU buffers
            comm.Bcast(host.numpy(), root=0)
            if host is not flat:
                flat.copy_(host)
        offset = 0
        for b in bufs:
            nbytes = b.numel() * b.element_size()
            b.copy_(flat[offset:offset + nbytes].view(b.dtype).view_as(b))
            offset += nbytes
