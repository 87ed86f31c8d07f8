"""The reducer's buckets: their size (``bucket_bytes``), how parameters are grouped into them
(``bucket_layout``) and one bucket (``Bucket``).  ``hpcnet.comm.reducer`` fills and sends them; where a bucket's
sums go is its placement's (``hpcnet.comm.sharding.placement``)."""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpcnet.comm.costmodel import LinkCost, auto_bucket_bytes, bucket_share, stage2_bucket_cap
from hpcnet.config import DistConfig
from hpcnet.world import World

log = logging.getLogger(__name__)

AUTO_FALLBACK_MB = 25
"""dist.bucket_mb=auto without a probed link: DDP's default."""


def bucket_bytes(cfg: DistConfig, world: World, total: int, link: LinkCost | None) -> int:
    """``dist.bucket_mb`` in bytes for ``total`` bytes of gradients; 'auto' from the probed ``link``
    (``costmodel.auto_bucket_bytes``); at ``dist.zero`` 2 and 3 at most ``costmodel.stage2_bucket_cap`` (the buckets
    in flight stay small beside the gradient shard a rank keeps).  Rank 0 logs what it chose and why."""
    if cfg.bucket_mb != "auto":
        chosen = int(float(cfg.bucket_mb) * 2**20)
    elif link is None:
        if world.is_main and world.size > 1:
            log.info("dist.bucket_mb=auto: no probed link (dist.probe=false), buckets of %d MiB", AUTO_FALLBACK_MB)
        chosen = AUTO_FALLBACK_MB * 2**20
    else:
        chosen = auto_bucket_bytes(link, total, world.size)
        if world.is_main:
            log.info("dist.bucket_mb=auto: %.2f MiB buckets (link %.1f us, %.2f GB/s; %.1f MiB of gradients)",
                     chosen / 2**20, link.latency_s * 1e6, link.bandwidth_Bps / 1e9, total / 2**20)
    if cfg.zero >= 2 and world.size > 1:
        share = bucket_share(cfg.zero)
        cap = stage2_bucket_cap(total, world.size, share=share)
        if chosen > cap:
            if world.is_main:
                log.info("dist.zero=%d: buckets of %.2f MiB, not %.2f (at most 1/%d of a rank's %.1f MiB "
                         "gradient shard)", cfg.zero, cap / 2**20, chosen / 2**20, round(1 / share),
                         total / world.size / 2**20)
            chosen = cap
    return chosen


def bucket_layout(sizes_bytes: list[int], bucket_bytes: int, first_bucket_bytes: int = 0) -> list[list[int]]:
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
    # hpcnet.comm.sharding.layout.ShardLayout).  ``offsets`` are the entries', in elements.
    entry_param: list[int] = field(default_factory=list)  # the entry's parameter, by its place in ``params``
    entry_tensor: list[torch.Tensor] = field(default_factory=list)  # what the entry's gradient belongs to
    entry_rows: list[tuple[int, int] | None] = field(default_factory=list)  # rows of a cut parameter, or None
    entry_unit: list[int] = field(default_factory=list)  # the entry's unit of ownership (its parameter's index)
    of_param: list[list[int]] = field(default_factory=list)  # each parameter's entries
    views: list[torch.Tensor] = field(default_factory=list)  # each entry's gradient in ``buffer``
    shard: Any = None  # the placement's state of the bucket (dist.zero=2: hpcnet.comm.sharding.placement.BucketShard)
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
