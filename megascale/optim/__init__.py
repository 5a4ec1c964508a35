"""Optimizers (AdamW from PyTorch, our LAMB), the lr schedule and global grad-norm clipping."""

from megascale.optim.build import build_optimizer, param_groups
from megascale.optim.clip import clip_grad_norm_
from megascale.optim.lamb import Lamb
from megascale.optim.schedule import lr_at, set_lr

__all__ = ["Lamb", "build_optimizer", "clip_grad_norm_", "lr_at", "param_groups", "set_lr"]
