"""Learning-rate schedule as a pure function of the step, so a resumed run needs no scheduler state.

`step` is the 0-based index of the optimizer step about to be taken. Warm-up is linear and
starts at lr / warmup_steps rather than 0: a first step at lr 0 would only feed Adam's
moments and waste a step. Then either a cosine from lr (at step warmup_steps) down to
min_lr (at step total_steps and after), or lr held constant.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer

from megascale.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    """Set the lr of every param group (the groups differ in weight decay, not in lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
