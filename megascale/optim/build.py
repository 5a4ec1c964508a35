"""Build the optimizer for a model from `OptimConfig`.

Two parameter groups, each with a `name` for the logs:

- "decay": every trainable tensor with ndim >= 2 (linear weights and embeddings). The
  embedding (tied with the output head by default) is decayed like any matrix, as in
  nanoGPT and Megatron-LM: tied, it *is* the output projection, and exempting it would
  leave the largest matrix of a small model without regularisation.
- "no_decay": tensors with ndim < 2 (biases, LayerNorm/RMSNorm gains), weight_decay 0,
  the usual exclusion (BERT, GPT-3, Megatron-LM). For LAMB this group also has
  adapt=False (no trust ratio), see megascale/optim/lamb.py for why.

Empty groups are dropped (a Llama-style model without biases still has norm gains, so in
practice both exist). The lr in the groups is cfg.lr; the trainer sets it every step from
`schedule.lr_at`.
"""

from __future__ import annotations

import torch
from torch import nn

from megascale.config import OptimConfig
from megascale.optim.lamb import Lamb


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # shared (tied) tensors are listed once
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        on_cuda = all(p.is_cuda for g in groups for p in g["params"])
        speed = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **speed)
    if cfg.name == "lamb":
        for g in groups:  # by shape, not by weight_decay: optim.weight_decay=0 must not turn LAMB into Adam
            g["adapt"] = g["name"] == "decay"
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r} (known: adamw, lamb)")
