"""The fused parallel block's two collectives hidden under its MLP's own rows (parallel.tp_overlap).

Why. Under sequence parallelism the parallel block  y = x + Attn(N1 h) + MLP(N2 h),  h = gather(x),
has ONE all-gather in and ONE reduce-scatter out (apply.fuse_branches: MegaScale's half of the
sequential block's collectives), and its column and row layers run as plain local GEMMs: the
per-layer chunking of overlap.py has nothing to pipeline there, so with the fused block the flag
hid nothing. But the MLP branch works token by token: its rows need nothing from the other ranks'
rows, and a rank's own rows are here before any gather. So, as async TP runs the own shard's GEMM
under the gather:

  forward   the all-gather of x issued; the MLP of the first half of the own rows under it; the
            attention over the gathered sequence; the MLP of the peers' rows; the peers' slots of the
            sum (attention + MLP) issued as the reduce-scatter; the MLP of the other half of the own
            rows under it; the own slot at the wait
  backward  the mirror image, as autograd orders it (later nodes first): the reduce-scatter's
            backward (an all-gather of the output gradient) under the second half's MLP backward;
            the all-gather's backward (a reduce-scatter of the peers' rows' gradients back to them)
            under the first half's

Each collective is a pair of autograd functions (start, finish) sharing one `_Exchange`; what runs
between them in the forward runs between them in the backward, mirrored. The sums are the fused
block's: every slot added in the same order (its own, then the peers' in rank order), the MLP's
rows in other GEMM blocks (equal to rounding, tested in float64).

Off by default (parallel.tp_overlap_branches): on CPU the split costs more than it hides. Each part
of the MLP is a GEMM of fewer rows, and its weights' gradients come in three parts that autograd
adds up; at d_model 256 and 64 rows a part the wgrad GEMM of a part costs about what adding its
result does. On the simulated 1 Gbit/s tp2 cluster (`benchmarks/overlap.py --dims tp --block
parallel`) the exposed tp wait fell 208 -> 71 ms a step at d_model 256 and 571 -> 158 at 512, but
the compute grew x1.38 and x1.27: H -44% and +2%; two loopback ranks spent 20-25% more CPU a step.

Where it applies: gloo's direct sends (the reduce-scatter's own slot is computed after the peers'
are sent: a backend's collective reads all of its input at once) and no residual dropout (the MLP
branch's mask would be drawn per part, not over the whole branch as the fused block draws it).
Elsewhere the fused block runs its collectives as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megascale.parallel.tensor.flight import Flight, Overlap


class _Exchange:
    """One collective of the block and its backward's: the forward's in `fwd`, the backward's in `bwd`."""

    __slots__ = ("ov", "tp", "half", "fwd", "bwd", "buf", "grad")

    def __init__(self, ov: Overlap, tp: int, half: int):
        self.ov, self.tp, self.half = ov, tp, half  # half: the own rows whose MLP runs under the gather
        self.fwd = self.bwd = self.buf = self.grad = None


def _peers(t: Tensor, dim: int, ex: _Exchange) -> Tensor:
    """The peers' slots of `t` along `dim`, in rank order (a view where tp is 2)."""
    me, tp = ex.ov.rank, ex.tp
    if tp == 2:
        return t.narrow(dim, 1 - me, 1)
    return t.index_select(dim, torch.tensor(ex.ov.peers(tp), device=t.device))


class _GatherStart(torch.autograd.Function):
    """x -> its own rows in two parts (x[:, :half], x[:, half:]), issuing the all-gather of x.
    Backward: the parts' gradients plus the sum of the peers' gradients of these rows."""

    @staticmethod
    def forward(ctx, x: Tensor, ex: _Exchange) -> tuple[Tensor, Tensor]:
        ex.buf = x.new_empty((ex.tp, *x.shape))  # rank-major: ex.buf[r] is rank r's rows
        ex.fwd = Flight(ex.ov)
        ex.fwd.all_gather(ex.buf, x.contiguous())
        ctx.ex = ex
        return x[:, :ex.half], x[:, ex.half:]

    @staticmethod
    def backward(ctx, g_first: Tensor, g_rest: Tensor):
        ex = ctx.ex
        ex.bwd.wait_all()  # issued by _GatherFinish.backward, the own rows' MLP backward ran under it
        grad = ex.grad  # the reduce-scatter's sum, a tensor of its own
        grad[:, :ex.half] += g_first
        grad[:, ex.half:] += g_rest
        return grad, None


class _GatherFinish(torch.autograd.Function):
    """Once the rows are here: the sequence in order (b, s, d) and the peers' rows (tp - 1, b, s/tp, d).
    Backward: their gradients reduce-scattered to the ranks the rows came from, issued (waited for in
    _GatherStart.backward)."""

    @staticmethod
    def forward(ctx, first: Tensor, ex: _Exchange) -> tuple[Tensor, Tensor]:
        ex.fwd.wait_all()
        ctx.ex = ex
        full = ex.buf
        return full.transpose(0, 1).flatten(1, 2), _peers(full, 0, ex)

    @staticmethod
    def backward(ctx, g_seq: Tensor, g_peers: Tensor):
        ex = ctx.ex
        tp, _, rows = ex.buf.shape[:3]
        parts = g_seq.unflatten(1, (tp, rows)).transpose(0, 1).contiguous()  # (tp, b, rows, d) by rank
        for i, r in enumerate(ex.ov.peers(tp)):
            parts[r] += g_peers[i]
        ex.grad = parts.new_empty(parts.shape[1:])
        ex.bwd = Flight(ex.ov)
        ex.bwd.reduce_scatter(ex.grad, parts)
        return None, None


class _ScatterStart(torch.autograd.Function):
    """The peers' slots of the sum, attention's rows (b, tp, s/tp, d) plus the MLP's of the peers' rows
    (tp - 1, b, s/tp, d), issued as the reduce-scatter whose own slot _ScatterFinish fills; returns a
    token that orders the pair. Backward: the whole of attention's gradient (its own slot's came back
    with the peers'), and the peers' MLP rows'."""

    @staticmethod
    def forward(ctx, attn: Tensor, mlp_peers: Tensor, ex: _Exchange) -> Tensor:
        me = ex.ov.rank
        ex.buf = mlp_peers.new_empty((ex.tp, *mlp_peers.shape[1:]))
        for i, r in enumerate(ex.ov.peers(ex.tp)):
            torch.add(attn[:, r], mlp_peers[i], out=ex.buf[r])
        ex.fwd = Flight(ex.ov)
        ex.fwd.reduce_scatter(ex.buf[me], ex.buf)  # direct sends: the own slot is read at the wait
        ctx.ex = ex
        return mlp_peers.new_empty(0)

    @staticmethod
    def backward(ctx, _token: Tensor):
        ex = ctx.ex
        ex.bwd.wait_all()  # issued by _ScatterFinish.backward, the own rows' MLP backward ran under it
        return ex.grad.transpose(0, 1), _peers(ex.grad, 0, ex), None


class _ScatterFinish(torch.autograd.Function):
    """The own slot's sum: attention's own rows plus the MLP's (two parts), plus the peers' slots for
    this rank, added at the wait in rank order. Backward: the output gradient all-gathered (the
    gradient of every rank's slot here: attention's, returned by _ScatterStart), issued."""

    @staticmethod
    def forward(ctx, attn: Tensor, first: Tensor, rest: Tensor, token: Tensor, ex: _Exchange) -> Tensor:
        out = ex.buf[ex.ov.rank]
        own = attn[:, ex.ov.rank]
        torch.add(own[:, :ex.half], first, out=out[:, :ex.half])
        torch.add(own[:, ex.half:], rest, out=out[:, ex.half:])
        ex.fwd.wait_all()
        ctx.ex = ex
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        ex = ctx.ex
        g = g.contiguous()
        ex.grad = g.new_empty((ex.tp, *g.shape))
        ex.bwd = Flight(ex.ov)
        ex.bwd.all_gather(ex.grad, g)
        # attention's gradient comes whole from _ScatterStart (ex.grad holds this slot's too)
        return None, g[:, :ex.half], g[:, ex.half:], g.new_empty(0), None


def applies(block: nn.Module, ov: Overlap | None, sequence_parallel: bool) -> bool:
    """Whether `overlapped_branches` can run this fused parallel block (the module docstring)."""
    return (ov is not None and ov.direct and sequence_parallel
            and isinstance(block.drop_mlp, nn.Identity))


def overlapped_branches(block: nn.Module, x: Tensor, ov: Overlap, tp: int) -> Tensor:
    """The fused parallel block's forward on this rank's rows x (b, s/tp, d), its all-gather and
    reduce-scatter each under half of the own rows' MLP (the module docstring)."""
    bsz, rows, d = x.shape

    def mlp(t: Tensor) -> Tensor:
        return block.drop_mlp(block.mlp(block.norm2(t)))

    gather = _Exchange(ov, tp, rows // 2)
    first, rest = _GatherStart.apply(x, gather)
    first_mlp = mlp(first)  # under the gather
    seq, peers = _GatherFinish.apply(first, gather)
    attn = block.drop_attn(block.attn(block.norm1(seq))).view(bsz, tp, rows, d)  # this rank's heads' sums
    scatter = _Exchange(ov, tp, rows // 2)
    token = _ScatterStart.apply(attn, mlp(peers), scatter)
    rest_mlp = mlp(rest)  # under the reduce-scatter
    return x + _ScatterFinish.apply(attn, first_mlp, rest_mlp, token, scatter)
