"""Checkpoints: sharded, two-stage (host memory, then storage in DCP format), resharding restore.

See manager.py for the flow, shards.py for how any layout's state maps to global tensors. The
names below are imported on first use, so that `megascale.checkpoint.cli` (the export verb,
registered by every CLI call) does not import torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

_NAMES = {
    "CheckpointError": "storage", "Storage": "storage", "CheckpointManager": "manager",
    "RestoreInfo": "manager", "read_model_state": "model_state", "rng_state": "rng", "set_rng_state": "rng",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"megascale.checkpoint.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'megascale.checkpoint' has no attribute {name!r}")


def list_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """Complete checkpoints in a run directory's default storage (RUN_DIR/checkpoints), oldest first."""
    from megascale.checkpoint.storage import Storage

    return [(step, Path(p)) for step, p in Storage(Path(run_dir) / "checkpoints").committed()]


__all__ = ["list_checkpoints", *_NAMES]
