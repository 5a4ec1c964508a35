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

Under train.compile (each block a compiled graph) the three collectives are PyTorch's functional
ones (`torch.distributed._functional_collectives`), which a graph can hold: ours run in place, time
themselves and may go through our own transport, each of which would cut the block's graph in two
(~35 pieces a rank in a tp2 block). The graph's collectives are not in the timers' tp figures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from megascale.distributed.direct import start_all_gather, start_reduce_scatter
from megascale.observe import timers
from megascale.parallel.mesh import Mesh


def _all_reduce(x: Tensor, mesh: Mesh) -> Tensor:
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", mesh.tp_group)  # out of place: no clone needed
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
    x = x.contiguous()
    # gloo wants the output in concatenated form (tp * n0, ...); viewed as stacked (tp, n0, ...).
    if torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(x, 0, mesh.tp_group)
    else:
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
    dim = dim % x.ndim
    if x.shape[dim] % mesh.tp:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over tp={mesh.tp}")
    pieces = x.unflatten(dim, (mesh.tp, -1)).movedim(dim, 0).contiguous()
    if torch.compiler.is_compiling():  # this rank's piece of the sum, from the pieces stacked on dim 0
        mine = funcol.reduce_scatter_tensor(pieces.flatten(0, 1), "sum", 0, mesh.tp_group)
        return mine.view(pieces.shape[1:])
    out = x.new_empty(pieces.shape[1:])
    with timers.comm("reduce_scatter", "tp", "tp", nbytes=pieces.numel() * pieces.element_size()):
        if mesh.direct_collectives:  # gloo: half the bytes of its own reduce-scatter
            start_reduce_scatter(out, pieces, mesh.tp_group).wait()
        else:
            dist.reduce_scatter_single(out, pieces.flatten(0, 1), group=mesh.tp_group)
    return out


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
