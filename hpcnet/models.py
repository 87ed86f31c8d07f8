"""Model zoo: ResNets, an MLP and a small GPT-style language model, built by name.

``build_model(name, info, options)`` is the one entry point the trainer uses.
Every built-in factory has the signature ``factory(info, **options)`` with
keyword-only options and defaults, so the options a config may set are exactly
the factory's keyword parameters.
"""

import difflib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcnet.data.info import DatasetInfo, is_int
from hpcnet.errors import ConfigError
from hpcnet.importing import load_object

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


# ---------------------------------------------------------------------------
# option validation helpers


def _positive_int(value: Any, option: str) -> int:
    if not is_int(value) or value < 1:
        raise ConfigError(f"model.options.{option}: must be a positive integer, got {value!r}")
    return value


def _optional_positive_int(value: Any, option: str) -> int | None:
    return None if value is None else _positive_int(value, option)


def _boolean(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"model.options.{option}: must be true or false, got {value!r}")
    return value


def _probability(value: Any, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"model.options.{option}: must be a number in [0, 1), got {value!r}")
    return float(value)


def _require_kind(info: DatasetInfo, kind: str, model_name: str) -> None:
    if info.kind != kind:
        raise ConfigError(
            f"model.name: model {model_name!r} needs {kind!r} data but the dataset kind is {info.kind!r}"
        )


def count_parameters(model: nn.Module) -> int:
    """Return the number of distinct parameter elements (tied weights count once).

    Args:
        model: any module; parameters may live on the meta device.
    """
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# ResNet (He et al. 2015), torchvision-compatible layout ("ResNet v1.5")


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or projected) shortcut; ResNet-18/34."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        """Build the block.

        Args:
            in_channels: channels of the block input.
            planes: channels of the convolutions; the output has ``planes * expansion``.
            stride: stride of the first convolution (2 halves the resolution).
            downsample: projection applied to the shortcut when shapes differ.
        """
        super().__init__()
        self.conv1 = _conv3x3(in_channels, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        """Return the BatchNorm whose gamma ``zero_init_residual`` zeroes."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand; ResNet-50/101/152.

    The stride sits on the 3x3 convolution (torchvision's "v1.5"), not on the
    first 1x1 as in the paper: slightly more accurate for the same parameters.
    """

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        """Build the block.

        Args:
            in_channels: channels of the block input.
            planes: channels of the inner convolutions; the output has ``planes * 4``.
            stride: stride of the 3x3 convolution.
            downsample: projection applied to the shortcut when shapes differ.
        """
        super().__init__()
        self.conv1 = _conv1x1(in_channels, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        """Return the BatchNorm whose gamma ``zero_init_residual`` zeroes."""
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet image classifier: stem, four stages of residual blocks, global pool, linear head."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        *,
        in_channels: int = 3,
        num_classes: int = 1000,
        width: int = 64,
        small_input: bool = False,
        zero_init_residual: bool = False,
    ):
        """Build the network.

        Args:
            block: ``BasicBlock`` or ``Bottleneck``.
            layers: number of blocks in each of the four stages.
            in_channels: channels of the input images.
            num_classes: size of the output logits.
            width: channels of the first stage; each later stage doubles it.
            small_input: use a 3x3 stride-1 stem without max-pool, for ~32x32 images
                where the ImageNet stem would throw away most of the resolution.
            zero_init_residual: start every block as the identity by zeroing the
                gamma of its last BatchNorm (Goyal et al. 2017), which helps large-batch training.
        """
        super().__init__()
        if small_input:
            self.conv1 = _conv3x3(in_channels, width)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        channels = width
        stages = []
        for index, num_blocks in enumerate(layers):
            planes = width * 2**index
            stride = 1 if index == 0 else 2
            stage, channels = self._make_stage(block, channels, planes, num_blocks, stride)
            stages.append(stage)
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(module.last_bn().weight)

    @staticmethod
    def _make_stage(
        block: type[BasicBlock] | type[Bottleneck], in_channels: int, planes: int, num_blocks: int, stride: int
    ) -> tuple[nn.Sequential, int]:
        out_channels = planes * block.expansion
        downsample = None
        if stride != 1 or in_channels != out_channels:
            downsample = nn.Sequential(_conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels))
        blocks = [block(in_channels, planes, stride, downsample)]
        blocks += [block(out_channels, planes) for _ in range(1, num_blocks)]
        return nn.Sequential(*blocks), out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``[B, C, H, W]`` to logits ``[B, num_classes]``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet_factory(
    name: str, block: type[BasicBlock] | type[Bottleneck], layers: list[int], default_width: int = 64
) -> Callable[..., ResNet]:
    # One closure per name, so each factory's signature lists exactly the options a config may set.
    def factory(
        info: DatasetInfo, *, width: int = default_width, small_input: bool | None = None,
        zero_init_residual: bool = False,
    ) -> ResNet:
        _require_kind(info, "image", name)
        if len(info.input_shape) != 3:
            raise ConfigError(f"model.name: {name!r} needs images shaped (C, H, W), got {info.input_shape}")
        channels, height, width_px = info.input_shape
        if small_input is None:
            small_input = max(height, width_px) <= 64
        return ResNet(
            block, layers, in_channels=channels, num_classes=info.num_classes,
            width=_positive_int(width, "width"), small_input=_boolean(small_input, "small_input"),
            zero_init_residual=_boolean(zero_init_residual, "zero_init_residual"),
        )

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (
        f"Build {name}: {block.__name__} blocks {layers}, base width {default_width}.\n\n"
        "Options: width (base channels), small_input (3x3 stem without max-pool; None = auto,\n"
        "True when H and W <= 64), zero_init_residual (zero the last BN gamma of each block)."
    )
    return factory


# ---------------------------------------------------------------------------
# MLP


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
    _require_kind(info, "image", "mlp")
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, (list, tuple)):
        raise ConfigError(f"model.options.hidden: must be a list of positive integers, got {hidden!r}")
    widths = [_positive_int(h, "hidden") for h in hidden]
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"model.options.activation: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}"
        )
    dropout = _probability(dropout, "dropout")
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(info.input_shape)
    for width in widths:
        layers += [nn.Linear(features, width), ACTIVATIONS[activation]()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        features = width
    layers.append(nn.Linear(features, info.num_classes))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------
# decoder-only transformer


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        """Build the layer.

        Args:
            d_model: model width; must be divisible by ``n_heads``.
            n_heads: number of attention heads.
            dropout: dropout on attention weights and on the output projection.
        """
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``[B, T, d_model]``."""
        batch, seq_len, d_model = x.shape
        # [B, T, 3, H, D] -> three tensors of [B, H, T, D], the layout SDPA expects.
        q, k, v = self.qkv(x).view(batch, seq_len, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out = out.transpose(1, 2).reshape(batch, seq_len, d_model)
        return self.proj_dropout(self.proj(out))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float):
        """Build the block.

        Args:
            d_model: model width.
            n_heads: number of attention heads.
            d_ff: hidden width of the feed-forward layer.
            dropout: dropout probability.
        """
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff_in = nn.Linear(d_model, d_ff)
        self.ff_out = nn.Linear(d_ff, d_model)
        self.ff_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[B, T, d_model]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.ff_dropout(self.ff_out(F.gelu(self.ff_in(self.ln2(x)))))


class TransformerLM(nn.Module):
    """GPT-style causal language model: token + learned position embeddings, blocks, LM head."""

    def __init__(
        self, *, vocab_size: int, max_seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
        dropout: float, tie_weights: bool,
    ):
        """Build the model.

        Args:
            vocab_size: number of token ids.
            max_seq_len: longest sequence the position embedding covers.
            d_model: model width.
            n_layers: number of transformer blocks.
            n_heads: attention heads per block.
            d_ff: feed-forward hidden width.
            dropout: dropout probability.
            tie_weights: share the token embedding with the output projection.
        """
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, d_ff, dropout) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # GPT-2 initialisation: N(0, 0.02), with residual projections scaled down by
        # sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for projection in (block.attn.proj, block.ff_out):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        if tie_weights:
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids ``[B, T]`` to next-token logits ``[B, T, vocab_size]``."""
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def transformer(
    info: DatasetInfo, *, d_model: int = 128, n_layers: int = 2, n_heads: int = 4, d_ff: int | None = None,
    dropout: float = 0.0, max_seq_len: int | None = None, tie_weights: bool = True,
) -> TransformerLM:
    """Build a small decoder-only language model for token data.

    Args:
        info: the dataset; must be token data, ``num_classes`` is the vocabulary size.
        d_model: model width.
        n_layers: number of blocks.
        n_heads: attention heads; must divide ``d_model``.
        d_ff: feed-forward hidden width; None means ``4 * d_model``.
        dropout: dropout probability.
        max_seq_len: longest sequence; None means the dataset's sequence length.
        tie_weights: share the token embedding with the output projection.
    """
    _require_kind(info, "tokens", "transformer")
    d_model = _positive_int(d_model, "d_model")
    n_heads = _positive_int(n_heads, "n_heads")
    if d_model % n_heads:
        raise ConfigError(f"model.options.n_heads: {n_heads} does not divide d_model {d_model}")
    d_ff = _optional_positive_int(d_ff, "d_ff")
    max_seq_len = _optional_positive_int(max_seq_len, "max_seq_len")
    return TransformerLM(
        vocab_size=info.num_classes,
        max_seq_len=info.input_shape[0] if max_seq_len is None else max_seq_len,
        d_model=d_model,
        n_layers=_positive_int(n_layers, "n_layers"),
        n_heads=n_heads,
        d_ff=4 * d_model if d_ff is None else d_ff,
        dropout=_probability(dropout, "dropout"),
        tie_weights=_boolean(tie_weights, "tie_weights"),
    )


# ---------------------------------------------------------------------------
# registry and entry point

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": _resnet_factory("resnet18", BasicBlock, [2, 2, 2, 2]),
    "resnet34": _resnet_factory("resnet34", BasicBlock, [3, 4, 6, 3]),
    "resnet50": _resnet_factory("resnet50", Bottleneck, [3, 4, 6, 3]),
    "resnet101": _resnet_factory("resnet101", Bottleneck, [3, 4, 23, 3]),
    "resnet152": _resnet_factory("resnet152", Bottleneck, [3, 8, 36, 3]),
    "resnet_tiny": _resnet_factory("resnet_tiny", BasicBlock, [1, 1, 1, 1], default_width=16),
    "mlp": mlp,
    "transformer": transformer,
}
"""Built-in models: name -> ``factory(info, **options)``."""


def _check_options(factory: Callable[..., Any], info: DatasetInfo, options: dict[str, Any], label: str) -> None:
    # Checking against the signature before calling keeps a TypeError raised inside
    # model construction (a bug) from being reported as a bad option.
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # some builtins have no signature; let the call itself fail
    try:
        signature.bind(info, **options)
    except TypeError as exc:
        params = signature.parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        valid = [n for n, p in list(params.items())[1:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        unknown = [] if accepts_any else [k for k in options if k not in valid]
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                     for k in unknown]
            raise ConfigError(
                f"model.options: unknown option {', '.join(hints)} for model {label}; "
                f"valid options: {', '.join(valid) or '(none)'}"
            ) from None
        option = "model.factory" if label.startswith("factory") else "model.options"
        raise ConfigError(f"{option}: cannot call {label} as fn(info, **options): {exc}") from None


def build_model(
    name: str, info: DatasetInfo, options: dict[str, Any] | None = None, *, factory: str = ""
) -> nn.Module:
    """Build a model for the dataset described by ``info``.

    Args:
        name: a key of ``MODELS``; ignored when ``factory`` is given.
        info: the dataset the model will be trained on.
        options: keyword options for the factory (``model.options``).
        factory: import path ``package.module:function`` of a user factory called as
            ``function(info, **options)``; empty to use the built-in ``name``.

    Raises:
        ConfigError: unknown name, unknown or bad option, a factory that cannot be
            loaded or does not return a module, or a model that does not fit the data.
    """
    options = dict(options or {})
    if factory:
        make = load_object(factory, "model.factory")
        label = f"factory {factory!r}"
    else:
        if name not in MODELS:
            close = difflib.get_close_matches(name, MODELS, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"model.name: unknown model {name!r}{hint}; choose one of {', '.join(sorted(MODELS))}"
            )
        make = MODELS[name]
        label = repr(name)
    _check_options(make, info, options, label)
    model = make(info, **options)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory: {factory or name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
