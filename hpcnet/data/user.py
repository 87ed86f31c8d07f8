"""User datasets: ``data.dataset = "package.module:function"``, called as ``function(split, **data.options)``.

The function returns a map-style torch ``Dataset`` (adapted by ``TorchDatasetSplit``) or an object with
``info``, ``__len__`` and ``read(indices)`` (used as is); both are checked by reading their first sample. Items
are (input, class index) pairs (images, tokens, sequences) or, for a model trained with ``model.loss``, any
structure of tensors (kind 'other').
See docs/data.md.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hpcnet.config.importing import load_object
from hpcnet.data.info import DatasetInfo, Split
from hpcnet.errors import DatasetError

OTHER_HINT = ("; for other targets (a mask, several labels) give the dataset an info attribute, "
              "DatasetInfo('other', input_shape, num_classes), and set model.loss")
"""How an (input, integer target) item that fits no kind is trained: kind 'other' with the user's objective."""
MAX_SCANNED_ITEMS = 100_000
"""A map-style dataset larger than this must say its ``num_classes`` instead of being scanned for it."""


class TorchDatasetSplit:
    """Adapt a map-style ``torch.utils.data.Dataset`` to ``Split``.

    An ``(input, class index)`` item is an image (float input, one class), tokens (integer [T] input, [T] next
    tokens) or a sequence (integer [T] input, one class); any other item (a dict, a longer tuple, float targets)
    is kind 'other', batched as its structure with each tensor stacked (``default_collate``), for a model whose
    ``model.loss`` understands it."""

    def __init__(self, dataset: Any, label: str) -> None:
        """Wrap ``dataset`` and infer its ``DatasetInfo`` (a ``dataset.info`` attribute overrides).

        Args:
            dataset: supports ``len()`` and ``dataset[i]``.
            label: names the dataset in error messages, e.g. ``"data.dataset: 'pkg.mod:fn' (train split)"``.
        """
        self.dataset = dataset
        self.label = label
        if len(dataset) == 0:
            raise DatasetError(f"{label}: the dataset is empty")
        info = getattr(dataset, "info", None)
        if info is not None and not isinstance(info, DatasetInfo):
            raise DatasetError(f"{label}: dataset.info is a {type(info).__name__}, not an hpcnet.data.info.DatasetInfo")
        first = dataset[0]
        pair = _class_pair(first)
        if info is None:
            info = self._infer(first, pair)
        elif info.kind != "other" and pair is None:
            raise DatasetError(f"{label}: dataset.info says kind {info.kind!r}, whose items are (input, class "
                               f"index) pairs; dataset[0] is {describe(first)}")
        self.info = info

    def _infer(self, first: Any, pair: tuple[torch.Tensor, torch.Tensor] | None) -> DatasetInfo:
        if pair is None:
            leaf = first_tensor(first)
            if leaf is None:
                raise DatasetError(f"{self.label}: dataset[0] is {describe(first)}, which holds no tensor or number")
            return DatasetInfo("other", tuple(leaf.shape), int(getattr(self.dataset, "num_classes", 0) or 0))
        x, y = pair
        if x.is_floating_point():
            kind = "image"
            if y.ndim != 0:
                raise DatasetError(f"{self.label}: float inputs are read as images and need one class index per "
                                   f"sample; got targets of shape {list(y.shape)}{OTHER_HINT}")
        elif x.ndim == 1 and y.shape == x.shape:
            kind = "tokens"
        elif x.ndim == 1 and y.ndim == 0:
            kind = "sequence"
        else:
            raise DatasetError(f"{self.label}: integer inputs are read as tokens ([T] inputs, [T] targets) or "
                               f"sequences ([T] inputs, one class); got inputs {list(x.shape)}, targets "
                               f"{list(y.shape)}{OTHER_HINT}")
        try:
            return DatasetInfo(kind, tuple(x.shape), self._count_classes(kind))
        except ValueError as exc:
            raise DatasetError(f"{self.label}: {exc}") from exc

    def _item(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.dataset[index]
        pair = _class_pair(item)
        if pair is None:
            raise DatasetError(f"{self.label}: dataset[{index}] must be an (input, class index) pair like the "
                               f"items before it, got {describe(item)}")
        return pair

    def _count_classes(self, kind: str) -> int:
        for attr in ("num_classes", "vocab_size") if kind == "tokens" else ("num_classes",):
            value = getattr(self.dataset, attr, None)
            if value is not None:
                return value
        if kind != "tokens" and getattr(self.dataset, "classes", None) is not None:
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

    def read(self, indices: np.ndarray) -> Any:
        """Fetch and stack items ``indices`` (in that order): an (inputs, targets) pair, or for kind 'other' the
        items' structure with every tensor stacked.

        Args:
            indices: 1-D integer item numbers.
        """
        numbers = [int(i) for i in np.asarray(indices).reshape(-1)]
        if self.info.kind == "other":
            return self._collate(numbers)
        items = [self._item(i) for i in numbers]
        expected = self.info.input_shape
        for i, (x, _) in zip(numbers, items):
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

    def _collate(self, numbers: list[int]) -> Any:
        items = [self.dataset[i] for i in numbers]
        try:
            return torch.utils.data.default_collate(items)
        except (RuntimeError, TypeError, ValueError, KeyError) as exc:
            raise DatasetError(f"{self.label}: items {numbers[:8]}{'...' if len(numbers) > 8 else ''} do not "
                               f"batch together (each tensor stacked, the same keys and shapes): "
                               f"{type(exc).__name__}: {exc}") from exc


def _class_pair(item: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``item`` as (input, class index) tensors when it is such a pair: two tensors or numbers, the second integer.
    None for anything else (kind 'other')."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return None
    try:
        x, y = torch.as_tensor(item[0]), torch.as_tensor(item[1])
    except (TypeError, ValueError, RuntimeError):
        return None
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        return None
    return x, y


def first_tensor(item: Any) -> torch.Tensor | None:
    """The first tensor (or number, as a tensor) of an item or a batch, depth first through mappings, tuples and
    lists; None where there is none."""
    if isinstance(item, torch.Tensor):
        return item
    if isinstance(item, (int, float, np.ndarray, np.number)) and not isinstance(item, bool):
        return torch.as_tensor(item)
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def describe(value: Any) -> str:
    """A short description of an item's, a batch's or a model output's structure for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(repr, list(value)[:8]))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _check_user_split(split: Any, label: str) -> Any:
    """Check a factory's result against ``Split`` by reading its first sample."""
    if not isinstance(split.info, DatasetInfo):
        raise DatasetError(f"{label}: .info is a {type(split.info).__name__}, not an hpcnet.data.info.DatasetInfo")
    if len(split) < 1:
        raise DatasetError(f"{label}: the dataset is empty")
    result = split.read(np.zeros(1, dtype=np.int64))
    info = split.info
    if info.kind == "other":
        if first_tensor(result) is None:
            raise DatasetError(f"{label}: read([0]) gave {describe(result)}, which holds no tensor")
        return split
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        raise DatasetError(f"{label}: read(indices) must return an (inputs, targets) pair of tensors")
    inputs, targets = result
    want = torch.float32 if info.kind == "image" else torch.int64
    target_shape = (1, *info.input_shape) if info.kind == "tokens" else (1,)
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
