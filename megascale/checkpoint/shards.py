"""A rank's training state as boxes of layout-independent tensors: what makes resharding free.

Every tensor of the training state has one *global* name and shape, the one a single process
would have: `model/blocks.0.attn.qkv.weight` is the whole matrix, `optim/exp_avg/blocks.0.
attn.qkv.weight` its AdamW moment, `optim/step/...` the step count. A rank of any (dp, pp, tp)
layout holds *boxes* of those tensors (an offset and a size per dimension):

* pipeline parallelism picks whole tensors (the stage's layers keep their global names);
* tensor parallelism cuts one dimension into contiguous pieces (`tp_split_dim`, the vocab
  padded up to a multiple of tp; the padding is not part of the global tensor);
* the ZeRO-2 distributed optimizer holds a contiguous range of each tensor's *flattened*
  TP piece, which is at most three boxes (a partial first row, whole rows, a partial last
  row: `flat_range_boxes`).

Saving writes each rank's boxes under the global names; loading asks for the boxes the
loading layout needs, wherever they lie in the files (DCP's chunk metadata does the
intersection). So a checkpoint of any layout loads into any other, optimizer state included.

`Chunk.tensor` is a view into the live state (parameter data, optimizer state), never a
copy: snapshots copy from it, restores copy into it. `Chunk.write` marks the one rank that
saves each element: data-parallel replica 0 for the weights (every replica holds them),
tensor-parallel rank 0 for tensors every tp rank holds whole.

The pipeline's second copy of a tied embedding (the last stage's head) is saved under its own
name, `head.weight`: the two copies are kept equal by summing their gradients, but LAMB's
norms of each are summed over differently cut shards, so they may differ in the last bit, and
an exact resume must give each copy its own value back. A layout without a separate copy (one
process, pp = 1) ignores it; a pipeline resuming from such a checkpoint reads the embedding
(`Chunk.fallback`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megascale.parallel.mesh import Mesh

TIED_HEAD = "head.weight"
EMBEDDING = "embed.tok.weight"


@dataclass
class Chunk:
    fqn: str  # global name: model/<param>, optim/<state key>/<param>
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # of this box in the global tensor
    tensor: Tensor  # the box's data: a contiguous view into the live state, shape = sizes
    write: bool  # this rank saves it (exactly one rank saves each element)
    fallback: str | None = None  # read this name instead when the checkpoint has no `fqn`

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.fqn, self.offsets


@dataclass(frozen=True)
class _Placement:
    """Where a local parameter sits in its global tensor."""

    name: str  # global (one-process) parameter name
    fallback: str | None  # the tied embedding's name, for the head copy
    global_shape: tuple[int, ...]
    dim: int | None  # tp split dimension (None: whole on every tp rank)
    offset: int  # of this rank's piece along dim
    valid: int  # rows of the piece inside the global tensor (the rest is vocab padding)
    write: bool  # this rank saves the weights


def _placement(name: str, p: Tensor, mesh: Mesh, tied: bool) -> _Placement:
    alias = tied and name == TIED_HEAD  # the pipeline's head copy of the tied embedding
    dim = getattr(p, "tp_split_dim", None)
    shape = list(p.shape)
    offset, valid = 0, shape[dim] if dim is not None else 0
    if dim is not None:
        full = int(getattr(p, "tp_full_size", shape[dim] * mesh.tp))
        offset = mesh.tp_rank * shape[dim]
        valid = max(0, min(shape[dim], full - offset))
        if valid != shape[dim] and dim != 0:
            raise ValueError(f"{name}: padding is only supported along dimension 0 (the vocab)")
        shape[dim] = full
    write = mesh.dp_rank == 0 and (dim is not None or mesh.tp_rank == 0)
    return _Placement(name, EMBEDDING if alias else None, tuple(shape), dim, offset, valid, write)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _local_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Boxes (offsets, sizes) of a tensor of `shape` that cover flat elements [start, end) in order."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, end // row  # rows [first, last) may be whole
    out = []
    if start % row:  # a partial first row
        stop = min(end, (first + 1) * row)
        inner = _local_boxes(shape[1:], start - first * row, stop - first * row)
        out += [((first, *o), (1, *s)) for o, s in inner]
        if stop == end:
            return out
        first += 1
    if last > first:
        out.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if end % row:  # a partial last row
        out += [((last, *o), (1, *s)) for o, s in _local_boxes(shape[1:], 0, end - last * row)]
    return out


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Public name of `_local_boxes`: boxes of `shape` covering its flattened elements [start, end)."""
    return _local_boxes(tuple(shape), start, end)


def _boxes(pl: _Placement, local_shape: tuple[int, ...], flat: Tensor, start: int, fqn: str,
           write: bool) -> list[Chunk]:
    """Chunks of `flat`, elements [start, start + flat.numel()) of a local tensor of local_shape."""
    out = []
    fallback = fqn.removesuffix(pl.name) + pl.fallback if pl.fallback else None
    if not local_shape:  # a 0-dim tensor
        return [Chunk(fqn, (), (), flat.view(()), write, fallback)]
    for offs, sizes in _local_boxes(local_shape, start, start + flat.numel()):
        begin = sum(o * math.prod(local_shape[i + 1:]) for i, o in enumerate(offs)) - start
        data = flat[begin:begin + math.prod(sizes)].view(sizes)
        offs, sizes = list(offs), list(sizes)
        if pl.dim is not None:
            if pl.dim == 0:  # drop the vocab padding rows (a suffix: the box stays contiguous)
                keep = max(0, min(offs[0] + sizes[0], pl.valid) - offs[0])
                if keep == 0:
                    continue
                data, sizes[0] = data.narrow(0, 0, keep), keep
            offs[pl.dim] += pl.offset
        out.append(Chunk(fqn, pl.global_shape, tuple(offs), data, write, fallback))
    return out


def model_chunks(model: nn.Module, mesh: Mesh, tied: bool) -> list[Chunk]:
    """The boxes of the weights this rank holds (all of them; `write` on the saving rank)."""
    out = []
    for name, p in model.named_parameters():
        pl = _placement(name, p, mesh, tied)
        out += _boxes(pl, tuple(p.shape), p.data.view(-1), 0, f"model/{pl.name}", pl.write)
    return out


def optimizer_chunks(optimizer, model: nn.Module, mesh: Mesh, tied: bool) -> list[Chunk]:
    """The boxes of the optimizer state this rank holds (AdamW/LAMB moments and step counts).

    Parameters without state yet (no step taken) have none; `ensure_optimizer_state` makes it.
    """
    from megascale.parallel.data.optimizer import DistributedOptimizer

    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    if isinstance(optimizer, DistributedOptimizer):
        inner = optimizer.optimizer
        for p, piece, view in zip(optimizer.params, optimizer.pieces, optimizer.views, strict=True):
            pl = _placement(names[id(p)], p, mesh, tied)
            write = pl.dim is not None or mesh.tp_rank == 0  # every dp rank saves its own pieces
            for key, t in inner.state.get(view, {}).items():
                fqn = f"optim/{key}/{pl.name}"
                if t.ndim == 0:
                    out += _boxes(pl, (), t, 0, fqn, write and mesh.dp_rank == 0)
                else:
                    out += _boxes(pl, tuple(p.shape), t.view(-1), piece.start, fqn, write)
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            pl = _placement(names[id(p)], p, mesh, tied)
            for key, t in optimizer.state.get(p, {}).items():
                fqn = f"optim/{key}/{pl.name}"
                if t.ndim == 0:
                    out += _boxes(pl, (), t, 0, fqn, pl.write)
                else:
                    out += _boxes(pl, tuple(p.shape), t.view(-1), 0, fqn, pl.write)
    return out


def ensure_optimizer_state(optimizer, keys: dict[str, tuple[bool, torch.dtype]]) -> None:
    """Give every parameter the state tensors `keys` names (key -> (is_scalar, dtype)), as zeros,
    so that a checkpoint can be copied into them before the first step."""
    from megascale.parallel.data.optimizer import DistributedOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    fused = any(g.get("fused") for g in inner.param_groups)
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            for key, (scalar, dtype) in keys.items():
                if key in state:
                    continue
                if scalar:
                    state[key] = torch.zeros((), dtype=dtype, device=p.device if fused else "cpu")
                else:
                    state[key] = torch.zeros_like(p, dtype=dtype)
