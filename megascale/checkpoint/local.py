"""Single-process checkpoints: one directory per step, written atomically.

Layout inside the run directory::

    checkpoints/step_000100/state.pt   model, optimizer, loader, RNG states, step
    checkpoints/step_000100/DONE       written last: a directory without it is ignored

A checkpoint is first written to `step_000100.tmp/` and renamed into place, so a crash or
Ctrl-C during the save never leaves a half-written checkpoint that a resume could pick up.
The distributed, two-stage (host memory, then storage) checkpoint is a later piece of work;
this module is the simple, exact one the single-process trainer needs.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megascale.errors import UserError

_PREFIX = "step_"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in the run directory, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit():
            if (p / "DONE").exists():
                found.append((int(p.name[len(_PREFIX):]), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` for `step` atomically, then delete all but the newest `keep` checkpoints."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f"{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    (tmp / "DONE").write_text(f"{step}\n")
    if final.exists():  # re-saving the same step (e.g. interrupted right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint directory (or its state.pt); a damaged file is a UserError naming it."""
    p = Path(path)
    f = p / "state.pt" if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"checkpoint {f}: does not exist")
    try:
        # weights_only=False: the state holds RNG tuples and numpy arrays, and these are our own files.
        state = torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise UserError(f"checkpoint {f}: cannot be read ({type(e).__name__}: {e})") from None
    for key in ("step", "model", "optimizer", "loader", "rng"):
        if key not in state:
            raise UserError(f"checkpoint {f}: missing '{key}', not a megascale checkpoint")
    return state
