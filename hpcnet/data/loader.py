"""Datasets: HDF5 splits, user datasets, the global batch sampler and a prefetcher.

A dataset file is HDF5 with groups ``/train`` and ``/eval``, each holding
``inputs`` and ``targets`` with one row per sample, and root attributes
``hpcnet_format = 1``, ``kind`` (``"image"`` or ``"tokens"``) and
``num_classes``. Every rank opens the file read-only with serial h5py and reads
only its own rows, so no parallel HDF5 is needed to train.

Data order does not depend on the number of ranks: ``GlobalBatchSampler`` cuts
one seeded permutation per epoch into global batches and each rank takes its
slice, so N ranks with batch B see exactly the batches one rank with N*B sees.
"""

import concurrent.futures
import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import h5py
import numpy as np
import torch

from hpcnet.errors import ConfigError, DatasetError
from hpcnet.importing import is_import_path, load_object
from hpcnet.models import DATASET_KINDS, DatasetInfo
from hpcnet.data.synthetic import FORMAT_VERSION, SPLITS, SYNTHETIC_DATASETS, ensure_synthetic, positive_ints

MAX_SCANNED_ITEMS = 100_000
"""A map-style dataset larger than this must say its ``num_classes`` instead of being scanned for it."""


@runtime_checkable
class Split(Protocol):
    """One split of a dataset: what the trainer reads from (``H5Split`` or a user object)."""

    info: DatasetInfo

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...


# ---------------------------------------------------------------------------
# reading HDF5


def _attribute(f: h5py.File, path: Path, name: str) -> Any:
    if name not in f.attrs:
        raise DatasetError(f"{path}: root attribute {name!r} is missing; an hpcnet dataset file needs "
                           f"hpcnet_format={FORMAT_VERSION}, kind ('image' or 'tokens') and num_classes")
    value = f.attrs[name]
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.shape == ()):
        value = value.item()  # numpy 2 reprs scalars as np.int64(0): unreadable in a message
    return value


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class H5Split:
    """One split (``train`` or ``eval``) of an hpcnet HDF5 file, validated on open.

    Each rank opens its own read-only handle and reads only the rows it asks for.
    """

    def __init__(self, path: str | os.PathLike[str], split: str) -> None:
        """Open and validate ``/<split>`` of ``path``.

        Args:
            path: an hpcnet HDF5 dataset file.
            split: ``"train"`` or ``"eval"``.

        Raises:
            DatasetError: naming the file and what is wrong with it.
        """
        self.path = Path(path)
        self.split = split
        if not self.path.exists():
            raise DatasetError(f"dataset file {self.path} does not exist")
        if not self.path.is_file():
            raise DatasetError(f"dataset file {self.path} is not a regular file")
        try:
            is_hdf5 = h5py.is_hdf5(self.path)
        except OSError as exc:
            raise DatasetError(f"cannot read dataset file {self.path}: {exc}") from exc
        if not is_hdf5:
            raise DatasetError(f"dataset file {self.path} is not an HDF5 file")
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            raise DatasetError(f"cannot open dataset file {self.path} as HDF5: {exc}") from exc
        try:
            self._inputs, self._targets, self.info = self._validate()
        except BaseException:
            self._file.close()
            raise

    def _validate(self) -> tuple[h5py.Dataset, h5py.Dataset, DatasetInfo]:
        f, path, split = self._file, self.path, self.split
        version = _attribute(f, path, "hpcnet_format")
        if not _is_integer(version) or version != FORMAT_VERSION:
            raise DatasetError(f"{path}: hpcnet_format is {version!r}; this hpcnet reads format {FORMAT_VERSION}")
        kind = _attribute(f, path, "kind")
        if kind not in DATASET_KINDS:
            raise DatasetError(f"{path}: root attribute kind is {kind!r}; expected 'image' or 'tokens'")
        num_classes = _attribute(f, path, "num_classes")
        if not _is_integer(num_classes) or num_classes < 1:
            raise DatasetError(f"{path}: root attribute num_classes is {num_classes!r}; expected a positive integer")
        group = f.get(split)
        if not isinstance(group, h5py.Group):
            raise DatasetError(f"{path}: HDF5 group '/{split}' is missing (the file has {sorted(f)})")
        found = {}
        for name in ("inputs", "targets"):
            dataset = group.get(name)
            if not isinstance(dataset, h5py.Dataset):
                raise DatasetError(f"{path}: HDF5 dataset '/{split}/{name}' is missing")
            found[name] = dataset
        inputs, targets = found["inputs"], found["targets"]
        where_x, where_y = f"{path}: '/{split}/inputs'", f"{path}: '/{split}/targets'"
        if kind == "image":
            if inputs.ndim < 2 or inputs.dtype.kind != "f":
                raise DatasetError(f"{where_x} is {inputs.dtype}{list(inputs.shape)}; image inputs must be "
                                   "floating point, [N, C, H, W]")
            if targets.ndim != 1:
                raise DatasetError(f"{where_y} has shape {list(targets.shape)}; image targets must be [N]")
        else:
            if inputs.ndim != 2 or inputs.dtype.kind not in "iu":
                raise DatasetError(f"{where_x} is {inputs.dtype}{list(inputs.shape)}; token inputs must be "
                                   "integers, [N, T]")
            if targets.shape[1:] != inputs.shape[1:]:
                raise DatasetError(f"{where_y} has shape {list(targets.shape)}; token targets must have the "
                                   f"shape of the inputs, {list(inputs.shape)}")
        if targets.dtype.kind not in "iu":
            raise DatasetError(f"{where_y} has dtype {targets.dtype}; targets must be integers")
        if len(inputs) != len(targets):
            raise DatasetError(f"{where_x} has {len(inputs)} rows but '/{split}/targets' has {len(targets)}")
        if len(inputs) == 0:
            raise DatasetError(f"{path}: split '/{split}' is empty")
        try:
            info = DatasetInfo(kind, tuple(int(d) for d in inputs.shape[1:]), int(num_classes))
        except ValueError as exc:
            raise DatasetError(f"{path}: {exc}") from exc
        # A bad label would surface much later as a cryptic error inside the loss
        # (a device-side assert on GPUs); check the first and last rows now.
        rows = max(1, min(len(targets), 65536 // max(1, math.prod(targets.shape[1:]))))
        for lo in sorted({0, len(targets) - rows}):
            self._check_range(inputs[lo:lo + rows] if kind == "tokens" else None, targets[lo:lo + rows],
                              info, lo)
        return inputs, targets, info

    def _check_range(self, inputs: np.ndarray | None, targets: np.ndarray, info: DatasetInfo, first_row: int) -> None:
        for name, values in (("inputs", inputs), ("targets", targets)):
            if values is None or values.size == 0:
                continue
            low, high = values.min(), values.max()
            if low < 0 or high >= info.num_classes:
                bad = low if low < 0 else high
                raise DatasetError(f"{self.path}: '/{self.split}/{name}' holds {bad} (rows from {first_row}), "
                                   f"outside [0, {info.num_classes}) given by num_classes")

    def __len__(self) -> int:
        return len(self._inputs)

    def __repr__(self) -> str:
        return f"H5Split({str(self.path)!r}, {self.split!r}, {len(self)} rows, {self.info})"

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Read rows ``indices`` (in that order) as (inputs, targets) tensors.

        Args:
            indices: 1-D integer row numbers in [0, len); repeats are allowed.
        """
        indices = np.asarray(indices)
        if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
            raise TypeError(f"indices must be a 1-D integer array, got {indices.dtype}{list(indices.shape)}")
        indices = indices.astype(np.int64, copy=False)
        if indices.size == 0:
            inputs, targets = self._inputs[0:0], self._targets[0:0]
        else:
            if indices.min() < 0 or indices.max() >= len(self):
                raise IndexError(f"{self.path}: row index out of range [0, {len(self)}) in '/{self.split}'")
            rows, order = np.unique(indices, return_inverse=True)
            # One slice per run of consecutive rows (a contiguous range is one read): h5py's
            # fancy indexing took 4-5x longer for 256 random rows here (HDF5 1.10).
            cut = np.flatnonzero(np.diff(rows) != 1) + 1
            runs = list(zip(rows[np.concatenate(([0], cut))], rows[np.concatenate((cut - 1, [-1]))] + 1))
            inputs = np.concatenate([self._inputs[lo:hi] for lo, hi in runs])
            targets = np.concatenate([self._targets[lo:hi] for lo, hi in runs])
            if rows.size != indices.size or not np.array_equal(rows, indices):
                inputs, targets = inputs[order], targets[order]  # back to the order asked for
            self._check_range(inputs if self.info.kind == "tokens" else None, targets, self.info, int(rows[0]))
        dtype = np.float32 if self.info.kind == "image" else np.int64
        return (torch.from_numpy(np.ascontiguousarray(inputs, dtype=dtype)),
                torch.from_numpy(np.ascontiguousarray(targets, dtype=np.int64)))

    def close(self) -> None:
        """Close the file handle."""
        self._file.close()

    def __enter__(self) -> "H5Split":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_split(path: str | os.PathLike[str], split: str) -> H5Split:
    """Open and validate one split of an hpcnet HDF5 file.

    Args:
        path: the file.
        split: ``"train"`` or ``"eval"``.

    Raises:
        DatasetError: naming the file and exactly what is wrong.
    """
    return H5Split(path, split)


# ---------------------------------------------------------------------------
# user datasets


class TorchDatasetSplit:
    """Adapt a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` items to ``Split``."""

    def __init__(self, dataset: Any, label: str) -> None:
        """Wrap ``dataset`` and infer its ``DatasetInfo`` (a ``dataset.info`` attribute overrides).

        Args:
            dataset: supports ``len()`` and ``dataset[i] -> (input, target)``.
            label: names the dataset in error messages, e.g. ``"data.dataset: 'pkg.mod:fn' (train split)"``.
        """
        self.dataset = dataset
        self.label = label
        if len(dataset) == 0:
            raise DatasetError(f"{label}: the dataset is empty")
        x, y = self._item(0)
        info = getattr(dataset, "info", None)
        if info is not None and not isinstance(info, DatasetInfo):
            raise DatasetError(f"{label}: dataset.info is a {type(info).__name__}, not an hpcnet.models.DatasetInfo")
        if info is None:
            kind = "image" if x.is_floating_point() else "tokens"
            if kind == "tokens" and (x.ndim != 1 or y.shape != x.shape):
                raise DatasetError(f"{label}: integer inputs are read as tokens and must be [T] with targets "
                                   f"of the same shape; got inputs {list(x.shape)}, targets {list(y.shape)}")
            if kind == "image" and y.ndim != 0:
                raise DatasetError(f"{label}: float inputs are read as images and need one class index per "
                                   f"sample; got targets of shape {list(y.shape)}")
            try:
                info = DatasetInfo(kind, tuple(x.shape), self._count_classes(kind))
            except ValueError as exc:
                raise DatasetError(f"{label}: {exc}") from exc
        self.info = info

    def _item(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.dataset[index]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DatasetError(f"{self.label}: dataset[{index}] must be an (input, target) pair, "
                               f"got {type(item).__name__}")
        x, y = torch.as_tensor(item[0]), torch.as_tensor(item[1])
        if y.is_floating_point() or y.dtype == torch.bool:
            raise DatasetError(f"{self.label}: targets must be integer class indices, got {y.dtype}")
        return x, y

    def _count_classes(self, kind: str) -> int:
        for attr in ("num_classes", "vocab_size") if kind == "tokens" else ("num_classes",):
            value = getattr(self.dataset, attr, None)
            if value is not None:
                return value
        if kind == "image" and getattr(self.dataset, "classes", None) is not None:
            return len(self.dataset.classes)  # torchvision's convention
        if len(self.dataset) > MAX_SCANNED_ITEMS:
            raise DatasetError(f"{self.label}: cannot infer the number of classes of {len(self.dataset)} items "
                               "without reading them all; give the dataset a num_classes or info attribute")
        highest = -1
        for index in range(len(self.dataset)):
            x, y = self._item(index)
            highest = max(highest, int(y.max()), int(x.max()) if kind == "tokens" else -1)
        return highest + 1

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Fetch and stack items ``indices`` (in that order).

        Args:
            indices: 1-D integer item numbers.
        """
        items = [self._item(int(i)) for i in np.asarray(indices).reshape(-1)]
        expected = self.info.input_shape
        for i, (x, y) in zip(np.asarray(indices).reshape(-1), items):
            if tuple(x.shape) != expected:
                raise DatasetError(f"{self.label}: item {i} has input shape {list(x.shape)}, expected {list(expected)}")
        dtype = torch.float32 if self.info.kind == "image" else torch.int64
        if not items:
            return torch.empty((0, *expected), dtype=dtype), torch.empty((0,), dtype=torch.int64)
        inputs = torch.stack([x for x, _ in items]).to(dtype)
        try:
            targets = torch.stack([y for _, y in items]).to(torch.int64)
        except RuntimeError as exc:
            raise DatasetError(f"{self.label}: targets of different shapes: {exc}") from exc
        return inputs, targets


def _check_user_split(split: Any, label: str) -> Any:
    """Check a factory's result against ``Split`` by reading its first sample."""
    if not isinstance(split.info, DatasetInfo):
        raise DatasetError(f"{label}: .info is a {type(split.info).__name__}, not an hpcnet.models.DatasetInfo")
    if len(split) < 1:
        raise DatasetError(f"{label}: the dataset is empty")
    result = split.read(np.zeros(1, dtype=np.int64))
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        raise DatasetError(f"{label}: read(indices) must return an (inputs, targets) pair of tensors")
    inputs, targets = result
    info = split.info
    want = torch.float32 if info.kind == "image" else torch.int64
    target_shape = (1,) if info.kind == "image" else (1, *info.input_shape)
    if inputs.dtype != want or tuple(inputs.shape) != (1, *info.input_shape):
        raise DatasetError(f"{label}: read([0]) gave inputs {inputs.dtype}{list(inputs.shape)}, "
                           f"expected {want}{[1, *info.input_shape]} for {info}")
    if targets.dtype != torch.int64 or tuple(targets.shape) != target_shape:
        raise DatasetError(f"{label}: read([0]) gave targets {targets.dtype}{list(targets.shape)}, "
                           f"expected torch.int64{list(target_shape)}")
    return split


def _open_here(spec: str, split: str, directory: str | os.PathLike[str], comm: Any,
               options: dict[str, Any], seed: int) -> Split:
    if spec in SYNTHETIC_DATASETS:
        return open_split(ensure_synthetic(spec, directory, comm=comm, seed=seed), split)
    if is_import_path(spec):
        factory = load_object(spec, "data.dataset")
        label = f"data.dataset: {spec!r} ({split} split)"
        try:
            result = factory(split, **options)
        except DatasetError:
            raise
        except Exception as exc:
            raise DatasetError(f"{label} failed: {type(exc).__name__}: {exc}") from exc
        if all(hasattr(result, name) for name in ("info", "read", "__len__")):
            return _check_user_split(result, label)
        if isinstance(result, torch.utils.data.IterableDataset):
            raise DatasetError(f"{label}: returned an IterableDataset; a map-style dataset is needed for "
                               "exact, resumable sampling")
        if hasattr(result, "__getitem__") and hasattr(result, "__len__"):
            return _check_user_split(TorchDatasetSplit(result, label), label)
        raise DatasetError(f"{label}: returned a {type(result).__name__}; expected a map-style torch Dataset "
                           "or an object with info, __len__ and read(indices)")
    path = Path(spec)
    if not path.exists():
        raise DatasetError(f"data.dataset: file {path} does not exist (expected {' or '.join(SYNTHETIC_DATASETS)}, "
                           "a path to an HDF5 file, or 'package.module:function')")
    return open_split(path, split)


def _share_error(comm: Any, error: Exception | None) -> None:
    """Collective: if any rank failed, raise the first failure's error on every rank."""
    report = None if error is None else (isinstance(error, ConfigError), str(error))
    reports = comm.allgather(report)
    failed = [rank for rank, rep in enumerate(reports) if rep is not None]
    if not failed:
        return
    is_config, message = reports[failed[0]]
    if len(failed) < len(reports):
        message += f" (on ranks {failed} of {len(reports)} only)"
    kind = ConfigError if is_config else DatasetError
    if error is not None and type(error) is kind and str(error) == message:
        raise error
    raise kind(message) from error


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
        DatasetError, ConfigError: the same error on every rank.
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
    _share_error(comm, error)
    assert opened is not None
    return opened


# ---------------------------------------------------------------------------
# sampling


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
    """

    def __init__(self, num_samples: int, batch_size: int, *, rank: int, world_size: int, seed: int = 0,
                 shuffle: bool = True) -> None:
        """Create the sampler at the start of epoch 0.

        Args:
            num_samples: samples in the split (N).
            batch_size: samples per rank per step (B).
            rank: this rank, in [0, world_size).
            world_size: number of ranks.
            seed: a non-negative seed; with the epoch it fixes the order.
            shuffle: False keeps the file order in every epoch.

        Raises:
            DatasetError: the dataset is smaller than one global batch.
        """
        positive_ints(num_samples=num_samples, batch_size=batch_size, world_size=world_size)
        if not _is_integer(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if not _is_integer(seed) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch_size = batch_size * world_size
        self.steps_per_epoch = num_samples // self.global_batch_size  # of an epoch started from sample 0
        if self.steps_per_epoch == 0:
            raise DatasetError(f"the dataset has {num_samples} samples, fewer than one global batch of "
                               f"{self.global_batch_size} (batch size {batch_size} x world size {world_size}); "
                               "lower train.batch_size or use fewer ranks")
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

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
        """Advance one step and return this rank's B sample indices (rolls over to the next epoch)."""
        if self._epoch_is_done():
            self._epoch, self._position = self._epoch + 1, 0
        if self._order_epoch != self._epoch:
            self._order, self._order_epoch = self.epoch_order(self._epoch), self._epoch
        start = self._position + self.rank * self.batch_size
        self._position += self.global_batch_size
        return self._order[start:start + self.batch_size].copy()

    def state_dict(self) -> dict[str, int]:
        """The position to resume from: ``{"epoch", "samples_consumed_in_epoch", "seed"}``."""
        if self._epoch_is_done():
            # A finished epoch is stored as the start of the next: the tail this run
            # dropped stays dropped, whatever global batch resumes.
            return {"epoch": self._epoch + 1, "samples_consumed_in_epoch": 0, "seed": self.seed}
        return {"epoch": self._epoch, "samples_consumed_in_epoch": self._position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from ``state_dict()``, possibly saved at another world size or batch size.

        The saved seed replaces this sampler's, so the resumed run continues the
        same order from the saved sample on, in global batches of this sampler's
        size; an epoch that has less than one of them left ends at once.

        Args:
            state: as returned by ``state_dict``.

        Raises:
            ValueError: a malformed state, or a position beyond the end of the dataset.
        """
        missing = {"epoch", "samples_consumed_in_epoch", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        epoch, consumed, seed = state["epoch"], state["samples_consumed_in_epoch"], state["seed"]
        if not all(_is_integer(v) and v >= 0 for v in (epoch, consumed, seed)):
            raise ValueError(f"sampler state must hold non-negative integers, got {dict(state)}")
        if consumed > self.num_samples:
            raise ValueError(f"cannot resume: epoch {epoch} stopped after {consumed} samples, but the dataset "
                             f"has only {self.num_samples} here (has the dataset shrunk?)")
        self.seed, self._epoch, self._position = int(seed), int(epoch), int(consumed)
        self._order_epoch = -1


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


# ---------------------------------------------------------------------------
# prefetching


class BatchLoader:
    """Read the next batch in a background thread while the current step computes."""

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
