"""ResNet (He et al. 2015), torchvision-compatible layout ("ResNet v1.5"): resnet18 ... resnet152, resnet_tiny."""

from collections.abc import Callable

import torch
from torch import nn

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models.options import boolean, positive_int, require_kind


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


def resnet_factory(
    name: str, block: type[BasicBlock] | type[Bottleneck], layers: list[int], default_width: int = 64
) -> Callable[..., ResNet]:
    # One closure per name, so each factory's signature lists exactly the options a config may set.
    def factory(
        info: DatasetInfo, *, width: int = default_width, small_input: bool | None = None,
        zero_init_residual: bool = False,
    ) -> ResNet:
        require_kind(info, "image", name)
        if len(info.input_shape) != 3:
            raise ConfigError(f"model.name: {name!r} needs images shaped (C, H, W), got {info.input_shape}")
        channels, height, width_px = info.input_shape
        if small_input is None:
            small_input = max(height, width_px) <= 64
        return ResNet(
            block, layers, in_channels=channels, num_classes=info.num_classes,
            width=positive_int(width, "width"), small_input=boolean(small_input, "small_input"),
            zero_init_residual=boolean(zero_init_residual, "zero_init_residual"),
        )

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (
        f"Build {name}: {block.__name__} blocks {layers}, base width {default_width}.\n\n"
        "Options: width (base channels), small_input (3x3 stem without max-pool; None = auto,\n"
        "True when H and W <= 64), zero_init_residual (zero the last BN gamma of each block)."
    )
    return factory
