"""Gradients and norms under tensor parallelism: partial-gradient sums and the norm reducers.

Three things differ from one process once parameters are split over tp:

* Replicated parameters marked `tp_partial_grad` (norms and biases under sequence
  parallelism, norms of a fused parallel block) hold a part of their gradient on each rank;
  `sync_partial_grads` sums them over tp in one flat all-reduce, after backward and before
  clipping and the optimizer.
* LAMB's trust ratio needs the norms of whole tensors: `lamb_norm_reducer` sums the squared
  norms of split tensors over tp and leaves replicated ones alone (they are whole already).
* The global grad norm counts every element of the model once: `grad_norm_reducer` counts
  split tensors on every tp rank (each holds a different piece) and replicated ones on tp
  rank 0 only, then sums over the model-parallel (tp x pp) group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megascale.observe import timers
from megascale.parallel.mesh import Mesh


def is_split(p: Tensor) -> bool:
    return getattr(p, "tp_split_dim", None) is not None


@torch.no_grad()
def sync_partial_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum the gradients of partial-gradient parameters over tp (one collective).

    A partial parameter without a gradient on this rank (a row bias used on tp rank 0 only)
    gets a zero one first, so every rank presents the same tensors to the optimizer.
    """
    params = [p for p in model.parameters() if p.requires_grad and getattr(p, "tp_partial_grad", False)]
    if mesh.tp == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    with timers.comm("all_reduce", "tp", "tp", nbytes=flat.numel() * flat.element_size()):
        mesh.all_reduce(flat, mesh.tp_group)
    for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(summed)


def lamb_norm_reducer(optimizer: torch.optim.Optimizer, mesh: Mesh) -> Callable[[Tensor], Tensor]:
    """For Lamb(norm_reducer=...): whole-tensor squared norms of (2, n) local ones."""

    def reduce(sq: Tensor) -> Tensor:
        if mesh.tp == 1:
            return sq
        adapted = [p for g in optimizer.param_groups if g["adapt"] for p in g["params"] if p.grad is not None]
        split = torch.tensor([is_split(p) for p in adapted], device=sq.device)
        pieces = sq * split
        with timers.comm("all_reduce", "tp", "tp"):
            mesh.all_reduce(pieces, mesh.tp_group)
        return torch.where(split, pieces, sq)

    return reduce


def grad_norm_reducer(params: Iterable[Tensor], mesh: Mesh) -> Callable[[Tensor], Tensor]:
    """For clip_grad_norm_(params, ..., norm_reducer=...): the global squared grad norm over the mesh."""
    params = list(params)

    def reduce(sq: Tensor) -> Tensor:
        counted = [is_split(p) or mesh.tp_rank == 0 for p in params if p.grad is not None]
        total = (sq * torch.tensor(counted, device=sq.device)).sum()
        if mesh.mp_group is not None:
            with timers.comm("all_reduce", "tp", "mp"):  # the global grad norm
                mesh.all_reduce(total, mesh.mp_group)
        return total

    return reduce
