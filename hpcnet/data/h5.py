"""HDF5 dataset files, the one home of the format: ``H5Split`` opens one split read-only, validates it
and reads rows by index; ``atomic_h5``, ``set_root_attributes`` and ``create_split`` write one.

Every rank opens its own handle with serial h5py and reads only its rows, so no parallel HDF5 is
needed to train. The file layout is in docs/data.md; ``hpcnet.data.synthetic`` (generated
sets) and ``hpcnet.data.convert`` (the user's arrays) write it. Torch is imported only to read, so the
writers' command lines start without it.
"""

import contextlib
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from hpcnet.data.info import DATASET_KINDS, FORMAT_VERSION, DatasetInfo, is_integer
from hpcnet.errors import DatasetError

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------
# writing


@contextlib.contextmanager
def atomic_h5(path: Path) -> Iterator[h5py.File]:
    """Write an HDF5 file under a temporary name and rename it into place on success.

    On any exception the temporary file is removed and ``path`` is left as it was.

    Args:
        path: the file to create or replace.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory, so os.replace is an atomic rename: readers see no file or a whole one.
    # Not mkstemp: its 0600 mode would hide the file from other users of a shared data.dir.
    tmp_name = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with h5py.File(tmp_name, "w-") as f:
            yield f
        with open(tmp_name, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def set_root_attributes(f: h5py.File, kind: str, num_classes: int, **provenance: Any) -> None:
    """Write the root attributes that make ``f`` an hpcnet dataset file.

    Args:
        f: the file, open for writing.
        kind: ``"image"`` or ``"tokens"``.
        num_classes: number of classes, or the vocabulary size for tokens.
        provenance: more attributes saying where the data came from (``generator``, ``seed``, ...).
    """
    if kind not in DATASET_KINDS:
        raise ValueError(f"kind must be one of {', '.join(DATASET_KINDS)}, got {kind!r}")
    if not is_integer(num_classes) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    f.attrs.update(hpcnet_format=FORMAT_VERSION, kind=kind, num_classes=num_classes, **provenance)


def chunk_shape(row_shape: tuple[int, ...], itemsize: int, num_rows: int, chunk_bytes: int) -> tuple[int, ...]:
    """Chunks of whole rows, as many as fit in ``chunk_bytes`` (at least one, at most ``num_rows``)."""
    rows = max(1, chunk_bytes // max(1, math.prod(row_shape) * itemsize))
    return (min(rows, num_rows), *row_shape)


def create_split(f: h5py.File, split: str, inputs: tuple[tuple[int, ...], Any], targets: tuple[tuple[int, ...], Any],
                 *, chunk_bytes: int) -> tuple[h5py.Dataset, h5py.Dataset]:
    """Create ``/<split>/inputs`` and ``/<split>/targets``, chunked by rows, for the caller to fill.

    Args:
        f: the file, open for writing.
        split: ``"train"`` or ``"eval"``.
        inputs: (shape, dtype) of the inputs, rows first.
        targets: (shape, dtype) of the targets, rows first.
        chunk_bytes: target size of one chunk (see ``chunk_shape``).
    """
    group = f.create_group(split)
    datasets = []
    for name, (shape, dtype) in (("inputs", inputs), ("targets", targets)):
        chunks = chunk_shape(shape[1:], np.dtype(dtype).itemsize, shape[0], chunk_bytes)
        datasets.append(group.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks))
    return datasets[0], datasets[1]


# ---------------------------------------------------------------------------
# reading


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


def _root_attributes(f: h5py.File, path: Path) -> tuple[str, int]:
    """The file's ``kind`` and ``num_classes``, after its format version."""
    version = _attribute(f, path, "hpcnet_format")
    if not is_integer(version) or version != FORMAT_VERSION:
        raise DatasetError(f"{path}: hpcnet_format is {version!r}; this hpcnet reads format {FORMAT_VERSION}")
    kind = _attribute(f, path, "kind")
    if kind not in DATASET_KINDS:
        raise DatasetError(f"{path}: root attribute kind is {kind!r}; expected 'image' or 'tokens'")
    num_classes = _attribute(f, path, "num_classes")
    if not is_integer(num_classes) or num_classes < 1:
        raise DatasetError(f"{path}: root attribute num_classes is {num_classes!r}; expected a positive integer")
    return kind, num_classes


def _arrays(f: h5py.File, path: Path, split: str, kind: str) -> tuple[h5py.Dataset, h5py.Dataset]:
    """``/<split>/inputs`` and ``/<split>/targets``, checked for the dtypes and shapes of ``kind``."""
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
    return inputs, targets


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
        kind, num_classes = _root_attributes(self._file, self.path)
        inputs, targets = _arrays(self._file, self.path, self.split, kind)
        try:
            info = DatasetInfo(kind, tuple(int(d) for d in inputs.shape[1:]), int(num_classes))
        except ValueError as exc:
            raise DatasetError(f"{self.path}: {exc}") from exc
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

    def read(self, indices: np.ndarray) -> "tuple[torch.Tensor, torch.Tensor]":
        """Read rows ``indices`` (in that order) as (inputs, targets) tensors.

        Args:
            indices: 1-D integer row numbers in [0, len); repeats are allowed.
        """
        import torch  # here, not at the top: the dataset writers' command lines do not need it

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
            # fancy indexing is several times slower for a batch of random rows.
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
