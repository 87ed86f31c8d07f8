"""The optimizer (``optim.name``)."""

import torch
from torch import nn

from hpcnet.config import OptimConfig
from hpcnet.errors import ConfigError


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW; no weight decay on biases and norm weights (1-d tensors); ``fused``: torch's
    single-kernel implementation (``cuda.fused_optimizer``).

    Raises:
        ConfigError: torch refuses the optimizer (the ``optim.*`` options are validated in ``OptimConfig``;
            this names the group for whatever torch still refuses, e.g. a fused kernel for these parameters).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    try:
        if cfg.name == "adamw":
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0, fused=fused or None)
    except (ValueError, TypeError, RuntimeError) as exc:
        fused_note = " with cuda.fused_optimizer" if fused else ""
        raise ConfigError(f"optim.* ({cfg.name}{fused_note}): torch refuses the optimizer: {exc}") from exc
