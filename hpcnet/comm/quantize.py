"""int8 blockwise quantization with error feedback, for the sums that cross the nodes (``dist.compression=int8``).

A tensor is cut into blocks of ``BLOCK`` elements; each block travels as int8 values and one float32 scale (its
largest magnitude / 127), 1.016 bytes an element instead of 4.  What the rounding loses is not thrown away: each
rank keeps it (``ErrorFeedback``) and adds it to what it sends next step, so over the steps every gradient gets
through in full (error feedback, as in 1-bit SGD, EF-SGD and ZeRO++'s quantized gradients) and training converges
as in full precision.  ``HierarchicalTransport`` quantizes twice: each rank's shard before the exchange between the
nodes ("worker" residual) and each node's sum of its part before the gather back ("server" residual); both residuals
are per rank, saved in checkpoints (``ErrorFeedback.state_entries``) so a resume continues bit for bit.

The quantization is pure (no communication); only the residuals' checkpoint entries are gathered (collective).
"""

import logging
from typing import Any

import torch

from hpcnet.ckpt.schema import FEEDBACK_PREFIX
from hpcnet.stateful import Entries, Saved, Stateful

log = logging.getLogger(__name__)

BLOCK = 256
"""Elements per quantization block: one float32 scale each (1.6% of the int8 bytes)."""
LEVELS = 127
"""int8 values run from -LEVELS to LEVELS (symmetric: -128 is never used, so negation is exact)."""


def padded_length(numel: int, parts: int, block: int = BLOCK) -> int:
    """``numel`` rounded up to ``parts`` equal parts of whole blocks (pure)."""
    unit = parts * block
    return max(unit, -(-numel // unit) * unit)


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and one float32 scale per block of a float32 tensor whose length is a multiple of ``block``.

    A block holding a non-finite value gets a non-finite scale, so it dequantizes to NaN: a step whose gradient
    overflowed is seen as such by the non-finite guard after the sum, and skipped.
    """
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1).div_(LEVELS)
    inverse = torch.where(scales > 0, scales, torch.ones_like(scales)).reciprocal_()
    scaled = torch.mul(blocks, inverse[:, None])
    if not bool(torch.isfinite(scales).all()):  # |x / scale| <= 127 elsewhere: no clamp needed
        scaled.nan_to_num_(0.0, 0.0, 0.0)
    return scaled.round_().to(torch.int8).view(-1), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The float32 values of ``quantize``'s output; a block with a non-finite scale (an overflowed block) is NaN
    throughout, also where its values are 0."""
    values = q.view(-1, block).to(torch.float32).mul_(scales[:, None])
    _overflowed_to_nan(values, scales)
    return values.view(-1)


def add_dequantized(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK,
                    alpha: float = 1.0) -> None:
    """``out += alpha * dequantize(q, scales)`` in one pass over ``out`` (a non-finite scale gives NaN there)."""
    out.view(-1, block).addcmul_(q.view(-1, block).to(torch.float32), scales[:, None], value=alpha)
    _overflowed_to_nan(out.view(-1, block), scales)


def _overflowed_to_nan(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """NaN throughout each block (a row of ``blocks``) whose scale is not finite."""
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        blocks[bad] = float("nan")


def packed_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes of ``numel`` elements packed by ``pack``."""
    return numel + 4 * (numel // block)


def pack(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """int8 values then their float32 scales, as bytes into ``out`` (uint8, ``packed_bytes`` long)."""
    n = q.numel()
    out[:n].copy_(q.view(torch.uint8))
    out[n:].copy_(scales.view(torch.uint8))


def unpack(data: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: views of the int8 values and float32 scales of ``numel`` elements in ``data``."""
    return data[:numel].view(torch.int8), data[numel:].view(torch.float32)


def compress_with_feedback(x: torch.Tensor, residual: torch.Tensor, block: int = BLOCK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x + residual`` and leave in ``residual`` what the quantization lost (in place).

    Where that is not finite (an overflowed gradient: the step is skipped by the guard) the residual is reset
    to 0 rather than carrying a NaN into every later step.
    """
    residual.add_(x)
    q, scales = quantize(residual, block)
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        residual.view(-1, block)[bad] = 0.0
        scales_ok = torch.where(bad, torch.zeros_like(scales), scales)
    else:
        scales_ok = scales
    add_dequantized(residual, q, scales_ok, block, alpha=-1.0)
    return q, scales


class ErrorFeedback(Stateful):
    """Each rank's residuals, by name (``<bucket>/<chunk>/<worker|server>``); made at zero on first use.

    A residual whose length changed (the buckets were laid out again, or another world size) starts from zero.

    Args:
        comm: the ranks whose residuals a checkpoint holds (``hpcnet.stateful``: a part of the run).
        in_checkpoints: whether checkpoints hold them (``dist.compression=int8``); otherwise a save offers none and
            a resume starts them from zero.
    """

    def __init__(self, comm: Any = None, *, in_checkpoints: bool = False) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self.comm, self.in_checkpoints = comm, in_checkpoints

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(name)
        if residual is None or residual.numel() != numel or residual.device != like.device:
            residual = self.residuals[name] = torch.zeros(numel, dtype=torch.float32, device=like.device)
        return residual

    def state(self) -> dict[str, torch.Tensor]:
        """The residuals by name (not copied)."""
        return dict(self.residuals)

    def load(self, residuals: dict[str, torch.Tensor]) -> None:
        """Replace the residuals by ``residuals`` (copied, float32)."""
        self.residuals = {name: value.detach().to(torch.float32).clone().reshape(-1)
                          for name, value in residuals.items()}

    def clear(self) -> None:
        self.residuals.clear()

    def state_entries(self) -> Entries:
        """The residuals for a checkpoint (collective): every rank's names (``FEEDBACK_PREFIX``), this rank's own
        residuals as tensors and the others' as ``meta`` tensors of their shapes, each held by its rank.  Nothing,
        and no collective, where checkpoints do not hold them (the same on every rank)."""
        if not self.in_checkpoints:
            return Entries()
        rank = self.comm.Get_rank()
        residuals = self.state()
        mine = [(name, r.numel()) for name, r in residuals.items()]
        entries = Entries()
        for owner, names in enumerate(self.comm.allgather(mine)):
            for name, numel in names:
                key = f"{FEEDBACK_PREFIX}{owner}/{name}"
                entries.holders[key] = owner
                entries.tensors[key] = residuals[name] if owner == rank else torch.empty(numel, device="meta")
        return entries

    def wants(self, name: str) -> bool | None:
        """Of a checkpoint's residuals (``FEEDBACK_PREFIX``), this rank reads its own only; None for other names."""
        if not name.startswith(FEEDBACK_PREFIX):
            return None
        return name.startswith(f"{FEEDBACK_PREFIX}{self.comm.Get_rank()}/")

    def load_entries(self, saved: Saved) -> None:
        """This rank's residuals, when saved at the same world size (the same buckets and shards); otherwise, or
        where checkpoints do not hold them, they start from zero (a step's quantization error, dropped once)."""
        if not self.in_checkpoints:
            self.clear()
            return
        rank, world_size = self.comm.Get_rank(), self.comm.Get_size()
        prefix = f"{FEEDBACK_PREFIX}{rank}/"
        mine = {name[len(prefix):]: value for name, value in saved.tensors.items() if name.startswith(prefix)}
        if saved.saved_world_size != world_size:
            self.clear()
            if rank == 0 and mine:
                log.info("resume: int8's error-feedback residuals were saved by %d ranks, this run has %d: they "
                         "start from zero", saved.saved_world_size, world_size)
            return
        self.load(mine)
