"""A multilayer perceptron for image or flat data."""

import math

from torch import nn

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models.options import ACTIVATIONS, positive_int, probability, require_kind


def mlp(
    info: DatasetInfo, *, hidden: list[int] | tuple[int, ...] = (512, 512), activation: str = "relu",
    dropout: float = 0.0,
) -> nn.Sequential:
    """Build a multilayer perceptron over the flattened image.

    Args:
        info: the dataset; must be image data.
        hidden: widths of the hidden layers (empty for a linear classifier).
        activation: ``relu``, ``gelu`` or ``tanh``.
        dropout: dropout probability after each hidden activation.
    """
    require_kind(info, "image", "mlp")
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, (list, tuple)):
        raise ConfigError(f"model.options.hidden: must be a list of positive integers, got {hidden!r}")
    widths = [positive_int(h, "hidden") for h in hidden]
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"model.options.activation: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}"
        )
    dropout = probability(dropout, "dropout")
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(info.input_shape)
    for width in widths:
        layers += [nn.Linear(features, width), ACTIVATIONS[activation]()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        features = width
    layers.append(nn.Linear(features, info.num_classes))
    return nn.Sequential(*layers)
