"""The reducer's buckets: how parameters are grouped (``plan_buckets``), one bucket (``Bucket``), and where a
bucket's sums go (``Placement``): ``Replicated`` here for ``dist.zero`` 0 and 1, ``hpcnet.comm.zero.Sharded``
for stage 2.  ``hpcnet.comm.reducer`` fills and sends them."""

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from hpcnet.comm.transport import Transport


def plan_buckets(sizes_bytes: list[int], bucket_bytes: int, first_bucket_bytes: int = 0) -> list[list[int]]:
    """Group tensor indices into buckets (pure logic).

    Tensors are taken in reverse order.  A bucket is closed once it holds at
    least its cap: ``first_bucket_bytes`` for the first (when > 0),
    ``bucket_bytes`` for the others.  A tensor is never split, so a bucket
    exceeds its cap by less than its last tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be greater than 0")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(sizes_bytes))):
        current.append(index)
        filled += sizes_bytes[index]
        cap = first_bucket_bytes if (not buckets and first_bucket_bytes > 0) else bucket_bytes
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(eq=False)
class Bucket:
    """One flat buffer of gradients: its parameters, their entries in it, and its progress in a backward."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor
    offsets: list[int]
    pending: int = 0  # parameters not yet complete
    arrived: list[int] = field(default_factory=list)  # each parameter's gradients this backward
    expected: list[int] = field(default_factory=list)  # and how many make it complete (Reducer._uses)
    launched: bool = False
    handle: Any = None
    wire: torch.Tensor | None = None
    token: int = 0  # its entry in the flight recorder while it runs
    # The bucket's entries in layout order: a whole parameter, or (dist.zero=2) rows of one (a unit of
    # hpcnet.comm.zero.ShardLayout).  ``offsets`` are the entries', in elements.
    entry_param: list[int] = field(default_factory=list)  # the entry's parameter, by its place in ``params``
    entry_tensor: list[torch.Tensor] = field(default_factory=list)  # what the entry's gradient belongs to
    entry_rows: list[tuple[int, int] | None] = field(default_factory=list)  # rows of a cut parameter, or None
    entry_unit: list[int] = field(default_factory=list)  # the entry's unit of ownership (its parameter's index)
    of_param: list[list[int]] = field(default_factory=list)  # each parameter's entries
    views: list[torch.Tensor] = field(default_factory=list)  # each entry's gradient in ``buffer``
    shard: Any = None  # the placement's state of the bucket (dist.zero=2: hpcnet.comm.zero.BucketShard)
    single: bool = False  # one entry, a whole contiguous CPU parameter: its gradient can be the buffer (Reducer._adopt)
    empty: torch.Tensor | None = None  # the buffer of a ``single`` bucket between steps (Reducer._let_go)

    @property
    def nbytes(self) -> int:
        """The bucket's size (its buffer is empty between steps at dist.zero=2)."""
        return self.offsets[-1] * self.params[0].element_size()

    def make_views(self) -> None:
        """Each entry's gradient in the buffer, laid out as its tensor is (channels-last stays so: fused
        optimizers read a gradient and its parameter in memory order, and give wrong updates otherwise).  Made
        once per buffer, not per step: two tensor ops a parameter, every step, add up for models of many tensors."""
        if self.buffer.numel() == 0:
            self.views = []  # a dropped bucket (dist.zero=2): made again with its buffer
            return
        self.views = [grad_view(self.buffer[self.offsets[e]:self.offsets[e + 1]], t)
                      for e, t in enumerate(self.entry_tensor)]


class Placement(Protocol):
    """Where a bucket's sums go: what differs between ``dist.zero`` 0/1 (``Replicated``: every rank keeps every
    sum) and 2 (``hpcnet.comm.zero.Sharded``: each rank keeps the sums it owns).  The ``Reducer`` calls it at
    those points only, and never asks which one it has."""

    drops_buckets: bool
    """The buckets are dropped once their sums are handed over, and made again by the next backward's folds."""
    releases_early: bool
    """The hooks launch complete buckets on every transport, and the reducer releases each as its sum is in (so
    a rank holds the buckets being filled and those in flight, not the whole gradient)."""
    adopts: bool
    """A bucket's buffer may be replaced by a tensor of the reducer's choosing in a fold (not a buffer in the
    transport's memory, shm's window)."""

    def set_transport(self, transport: Transport) -> None:
        """The transport the buckets go over from now on."""

    def set_owners(self, owners: list[int]) -> None:
        """New owners of the units (``Reducer.reassign``); ValueError where they do not fit."""

    def entries(self, i: int, p: nn.Parameter) -> list[tuple[int, torch.Tensor, tuple[int, int] | None]]:
        """Trainable parameter ``i``'s entries in a bucket: (unit index, tensor, rows or None when whole)."""

    def order(self, entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """A bucket's entries, ``(j, unit, tensor, rows)``, in the order its buffer lays them out."""

    def attach(self, bucket: Bucket) -> None:
        """Give a newly laid-out bucket the placement's state (``bucket.shard``)."""

    def assign(self, bucket: Bucket) -> None:
        """The owners set last (``set_owners``) for a bucket kept as it is laid out."""

    def start(self, bucket: Bucket, wire: torch.Tensor | None) -> Any:
        """Start the bucket's collective, on ``wire`` (its compressed copy) or, when None, its buffer; the handle."""

    def release(self, bucket: Bucket) -> None:
        """Hand a bucket's complete sums over as gradients (``.grad``)."""

    def zero_grad(self, bucket: Bucket) -> None:
        """Drop what the placement keeps of the bucket's gradients besides ``.grad``."""

    def tensors(self, bucket: Bucket) -> list[torch.Tensor]:
        """The tensors that hold the bucket's gradients here (a memory account)."""


class Replicated:
    """``dist.zero`` 0 and 1: each bucket is all-reduced and every rank keeps the whole sum, its views becoming
    the gradients; the buckets live from step to step (``Placement``)."""

    drops_buckets = False
    releases_early = False

    def set_transport(self, transport: Transport) -> None:
        self.transport = transport
        self.adopts = getattr(transport, "allocate", None) is None

    def set_owners(self, owners: list[int]) -> None:
        raise ValueError("reassign needs a reducer made with owners (dist.zero=2)")

    def entries(self, i: int, p: nn.Parameter) -> list[tuple[int, torch.Tensor, tuple[int, int] | None]]:
        return [(i, p, None)]

    def order(self, entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return entries

    def attach(self, bucket: Bucket) -> None:
        pass

    def assign(self, bucket: Bucket) -> None:
        pass

    def start(self, bucket: Bucket, wire: torch.Tensor | None) -> Any:
        return self.transport.start(bucket.buffer if wire is None else wire, bucket.index)

    def release(self, bucket: Bucket) -> None:
        for t, view in zip(bucket.entry_tensor, bucket.views):  # every entry a whole parameter
            t.grad = view

    def zero_grad(self, bucket: Bucket) -> None:
        pass

    def tensors(self, bucket: Bucket) -> list[torch.Tensor]:
        return [bucket.buffer]


def grad_view(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``flat`` (``p.numel()`` elements) laid out as ``p`` is: a dense parameter in another order of its
    dimensions (channels-last) gets its strides, any other its shape."""
    return flat.as_strided(p.shape, p.stride()) if not p.is_contiguous() and dense(p) else flat.view_as(p)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its extent without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True
