"""What a training run saves and restores, and when it saves.

``StepBoundary.agree`` is the one control-plane collective of every step: the
ranks share a stop request (a signal on any rank), a non-finite loss or
gradient norm (``train.nonfinite``) and rank 0's clock for time-based saves in
one small all-reduce, so every rank decides to save, and to stop, after the
same step.
"""

import logging
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.ckpt.manager import CheckpointManager, Loaded, flatten_state, restore_state, rng_state, set_rng_state
from hpcnet.config import Config
from hpcnet.config_manager import to_dict
from hpcnet.agree import shared_errors

log = logging.getLogger(__name__)


def should_save(step: int, *, every_steps: int, time_due: bool, stopping: bool) -> bool:
    """The save decision at a step boundary (pure)."""
    return stopping or time_due or (every_steps > 0 and step % every_steps == 0)


NONFINITE_LOSS = 1
"""``StepBoundary.agree``'s ``nonfinite`` bit: this rank's loss is NaN or infinite."""
NONFINITE_GRAD = 2
"""``StepBoundary.agree``'s ``nonfinite`` bit: the (global) gradient norm is NaN or infinite."""


@dataclass
class StepBoundary:
    """Agree, once per step, on stopping, on non-finite values and on time-based saves (collective)."""

    every_s: float
    last_save: float = 0.0

    def __post_init__(self) -> None:
        self.last_save = time.monotonic()

    def agree(self, comm: Any, signum: int, *, nonfinite: int = 0) -> tuple[int, bool, int]:
        """Share this rank's flags; return what any rank set (collective).

        Returns:
            (the signal number any rank received or 0, whether a time-based save
            is due, the ``NONFINITE_*`` bits of all ranks together).
        """
        from mpi4py import MPI

        # Only rank 0's clock counts: ranks' clocks drift, their decisions must not.
        due = comm.Get_rank() == 0 and self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        flags = np.array([signum, int(due), nonfinite & NONFINITE_LOSS, nonfinite & NONFINITE_GRAD], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        return int(flags[0]), bool(flags[1]), int(flags[2] | flags[3])

    def saved(self) -> None:
        self.last_save = time.monotonic()


class TrainState:
    """The pieces of a run that a checkpoint holds: model, optimizer, data position, RNG."""

    def __init__(self, cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: Any,
                 manager: CheckpointManager) -> None:
        self.cfg, self.model, self.optimizer, self.sampler, self.manager = cfg, model, optimizer, sampler, manager
        self.last_saved_step = -1

    def save(self, step: int, loader_state: dict[str, Any]) -> Path:
        """Collective: checkpoint the state after ``step`` (blocks only for the snapshot when async)."""
        tensors, state_meta = flatten_state(self.model, self.optimizer)
        meta = {"state": state_meta, "sampler": loader_state, "config": to_dict(self.cfg), "step": step}
        path = self.manager.save(step, tensors, meta, rng_state())
        self.last_saved_step = step
        timings = self.manager.last_timings
        log.info("checkpoint at step %d: %s (%s, blocked %.3f s)", step, path.name,
                 "writing in the background" if self.manager.async_save else "written",
                 timings.get("blocking_s", 0.0))
        return path

    def is_finite(self) -> bool:
        """Collective: whether the model and optimizer state hold only finite numbers on every rank.

        A pass over the whole state, so it runs before saves only: the per-step
        checks see the loss and the gradient norm, not an update that overflowed
        (a finite gradient times a huge learning rate) or statistics a forward
        pass left non-finite.
        """
        from mpi4py import MPI

        tensors, _ = flatten_state(self.model, self.optimizer)
        checks: dict[torch.device, list[torch.Tensor]] = {}
        for tensor in tensors.values():
            if tensor.is_floating_point() or tensor.is_complex():
                checks.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
        # One device-to-host copy per device (Adam keeps its step counters on the CPU).
        finite = all(bool(torch.stack(flags).all()) for flags in checks.values())
        return bool(self.manager.comm.allreduce(int(finite), op=MPI.MIN))

    def start(self, which: str, *, rank: int) -> int:
        """Collective: begin the run, fresh (``''``) or from a checkpoint (``'auto'`` or a path).

        Returns the step to continue from.  A fresh run needs a checkpoint
        directory of its own (see ``CheckpointManager.start_fresh``).
        """
        if not which:
            self.manager.start_fresh()
            return 0
        loaded = self.manager.resume(which)
        if loaded is None:
            log.info("no checkpoint in %s yet: starting from step 0", self.manager.directory)
            return 0
        self._restore(loaded, rank)
        return loaded.step

    def _restore(self, loaded: Loaded, rank: int) -> None:
        # Everything here may fail on some ranks only (each restores its own
        # RNG state), so the outcome is shared before the next collective.
        with shared_errors(self.manager.comm):
            restore_state(self.model, self.optimizer, loaded.tensors, loaded.meta["state"])
            # Any world size and batch size continue from the saved sample position;
            # a malformed state or a shrunk dataset is a clear ValueError.
            self.sampler.load_state_dict(loaded.meta["sampler"])
            if loaded.rank_state is not None:
                set_rng_state(loaded.rank_state)
            else:
                # More ranks than were saved: a fresh, distinct, reproducible seed.
                torch.manual_seed(zlib.crc32(f"{self.cfg.run.seed}/{rank}/{loaded.step}".encode()))
        self.last_saved_step = loaded.step
        log.info("resumed from %s at step %d (saved by %d rank(s)%s)", loaded.path, loaded.step,
                 loaded.saved_world_size,
                 f"; skipped {len(loaded.skipped)} unusable newer checkpoint(s)" if loaded.skipped else "")
