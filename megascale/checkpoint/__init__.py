"""Checkpoints: save and restore the full training state."""

from megascale.checkpoint.local import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

__all__ = [
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
