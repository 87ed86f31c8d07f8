"""bench train's models (``SPECS``) and contenders: hpcnet's ``DataParallel``, DDP, DDP with its communication
hooks and the no-communication baseline, each training its own copy of one model (``make_contenders``), and the
synthetic batches they all train on."""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpcnet.models.device import DeviceSettings, apply_settings


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A benchmark model: a built-in hpcnet model, its input and its per-rank batch."""

    model: str
    options: dict[str, Any]
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    kind: str
    target: float
    """The issue's target for hpcnet samples/s over DDP's."""


# Sized so that a step takes roughly 100-300 ms with one core per rank on the
# 2-core development machine (measured there: mlp 130 ms forward+backward and
# 65 ms optimizer, resnet18 300 ms and 14 ms).
SPECS: dict[str, ModelSpec] = {
    # 10.5 M parameters (40 MiB of gradients) for little arithmetic per sample.
    "mlp": ModelSpec("mlp", {"hidden": [2048, 2048]}, (3, 32, 32), 10, 32, "communication-heavy", 1.3),
    # 29.4 M parameters (112 MiB); about 700 ms a step there.
    "mlp-4096": ModelSpec("mlp", {"hidden": [4096, 4096]}, (3, 32, 32), 10, 16, "communication-heavy", 1.3),
    # ResNet-18 at half width: 2.8 M parameters (11 MiB), ~0.15 GFLOP per 32x32 sample forward.
    "resnet18": ModelSpec("resnet18", {"width": 32}, (3, 32, 32), 10, 8, "compute-heavy", 1.0),
    # 0.31 M parameters (1.2 MiB): communication is latency only.
    "resnet_tiny": ModelSpec("resnet_tiny", {}, (3, 32, 32), 10, 32, "compute-heavy", 1.0),
    # ResNet-50 on 224x224 ImageNet-sized inputs, 64 a GPU: 25.6 M parameters (98 MiB), ~4 GFLOP per sample
    # forward (scripts/gpu-check.sh; far too slow on a CPU).
    "resnet50": ModelSpec("resnet50", {}, (3, 224, 224), 1000, 64, "GPU", 1.0),
    # A smoke test (seconds), not a benchmark.
    "mlp-small": ModelSpec("mlp", {"hidden": [256, 256]}, (3, 32, 32), 10, 16, "smoke test", 1.0),
}
DEFAULT_MODELS = "mlp,resnet18"


@dataclass
class Contender:
    """One way to train: a step is ``forward_backward(inputs, targets)`` then ``update()``."""

    name: str
    model: nn.Module
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Forward, backward and gradient averaging (whatever of it is not hidden); returns the loss."""
    update: Callable[[], None]
    """Gradient clipping and the optimizer step."""
    dp: Any = None
    """hpcnet's DataParallel (for the instrumented block), else None."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(inputs, targets)
        self.update()
        return loss


DDP_HOOKS = ("bf16", "fp16", "powersgd")
"""``--ddp-hooks``: DDP's own gradient compression, as further contenders (``ddp_hook``)."""
POWERSGD_RANK = 4


def ddp_hook(ddp: Any, name: str) -> str:
    """Register DDP's communication hook ``name`` (one of ``DDP_HOOKS``) on ``ddp``; returns the contender's
    suffix.  PowerSGD (rank ``POWERSGD_RANK``, error feedback and warm start, torch's defaults) compresses from
    the second step on (torch's default waits 1,000 steps with plain all-reduces)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    cuda = next(ddp.module.parameters()).device.type == "cuda"
    if name == "bf16":
        # torch's bf16_compress_hook refuses CPU tensors (it asks for CUDA 11+ and NCCL 2.10+): on CPU, the same
        # steps over gloo (``_cast_hook``).
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if cuda else _cast_hook(torch.bfloat16))
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return f"powersgd{POWERSGD_RANK}"
    else:
        raise ValueError(f"unknown DDP hook {name!r}; choose among {', '.join(DDP_HOOKS)}")
    return name


def _cast_hook(dtype: torch.dtype) -> Callable[[Any, Any], Any]:
    """What torch's ``bf16_compress_hook`` does, for any backend: the bucket cast to ``dtype`` and divided by the
    world size, all-reduced, cast back into the bucket."""
    import torch.distributed as dist

    # DDP checks the annotations.
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        wire = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(wire, async_op=True).get_future()

        def back(done: Any) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(back)

    return hook


def make_contenders(spec: ModelSpec, comm: Any, world: Any, *, device: torch.device, local: bool,
                    seed: int = 0, dist_cfg: Any = None, precision: str = "fp32",
                    settings: Any = None, base: nn.Module | None = None,
                    ddp_hooks: tuple[str, ...] = ()) -> list[Contender]:
    """hpcnet, DDP, DDP with each of ``ddp_hooks`` and (optionally) the no-communication baseline on copies of one
    model (collective); every contender gets the same device ``settings`` (``hpcnet.models.device``:
    channels-last, fused optimizer, ...)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcnet.comm.dataparallel import DataParallel
    from hpcnet.comm.route import agree_route
    from hpcnet.config import DistConfig, OptimConfig
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model
    from hpcnet.objective import Objective
    from hpcnet.optim import build_optimizer

    compute_loss = Objective(device=device, precision=precision)  # every contender's forward in the same precision

    if base is None:  # the model every contender copies (``bench_model`` builds it to decide the settings)
        torch.manual_seed(seed)
        base = build_model(spec.model, DatasetInfo("image", spec.input_shape, spec.num_classes), spec.options)
    base = base.to(device)
    settings = settings or DeviceSettings()
    base = apply_settings(settings, base)
    optim_cfg = OptimConfig()  # hpcnet's defaults for every contender (SGD, momentum, weight decay, clip 1.0)

    def updater(model: nn.Module) -> tuple[torch.optim.Optimizer, Callable[[], None]]:
        optimizer = build_optimizer(model, optim_cfg, fused=settings.fused_optimizer)

        def update() -> None:
            if optim_cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
            optimizer.step()

        return optimizer, update

    model_h = copy.deepcopy(base)
    dist_cfg = dist_cfg or DistConfig()  # hpcnet's defaults unless --dist says otherwise
    dp = DataParallel(model_h, comm, world, dist_cfg, device=device,
                      route=agree_route(comm, world, dist_cfg, device_type=device.type))
    update_h = updater(model_h)[1]  # at stage 0 torch's clip and step, as DDP's: the same weights, bit for bit
    if dist_cfg.zero:  # the gradients are the owners': the optimizer sharded by the owners, the clip collective
        optimizer_h = dp.shard_optimizer(build_optimizer(model_h, optim_cfg, fused=settings.fused_optimizer))

        def update_h() -> None:
            if optim_cfg.grad_clip > 0:
                dp.clip_grad_norm_(optim_cfg.grad_clip)
            optimizer_h.step()
    contenders = [Contender("hpcnet", model_h, lambda x, y: dp.step([(x, y)], compute_loss), update_h, dp)]

    model_d = copy.deepcopy(base)
    ddp = DistributedDataParallel(model_d, device_ids=[device] if device.type == "cuda" else None)  # its defaults
    # DDP all-reduces its buckets during backward and waits for them at its end.
    contenders.append(_plain(f"ddp-{dist.get_backend()}", model_d, ddp, updater, compute_loss))
    for hook in ddp_hooks:
        model_c = copy.deepcopy(base)
        # PowerSGD issues its all-reduces from the futures' callbacks; over gloo, two buckets' callbacks run them in
        # different orders on different ranks ("Received data size doesn't match expected size", an abort or a
        # hang): one bucket for it.
        cap = {"bucket_cap_mb": 1 << 16} if hook == "powersgd" and device.type != "cuda" else {}
        hooked = DistributedDataParallel(model_c, device_ids=[device] if device.type == "cuda" else None, **cap)
        suffix = ddp_hook(hooked, hook)
        contenders.append(_plain(f"ddp-{dist.get_backend()}-{suffix}", model_c, hooked, updater, compute_loss))
    if local:
        model_l = copy.deepcopy(base)
        contenders.append(_plain("local", model_l, model_l, updater, compute_loss))
    return contenders


def _plain(name: str, model: nn.Module, forward: nn.Module, updater: Callable[[nn.Module], Any],
           compute_loss: Callable[..., torch.Tensor]) -> Contender:
    """A contender whose step is zero_grad, ``forward``'s loss, backward (DDP, or no communication at all)."""
    optimizer, update = updater(model)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(forward, (x, y))
        loss.backward()
        return loss.detach()

    return Contender(name, model, forward_backward, update)


def synthetic_batches(spec: ModelSpec, batch_size: int, count: int, rank: int,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random batches, different on every rank, the same for every contender."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch_size, *spec.input_shape, generator=gen).to(device),
             torch.randint(0, spec.num_classes, (batch_size,), generator=gen).to(device)) for _ in range(count)]
