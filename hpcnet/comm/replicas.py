"""Replicas kept equal: every rank holds the same model (``check_same_model``), starts from rank 0's parameters and
buffers (``broadcast_module``), and takes rank 0's buffers before each step (``broadcast_buffers``), as DDP does."""

import hashlib
from typing import Any

import torch
from torch import nn

from hpcnet.agree import mark_agreed
from hpcnet.errors import UsageError


def check_same_model(model: nn.Module, comm: Any) -> None:
    """Raise on every rank unless all ranks hold the same parameter names, shapes and dtypes (collective).

    Mismatched replicas would otherwise pair unrelated buffers in the
    collectives, or wait forever for a bucket another rank does not have.
    """
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) > 1:
        first = comm.bcast(layout, root=0)
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        diff = next((f"{a} vs {b}" for a, b in zip(first, layout) if a != b), None)
        if diff is None and len(first) != len(layout):
            diff = f"{len(first)} tensors on rank 0, {len(layout)} here"
        raise mark_agreed(UsageError(f"the model differs across ranks: ranks {odd} do not match rank 0"
                         + (f" (rank {comm.Get_rank()}: {diff})" if diff else "")))


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
