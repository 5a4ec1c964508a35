"""Rotary position embedding as one fused op, the same function as megascale/model/rotary.py.

"Rotate half" pairs (x[k], x[k + hd/2]) by angle pos * theta^(-2k/hd):

    y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin,   x = [x1, x2] split along head_dim

Unfused that is a chunk, four products, two sums and a cat, each a pass over q or k, and in
backward as many again; fused it is one read of x and one write of y each way (the backward
is the rotation by -angle: the same kernel with sin negated). q and k arrive as strided views
of the qkv projection's output, which the fused op reads in place.

`cos` and `sin` are the (seq, head_dim / 2) rows of the model's tables for x's positions; like
Rotary.forward they are rounded to x's dtype before use.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megascale.ops import dispatch


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary.forward's arithmetic on x (..., seq, head_dim) with tables (seq, head_dim / 2)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (..., seq, head_dim) by the tables' angles; see the module docstring."""
    if x.shape[-1] % 2 or cos.shape != (x.shape[-2], x.shape[-1] // 2) or sin.shape != cos.shape:
        raise ValueError(f"apply_rotary: x {tuple(x.shape)} needs (seq, head_dim/2) tables, got cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if dispatch.use_triton(x) and cos.is_cuda:
        return dispatch.triton_kernels().rotary(x, cos, sin)
    return dispatch.pick("rotary", rotary_reference, x)(x, cos, sin)
