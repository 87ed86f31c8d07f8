"""User datasets: ``data.dataset = "package.module:function"``, called as ``function(split, **data.options)``.

The function returns a map-style torch ``Dataset`` (adapted by ``TorchDatasetSplit``) or an object with
``info``, ``__len__`` and ``read(indices)`` (used as is); both are checked by reading their first sample.
See docs/data.md.
"""

from typing import Any

import numpy as np
import torch

from hpcnet.data.info import DatasetInfo, Split
from hpcnet.errors import DatasetError
from hpcnet.config.importing import load_object

MAX_SCANNED_ITEMS = 100_000
"""A map-style dataset larger than this must say its ``num_classes`` instead of being scanned for it."""


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
            raise DatasetError(f"{label}: dataset.info is a {type(info).__name__}, not an hpcnet.data.info.DatasetInfo")
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
        raise DatasetError(f"{label}: .info is a {type(split.info).__name__}, not an hpcnet.data.info.DatasetInfo")
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


def open_user_dataset(spec: str, split: str, options: dict[str, Any]) -> Split:
    """Call the factory named by ``spec`` (``package.module:function``) and check what it returns.

    Args:
        spec: the import path (``data.dataset``).
        split: ``"train"`` or ``"eval"``, the factory's first argument.
        options: its keyword arguments (``data.options``).

    Raises:
        ConfigError: ``spec`` cannot be imported.
        DatasetError: the factory failed or returned something that is not a dataset.
    """
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
