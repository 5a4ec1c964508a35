"""Learning-rate schedule as a pure function of the step, so a resumed run needs no scheduler state.

`step` is the 0-based index of the optimizer step about to be taken. Warm-up is linear and
starts at lr / warmup_steps rather than 0: a first step at lr 0 would only feed Adam's
moments and waste a step. Then a cosine or a straight line from lr (at step warmup_steps) down
to min_lr (at step total_steps and after); or warm-up, stable, decay ("wsd", as Megatron-LM and
torchtitan have it): lr held until the last `decay_fraction` of total_steps, which fall to min_lr
as 1 - sqrt(progress), the shape Hägele et al. (2024) found to match a cosine run's loss. A wsd run
can be extended on resume (a larger train.steps moves only its decay), which a cosine cannot; or lr
held constant.
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
    start = cfg.warmup_steps
    if cfg.schedule == "wsd":  # (a decay longer than the steps after the warm-up starts right after it)
        start = max(start, total_steps - max(1, round(cfg.decay_fraction * total_steps)))
        if step < start:
            return cfg.lr
    progress = min(1.0, (step - start) / max(1, total_steps - start))
    if cfg.schedule == "wsd":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - math.sqrt(progress))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    """Set the lr of every param group (the groups differ in weight decay, not in lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
