"""What describes a dataset: ``DatasetInfo`` (kind, sample shape, classes), the ``Split`` protocol the
trainer reads from, the file format's version and split names, and the integer checks the data modules share.

Torch-free at import (the generator CLI uses it); models import ``DatasetInfo`` from here. The file
format is described in docs/data.md.
"""

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

FORMAT_VERSION = 1
"""The ``hpcnet_format`` root attribute of a dataset file that this hpcnet reads and writes."""
SPLITS = ("train", "eval")
DATASET_KINDS = ("image", "tokens")
"""The kinds a dataset file holds (``hpcnet.data.h5``, the converter)."""
INFO_KINDS = (*DATASET_KINDS, "sequence", "other")
"""Every kind a ``DatasetInfo`` may have: a dataset from ``data.dataset = "package.module:function"`` may also be
token sequences with one class each ('sequence') or anything a model and its ``model.loss`` understand ('other')."""


def is_int(value: Any) -> bool:
    """A Python int that is not a bool: ``width = true`` in a config is a mistake, not 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An int or numpy integer that is not a bool (a value read from a file or an array)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_ints(**values: int) -> None:
    """Raise ValueError naming the first value that is not a positive integer."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """What a model needs to know about the data it will be trained on."""

    kind: str
    """``"image"`` (inputs float[B, C, H, W], targets long[B]), ``"tokens"`` (inputs long[B, T], targets long[B, T],
    the next tokens), ``"sequence"`` (inputs long[B, T], targets long[B]: one class a sequence) or ``"other"``
    (batches of any structure: tensors, tuples, dicts; only the model and ``model.loss`` know what they mean)."""
    input_shape: tuple[int, ...]
    """Per-sample input shape, e.g. ``(3, 32, 32)`` or ``(T,)``; for 'other', the shape of the first tensor of
    an item (may be ``()``)."""
    num_classes: int
    """Number of classes (images, sequences), or the vocabulary size for tokens; for 'other', the dataset's own
    ``num_classes`` or 0."""

    def __post_init__(self) -> None:
        if self.kind not in INFO_KINDS:
            raise ValueError(f"DatasetInfo.kind must be one of {', '.join(INFO_KINDS)}, got {self.kind!r}")
        # A list would make the frozen dataclass unhashable; slots+frozen still allow object.__setattr__.
        object.__setattr__(self, "input_shape", tuple(self.input_shape))
        other = self.kind == "other"
        if (not self.input_shape and not other) or any(not is_int(d) or d < 1 for d in self.input_shape):
            raise ValueError(f"DatasetInfo.input_shape must be positive integers, got {self.input_shape}")
        if self.kind in ("tokens", "sequence") and len(self.input_shape) != 1:
            raise ValueError(f"DatasetInfo.input_shape must be (T,) for {self.kind} data, got {self.input_shape}")
        if not is_int(self.num_classes) or self.num_classes < (0 if other else 1):
            raise ValueError(f"DatasetInfo.num_classes must be a positive integer, got {self.num_classes!r}")


@runtime_checkable
class Split(Protocol):
    """One split of a dataset: what the trainer reads from (``H5Split`` or a user object)."""

    info: DatasetInfo

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray) -> Any:
        """The items ``indices`` as one batch: an (inputs, targets) pair of tensors, or for kind 'other' the
        items' structure with each tensor stacked (tensors, tuples, dicts)."""
        ...
