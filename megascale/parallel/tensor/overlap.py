"""Tensor-parallel communication hidden under the GEMMs (MegaScale sec. 3.2, flag parallel.tp_overlap).

Why: a TP layer's collective sits on the critical path. Under sequence parallelism a column
layer cannot start its GEMM before the all-gather of its input has finished, and a row layer's
reduce-scatter cannot start before its GEMM has; plain TP's all-reduce likewise. Cut the GEMM
into chunks and the collectives become a pipeline: chunk i's communication runs while chunk
i+1's (or i-1's) GEMM computes, so only about one chunk of it stays exposed.

  column, SP   fwd: the own rows' GEMMs under chunk 0's all-gather, then chunk i+1's under the
                    peers' rows of chunk i (all gathers issued first)
               bwd: the dgrad in one GEMM, every chunk's reduce-scatter under the one wgrad GEMM
                    (Megatron's linear backward)
  column, TP   fwd: the GEMM as is (copy has no forward collective)
               bwd: one all-reduce per chunk, under the next chunk's dgrad, the last under the wgrad
  row, SP      fwd: reduce-scatter chunk i under the GEMM of chunk i+1, the last ones under the own rows'
               bwd: as column SP's forward (all-gather grad_output), the own rows' part of the
                    wgrad also under the gathers, each peer's rows' added as they come
  row, TP      fwd: all-reduce chunk i under the GEMM of chunk i+1;  bwd: no collective

Own rows. Of an all-gather + GEMM, the rows of this rank's own shard need nothing from the wire,
and of a GEMM + reduce-scatter, the rows whose sum stays here are sent nowhere: as torchtitan's
async TP and Megatron's ring-exchange overlap decompose the GEMM by rank, they run first (under the
first gathers) or last (under the last reduce-scatters), so even one chunk hides 1/tp of its GEMM
and no collective is left wholly exposed. A last reduce-scatter's own rows need the direct sends
(gloo, distributed/direct.py), where only the peers' rows leave and the sum lands in the own slot
at the wait; a backend's collective reads all of its input while it runs. On the simulated 1 Gbit/s
tp2 cluster it took the exposed tp wait from 99 to 72-85 ms a step at 2 chunks (one sitting), and
1 chunk (half the messages) then hid as much as 2 (`benchmarks/overlap.py --dims tp`).

Chunks. Plain TP cuts the flattened tokens (batch * seq rows): contiguous slices, every
chunk's all-reduce is elementwise, no reordering. SP cuts each rank's local sequence (dim 1):
that works at micro-batch 1 (the usual size at scale), where batch chunks could not. The
all-gather of every rank's local chunk i gives rows rank-major, (tp, batch, seq/(tp c)):
`slots.gathered_order` views a full-sequence tensor in that order, [chunk][rank], so GEMMs write
straight to their place in natural order (`slots.gemm_into`) and reduce-scatter inputs are read from it. Chunk
counts are the largest divisor of the size that is <= tp_overlap_chunks (`num_chunks`): equal
chunks only, never a ragged one and never a wrong result.

The column layer keeps its gathered input for the weight gradient instead of re-gathering it
in backward as Megatron does: that is what the plain path (gather_seq + F.linear) saves too, so
the memory is the same with the flag on or off, and re-gathering would move an extra all-gather
per layer, on links that are the scarce resource here. With activation recomputation the
saved copy lives only inside one block's backward anyway.

The collectives run on a process group of their own, each pass waiting for all it issued
(flight.py).

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

import torch
import torch.nn.functional as F
from torch import Tensor

from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor import symm_mem
from megascale.parallel.tensor.flight import Flight, Overlap, num_chunks
from megascale.parallel.tensor.slots import add_wgrad, gathered_order, gemm_into, paired_rows


def _amp_state(x: Tensor) -> tuple[str, bool, torch.dtype]:
    dev = x.device.type
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def _amp(state: tuple[str, bool, torch.dtype]):
    """The forward's autocast state, for the backward's GEMMs (what torch.amp.custom_bwd does)."""
    dev, enabled, dtype = state
    return torch.autocast(dev, dtype=dtype, enabled=enabled)


def _compute_dtype(amp: tuple[str, bool, torch.dtype], dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast would run a GEMM of `dtype` operands in (it leaves float64 alone)."""
    _, enabled, amp_dtype = amp
    return amp_dtype if enabled and dtype != torch.float64 else dtype


def _save(ctx, ov: Overlap, tp: int, amp, *tensors: Tensor) -> None:
    ctx.ov, ctx.tp, ctx.amp = ov, tp, amp
    ctx.save_for_backward(*tensors)


def _reduce_scatter_rows(flight: Flight, ov: Overlap, parts: Tensor, rows=None) -> Tensor:
    """Issue the reduce-scatter of one chunk, `parts` (tp, ...) stacked by the rank each slot goes to,
    `rows(r, out)` writing slot r into `out` (None: every slot is written already); returns where this
    rank's sum lands.

    With direct sends only the peers' slots must exist when the exchange starts, and the sum lands in
    this rank's own slot, added to in rank order at the wait, as the plain path adds: the own slot is
    computed later (`_own_rows_last`), under the exchanges in flight. A backend's collective reads its
    whole input while it runs, so there every slot is computed first, the sum goes to a tensor of its own."""
    if rows is not None:
        for r in ov.peers(parts.shape[0]) if ov.direct else range(parts.shape[0]):
            rows(r, parts[r])
    out = parts[ov.rank] if ov.direct else parts.new_empty(parts.shape[1:])
    flight.reduce_scatter(out, parts)
    return out


def _own_rows_last(ov: Overlap, parts: Tensor, rows) -> None:
    """Direct sends: each chunk i's own slot, `rows(i, out)`, under the reduce-scatters already issued."""
    if ov.direct:
        for i in range(parts.shape[0]):
            rows(i, parts[i][ov.rank])


class _GatherColumn(torch.autograd.Function):
    """y = gather_seq(x) W^T + b with the all-gather pipelined under the GEMM, in chunks of dim 1."""

    @staticmethod
    def forward(ctx, x, w, b, tp, ov, chunks):
        bsz, sl, d = x.shape
        c = num_chunks(sl, chunks)
        sc = sl // c
        amp = _amp_state(x)
        dt = _compute_dtype(amp, x.dtype)
        gathered = x.new_empty((c, tp, bsz, sc, d))  # kept for the wgrad (see the module docstring)
        flight, own = Flight(ov), [x.narrow(1, i * sc, sc).contiguous() for i in range(c)]
        for i in range(c):
            flight.all_gather(gathered[i], own[i])
        y = x.new_empty((bsz, tp * sl, w.shape[0]), dtype=dt)
        slots, wt, bias = gathered_order(y, c, tp), w.t().to(dt), None if b is None else b.to(dt)
        for i in range(c):  # this rank's own rows need no gather: their GEMMs run while chunk 0 travels
            gemm_into(slots[i][ov.rank], own[i].to(dt), wt, bias)
        for i in range(c):
            flight.wait(i)  # the gathers of chunks > i go on under this chunk's GEMMs
            for r in ov.peers(tp):
                gemm_into(slots[i][r], gathered[i][r].to(dt), wt, bias)
        ctx.bias_dtype = None if b is None else b.dtype
        _save(ctx, ov, tp, amp, gathered, w)
        return y

    @staticmethod
    def backward(ctx, g):
        gathered, w = ctx.saved_tensors
        c, tp, bsz, sc, d = gathered.shape
        ov = ctx.ov
        flight = Flight(ov)
        with _amp(ctx.amp):
            dt = _compute_dtype(ctx.amp, g.dtype)
            # The dgrad in one GEMM, copied into rank order (the copy also casts it to the input's dtype):
            # each slot a GEMM of its own cost more than the copy and hid less than it cost
            # (benchmarks/tp_layers.py, docs/overlap.md). Every reduce-scatter runs under the wgrad GEMM.
            # At one sequence and one chunk its rows are in rank order already: no copy, unless to cast.
            parts = gathered_order(g.contiguous().to(dt) @ w.to(dt), c, tp)  # stacked by the rank it goes to
            if not parts.is_contiguous() or parts.dtype != gathered.dtype:
                parts = gathered.new_empty((c, tp, bsz, sc, d)).copy_(parts)
            dx = [_reduce_scatter_rows(flight, ov, parts[i]) for i in range(c)]
            dw = None
            if ctx.needs_input_grad[1]:
                g_rows, x_rows = paired_rows(g, gathered, c, tp)
                dw = (g_rows.T @ x_rows).to(w.dtype)
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
        flight = Flight(ctx.ov)
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
        amp = _amp_state(x)
        dt = _compute_dtype(amp, x.dtype)
        # every chunk's GEMM results, stacked by the rank each slot's sum goes to
        parts = x.new_empty((c, tp, bsz, s // (tp * c), w.shape[0]), dtype=dt)
        flight = Flight(ov)
        xs, wt = gathered_order(x.contiguous().to(dt), c, tp), w.t().to(dt)  # xs[i][r]: rank r's rows

        def rows(i: int, r: int, out: Tensor) -> None:
            gemm_into(out, xs[i][r], wt)
        out = [_reduce_scatter_rows(flight, ov, parts[i], lambda r, o, i=i: rows(i, r, o)) for i in range(c)]
        _own_rows_last(ov, parts, lambda i, o: rows(i, ov.rank, o))
        flight.wait_all()
        ctx.chunks = c
        _save(ctx, ov, tp, amp, x, w)
        return torch.cat(out, 1)  # a tensor of its own: a view would keep every rank's slot alive

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        c, tp = ctx.chunks, ctx.tp
        bsz, sl, f = g.shape
        sc = sl // c
        gathered, ov = g.new_empty((c, tp, bsz, sc, f)), ctx.ov
        flight, own = Flight(ov), [g.narrow(1, i * sc, sc).contiguous() for i in range(c)]
        for i in range(c):
            flight.all_gather(gathered[i], own[i])
        dx, dw = x.new_empty(x.shape), None
        dx_slots = gathered_order(dx, c, tp)
        with _amp(ctx.amp):
            dt = _compute_dtype(ctx.amp, g.dtype)
            wd, wgrad = w.to(dt), ctx.needs_input_grad[1]
            xs = gathered_order(x.contiguous().to(dt), c, tp) if wgrad else None
            # The own rows first, while chunk 0's gather travels: their input gradient and their part of
            # the weight gradient, which needs nothing from the wire either (twice the GEMM under it)
            for i in range(c):
                gemm_into(dx_slots[i][ov.rank], own[i].to(dt), wd)
            for i in range(c) if wgrad else ():
                dw = add_wgrad(dw, own[i].to(dt), xs[i][ov.rank], w.dtype)
            for i in range(c):
                flight.wait(i)  # the gathers of chunks > i go on under this chunk's GEMMs
                for r in ov.peers(tp):
                    gemm_into(dx_slots[i][r], gathered[i][r].to(dt), wd)
                    if wgrad:
                        dw = add_wgrad(dw, gathered[i][r].to(dt), xs[i][r], w.dtype)
        return dx, dw, None, None, None


class _RowReduce(torch.autograd.Function):
    """y = reduce_from_tp(x W^T): chunk i's all-reduce under chunk i+1's GEMM (token chunks)."""

    @staticmethod
    def forward(ctx, x, w, tp, ov, chunks):
        x2 = x.reshape(-1, x.shape[-1])
        flight, out = Flight(ov), []
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
