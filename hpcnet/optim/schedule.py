"""The learning-rate schedule (``optim.warmup_steps``, ``optim.decay``)."""

import math

from hpcnet.config import OptimConfig


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate at ``step`` as a fraction of ``optim.lr``: linear warm-up, then decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape
