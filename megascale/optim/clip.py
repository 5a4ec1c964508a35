"""Global gradient-norm clipping with a hook for the distributed sum of squares.

The norm is global: over every gradient of the model, wherever its pieces live. Locally we
compute one squared norm per tensor; `norm_reducer` turns that vector into the global
squared total (default: its sum). A distributed trainer installs a reducer that zeroes the
entries of tensor-parallel-replicated tensors on all but one tp rank (so they count once),
sums, and all-reduces over the mesh. The entries follow the order of `params` that have a
gradient.

Why nothing is synchronised here: the clip coefficient is computed on the device and is
forced to 1 when the norm is not finite, so a NaN/inf gradient is never used to scale the
others; the pre-clip norm is returned and the trainer decides to skip or flag the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    norm_reducer: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Scale gradients in place so their global L2 norm is at most max_norm; return the pre-clip norm.

    max_norm <= 0 computes and returns the norm without clipping (for logging).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    sq = torch.stack(torch._foreach_norm(grads)).square()
    total_sq = sq.sum() if norm_reducer is None else norm_reducer(sq)
    total = total_sq.sqrt()
    if max_norm > 0:
        # Same coefficient as torch.nn.utils.clip_grad_norm_, but 1 when the norm is inf/NaN.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total), coef, 1.0)
        torch._foreach_mul_(grads, coef)
    return total
