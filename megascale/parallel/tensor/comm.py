"""Autograd-aware collectives of the tensor-parallel region (Megatron-LM's mappings).

Each function is an identity when tp == 1 (no group, no cost). Activations are batch
first, (batch, seq, features): tensor parallelism splits `features` (the last dim),
sequence parallelism splits `seq` (dim 1).

  copy_to_tp          fwd: identity            bwd: all-reduce      (input of a column layer)
  reduce_from_tp      fwd: all-reduce          bwd: identity        (output of a row layer)
  gather_from_tp      fwd: all-gather last     bwd: keep own slice  (gather a column output)
  scatter_to_tp       fwd: keep own slice      bwd: all-gather last (split a row input)
  gather_seq          fwd: all-gather seq      bwd: reduce-scatter  (SP -> column layer)
  reduce_scatter_seq  fwd: reduce-scatter seq  bwd: all-gather      (row layer -> SP)
  scatter_seq         fwd: keep own seq slice  bwd: all-gather      (replicated -> SP)

Why the backward passes clone before an in-place collective: autograd may hand the same
gradient tensor to several consumers (the residual add does), and an in-place all-reduce
on it would corrupt the others.

Under train.compile (each block a compiled graph) the three collectives are custom operators
(torch.library), which a graph holds as calls: run in place, timed and through our transport as they
are, each of them cut the block's graph in two (30 pieces a rank in a tp2 block). The operator runs
the same code as eager (timers included), so the figures and the bits stay those of eager; its mesh
it finds by `Mesh.key` (an operator takes tensors and plain values). PyTorch's functional collectives
would hold them too, but run gloo's own all-gather and reduce-scatter, which made a compiled tp2 step
1.4x slower than eager's on CPU (ours: distributed/direct.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed.direct import start_all_gather, start_reduce_scatter
from megascale.observe import timers
from megascale.parallel.mesh import Mesh


def _all_reduce(x: Tensor, mesh: Mesh) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.megascale.tp_all_reduce(x, mesh.key)
    x = x.clone(memory_format=torch.contiguous_format)
    with timers.comm("all_reduce", "tp", "tp", nbytes=x.numel() * x.element_size()):
        mesh.all_reduce(x, mesh.tp_group)
    return x


def _split(x: Tensor, mesh: Mesh, dim: int) -> Tensor:
    size = x.shape[dim]
    if size % mesh.tp:
        raise ValueError(f"dimension {dim} of size {size} does not split over tp={mesh.tp}")
    return x.narrow(dim, mesh.tp_rank * (size // mesh.tp), size // mesh.tp).contiguous()


def _all_gather(x: Tensor, mesh: Mesh, dim: int) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.megascale.tp_all_gather(x, mesh.key, dim)
    x = x.contiguous()
    # gloo wants the output in concatenated form (tp * n0, ...); viewed as stacked (tp, n0, ...).
    out = x.new_empty((mesh.tp * x.shape[0], *x.shape[1:]))
    with timers.comm("all_gather", "tp", "tp", nbytes=out.numel() * out.element_size()):
        if mesh.direct_collectives:  # gloo: faster than its own (distributed/direct.py)
            start_all_gather(out, x, mesh.tp_group).wait()
        else:
            dist.all_gather_single(out, x, group=mesh.tp_group)
    out = out.view(mesh.tp, *x.shape)
    # (tp, ..., n, ...) -> (..., tp * n, ...): the gathered pieces in rank order along dim.
    dim = dim % x.ndim
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: Tensor, mesh: Mesh, dim: int) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.megascale.tp_reduce_scatter(x, mesh.key, dim)
    dim = dim % x.ndim
    if x.shape[dim] % mesh.tp:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over tp={mesh.tp}")
    pieces = x.unflatten(dim, (mesh.tp, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(pieces.shape[1:])
    with timers.comm("reduce_scatter", "tp", "tp", nbytes=pieces.numel() * pieces.element_size()):
        if mesh.direct_collectives:  # gloo: half the bytes of its own reduce-scatter
            start_reduce_scatter(out, pieces, mesh.tp_group).wait()
        else:
            dist.reduce_scatter_single(out, pieces.flatten(0, 1), group=mesh.tp_group)
    return out


# The same three as operators a compiled graph calls (the eager code above, run when the graph runs);
# their fake versions give the graph the output's shape.


def _resized(x: Tensor, dim: int, size: int) -> Tensor:
    shape = list(x.shape)
    shape[dim % x.ndim] = size
    return x.new_empty(shape)


@torch.library.custom_op("megascale::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: Tensor, mesh_key: int) -> Tensor:
    return _all_reduce(x, Mesh.by_key(mesh_key))


@_tp_all_reduce.register_fake
def _(x: Tensor, mesh_key: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("megascale::tp_all_gather", mutates_args=())
def _tp_all_gather(x: Tensor, mesh_key: int, dim: int) -> Tensor:
    return _all_gather(x, Mesh.by_key(mesh_key), dim).contiguous()


@_tp_all_gather.register_fake
def _(x: Tensor, mesh_key: int, dim: int) -> Tensor:
    return _resized(x, dim, x.shape[dim] * Mesh.by_key(mesh_key).tp)


@torch.library.custom_op("megascale::tp_reduce_scatter", mutates_args=())
def _tp_reduce_scatter(x: Tensor, mesh_key: int, dim: int) -> Tensor:
    return _reduce_scatter(x, Mesh.by_key(mesh_key), dim)


@_tp_reduce_scatter.register_fake
def _(x: Tensor, mesh_key: int, dim: int) -> Tensor:
    return _resized(x, dim, x.shape[dim] // Mesh.by_key(mesh_key).tp)


def all_gather_dim(x: Tensor, mesh: Mesh, dim: int) -> Tensor:
    """Concatenate every tp rank's x along dim (no autograd): for gathering full weights."""
    return x if mesh.tp == 1 else _all_gather(x, mesh, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.mesh), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        return _all_reduce(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _all_gather(x, mesh, -1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.mesh, -1), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _split(x, mesh, -1)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.mesh, -1), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _all_gather(x, mesh, 1)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.mesh, 1), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _reduce_scatter(x, mesh, 1)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.mesh, 1), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _split(x, mesh, 1)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.mesh, 1), None


def copy_to_tp(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _CopyToTP.apply(x, mesh)


def reduce_from_tp(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _ReduceFromTP.apply(x, mesh)


def gather_from_tp(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _GatherFromTP.apply(x, mesh)


def scatter_to_tp(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _ScatterToTP.apply(x, mesh)


def gather_seq(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _GatherSeq.apply(x, mesh)


def reduce_scatter_seq(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _ReduceScatterSeq.apply(x, mesh)


def scatter_seq(x: Tensor, mesh: Mesh) -> Tensor:
    return x if mesh.tp == 1 else _ScatterSeq.apply(x, mesh)
