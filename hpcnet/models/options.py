"""Checks for ``model.options`` values, shared by the built-in factories: each error names the option."""

from collections.abc import Callable
from typing import Any

from torch import nn

from hpcnet.data.info import DatasetInfo, is_int
from hpcnet.errors import ConfigError

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def positive_int(value: Any, option: str) -> int:
    if not is_int(value) or value < 1:
        raise ConfigError(f"model.options.{option}: must be a positive integer, got {value!r}")
    return value


def optional_positive_int(value: Any, option: str) -> int | None:
    return None if value is None else positive_int(value, option)


def boolean(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"model.options.{option}: must be true or false, got {value!r}")
    return value


def probability(value: Any, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"model.options.{option}: must be a number in [0, 1), got {value!r}")
    return float(value)


def require_kind(info: DatasetInfo, kind: str, model_name: str) -> None:
    if info.kind != kind:
        raise ConfigError(
            f"model.name: model {model_name!r} needs {kind!r} data but the dataset kind is {info.kind!r}"
        )
