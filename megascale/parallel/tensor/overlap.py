"""Tensor-parallel communication hidden under the GEMMs (MegaScale sec. 3.2, flag parallel.tp_overlap).

Why: a TP layer's collective sits on the critical path. Under sequence parallelism a column
layer cannot start its GEMM before the all-gather of its input has finished, and a row layer's
reduce-scatter cannot start before its GEMM has; plain TP's all-reduce likewise. Cut the GEMM
into chunks and the collectives become a pipeline: chunk i's communication runs while chunk
i+1's (or i-1's) GEMM computes, so only about one chunk of it stays exposed.

  column, SP   fwd: all-gather chunk i+1 under the GEMM of chunk i (all gathers issued first)
               bwd: reduce-scatter of chunk i's dgrad under chunk i+1's dgrad GEMM; the last one
                    under the one wgrad GEMM (Megatron's linear backward, chunked)
  column, TP   fwd: the GEMM as is (copy has no forward collective)
               bwd: as SP's, with one all-reduce per chunk
  row, SP      fwd: reduce-scatter chunk i under the GEMM of chunk i+1
               bwd: all-gather grad_output chunk i+1 under chunk i's dgrad GEMM, then one wgrad
  row, TP      fwd: all-reduce chunk i under the GEMM of chunk i+1;  bwd: no collective

Chunks. Plain TP cuts the flattened tokens (batch * seq rows): contiguous slices, every
chunk's all-reduce is elementwise, no reordering. SP cuts each rank's local sequence (dim 1):
that works at micro-batch 1 (the usual size at scale), where batch chunks could not. The
all-gather of every rank's local chunk i gives rows rank-major, (tp, batch, seq/(tp c)):
`_gathered_order` is that chunk's view of a full-sequence tensor, so GEMM results are written
straight to their place in natural order and reduce-scatter inputs are read from it. Chunk
counts are the largest divisor of the size that is <= tp_overlap_chunks (`num_chunks`): equal
chunks only, never a ragged one and never a wrong result.

The column layer keeps its gathered input for the weight gradient instead of re-gathering it
in backward as Megatron does: that is what the plain path (gather_seq + F.linear) saves too, so
the memory is the same with the flag on or off, and re-gathering would move an extra all-gather
per layer, on links that are the scarce resource here. With activation recomputation the
saved copy lives only inside one block's backward anyway.

The collectives run on a process group of their own (the ranks of mesh.tp_group; one per
TPLayerFactory, created on every rank at construction), as Megatron's TP-overlap communicators
do: a group runs its collectives in issue order, so a chunk never queues behind another tp
collective of the plain path (vocab-parallel loss, BranchIn/BranchOut, partial-gradient sums),
and on NCCL it is a communicator of its own, on its own stream. Every function here waits for
all it issued before it returns, so each group sees the same order on every rank.

Where it does not apply, the plain path runs unchanged: regions whose collective is shared by
several layers (the fused parallel block's BranchIn/BranchOut: column input_mode "none", row
output_mode "none"), fc_in of the fused GeLU MLP (its matmul runs inside the fused op) and the
fused head + loss. Under SP, qkv then gathers inside the layer (apply.py skips its gather at
the attention's entry), so that gather hides under qkv's GEMM too. Under autocast the backward
runs its GEMMs in the forward's autocast state and returns gradients in the parameters' and
inputs' dtypes, as autocast's own casts do.
On CUDA the sequence-parallel layers can instead use PyTorch's fused symmetric-memory ops
(parallel.tp_overlap_impl, symm_mem.py); plain TP's all-reduces always take the chunks here.
torch.compile runs these functions eagerly (a graph break at each call), like the other
collectives of megascale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megascale.distributed import p2p
from megascale.distributed.direct import start_all_gather, start_reduce_scatter
from megascale.distributed.groups import create_groups
from megascale.observe import timers
from megascale.parallel.mesh import Mesh, group_ranks
from megascale.parallel.tensor import symm_mem


@dataclass(frozen=True, eq=False)
class Overlap:
    """How the layers of one TPLayerFactory overlap: chunks per GEMM, and the group they use."""

    chunks: int
    group: dist.ProcessGroup
    direct: bool = False  # collectives as direct sends (gloo, Mesh.direct_collectives)
    symm_mem: bool = False  # the SP layers through PyTorch's fused symmetric-memory ops (symm_mem.py)


def overlap_settings(mesh: Mesh, chunks: int, impl: str = "chunked",
                     device: torch.device | str = "cpu") -> Overlap | None:
    """None when off (chunks == 0, or tp == 1). impl: parallel.tp_overlap_impl (symm_mem.py), for a
    model on `device`. Collective: every rank calls it, in the same order."""
    if chunks <= 0 or mesh.tp == 1:
        return None
    fused = symm_mem.resolve(impl, device)  # before the group: a bad setting fails before any collective
    group = create_groups([group_ranks(mesh.dp, mesh.pp, mesh.tp, "tp")], mesh.rank)[0]
    if p2p.routed(mesh.tp_group):  # parallel.transport = "sockets": its messages on a channel of its own
        p2p.use_sockets((group,))
    return Overlap(chunks, group, mesh.direct_collectives, fused)


def num_chunks(size: int, chunks: int) -> int:
    """The largest divisor of `size` that is <= chunks (at least 1): equal chunks only."""
    return next(c for c in range(max(1, min(chunks, size)), 0, -1) if size % c == 0)


def _gathered_order(t: Tensor, i: int, c: int, tp: int) -> Tensor:
    """Chunk i of a full-sequence (b, s, f) tensor as the all-gather of the ranks' local chunks i
    lays it out: a (tp, b, s / (tp c), f) view, rank-major."""
    return t.unflatten(1, (tp, c, -1))[:, :, i].transpose(0, 1)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class _Flight:
    """The async collectives of one pass, in issue order (the same on every rank), each waited once.

    The tensors stay referenced until their wait, so nothing in flight is freed under gloo."""

    def __init__(self, ov: Overlap):
        self.group, self.direct, self.ops = ov.group, ov.direct, []

    def _issue(self, op: str, nbytes: int, collective, *tensors: Tensor) -> None:
        pending = timers.launch(op, "tp", "tp", nbytes=nbytes)
        self.ops.append((pending, collective(*tensors, group=self.group, async_op=True), tensors))

    # out / inp (tp, ...) stacked by rank; gloo wants them concatenated, (tp * n0, ...): views
    def all_gather(self, out: Tensor, inp: Tensor) -> None:
        if self.direct:  # gloo: faster than its own (distributed/direct.py)
            self._direct("all_gather", _nbytes(out), start_all_gather, out, inp)
        else:
            self._issue("all_gather", _nbytes(out), dist.all_gather_single, out.flatten(0, 1), inp)

    def reduce_scatter(self, out: Tensor, inp: Tensor) -> None:
        if self.direct:  # gloo: half the bytes of its own reduce-scatter (distributed/direct.py)
            self._direct("reduce_scatter", _nbytes(inp), start_reduce_scatter, out, inp)
        else:
            self._issue("reduce_scatter", _nbytes(inp), dist.reduce_scatter_single, out, inp.flatten(0, 1))

    def _direct(self, op: str, nbytes: int, start, out: Tensor, inp: Tensor) -> None:
        pending = timers.launch(op, "tp", "tp", nbytes=nbytes)  # the exchange keeps its tensors itself
        self.ops.append((pending, start(out, inp, self.group), ()))

    def all_reduce(self, t: Tensor) -> None:
        self._issue("all_reduce", _nbytes(t), dist.all_reduce, t)

    def wait(self, i: int) -> None:
        if self.ops[i] is not None:
            pending, work, _ = self.ops[i]
            self.ops[i] = None
            pending.wait(work)  # only the wait counts as exposed communication

    def wait_all(self) -> None:
        for i in range(len(self.ops)):
            self.wait(i)


def _amp_state(x: Tensor) -> tuple[str, bool, torch.dtype]:
    dev = x.device.type
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def _amp(state: tuple[str, bool, torch.dtype]):
    """The forward's autocast state, for the backward's GEMMs (what torch.amp.custom_bwd does)."""
    dev, enabled, dtype = state
    return torch.autocast(dev, dtype=dtype, enabled=enabled)


def _save(ctx, ov: Overlap, tp: int, amp, *tensors: Tensor) -> None:
    ctx.ov, ctx.tp, ctx.amp = ov, tp, amp
    ctx.save_for_backward(*tensors)


class _GatherColumn(torch.autograd.Function):
    """y = gather_seq(x) W^T + b with the all-gather pipelined under the GEMM, in chunks of dim 1."""

    @staticmethod
    def forward(ctx, x, w, b, tp, ov, chunks):
        bsz, sl, d = x.shape
        c = num_chunks(sl, chunks)
        sc = sl // c
        gathered = x.new_empty((c, tp, bsz, sc, d))  # kept for the wgrad (see the module docstring)
        flight = _Flight(ov)
        for i in range(c):
            flight.all_gather(gathered[i], x.narrow(1, i * sc, sc).contiguous())
        y = None
        for i in range(c):
            flight.wait(i)  # the gathers of chunks > i go on under this chunk's GEMM
            part = F.linear(gathered[i], w, b)
            y = part.new_empty((bsz, tp * sl, part.shape[-1])) if y is None else y
            _gathered_order(y, i, c, tp).copy_(part)
        ctx.bias_dtype = None if b is None else b.dtype
        _save(ctx, ov, tp, _amp_state(x), gathered, w)
        return y

    @staticmethod
    def backward(ctx, g):
        gathered, w = ctx.saved_tensors
        c, tp, bsz, sc, d = gathered.shape
        flight = _Flight(ctx.ov)
        with _amp(ctx.amp):
            gp = g.new_empty((c, tp, bsz, sc, g.shape[-1]))  # g in the gathered order of the input
            dx = []
            for i in range(c):
                gp[i].copy_(_gathered_order(g, i, c, tp))
                dx.append(gathered.new_empty((bsz, sc, d)))
                # chunk i's reduce-scatter runs under chunk i+1's dgrad GEMM ...
                flight.reduce_scatter(dx[i], (gp[i] @ w).to(gathered.dtype))
            # ... and the last one under the weight-gradient GEMM
            dw = None
            if ctx.needs_input_grad[1]:
                dw = (gp.flatten(0, -2).T @ gathered.flatten(0, -2)).to(w.dtype)
            db = None if ctx.bias_dtype is None else g.sum((0, 1)).to(ctx.bias_dtype)
        flight.wait_all()
        return torch.cat(dx, 1), dw, db, None, None, None


class _CopyColumn(torch.autograd.Function):
    """y = copy_to_tp(x) W^T + b: backward all-reduces dx per token chunk, under the next dgrad
    chunk, the last one under the wgrad GEMM."""

    @staticmethod
    def forward(ctx, x, w, b, tp, ov, chunks):
        ctx.bias_dtype, ctx.chunks = None if b is None else b.dtype, chunks
        _save(ctx, ov, tp, _amp_state(x), x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        rows = g2.shape[0] // num_chunks(g2.shape[0], ctx.chunks)
        flight = _Flight(ctx.ov)
        with _amp(ctx.amp):
            dx = []
            for g_i in g2.split(rows):
                dx.append((g_i @ w).to(x.dtype))
                flight.all_reduce(dx[-1])
            dw = (g2.T @ x2).to(w.dtype) if ctx.needs_input_grad[1] else None
            db = None if ctx.bias_dtype is None else g2.sum(0).to(ctx.bias_dtype)
        flight.wait_all()
        return torch.cat(dx).view_as(x), dw, db, None, None, None


class _RowReduceScatter(torch.autograd.Function):
    """y = reduce_scatter_seq(x W^T): chunk i's reduce-scatter under chunk i+1's GEMM."""

    @staticmethod
    def forward(ctx, x, w, tp, ov, chunks):
        bsz, s, _ = x.shape
        if s % tp:
            raise ValueError(f"dimension 1 of size {s} does not split over tp={tp}")
        c = num_chunks(s // tp, chunks)
        flight, out = _Flight(ov), []
        for i in range(c):
            part = F.linear(_gathered_order(x, i, c, tp), w)  # (tp, b, chunk, out): stacked by rank
            out.append(part.new_empty(part.shape[1:]))
            flight.reduce_scatter(out[i], part)
        flight.wait_all()
        ctx.chunks = c
        _save(ctx, ov, tp, _amp_state(x), x, w)
        return torch.cat(out, 1)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        c, tp = ctx.chunks, ctx.tp
        bsz, sl, f = g.shape
        sc = sl // c
        gathered = g.new_empty((c, tp, bsz, sc, f))
        flight = _Flight(ctx.ov)
        for i in range(c):
            flight.all_gather(gathered[i], g.narrow(1, i * sc, sc).contiguous())
        dx, g_full, dw = x.new_empty(x.shape), g.new_empty((bsz, tp * sl, f)), None
        with _amp(ctx.amp):
            for i in range(c):
                flight.wait(i)  # the gathers of chunks > i go on under this chunk's dgrad GEMM
                _gathered_order(dx, i, c, tp).copy_(gathered[i] @ w)
                _gathered_order(g_full, i, c, tp).copy_(gathered[i])
            if ctx.needs_input_grad[1]:
                # one wgrad GEMM in natural order, on the saved input as is: reordering the gradient
                # (d_model wide) moves fewer bytes than reordering the input (ffn/tp wide) per chunk
                dw = (g_full.flatten(0, 1).T @ x.flatten(0, 1)).to(w.dtype)
        return dx, dw, None, None, None


class _RowReduce(torch.autograd.Function):
    """y = reduce_from_tp(x W^T): chunk i's all-reduce under chunk i+1's GEMM (token chunks)."""

    @staticmethod
    def forward(ctx, x, w, tp, ov, chunks):
        x2 = x.reshape(-1, x.shape[-1])
        flight, out = _Flight(ov), []
        for x_i in x2.split(x2.shape[0] // num_chunks(x2.shape[0], chunks)):
            out.append(F.linear(x_i, w))
            flight.all_reduce(out[-1])
        flight.wait_all()
        _save(ctx, ov, tp, _amp_state(x), x, w)
        return torch.cat(out).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dw = None
        with _amp(ctx.amp):  # reduce's backward is the identity: a plain linear backward
            dx = (g @ w).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = (g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])).to(w.dtype)
        return dx, dw, None, None, None


@torch.compiler.disable  # async work handles and timers are not traceable: run eagerly, one graph break
def column_linear(x: Tensor, w: Tensor, b: Tensor | None, input_mode: str, mesh: Mesh, ov: Overlap) -> Tensor:
    """ColumnParallelLinear's input stage ("gather_seq" or "copy") and GEMM, overlapped."""
    if ov.symm_mem and input_mode == "gather_seq":
        return symm_mem.gather_column(x, w, b, ov.group.group_name)
    fn = _GatherColumn if input_mode == "gather_seq" else _CopyColumn
    return fn.apply(x, w, b, mesh.tp, ov, ov.chunks)


@torch.compiler.disable
def row_linear(x: Tensor, w: Tensor, output_mode: str, mesh: Mesh, ov: Overlap) -> Tensor:
    """RowParallelLinear's GEMM and output stage ("reduce_scatter_seq" or "reduce"), overlapped."""
    if ov.symm_mem and output_mode == "reduce_scatter_seq":
        return symm_mem.row_reduce_scatter(x, w, ov.group.group_name)
    fn = _RowReduceScatter if output_mode == "reduce_scatter_seq" else _RowReduce
    return fn.apply(x, w, mesh.tp, ov, ov.chunks)
