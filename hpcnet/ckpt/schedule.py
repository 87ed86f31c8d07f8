"""When a run saves: every N steps, every T seconds (rank 0's clock), at the end, and when stopped.

``SavePolicy.agree`` is the one control-plane collective of every step: the
ranks share a stop request (a signal on any rank), a non-finite loss or
gradient norm (``train.nonfinite``), rank 0's clock for time-based saves and
whether any rank's checkpoint writer is still busy in one small all-reduce, so
every rank decides to save, to stop, and to take a background save one
collective stretch further, after the same step.  The other flags ride along
because one all-reduce per step is the cost the loop pays for all of them.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hpcnet.config import Config

NONFINITE_LOSS = 1
"""``SavePolicy.agree``'s ``nonfinite`` bit: this rank's loss is NaN or infinite."""
NONFINITE_GRAD = 2
"""``SavePolicy.agree``'s ``nonfinite`` bit: the (global) gradient norm is NaN or infinite."""


class Boundary(NamedTuple):
    """What the ranks agreed at a step boundary (``SavePolicy.agree``)."""

    stopped_by: int
    """The signal number any rank received, or 0."""
    save: bool
    """Whether to save after this step."""
    nonfinite: int
    """The ``NONFINITE_*`` bits of all ranks together."""
    writing: bool
    """Whether any rank's background checkpoint stretch is still running (``CheckpointManager.busy``)."""
    grow: int = 0
    """Rank 0's word on replacements for lost ranks after this step (``hpcnet.fault.live.Live.grow_flag``): 1 start
    them, 2 they join."""


def should_save(step: int, *, every_steps: int, time_due: bool, stopping: bool, at_end: bool) -> bool:
    """The save decision at a step boundary (pure); ``at_end``: this is the last step and the run saves there."""
    return stopping or time_due or at_end or (every_steps > 0 and step % every_steps == 0)


@dataclass
class SavePolicy:
    """The save policy of one run, with its own clock (``time.monotonic`` unless given).

    Args:
        every_steps: ``checkpoint.every_steps`` (0: never by step count).
        every_s: ``checkpoint.every_s`` (0: never by time).
        at_end: ``checkpoint.at_end``: save after the last step.
        total_steps: ``train.steps``, the last step.
        clock: seconds, monotonic; read on rank 0 only.
    """

    every_steps: int
    every_s: float
    at_end: bool
    total_steps: int
    clock: Callable[[], float] = time.monotonic
    last_save: float = field(init=False)
    """When the clock last saw a save (or the policy was made)."""

    def __post_init__(self) -> None:
        self.last_save = self.clock()

    @classmethod
    def from_config(cls, cfg: Config) -> "SavePolicy":
        """The policy of ``cfg.checkpoint`` for a run of ``cfg.train.steps`` steps; the clock starts now."""
        c = cfg.checkpoint
        return cls(every_steps=c.every_steps, every_s=c.every_s, at_end=c.at_end, total_steps=cfg.train.steps)

    def time_due(self) -> bool:
        """Whether ``every_s`` passed since the last save on this rank's clock."""
        return self.every_s > 0 and self.clock() - self.last_save >= self.every_s

    def agree(self, comm: Any, step: int, signum: int, *, nonfinite: int = 0, writing: bool = False,
              grow: int = 0) -> Boundary:
        """Share this rank's flags after ``step``; what any rank set, and whether to save (collective).

        Args:
            signum: the stop signal this rank received, or 0.
            nonfinite: this rank's ``NONFINITE_*`` bits.
            writing: whether this rank's checkpoint writer is still busy.
            grow: this rank's word on replacements for lost ranks (0 where it has none).
        """
        from mpi4py import MPI

        # Only rank 0's clock counts: ranks' clocks drift, their decisions must not.
        due = comm.Get_rank() == 0 and self.time_due()
        flags = np.array([signum, int(due), nonfinite & NONFINITE_LOSS, nonfinite & NONFINITE_GRAD, int(writing),
                          grow],
                         dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        stopped_by = int(flags[0])
        save = should_save(step, every_steps=self.every_steps, time_due=bool(flags[1]), stopping=bool(stopped_by),
                           at_end=self.at_end and step == self.total_steps)
        return Boundary(stopped_by, save, int(flags[2] | flags[3]), bool(flags[4]), int(flags[5]))

    def saved(self) -> None:
        """Restart the clock: a save just finished."""
        self.last_save = self.clock()
