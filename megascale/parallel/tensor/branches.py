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

    __slots__ = ("ov", "tp", "fwd", "bwd", "buf", "grad")

    def __init__(self, ov: Overlap, tp: int):
        self.ov, self.tp = ov, tp
        self.fwd = self.bwd = self.buf = self.grad = None


class _GatherStart(torch.autograd.Function):
    """x -> x, issuing the all-gather of x; backward: the gradient plus what the peers' rows sent back."""

    @staticmethod
    def forward(ctx, x: Tensor, ex: _Exchange) -> Tensor:
        ex.buf = x.new_empty((ex.tp, *x.shape))  # rank-major: ex.buf[r] is rank r's rows
        ex.fwd = Flight(ex.ov)
        ex.fwd.all_gather(ex.buf, x.contiguous())
        ctx.ex = ex
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        ex = ctx.ex
        ex.bwd.wait_all()  # issued by _GatherFinish.backward, the own rows' MLP backward ran under it
        return g + ex.grad, None


class _GatherFinish(torch.autograd.Function):
    """The gathered rows, (tp, b, s/tp, d) rank-major, once they are here; backward: the reduce-scatter
    of their gradient to the ranks they came from, issued (waited for in _GatherStart.backward)."""

    @staticmethod
    def forward(ctx, own: Tensor, ex: _Exchange) -> Tensor:
        ex.fwd.wait_all()
        ctx.ex = ex
        return ex.buf

    @staticmethod
    def backward(ctx, g: Tensor):
        ex = ctx.ex
        ex.grad = g.new_empty(g.shape[1:])
        ex.bwd = Flight(ex.ov)
        ex.bwd.reduce_scatter(ex.grad, g.contiguous())
        return None, None


class _ScatterStart(torch.autograd.Function):
    """The peers' slots of the sum (tp - 1, b, s/tp, d), in rank order, issued as the reduce-scatter whose
    own slot _ScatterFinish fills; returns a token that orders the pair. Backward: the peers' gradients."""

    @staticmethod
    def forward(ctx, peers: Tensor, ex: _Exchange) -> Tensor:
        me = ex.ov.rank
        ex.buf = peers.new_empty((ex.tp, *peers.shape[1:]))
        ex.buf[:me].copy_(peers[:me])
        ex.buf[me + 1:].copy_(peers[me:])
        ex.fwd = Flight(ex.ov)
        ex.fwd.reduce_scatter(ex.buf[me], ex.buf)  # direct sends: the own slot is read at the wait
        ctx.ex = ex
        return peers.new_empty(0)

    @staticmethod
    def backward(ctx, _token: Tensor):
        ex = ctx.ex
        ex.bwd.wait_all()  # issued by _ScatterFinish.backward, the own rows' MLP backward ran under it
        me = ex.ov.rank
        return torch.cat([ex.grad[:me], ex.grad[me + 1:]]), None


class _ScatterFinish(torch.autograd.Function):
    """The own slot's sum: `own` plus the peers' slots for this rank, added at the wait in rank order.
    Backward: the output gradient all-gathered to the peers (the gradient of their slots here), issued."""

    @staticmethod
    def forward(ctx, own: Tensor, token: Tensor, ex: _Exchange) -> Tensor:
        out = ex.buf[ex.ov.rank]
        out.copy_(own)
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
        return g, g.new_empty(0), None


def applies(block: nn.Module, ov: Overlap | None, sequence_parallel: bool) -> bool:
    """Whether `overlapped_branches` can run this fused parallel block (the module docstring)."""
    return (ov is not None and ov.direct and sequence_parallel
            and isinstance(block.drop_mlp, nn.Identity))


def overlapped_branches(block: nn.Module, x: Tensor, ov: Overlap, tp: int) -> Tensor:
    """The fused parallel block's forward on this rank's rows x (b, s/tp, d), its all-gather and
    reduce-scatter each under half of the own rows' MLP (the module docstring)."""
    bsz, rows, d = x.shape
    me, peers = ov.rank, ov.peers(tp)
    half = rows // 2  # the own rows' MLP: this many under the gather, the rest under the reduce-scatter

    def mlp(t: Tensor) -> Tensor:
        return block.drop_mlp(block.mlp(block.norm2(t)))

    gather = _Exchange(ov, tp)
    own = _GatherStart.apply(x, gather)
    first = mlp(own[:, :half]) if half else None
    full = _GatherFinish.apply(own, gather)  # (tp, b, rows, d)
    h = full.transpose(0, 1).reshape(bsz, tp * rows, d)  # the sequence in order
    attn = block.drop_attn(block.attn(block.norm1(h))).view(bsz, tp, rows, d)  # this rank's heads' sums
    index = torch.tensor(peers, device=x.device)
    sent = attn.index_select(1, index).transpose(0, 1) + mlp(full.index_select(0, index))
    scatter = _Exchange(ov, tp)
    token = _ScatterStart.apply(sent, scatter)
    rest = mlp(own[:, half:])
    own_mlp = rest if first is None else torch.cat([first, rest], 1)
    return x + _ScatterFinish.apply(attn[:, me] + own_mlp, token, scatter)
