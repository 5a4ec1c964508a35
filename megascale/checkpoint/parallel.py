"""Checkpoints of parallel runs: the full model once, each rank's optimizer shard and RNG apart.

Layout inside the run directory (the same step directories as local.py, so `latest_checkpoint`,
`megascale generate` and `keep` work unchanged)::

    checkpoints/step_000100/state.pt              step, full (one-process) model state, loader,
                                                  rank 0's RNG, config, the layout it was saved with
    checkpoints/step_000100/optim_rank00003.pt    rank 3's optimizer state (its shard) and RNG state
    checkpoints/step_000100/DONE                  written last

Every rank writes its own file into `step_000100.tmp/` (created by rank 0 before a barrier);
after a second barrier rank 0 writes state.pt and DONE and renames the directory into place,
so a crash at any point leaves either the previous checkpoint or a complete new one. The
directory must be on a file system every rank sees (one machine here; shared storage across
machines). Resuming needs the same layout: the optimizer shards are cut for it (see the
Trainer's check). The full model state makes the checkpoint readable by any layout and by
one process (generate, export) all the same.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megascale.checkpoint.local import _PREFIX, checkpoint_dir, list_checkpoints, load_checkpoint
from megascale.errors import UserError


def rank_file(path: str | Path, rank: int) -> Path:
    return Path(path) / f"optim_rank{rank:05d}.pt"


def _write(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_parallel_checkpoint(run_dir: str | Path, step: int, shared: dict[str, Any] | None,
                             rank_state: dict[str, Any], keep: int) -> Path:
    """Collective: every rank passes its own `rank_state`; rank 0 also passes `shared` (state.pt)."""
    rank = dist.get_rank()
    root = checkpoint_dir(run_dir)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f"{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    _write(rank_file(tmp, rank), rank_state)
    dist.barrier()
    if rank == 0:
        assert shared is not None, "rank 0 writes state.pt"
        _write(tmp / "state.pt", shared)
        (tmp / "DONE").write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # the checkpoint exists for everyone once save returns
    return final


def load_parallel_checkpoint(path: str | Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state.pt, this rank's optim_rank file); a missing or damaged file is a UserError naming it."""
    shared = load_checkpoint(path)
    if "parallel" not in shared:
        raise UserError(f"checkpoint {path}: written by a single-process run; a parallel run resumes only "
                        "from its own layout's checkpoints (start it with checkpoint.resume=false)")
    f = rank_file(path, rank)
    if not f.is_file():
        raise UserError(f"checkpoint {f}: does not exist (the checkpoint has fewer ranks than this run)")
    try:
        own = torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise UserError(f"checkpoint {f}: cannot be read ({type(e).__name__}: {e})") from None
    for key in ("optimizer", "rng"):
        if key not in own:
            raise UserError(f"checkpoint {f}: missing '{key}', not a megascale rank file")
    return shared, own
