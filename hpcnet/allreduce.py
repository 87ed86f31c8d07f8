"""Gradient averaging over the data plane.

Gradients are packed into flat buckets (about ``bucket_bytes`` each, in
reverse registration order like DDP, since the last layers' gradients are
ready first) and each bucket is reduced with one all-reduce.
"""

from typing import Any

import torch
from torch import nn


def plan_buckets(sizes_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets of at most ``bucket_bytes`` (pure logic).

    Tensors are taken in reverse order; a tensor larger than the cap gets a
    bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be greater than 0")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(sizes_bytes))):
        size = sizes_bytes[index]
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets


class GradientAverager:
    """Average the gradients of ``params`` across the ranks of a process group."""

    def __init__(self, params: list[nn.Parameter], *, group: Any, world_size: int,
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size = world_size
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = plan_buckets(sizes, bucket_bytes)

    def average(self) -> None:
        """All-reduce every gradient and divide by the world size (collective)."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise RuntimeError(
                f"{len(missing)} parameter(s) received no gradient this step (first: parameter #{missing[0]} "
                f"of shape {tuple(self.params[missing[0]].shape)}); every parameter must take part in the loss")
        if self.world_size == 1:
            return
        import torch.distributed as dist

        for bucket in self.buckets:
            grads = [self.params[i].grad for i in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(self.world_size)  # pre-divide, as DDP does, to keep sums in range
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for grad in grads:
                n = grad.numel()
                grad.copy_(flat[offset:offset + n].view_as(grad))
                offset += n


def broadcast_module(module: nn.Module, *, group: Any, world_size: int) -> None:
    """Make every rank's parameters and buffers equal to rank 0's (collective)."""
    if world_size == 1:
        return
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0, group=group)


def average_buffers(module: nn.Module, *, group: Any, world_size: int) -> None:
    """Average floating-point buffers (BatchNorm statistics) across ranks (collective)."""
    if world_size == 1:
        return
    import torch.distributed as dist

    with torch.no_grad():
        for buf in module.buffers():
            if buf.is_floating_point():
                buf.div_(world_size)
                dist.all_reduce(buf, group=group)
