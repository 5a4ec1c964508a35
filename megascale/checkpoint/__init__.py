"""Checkpoints: save and restore the full training state."""

from megascale.checkpoint.local import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from megascale.checkpoint.parallel import load_parallel_checkpoint, save_parallel_checkpoint

__all__ = [
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_parallel_checkpoint",
    "rng_state",
    "save_checkpoint",
    "save_parallel_checkpoint",
    "set_rng_state",
]
