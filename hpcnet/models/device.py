"""The device settings of ``cuda.*``: decided once per run from the options and the device, applied in one place.

On a CUDA device every setting defaults to on: cuDNN autotuning
(``cudnn.benchmark``; the input shapes of a training run are fixed), TF32
matmuls (``set_float32_matmul_precision('high')``), channels-last memory
format for convolutional models and their inputs, batches copied from pinned
host memory on a side stream, and the fused SGD/AdamW kernels.  On a CPU
they default to off: cuDNN and pinned memory mean nothing there, and
channels-last and the fused optimizers, which torch also has on CPU, are
there only when asked for (``on``), so a CPU run is bit for bit what it was.

Stream order of a pinned batch (``BatchMover``): the host-to-device copies
are enqueued on a side stream after the host tensors are pinned; the
current (compute) stream waits for the side stream before anything of the
step is enqueued behind it, so the forward never reads a partial batch; the
device tensors are marked as used by the compute stream (``record_stream``),
so the caching allocator does not hand their memory to the side stream's
next copy while the step still reads them.  The pinned host blocks are kept
by torch's host allocator until the copies recorded on them have finished.
Nothing waits on the host: the copy overlaps the host's enqueueing of the
forward.
"""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpcnet.config import CudaConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSettings:
    """What ``cuda.*`` resolves to for one device and model."""

    cudnn_benchmark: bool = False
    matmul_precision: str = "highest"
    channels_last: bool = False
    pin_memory: bool = False
    fused_optimizer: bool = False

    def describe(self) -> str:
        """One line for the log: what is on."""
        on = [name for name in ("cudnn_benchmark", "channels_last", "pin_memory", "fused_optimizer")
              if getattr(self, name)]
        return f"matmul precision {self.matmul_precision}; " + (", ".join(on) + " on" if on else "nothing else on")


def _switch(value: str, on_cuda: bool) -> bool:
    return on_cuda if value == "auto" else value == "on"


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def device_settings(cfg: CudaConfig, device: torch.device, model: nn.Module) -> DeviceSettings:
    """The settings for ``model`` on ``device``; an ``on`` that cannot apply here is logged, not an error (a
    config shared by GPU and CPU partitions must run on both)."""
    on_cuda = device.type == "cuda"
    for name in ("cudnn_benchmark", "pin_memory"):
        if getattr(cfg, name) == "on" and not on_cuda:
            log.info("cuda.%s=on has no effect on %s", name, device)
    wanted_cl = _switch(cfg.channels_last, on_cuda)
    if cfg.channels_last == "on" and not has_conv2d(model):
        log.info("cuda.channels_last=on has no effect: the model has no 2-d convolution")
    precision = cfg.matmul_precision if cfg.matmul_precision != "auto" else ("high" if on_cuda else "highest")
    return DeviceSettings(cudnn_benchmark=_switch(cfg.cudnn_benchmark, on_cuda) and on_cuda,
                          matmul_precision=precision,
                          channels_last=wanted_cl and has_conv2d(model),
                          pin_memory=_switch(cfg.pin_memory, on_cuda) and on_cuda,
                          fused_optimizer=_switch(cfg.fused_optimizer, on_cuda))


def apply_settings(settings: DeviceSettings, model: nn.Module) -> nn.Module:
    """Set the process-wide flags and the model's memory format (before DataParallel and the optimizer)."""
    torch.backends.cudnn.benchmark = settings.cudnn_benchmark
    torch.set_float32_matmul_precision(settings.matmul_precision)
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


class BatchMover:
    """Moves a batch to the device: each tensor of it, through dicts, tuples and lists (``map_tensors``);
    channels-last for 4-d tensors when on, from pinned memory on a side stream when ``pin_memory`` (see the
    module docstring for the stream order)."""

    def __init__(self, device: torch.device, settings: DeviceSettings) -> None:
        self.device = device
        self.channels_last = settings.channels_last
        self._stream = torch.cuda.Stream(device) if settings.pin_memory else None

    def _format(self, t: torch.Tensor) -> torch.Tensor:
        if self.channels_last and t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        return t

    def __call__(self, batch: Any) -> Any:
        if self._stream is None:
            return map_tensors(lambda t: self._format(t.to(self.device, non_blocking=True)), batch)
        pinned = map_tensors(lambda t: t.pin_memory(), batch)
        compute = torch.cuda.current_stream(self.device)
        moved: list[torch.Tensor] = []

        def move(t: torch.Tensor) -> torch.Tensor:
            moved.append(self._format(t.to(self.device, non_blocking=True)))
            return moved[-1]
        with torch.cuda.stream(self._stream):
            result = map_tensors(move, pinned)
        compute.wait_stream(self._stream)
        for t in moved:
            t.record_stream(compute)
        return result


def map_tensors(fn: Any, batch: Any) -> Any:
    """``batch`` with ``fn`` applied to each tensor in it, through mappings (as dicts), tuples (named ones too) and
    lists; anything else is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {key: map_tensors(fn, value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(fn, value) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, value) for value in batch)
    return batch
