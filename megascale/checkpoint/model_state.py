"""The trained model of a run as one-process weights: what `generate` and `export` read.

    cfg, state = read_model_state("runs/cpu_default")      # newest complete checkpoint
    cfg, state = read_model_state("runs/x/checkpoints/step_000500")

`state` is the single-process GPT's state dict (full tensors, CPU) whatever layout saved it:
each global tensor is read whole from the DCP checkpoint, its boxes assembled by DCP. The
files are checked against the commit marker's checksums first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megascale.checkpoint.dcp_io import load_chunks, stored_tensors, verify
from megascale.checkpoint.shards import EMBEDDING, TIED_HEAD, Chunk
from megascale.checkpoint.storage import COMMIT, CheckpointError, Storage
from megascale.config import Config, from_dict, load_config
from megascale.errors import UserError


def _locate(p: Path) -> tuple[Storage, str]:
    if (p / COMMIT).exists():
        return Storage(p.parent), str(p.resolve())
    if (p / "config.toml").exists():
        cfg = load_config(p / "config.toml")
        storage = Storage(cfg.checkpoint.path or p / "checkpoints")
    elif p.is_dir():
        storage = Storage(p)
    else:
        raise UserError(f"checkpoint {p}: does not exist")
    done = storage.committed()
    if not done:
        raise UserError(f"checkpoint {p}: no complete checkpoint there")
    return storage, done[-1][1]


def read_model_state(path: str | Path) -> tuple[Config, dict[str, Tensor]]:
    """(the run's config, its full model state dict) from a run directory or one checkpoint in it."""
    storage, ckpt = _locate(Path(path))
    record = storage.read_commit(ckpt)
    problem = verify(storage, ckpt, record, sorted(record["files"]))
    if problem:
        raise CheckpointError(problem)
    if "config" not in record:
        raise CheckpointError(f"checkpoint {storage.url(ckpt)}: its commit marker has no config")
    cfg = from_dict(record["config"])
    tensors = stored_tensors(storage, ckpt)
    chunks, state = [], {}
    for fqn, md in tensors.items():
        if fqn.startswith("model/") and not (cfg.model.tie_embeddings and fqn == f"model/{TIED_HEAD}"):
            t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            state[fqn.removeprefix("model/")] = t
            chunks.append(Chunk(fqn, tuple(md.size), (0,) * len(md.size), t, False))
    load_chunks(storage, ckpt, chunks)
    if cfg.model.tie_embeddings and EMBEDDING in state:
        state[TIED_HEAD] = state[EMBEDDING]
    return cfg, state
