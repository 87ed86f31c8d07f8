"""Opening a dataset and feeding the trainer: ``open_dataset`` chooses how ``data.dataset`` is read
(a built-in synthetic set, an HDF5 file, or a user factory) and shares a failure on any rank with all;
``BatchLoader`` reads the next batch in a background thread while the current step computes.

The choices are in docs/data.md.
"""

import concurrent.futures
import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from hpcnet.agree import agree_on_first_error
from hpcnet.stateful import Entries, Saved, Stateful
from hpcnet.data.h5 import open_split
from hpcnet.data.info import SPLITS, Split
from hpcnet.data.sampler import GlobalBatchSampler
from hpcnet.data.synthetic import SYNTHETIC_DATASETS, ensure_synthetic
from hpcnet.data.user import open_user_dataset
from hpcnet.errors import ConfigError, DatasetError
from hpcnet.config.importing import is_import_path


def _open_here(spec: str, split: str, directory: str | os.PathLike[str], comm: Any,
               options: dict[str, Any], seed: int) -> Split:
    if spec in SYNTHETIC_DATASETS:
        return open_split(ensure_synthetic(spec, directory, comm=comm, seed=seed), split)
    if is_import_path(spec):
        return open_user_dataset(spec, split, options)
    path = Path(spec)
    if not path.exists():
        raise DatasetError(f"data.dataset: file {path} does not exist (expected {' or '.join(SYNTHETIC_DATASETS)}, "
                           "a path to an HDF5 file, or 'package.module:function')")
    return open_split(path, split)


def open_dataset(spec: str, split: str, *, directory: str | os.PathLike[str], comm: Any,
                 options: dict[str, Any] | None = None, seed: int = 0) -> Split:
    """Open one split of the dataset named by ``data.dataset`` (collective).

    Args:
        spec: a built-in name (``synthetic-images``, ``synthetic-tokens``), a path to an
            hpcnet HDF5 file, or ``package.module:function`` called as ``function(split, **options)``
            and returning a map-style torch ``Dataset`` or an object with ``info``, ``__len__``, ``read``.
        split: ``"train"`` or ``"eval"``.
        directory: where built-in datasets are cached (``data.dir``).
        comm: the ranks that will read the data; a failure on any is raised on all.
        options: keyword arguments for a factory (``data.options``).
        seed: generation seed of the built-in datasets.

    Raises:
        DatasetError, ConfigError: the same error, with the same message, on every rank.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    opened: Split | None = None
    error: Exception | None = None
    try:
        opened = _open_here(spec, split, directory, comm, dict(options or {}), seed)
    except Exception as exc:  # noqa: BLE001 - shared so every rank raises alike
        error = exc if isinstance(exc, (DatasetError, ConfigError)) else DatasetError(
            f"data.dataset: {spec!r} ({split} split): {type(exc).__name__}: {exc}")
        if error is not exc:
            error.__cause__ = exc
    agree_on_first_error(comm, error)
    assert opened is not None
    return opened


class BatchLoader(Stateful):
    """Read the next batch in a background thread while the current step computes; a part of the run
    (``hpcnet.stateful``) whose checkpoint entry is the data position, the meta's ``sampler``."""

    def __init__(self, split: Split, sampler: GlobalBatchSampler, *, prefetch: bool = True) -> None:
        """Start reading the first batch.

        Load the sampler's state before creating the loader, or call ``load_state_dict`` here.

        Args:
            split: what to read from.
            sampler: decides the indices; only this loader should advance it from now on.
            prefetch: False reads synchronously in ``next()`` (for debugging).
        """
        self.split, self.sampler = split, sampler
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcnet-prefetch")
                          if prefetch else None)
        self._state = sampler.state_dict()
        self._epoch = sampler.epoch
        self._pending: tuple[Any, dict[str, int], int] | None = None
        self._closed = False
        self._submit()

    def _submit(self) -> None:
        indices = self.sampler.next_indices()
        state, epoch = self.sampler.state_dict(), self.sampler.epoch
        if self._executor is None:
            self._pending = (indices, state, epoch)
        else:
            self._pending = (self._executor.submit(self.split.read, indices), state, epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the batch last returned by ``next()`` (the sampler itself runs one batch ahead)."""
        return self._epoch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's next (inputs, targets) and start reading the one after.

        Raises:
            Exception: whatever the read raised, here in the caller's thread.
        """
        if self._closed or self._pending is None:
            raise RuntimeError("BatchLoader is closed (or a read failed earlier)")
        work, state, epoch = self._pending
        self._pending = None
        batch = work.result() if self._executor is not None else self.split.read(work)
        self._state, self._epoch = state, epoch
        self._submit()
        return batch

    __next__ = next

    def __iter__(self) -> "BatchLoader":
        return self

    def state_dict(self) -> dict[str, int]:
        """The sampler position after the batches returned so far (not the one being prefetched)."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Drop the prefetched batch and resume from ``state`` (see ``GlobalBatchSampler.load_state_dict``).

        Args:
            state: as returned by ``state_dict``.
        """
        self._wait_pending()
        self.sampler.load_state_dict(state)
        self._state, self._epoch = self.sampler.state_dict(), self.sampler.epoch
        self._submit()

    def state_entries(self) -> Entries:
        """The data position (``state_dict``), with the slice sizes where ``data.balance`` made them unequal."""
        return Entries(meta={"sampler": self.state_dict()})

    def load_entries(self, saved: Saved) -> None:
        """Go on from the checkpoint's data position, at any world size and batch size (``load_state_dict``); a
        malformed position or a shrunk dataset is a clear ValueError."""
        self.load_state_dict(saved.meta["sampler"])

    def set_sizes(self, sizes: list[int] | None) -> None:
        """Split the global batches into these per-rank sizes from the next ``next()`` on
        (``GlobalBatchSampler.set_sizes``); the batch read ahead with the old sizes is dropped and read again.

        Args:
            sizes: samples per rank, rank by rank, summing to the global batch; None: equal slices.
        """
        if self._closed:
            raise RuntimeError("BatchLoader is closed")
        self._wait_pending()
        self.sampler.load_state_dict(self._state)  # back to the position after the batches returned so far
        self.sampler.set_sizes(sizes)
        self._state = self.sampler.state_dict()  # a checkpoint taken now resumes with the new sizes
        self._submit()

    def _wait_pending(self) -> None:
        if self._pending is not None and self._executor is not None:
            future = self._pending[0]
            if not future.cancel():
                with contextlib.suppress(Exception):
                    future.result()  # the batch is being dropped, and so is its error
        self._pending = None

    def close(self) -> None:
        """Wait for the read in flight and stop the thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._wait_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
