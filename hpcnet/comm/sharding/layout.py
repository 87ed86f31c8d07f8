"""What is owned: the units of ownership of a model's trainable parameters (``split_units``) and the tensor each
unit is updated and summed through (``ShardLayout``).

A unit is a trainable parameter, except that a parameter larger than a quarter of a rank's even share is cut into
row ranges, so one huge matrix is spread over several owners as a flat buffer would be; every unit is a
contiguous range of memory.  Only for an elementwise optimizer (``hpcnet.config.optimizers``): Muon, Adafactor
and any optimizer not known to be elementwise compute each parameter's update from the whole matrix, so their
units are whole parameters (``cut=False``), and the owners balance whole matrices.
"""

from dataclasses import dataclass

import torch
from torch import nn

UNITS_PER_RANK = 4
"""A parameter larger than 1/UNITS_PER_RANK of a rank's even share of the parameter bytes is cut into row ranges
no larger than that: with equal speeds the greedy assignment then gives no rank more than about
(1 + 1/UNITS_PER_RANK) times the even share, however the bytes are spread over the parameters, while a model of
many ordinary layers keeps its parameters whole (one optimizer tensor each)."""
MIN_UNIT_BYTES = 4096
"""No parameter is cut into pieces smaller than this."""


@dataclass(frozen=True, slots=True)
class Unit:
    """What one owner owns: rows ``lo`` to ``hi`` of parameter ``param``, which has ``rows`` rows (dim 0)."""

    param: int
    lo: int
    hi: int
    rows: int

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.rows


def split_units(params: list[torch.Tensor], world_size: int, *, per_rank: int = UNITS_PER_RANK,
                min_bytes: int = MIN_UNIT_BYTES, cut: bool = True) -> list[Unit]:
    """The units of ownership of ``params`` at ``world_size`` ranks, in parameter order (pure, deterministic).

    A parameter of more than ``max(min_bytes, total bytes / (world_size * per_rank))`` bytes with at least two
    rows, contiguous in memory, is cut along dim 0 into that many near-equal row ranges as keep each under the
    cap; every other parameter is one unit.  One rank, or ``cut=False`` (an optimizer that is not elementwise):
    no cuts.
    """
    sizes = [p.numel() * p.element_size() for p in params]
    cap = max(min_bytes, sum(sizes) // max(1, world_size * per_rank))
    units: list[Unit] = []
    for i, (p, size) in enumerate(zip(params, sizes)):
        rows = p.shape[0] if p.dim() else 1
        if cut and world_size > 1 and size > cap and rows >= 2 and p.is_contiguous():
            m = min(rows, -(-size // cap))
            cuts = [r * rows // m for r in range(m + 1)]
            units.extend(Unit(i, cuts[r], cuts[r + 1], rows) for r in range(m))
        else:
            units.append(Unit(i, 0, rows, rows))
    return units


class ShardLayout:
    """The units of ownership of a model's trainable ``params`` (``split_units``) and the tensor each unit is
    updated through: the parameter itself when whole, else a leaf tensor viewing its rows (same memory, so an
    update of the view is an update of the parameter, and a broadcast into it fills those rows).  ``cut``:
    whether ``split_units`` may cut a parameter (an elementwise optimizer)."""

    def __init__(self, params: list[nn.Parameter], world_size: int, units: list[Unit] | None = None, *,
                 cut: bool = True) -> None:
        self.params = params
        self.units = split_units(params, world_size, cut=cut) if units is None else units
        self.tensors: list[torch.Tensor] = [
            params[u.param] if u.whole else nn.Parameter(params[u.param].detach()[u.lo:u.hi])
            for u in self.units]
        self.sizes = [t.numel() * t.element_size() for t in self.tensors]
        self.of_param: list[list[int]] = [[] for _ in params]
        for k, u in enumerate(self.units):
            self.of_param[u.param].append(k)

    @property
    def cut(self) -> bool:
        """Whether a parameter is cut into row ranges."""
        return any(not u.whole for u in self.units)

    def is_split(self, param: int) -> bool:
        return len(self.of_param[param]) > 1

    def owns_rows(self, param: int, owner: list[int], rank: int, rows: tuple[int, int] | None) -> bool:
        """Whether ``rank`` owns a unit of parameter ``param`` (``owner``: unit -> rank) over any of rows ``rows``
        (``(lo, hi)``; None: any row): what a rank reads of a checkpoint's piece of that parameter, whatever its
        cuts."""
        return any(owner[k] == rank and (rows is None or (rows[0] < self.units[k].hi and self.units[k].lo < rows[1]))
                   for k in self.of_param[param])

    def to_json(self) -> list[list[int]]:
        """[param, lo, hi] per unit (a checkpoint's meta and owners.json)."""
        return [[u.param, u.lo, u.hi] for u in self.units]
