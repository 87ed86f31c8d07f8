"""Where a bucket's sums go, side by side for every ``dist.zero`` stage (the ``Placement`` protocol):
``ReplicatedGradients`` (stages 0 and 1: every rank keeps every sum) and ``ShardedGradients`` (stages 2 and 3:
each rank keeps the sums of the units it owns).  The reducer (``hpcnet.comm.reducer``) calls a placement at these
points only, and never asks which one it has."""

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from hpcnet.comm.buckets import Bucket, grad_view
from hpcnet.comm.sharding.layout import ShardLayout
from hpcnet.comm.transport import Transport


class Placement(Protocol):
    """Where a bucket's sums go (see the module's doc)."""

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


class ReplicatedGradients:
    """``dist.zero`` 0 and 1: each bucket is all-reduced and every rank keeps the whole sum, its views becoming
    the gradients; the buckets live from step to step."""

    drops_buckets = False
    releases_early = False

    def set_transport(self, transport: Transport) -> None:
        self.transport = transport
        self.adopts = not transport.keeps_buckets

    def set_owners(self, owners: list[int]) -> None:
        raise ValueError("reassign needs a reducer whose gradients are sharded (dist.zero=2 or 3)")

    def entries(self, i: int, p: nn.Parameter) -> list[tuple[int, torch.Tensor, tuple[int, int] | None]]:
        return [(i, p, None)]

    def order(self, entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return entries

    def attach(self, bucket: Bucket) -> None:
        """Nothing to keep: the buffer is the bucket's whole state."""

    def assign(self, bucket: Bucket) -> None:
        """No owners: every rank keeps every sum."""

    def start(self, bucket: Bucket, wire: torch.Tensor | None) -> Any:
        return self.transport.start(bucket.buffer if wire is None else wire, bucket.index)

    def release(self, bucket: Bucket) -> None:
        for t, view in zip(bucket.entry_tensor, bucket.views):  # every entry a whole parameter
            t.grad = view

    def zero_grad(self, bucket: Bucket) -> None:
        """Nothing besides ``.grad``: the reducer drops those."""

    def tensors(self, bucket: Bucket) -> list[torch.Tensor]:
        return [bucket.buffer]


@dataclass(eq=False)
class BucketShard:
    """``ShardedGradients``' state of one reducer bucket (``Bucket.shard``)."""

    grouped: bool  # laid out owner by owner (reduce-scatter), else in dist.zero=0's order
    counts: list[int] = field(default_factory=list)  # elements each rank owns, in rank order
    owner_of: list[int] = field(default_factory=list)  # each entry's owner rank
    owned: torch.Tensor | None = None  # this rank's sums, from its collective to the next zero_grad
    owned_views: list[torch.Tensor | None] = field(default_factory=list)  # its entries' gradients in ``owned``
    scattered: bool = False  # the transport reduce-scattered into ``owned``


class ShardedGradients:
    """``dist.zero`` 2 and 3: each bucket is laid out owner by owner and reduce-scattered (or all-reduced, where
    the transport offers no reduce-scatter, and its owned part kept); after the reducer's ``finish`` a unit's
    tensor has a ``.grad`` on its owner only, and the buckets are dropped until the next backward (unless they live
    in the transport's memory, shm's window), so between steps a rank holds its own sums only; and those are
    dropped by the next ``zero_grad`` and made again bucket by bucket as the sums go out.

    Args:
        owners: the owner rank of each unit (``units``; without them, of each trainable parameter).
        units: the units of ownership and their tensors (``ShardLayout``), or None: every parameter whole.
        n_params: the number of trainable parameters.
        rank: this rank.
        world_size: the number of ranks.
    """

    def __init__(self, owners: list[int], units: ShardLayout | None, *, n_params: int, rank: int,
                 world_size: int) -> None:
        self.units = units
        self.n_units = n_params if units is None else len(units.units)
        self.rank, self.world_size = rank, world_size
        self.set_owners(owners)

    def set_owners(self, owners: list[int]) -> None:
        if len(owners) != self.n_units:
            raise ValueError(f"owners names {len(owners)} units, the model has {self.n_units}")
        self.owners = owners

    def set_transport(self, transport: Transport) -> None:
        self.transport = transport
        self.reduce_scatters = transport.reduce_scatters
        # Buckets outside the transport's memory (not shm's window) are dropped between steps.
        self.drops_buckets = self.releases_early = self.adopts = not transport.keeps_buckets

    def entries(self, i: int, p: nn.Parameter) -> list[tuple[int, torch.Tensor, tuple[int, int] | None]]:
        if self.units is None:
            return [(i, p, None)]
        units = self.units
        return [(k, units.tensors[k], None if units.units[k].whole else (units.units[k].lo, units.units[k].hi))
                for k in units.of_param[i]]

    def order(self, entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        if not self.reduce_scatters:
            # An all-reduce sums each element in an order that depends on its place in the bucket: the layout
            # stays dist.zero=0's, and the same place gives the same bits.
            return entries
        # Owner by owner, so each rank's sums are one contiguous piece to reduce-scatter.
        return sorted(entries, key=lambda entry: self.owners[entry[1]])

    def attach(self, bucket: Bucket) -> None:
        bucket.shard = BucketShard(grouped=self.reduce_scatters)  # as ``order`` laid it out
        self.assign(bucket)

    def assign(self, bucket: Bucket) -> None:
        shard = bucket.shard
        shard.owner_of = [self.owners[k] for k in bucket.entry_unit]
        shard.counts = [0] * self.world_size
        for t, owner in zip(bucket.entry_tensor, shard.owner_of):
            shard.counts[owner] += t.numel()
        shard.owned, shard.owned_views = None, []  # made when its collective starts (_ensure_owned)

    def start(self, bucket: Bucket, wire: torch.Tensor | None) -> Any:
        shard = bucket.shard
        shard.scattered = wire is None and shard.grouped and self.reduce_scatters
        if shard.scattered:
            self._ensure_owned(bucket)
            return self.transport.start_reduce_scatter(bucket.buffer, shard.counts, shard.owned)
        return self.transport.start(bucket.buffer if wire is None else wire, bucket.index)

    def release(self, bucket: Bucket) -> None:
        """The owned gradients kept in ``owned``, the others None; a dropped bucket's buffer freed."""
        shard = bucket.shard
        self._ensure_owned(bucket)
        if shard.grouped and not shard.scattered:  # all-reduced (a compressed wire): one piece to keep
            lo = sum(shard.counts[:self.rank])
            shard.owned.copy_(bucket.buffer[lo:lo + shard.counts[self.rank]])
        for e, (t, view) in enumerate(zip(bucket.entry_tensor, shard.owned_views)):
            if view is not None and not shard.grouped:
                view.copy_(bucket.views[e])
            t.grad = view
        if self.drops_buckets:
            bucket.buffer = bucket.buffer.new_empty(0)
            bucket.views = []

    def zero_grad(self, bucket: Bucket) -> None:
        bucket.shard.owned, bucket.shard.owned_views = None, []

    def tensors(self, bucket: Bucket) -> list[torch.Tensor]:
        owned = bucket.shard.owned
        return [bucket.buffer] if owned is None else [bucket.buffer, owned]

    def _ensure_owned(self, bucket: Bucket) -> None:
        """This rank's sums of the bucket, its parameters' in bucket order, and their gradient views, made when
        the bucket's collective starts.  ``zero_grad`` drops them, so during the next forward and the early
        backward, when the activations are all alive, the last step's gradient shard is not: its peak is lower
        by up to the shard."""
        shard = bucket.shard
        if shard.owned is not None:
            return
        like = bucket.params[0]
        shard.owned = torch.empty(shard.counts[self.rank], dtype=like.dtype, device=like.device)
        shard.owned_views = []
        at = 0
        for e, t in enumerate(bucket.entry_tensor):
            if shard.owner_of[e] != self.rank:
                shard.owned_views.append(None)
                continue
            shard.owned_views.append(grad_view(shard.owned[at:at + t.numel()], t))
            at += t.numel()
