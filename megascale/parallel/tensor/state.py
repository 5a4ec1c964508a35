"""Full (single-process) weights <-> tensor-parallel shards.

A split parameter is cut into tp contiguous pieces along `tp_split_dim`, after padding to a
multiple of tp (the vocab). Contiguous pieces are the right cut for every fused layout of
the model (qkv ordered by head, SwiGLU gate/up interleaved; see model/factory.py), so no
permutation is needed. Used for parity checks against one process, to start TP from a
serial checkpoint, and to write checkpoints any layout can read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor.comm import all_gather_dim


def shard(full: Tensor, dim: int, mesh: Mesh, local_size: int) -> Tensor:
    """This rank's piece of a full tensor, zero-padded along dim to local_size * tp."""
    pad = local_size * mesh.tp - full.shape[dim]
    if pad:
        widths = [0, 0] * (full.ndim - 1 - dim) + [0, pad]
        full = F.pad(full, widths)
    return full.narrow(dim, mesh.tp_rank * local_size, local_size)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, Tensor], mesh: Mesh) -> None:
    """Copy a single-process state dict into the sharded model (every rank, same dict)."""
    own = model.state_dict(keep_vars=True)
    missing, unexpected = own.keys() - full.keys(), full.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, t in own.items():
        value = full[name]
        dim = getattr(t, "tp_split_dim", None)
        if dim is not None:
            value = shard(value, dim, mesh, t.shape[dim])
        if value.shape != t.shape:
            raise ValueError(f"{name}: full shape {tuple(full[name].shape)} does not fit {tuple(t.shape)}")
        t.copy_(value)


@torch.no_grad()
def full_state_dict(model: nn.Module, mesh: Mesh) -> dict[str, Tensor]:
    """The single-process state dict, gathered over tp (every rank gets all of it)."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        dim = getattr(t, "tp_split_dim", None)
        if dim is None:
            out[name] = t.detach().clone()
        else:
            out[name] = all_gather_dim(t.detach(), mesh, dim).narrow(dim, 0, t.tp_full_size).clone()
    return out
