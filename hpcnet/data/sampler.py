"""Which samples each rank reads: ``GlobalBatchSampler`` for training, ``eval_indices`` for evaluation.

Data order does not depend on the number of ranks: one seeded permutation per epoch is cut into global
batches and each rank takes its slice, so N ranks with batch B see exactly the batches one rank with
N*B sees; the position is kept in samples, so a run resumes at any world or batch size (docs/data.md). Pure: no communication, no files.
"""

from typing import Any

import numpy as np

from hpcnet.data.info import is_integer, positive_ints
from hpcnet.errors import DatasetError


class GlobalBatchSampler:
    """Seeded global batches, each rank taking its contiguous slice.

    Epoch ``e`` orders all samples by a permutation drawn from
    ``PCG64(SeedSequence([seed, e]))`` and hands it out in consecutive global
    batches of ``G = batch_size * world_size`` samples from the epoch's
    position (0 in a fresh epoch, so global batch ``k`` is ``perm[k*G:(k+1)*G]``);
    rank ``r`` takes ``[r*B:(r+1)*B]`` of each. When fewer than ``G`` samples
    are left, they are dropped and the next epoch begins. The position is kept
    in samples, so a run can resume at another world size or batch size: it
    continues the same order from the saved sample on, in its own batch grid.

    With ``set_sizes`` (``data.balance=auto``) the ranks take slices of unequal
    sizes ``b_0 .. b_{N-1}`` that sum to ``G``: rank ``r`` takes
    ``[b_0 + .. + b_{r-1}, + b_r)``, so the global batches are unchanged.
    """

    def __init__(self, num_samples: int, batch_size: int, *, rank: int, world_size: int, seed: int = 0,
                 shuffle: bool = True, global_batch: int | None = None) -> None:
        """Create the sampler at the start of epoch 0.

        Args:
            num_samples: samples in the split (N).
            batch_size: samples per rank per step (B).
            rank: this rank, in [0, world_size).
            world_size: number of ranks.
            seed: a non-negative seed; with the epoch it fixes the order.
            shuffle: False keeps the file order in every epoch.
            global_batch: samples per step of all ranks together, when not ``batch_size * world_size`` (a job
                that lost ranks keeps its global batch: ``fault.recovery=shrink``); the ranks then take slices
                as equal as they can be (the first ``G mod N`` one sample more).

        Raises:
            DatasetError: the dataset is smaller than one global batch.
        """
        positive_ints(num_samples=num_samples, batch_size=batch_size, world_size=world_size)
        if not is_integer(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if not is_integer(seed) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch_size = batch_size * world_size if global_batch is None else global_batch
        if not is_integer(self.global_batch_size) or self.global_batch_size < world_size:
            raise ValueError(f"global_batch must be at least one sample a rank ({world_size}), got {global_batch!r}")
        base, extra = divmod(self.global_batch_size, world_size)
        self._equal = [base + (r < extra) for r in range(world_size)]
        self.steps_per_epoch = num_samples // self.global_batch_size  # of an epoch started from sample 0
        if self.steps_per_epoch == 0:
            raise DatasetError(f"the dataset has {num_samples} samples, fewer than one global batch of "
                               f"{self.global_batch_size} (batch size {batch_size} x world size {world_size}); "
                               "lower train.batch_size or use fewer ranks")
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)
        self._sizes: list[int] | None = None
        self._start = sum(self._equal[:rank])
        self.resumed_sizes: list[int] | None = None

    @property
    def sizes(self) -> list[int]:
        """Samples per rank per step, rank by rank (all ``batch_size``, or the global batch's equal slices, unless
        ``set_sizes`` changed them)."""
        return list(self._sizes) if self._sizes is not None else list(self._equal)

    @property
    def local_batch_size(self) -> int:
        """This rank's samples per step (micro-batch)."""
        return self.sizes[self.rank]

    def set_sizes(self, sizes: list[int] | None) -> None:
        """Split every later global batch into slices of ``sizes`` (rank by rank); None: equal slices.

        Raises:
            ValueError: not one positive integer per rank, or a sum other than the global batch.
        """
        if sizes is not None:
            if len(sizes) != self.world_size or not all(is_integer(b) and b >= 1 for b in sizes):
                raise ValueError(f"sizes must be {self.world_size} positive integers, got {sizes!r}")
            if sum(sizes) != self.global_batch_size:
                raise ValueError(f"sizes {list(sizes)} sum to {sum(sizes)}, not the global batch "
                                 f"{self.global_batch_size}")
            sizes = [int(b) for b in sizes]
            if sizes == self._equal:
                sizes = None
        self._sizes = sizes
        self._start = sum(self.sizes[:self.rank])

    @property
    def epoch(self) -> int:
        """The epoch of the batch last returned (0 before the first)."""
        return self._epoch

    @property
    def samples_in_epoch(self) -> int:
        """Samples of the current epoch already handed out, by all ranks together."""
        return self._position

    def _epoch_is_done(self) -> bool:
        # Less than one global batch left: the tail is dropped, as at the end of every epoch.
        return self._position + self.global_batch_size > self.num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of all samples in ``epoch`` (the same on every rank and world size).

        Args:
            epoch: a non-negative epoch number.
        """
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        # argsort of raw PCG64 output rather than Generator.permutation: raw bit-generator
        # streams are guaranteed stable across numpy versions, Generator methods are not.
        keys = np.random.PCG64(np.random.SeedSequence([self.seed, epoch])).random_raw(self.num_samples)
        return np.argsort(keys, kind="stable").astype(np.int64)

    def next_indices(self) -> np.ndarray:
        """Advance one step and return this rank's sample indices (rolls over to the next epoch)."""
        if self._epoch_is_done():
            self._epoch, self._position = self._epoch + 1, 0
        if self._order_epoch != self._epoch:
            self._order, self._order_epoch = self.epoch_order(self._epoch), self._epoch
        start = self._position + self._start
        self._position += self.global_batch_size
        return self._order[start:start + self.local_batch_size].copy()

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: ``{"epoch", "samples_consumed_in_epoch", "seed"}``, and ``"batch_sizes"``
        (per rank) when ``set_sizes`` made them unequal."""
        if self._epoch_is_done():
            # A finished epoch is stored as the start of the next: the tail this run
            # dropped stays dropped, whatever global batch resumes.
            state: dict[str, Any] = {"epoch": self._epoch + 1, "samples_consumed_in_epoch": 0, "seed": self.seed}
        else:
            state = {"epoch": self._epoch, "samples_consumed_in_epoch": self._position, "seed": self.seed}
        if self._sizes is not None:
            state["batch_sizes"] = list(self._sizes)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``, possibly saved at another world size or batch size.

        The saved seed replaces this sampler's, so the resumed run continues the
        same order from the saved sample on, in global batches of this sampler's
        size; an epoch that has less than one of them left ends at once. Saved
        per-rank sizes are kept in ``resumed_sizes`` when they fit this world and
        global batch (None otherwise), for the caller to apply with ``set_sizes``;
        the sampler itself goes on with equal slices.

        Args:
            state: as returned by ``state_dict``.

        Raises:
            ValueError: a malformed state, or a position beyond the end of the dataset.
        """
        missing = {"epoch", "samples_consumed_in_epoch", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        epoch, consumed, seed = state["epoch"], state["samples_consumed_in_epoch"], state["seed"]
        if not all(is_integer(v) and v >= 0 for v in (epoch, consumed, seed)):
            raise ValueError(f"sampler state must hold non-negative integers, got {dict(state)}")
        if consumed > self.num_samples:
            raise ValueError(f"cannot resume: epoch {epoch} stopped after {consumed} samples, but the dataset "
                             f"has only {self.num_samples} here (has the dataset shrunk?)")
        self.seed, self._epoch, self._position = int(seed), int(epoch), int(consumed)
        self._order_epoch = -1
        saved = state.get("batch_sizes")
        fits = (isinstance(saved, list) and len(saved) == self.world_size and sum(saved) == self.global_batch_size
                and all(is_integer(b) and b >= 1 for b in saved))
        self.resumed_sizes = [int(b) for b in saved] if fits else None


def eval_indices(n: int, rank: int, size: int) -> np.ndarray:
    """This rank's contiguous shard of ``range(n)``; the first ``n % size`` ranks get one more.

    Args:
        n: number of samples; every one lands on exactly one rank (a rank may get none).
        rank: this rank.
        size: number of ranks.
    """
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return np.arange(start, start + base + (rank < extra), dtype=np.int64)
