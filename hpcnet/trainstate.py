"""What a training run saves and restores, and when it saves.

``StepBoundary.agree`` is the one control-plane collective of every step: the
ranks share a stop request (a signal on any rank) and rank 0's clock for
time-based saves in one small all-reduce, so every rank decides to save, and
to stop, after the same step.
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

from hpcnet.checkpoint import CheckpointManager, Loaded, flatten_state, restore_state, rng_state, set_rng_state
from hpcnet.config import Config, to_dict
from hpcnet.world import shared_errors

log = logging.getLogger(__name__)


def checkpoint_dir(cfg: Config) -> Path:
    """``checkpoint.dir``, or ``<run.dir>/<run.name>.ckpt`` (shared by every run of that name)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / f"{cfg.run.name}.ckpt"


def should_save(step: int, *, every_steps: int, time_due: bool, stopping: bool) -> bool:
    """The save decision at a step boundary (pure)."""
    return stopping or time_due or (every_steps > 0 and step % every_steps == 0)


@dataclass
class StepBoundary:
    """Agree, once per step, on stopping and on time-based saves (collective)."""

    every_s: float
    last_save: float = 0.0

    def __post_init__(self) -> None:
        self.last_save = time.monotonic()

    def agree(self, comm: Any, signum: int) -> tuple[int, bool]:
        """Return (signal number any rank received or 0, whether a time-based save is due)."""
        from mpi4py import MPI

        # Only rank 0's clock counts: ranks' clocks drift, their decisions must not.
        due = comm.Get_rank() == 0 and self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        flags = np.array([signum, int(due)], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        return int(flags[0]), bool(flags[1])

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

    def resume(self, which: str, *, rank: int) -> int:
        """Collective: restore from a checkpoint (``'auto'`` or a path); return the step to continue from."""
        loaded = self.manager.load(which)
        if loaded is None:
            log.info("no checkpoint in %s: starting from step 0", self.manager.directory)
            return 0
        self._restore(loaded, rank)
        return loaded.step

    def _restore(self, loaded: Loaded, rank: int) -> None:
        # Everything here may fail on some ranks only (each restores its own
        # RNG state), so the outcome is shared before the next collective.
        with shared_errors(self.manager.comm):
            restore_state(self.model, self.optimizer, loaded.tensors, loaded.meta["state"])
            # Raises a clear ValueError when the new global batch cannot continue
            # mid-epoch from the saved position.
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
