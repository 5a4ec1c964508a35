"""Where each rank's rows of a sequence-parallel tensor sit, and GEMMs on them in place (overlap.py).

Under sequence parallelism rank r holds positions [r s/tp, (r+1) s/tp) of every sequence, and the
tensor-parallel overlap cuts that local sequence further into c chunks. The all-gather of every rank's
chunk i lays the rows out rank-major, (tp, b, s/(tp c), f), while the layers around keep full
sequences in natural order, (b, s, f). `gathered_order` is the view of a natural tensor in the
gathered order, [chunk][rank]; each such slot is one contiguous block of rows per sequence of the
batch, which is what lets `gemm_into` write a slot's GEMM in place, and `paired_rows` puts a natural
and a gathered tensor in one row order for a weight gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gathered_order(t: Tensor, c: int, tp: int) -> Tensor:
    """A full-sequence (b, s, f) tensor as the all-gathers of the ranks' local chunks lay it out: a
    (c, tp, b, s / (tp c), f) view, [i][r] rank r's rows of chunk i; `t` contiguous (ours always are,
    an input is made so). Taken once per pass, not per slot: Tensor.unflatten is Python."""
    b, s, f = t.shape
    return t.view(b, tp, c, s // (tp * c), f).permute(2, 1, 0, 3, 4)


def paired_rows(natural: Tensor, gathered: Tensor, c: int, tp: int) -> tuple[Tensor, Tensor]:
    """The rows of a full-sequence (b, s, f) tensor and of a (c, tp, b, s / (tp c), g) one in gathered
    order, as two 2D tensors in one order, for a weight gradient's one GEMM: the narrower of the two is
    copied into the other's order (the fewer bytes moved), the other stays a view."""
    nf, gf = natural.shape[-1], gathered.shape[-1]
    if nf < gf:
        return gathered_order(natural.contiguous(), c, tp).reshape(-1, nf), gathered.reshape(-1, gf)
    return natural.reshape(-1, nf), gathered.permute(2, 1, 0, 3, 4).reshape(-1, gf)


def gemm_into(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None) -> None:
    """out[j] = a[j] @ b (+ bias) over dim 0 of 3D views whose every [j] is one contiguous block of rows
    (a rank's slot of a full-sequence tensor is one block per sequence of the batch), operands in the
    compute dtype (overlap.py's `_compute_dtype`: an out= GEMM is not autocast's to cast).

    A GEMM per block, written in place where `out` has that dtype: on the slot as a whole matmul copies
    the strided operand first and its result is copied to its place after. In a fake world (every
    collective a no-op) a tp2 step's compute with the overlap was x1.13-1.19 the plain path's that way,
    x1.11-1.12 in place; on the simulated tp2 cluster the no-comm step 5% shorter (README). Where `out`
    has another dtype (autocast's bf16 GEMMs into a float32 gradient) the result is made, then copied:
    only gradients go there, never with a bias (a forward writes into a tensor of the compute dtype)."""
    if out.dtype != a.dtype:
        assert bias is None, "gemm_into: a bias only where out has the compute dtype"
        out.copy_(a @ b)
        return
    for j in range(a.shape[0]):
        if bias is None:
            torch.mm(a[j], b, out=out[j])
        else:
            torch.addmm(bias, a[j], b, out=out[j])


def add_wgrad(acc: Tensor | None, g: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """acc + sum_j g[j]^T @ x[j] (a new tensor of `dtype` where acc is None), over dim 0 of 3D views
    whose every [j] is one contiguous block of rows, operands in the compute dtype: a weight gradient
    summed slot by slot, so that a slot's part is computed as soon as its rows are in. Accumulated in
    place where `dtype` is the compute dtype, else (autocast's bf16 GEMMs) each part added in `dtype`,
    never rounded to the compute dtype in between."""
    for j in range(g.shape[0]):
        if acc is None:
            acc = (g[j].T @ x[j]).to(dtype)
        elif acc.dtype == g.dtype:
            acc.addmm_(g[j].T, x[j])
        else:
            acc += g[j].T @ x[j]
    return acc
