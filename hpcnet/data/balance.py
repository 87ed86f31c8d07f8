"""Per-rank batch sizes in proportion to each rank's measured speed (``data.balance=auto``).

On ranks of unequal speed (a slower GPU model, a throttled node, a noisy neighbour) every step waits for the
slowest rank. With ``data.balance=auto`` each rank times its forward and backward (not the wait for the
others), and every ``data.balance_every`` steps the ranks exchange their time per sample and split the next
global batches in proportion to their speeds; the global batch, the data order and the update stay the same:
rank ``r``'s gradient is weighted by ``b_r / G`` instead of ``1 / N`` (``Reducer.set_share``), so the sum is
the mean over the same ``G`` samples. The sizes are kept in the checkpoint's sampler state, so a resumed run
goes on with them (docs/data.md).

``balanced_sizes`` and ``predicted_step_s`` are pure and tested on one process; ``Balancer`` is collective.
"""

import logging
import math
from typing import Any

import numpy as np
import torch

from hpcnet.stateful import Entries, Saved, Stateful
from hpcnet.observe.timer import SpanTimer

log = logging.getLogger(__name__)

GAIN_THRESHOLD = 0.05
"""Re-split only when the modelled step time drops by more than this fraction: measurements are noisy, and each
re-split drops the batch read ahead and, on a GPU, may re-tune kernels for new shapes."""


def balanced_sizes(speeds: list[float], global_batch: int) -> list[int]:
    """Per-rank sizes proportional to ``speeds``, each at least 1, summing to ``global_batch``.

    Largest-remainder rounding, ties to the lower rank, so every rank computes the same split from the same
    speeds.

    Args:
        speeds: samples per second of each rank (positive, finite).
        global_batch: samples per step over all ranks, at least one per rank.

    Raises:
        ValueError: a speed that is not positive and finite, or fewer samples than ranks.
    """
    n = len(speeds)
    if n == 0 or global_batch < n:
        raise ValueError(f"a global batch of {global_batch} cannot give each of {n} rank(s) a sample")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"speeds must be positive and finite, got {speeds}")
    # Each rank keeps one sample; the rest is shared out by speed.
    spare = global_batch - n
    ideal = np.asarray(speeds, dtype=np.float64) / float(sum(speeds)) * spare
    sizes = np.floor(ideal).astype(np.int64)
    left = spare - int(sizes.sum())
    order = sorted(range(n), key=lambda r: (-(ideal[r] - sizes[r]), r))
    for r in order[:left]:
        sizes[r] += 1
    return [int(b) + 1 for b in sizes]


def predicted_step_s(sizes: list[int], seconds_per_sample: list[float]) -> float:
    """The modelled compute time of a step: the slowest rank's samples times its time per sample."""
    return max(b * t for b, t in zip(sizes, seconds_per_sample))


class Balancer(Stateful):
    """Re-split the global batch among the ranks of ``comm`` by their measured speed (collective); a part of the run
    (``hpcnet.stateful``) that takes the shares back after the data position.

    Args:
        comm: the ranks that train.
        loader: the ``BatchLoader``; its sampler's slices are changed.
        dp: the ``DataParallel``; its gradient weights follow the slices and it times the compute.
        every: steps per measuring window (``data.balance_every``); a decision after each.
        device: where the model computes (CUDA steps are timed with events).
        monitor: the ``Monitor`` whose flight recorder logs the exchange.
    """

    def __init__(self, comm: Any, loader: Any, dp: Any, *, every: int, device: torch.device,
                 monitor: Any = None) -> None:
        self.comm, self.loader, self.dp, self.every, self.monitor = comm, loader, dp, every, monitor
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timer = SpanTimer(device)
        dp.compute_timer = self.timer
        self.changes = 0
        self.history: list[dict[str, Any]] = []

    @property
    def sizes(self) -> list[int]:
        return self.loader.sampler.sizes

    @property
    def shares(self) -> list[float]:
        """Each rank's fraction of the global batch."""
        sizes = self.sizes
        return [b / sum(sizes) for b in sizes]

    def after_step(self, step: int) -> None:
        """Called by every rank after each step; every ``every`` steps, the ranks agree on new sizes."""
        if self.size == 1 or step % self.every:
            return
        per_sample = self.seconds_per_sample()
        if self.monitor is not None:
            with self.monitor.collective("balance.allgather"):
                measured = self.comm.allgather(per_sample)
        else:
            measured = self.comm.allgather(per_sample)
        if not all(math.isfinite(t) and t > 0 for t in measured):
            return  # a rank without a measurement (no step timed in the window): keep the sizes
        current = self.sizes
        proposed = balanced_sizes([1.0 / t for t in measured], sum(current))
        before, after = predicted_step_s(current, measured), predicted_step_s(proposed, measured)
        if proposed == current or after >= (1 - GAIN_THRESHOLD) * before:
            return
        self._apply(proposed)
        self.timer.discard()
        self.changes += 1
        self.history.append({"step": step, "sizes": proposed, "seconds_per_sample": measured,
                             "predicted_compute_s": [before, after]})
        if self.rank == 0:
            log.info("data.balance: from step %d the ranks take %s samples per micro-batch (measured %s ms per "
                     "sample; modelled compute per step %.1f -> %.1f ms)", step + 1, _short(proposed),
                     _short([f"{1e3 * t:.2f}" for t in measured]), 1e3 * before, 1e3 * after)

    def seconds_per_sample(self) -> float:
        """This rank's forward and backward time per sample over the window (median step; 0: none timed)."""
        times = self.timer.drain()
        if not times:
            return 0.0
        # The first step of a window may carry one-off costs (new shapes, a re-read batch): left out when more
        # than one was timed.
        return float(np.median(times[1:] if len(times) > 1 else times)) / self.sizes[self.rank]

    def state_entries(self) -> Entries:
        """Nothing of its own: the shares are the sampler's slice sizes, saved with the data position (the loader's
        entry, ``batch_sizes``)."""
        return Entries()

    def load_entries(self, saved: Saved) -> None:
        """Go on with the sizes of the run that saved, where they fit this world and global batch (the sampler
        took them back with the data position: ``resumed_sizes``), so its next steps are repeated exactly."""
        resumed = self.loader.sampler.resumed_sizes
        if resumed is not None and resumed != self.sizes:
            self._apply(resumed)

    def _apply(self, sizes: list[int]) -> None:
        self.loader.set_sizes(sizes)
        self.dp.set_share(sizes[self.rank] / sum(sizes))

    def summary(self) -> dict[str, Any]:
        return {"sizes": self.sizes, "changes": self.changes, "history": self.history[-8:]}


def _short(values: list[Any], head: int = 8) -> str:
    text = ", ".join(str(v) for v in values[:head])
    return f"[{text}{', ...' if len(values) > head else ''}]"
