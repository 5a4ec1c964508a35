"""parallel.tp_overlap equals the plain TP path: the chunked, asynchronous collectives of overlap.py
change when bytes move, never what is computed.

On 2 gloo ranks in float64: each overlapped layer against the plain one (forward, input and
parameter gradients, to 1e-12 relative), then whole GPTs (gpt and llama style, sequential and
parallel block, with and without sequence parallelism) built with overlap off and on from the same
weights, whose loss and every parameter gradient must agree at each of a few AdamW steps, and so
must the weights after them, to test_tp_parity's float64 bounds: 1e-11 relative for losses and
gradients, 1e-11 absolute for weights (O(0.01..1)). Not tighter: a GEMM's rows round differently
with the rows beside them (~1e-15), so any chunking differs from the plain path there, and AdamW
turns such noise in a gradient element near its eps (1e-8) into steps that differ by lr / eps
times as much: 1.8e-13 on one fc_in weight after the first step, 2.6e-12 of that tensor's largest.
The attention's key bias, whose exact gradient is zero, is one such element everywhere. A real bug
(a chunk in the wrong place, a missing sum) is off by orders of magnitude.
Chunk counts 1 (the default: each GEMM split by rank only), 2, 3 and 5 are used: at seq 12 (6
tokens per rank under SP) 5 divides neither, so the layers fall back to 4 or 3 chunks
(`num_chunks`). The one Trainer-level case is the "tp2-sp-overlap" layout of test_trainer_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import WorkerPool
from _parity import SyntheticSamples

from megascale.config import ModelConfig, OptimConfig, ParallelConfig
from megascale.model import GPT
from megascale.observe import timers
from megascale.optim import build_optimizer
from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor.apply import TPLayerFactory, parallelize, tp_loss
from megascale.parallel.tensor.flight import num_chunks, overlap_settings
from megascale.parallel.tensor.grads import sync_partial_grads
from megascale.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from megascale.parallel.tensor.state import load_full_state_dict

F64 = torch.float64
SEQ, BATCH, VOCAB, STEPS = 12, 2, 97, 3
TOL = 1e-12  # one layer, relative
STEP_TOL = 1e-11  # whole models over AdamW steps: losses and gradients relative, weights absolute


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's largest element (0 for equal zero tensors)."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def test_chunk_count_falls_back_to_the_largest_divisor():
    assert [num_chunks(12, c) for c in (1, 2, 3, 4, 5, 7, 12, 13)] == [1, 2, 3, 4, 4, 6, 12, 12]
    assert [num_chunks(6, c) for c in (2, 4, 5)] == [2, 3, 3]
    assert num_chunks(7, 3) == 1 and num_chunks(1, 4) == 1 and num_chunks(0, 2) == 1


def test_overlap_is_off_without_tp_or_chunks():
    mesh = Mesh(1, 1, 1, 0)
    assert overlap_settings(mesh, 2) is None and TPLayerFactory(mesh, overlap_chunks=2).overlap is None


# ---------------------------------------------------------------------------------------
# One layer, overlapped vs plain


class _Launches:
    """A stand-in recorder: counts the async collectives, checks each is marked issued once started (its
    issuing thread's part timed) and waited once."""

    def __init__(self):
        self.launched, self.started, self.waited = [], 0, 0

    def launch(self, op, stream, group, peer, tag, nbytes):
        self.launched.append((op, stream, group))
        outer = self

        class Pending:
            def issued(self):
                outer.started += 1

            def wait(self, work=None):
                outer.waited += 1
                work.wait()

        return Pending()


def _layer_pair(rank, kind, sp, chunks, batch, seq, direct=True, autocast=False):
    torch.manual_seed(0)
    mesh = Mesh.build(ParallelConfig(tp=2, direct_collectives=direct))
    ov = overlap_settings(mesh, chunks)
    dtype = torch.float32 if autocast else F64
    if kind == "column":
        mode = dict(input_mode="gather_seq" if sp else "copy")
        plain, lap = (ColumnParallelLinear(8, 6, True, mesh, **mode, overlap=o).to(dtype) for o in (None, ov))
    else:
        mode = dict(output_mode="reduce_scatter_seq" if sp else "reduce")
        plain, lap = (RowParallelLinear(8, 6, True, mesh, **mode, overlap=o).to(dtype) for o in (None, ov))
    lap.load_state_dict(plain.state_dict())
    in_seq = seq // 2 if kind == "column" and sp else seq
    x = torch.randn(batch, in_seq, plain.weight.shape[1], dtype=dtype)
    out = []
    for layer in (plain, lap):
        rec = _Launches()
        timers.install(rec if layer is lap else None)
        try:
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(xi)
            (y.double() * torch.arange(y.numel(), dtype=F64).view_as(y).sin()).sum().backward()
        finally:
            timers.install(None)
        out.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    diffs = [rel(a.double(), b.double()) for a, b in zip(out[1], out[0], strict=True)]
    if autocast:
        return diffs, [[t.dtype for t in o] for o in out]
    return diffs, rec.launched, (rec.started, rec.waited)


CHUNKED = {"column": {True: "reduce_scatter", False: "all_reduce"},  # backward's collective
           "row": {True: "reduce_scatter", False: "all_reduce"}}  # forward's


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gloo"])
@pytest.mark.parametrize("batch,seq,chunks",
                         [(2, 12, 1), (1, 12, 1), (2, 12, 2), (2, 12, 3), (1, 12, 5), (3, 4, 4)])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_overlapped_layer_equals_the_plain_layer(pool, kind, sp, chunks, batch, seq, direct):
    """direct: the reduce-scatters as direct sends, whose own slot is computed after they start
    (overlap.py `_reduce_scatter_rows`); gloo: its collectives, every slot first."""
    (diffs, launched, (started, waited)), _ = pool.run(_layer_pair, kind, sp, chunks, batch, seq, direct)
    assert max(diffs) < TOL, diffs
    tokens = seq // 2 if sp else batch * seq  # what SP chunks (the local sequence) or TP (the tokens)
    n = num_chunks(tokens, chunks)
    ops = [op for op, _, _ in launched]
    assert all(stream == "tp" and group == "tp" for _, stream, group in launched)
    assert ops.count(CHUNKED[kind][sp]) == n and started == waited == len(launched)
    assert ops.count("all_gather") == (n if sp else 0)  # column fwd / row bwd under SP


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gloo"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_overlapped_layer_under_autocast_returns_what_autocast_does(pool, kind, sp, direct):
    """bf16 autocast (train.dtype = "bf16"): the overlapped layer's GEMMs in bf16 as autocast's linear runs
    them (overlap.py casts their operands itself: an out= GEMM is not autocast's), output and gradients in
    the plain layer's dtypes, values the plain layer's to bf16's precision."""
    for diffs, dtypes in pool.run(_layer_pair, kind, sp, 2, 2, 12, direct, True):
        assert dtypes[1] == dtypes[0], dtypes
        assert dtypes[0][1:] == [torch.float32] * 3, dtypes  # gradients in the input's and parameters'
        assert max(diffs) < 2e-2, diffs


# ---------------------------------------------------------------------------------------
# Whole models: loss and every gradient, step by step


def _model_config(style: str, block: str, recompute: bool = False) -> ModelConfig:
    llama = style == "llama"
    return ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layers=2, d_model=32, n_heads=4, style=style,
                       block=block, bias=not llama, tie_embeddings=not llama, recompute=recompute)


def _build(mcfg, mesh, sp, fuse, chunks, init, impl="chunked"):
    factory = TPLayerFactory(mesh, sequence_parallel=sp, overlap_chunks=chunks, overlap_impl=impl,
                             overlap_branches=True)
    model = parallelize(GPT(mcfg, factory), factory, fuse_parallel_block=fuse).to(F64)
    load_full_state_dict(model, init, mesh)
    ocfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    return model, factory, build_optimizer(model, ocfg)


def _model_parity(rank, style, block, sp, fuse, recompute, chunks, impl="chunked", tp=2, transport="sockets"):
    """Overlap off against on (impl: parallel.tp_overlap_impl; test_tp_symm_mem uses "auto"; transport:
    parallel.transport, the direct exchanges' messages over our sockets or gloo's own isend/irecv)."""
    mcfg = _model_config(style, block, recompute)
    torch.manual_seed(1234)
    init = GPT(mcfg).to(F64).state_dict()
    mesh = Mesh.build(ParallelConfig(tp=tp, sequence_parallel=sp, transport=transport))
    runs = [_build(mcfg, mesh, sp, fuse, c, init, impl) for c in (0, chunks)]
    samples = SyntheticSamples(16, SEQ, VOCAB)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for step in range(STEPS):
        tokens = samples.batch(range(step * BATCH, (step + 1) * BATCH))
        grads, losses = [], []
        for model, factory, optimizer in runs:
            optimizer.zero_grad(set_to_none=True)
            loss = tp_loss(model, factory, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            sync_partial_grads(model, mesh)
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in model.named_parameters()})
            optimizer.step()
        worst["loss"] = max(worst["loss"], rel(losses[1], losses[0]))
        assert grads[0].keys() == grads[1].keys()
        worst["grad"] = max(worst["grad"], *(rel(grads[1][n], g) for n, g in grads[0].items()))
    off, on = ({n: p.detach() for n, p in model.named_parameters()} for model, _, _ in runs)
    worst["weight"] = max((on[n] - p).abs().max().item() for n, p in off.items())
    overlapped = sum(getattr(m, "overlap", None) is not None and getattr(m, mode, "none") != "none"
                     for m in runs[1][0].modules() for mode in ("input_mode", "_output_mode"))
    overlapped += sum(getattr(m, "branch_schedule", None) is not None for m in runs[1][0].modules())
    return worst, overlapped


MODELS = {
    # name: (style, block, sequence_parallel, fuse the parallel block's collectives, recompute)
    "gpt-sp": ("gpt", "sequential", True, False, False),
    "gpt-tp": ("gpt", "sequential", False, False, False),
    "llama-sp": ("llama", "sequential", True, False, False),
    "llama-tp": ("llama", "sequential", False, False, False),
    "gpt-parallel-sp-fused": ("gpt", "parallel", True, True, False),  # the engine's parallel block
    "llama-parallel-sp-fused": ("llama", "parallel", True, True, False),
    "gpt-parallel-sp-fused-recompute": ("gpt", "parallel", True, True, True),  # backward replays the pairs
    "llama-parallel-tp-fused": ("llama", "parallel", False, True, False),
    "gpt-parallel-sp-unfused": ("gpt", "parallel", True, False, False),
    "llama-sp-recompute": ("llama", "sequential", True, False, True),  # backward replays the chunks
}


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
@pytest.mark.parametrize("name", list(MODELS))
def test_overlap_matches_plain_tp_loss_grads_and_steps(pool, name, chunks):
    style, block, sp, fuse, recompute = MODELS[name]
    (worst, overlapped), (worst1, _) = pool.run(_model_parity, style, block, sp, fuse, recompute, chunks)
    print(f"\n{name} chunks={chunks}: {worst} ({overlapped} overlapped layers)")
    for w in (worst, worst1):
        assert max(w.values()) < STEP_TOL, w
    layers = _model_config(style, block).n_layers
    # every block's 4 linears and the head; the fused parallel block's shared collectives under its
    # MLP's own rows (branches.py: SP only, plain TP's all-reduces keep their place)
    assert overlapped == ((1 + layers if sp else 1) if fuse else 4 * layers + 1)


def test_recompute_replays_the_fused_blocks_exchanges_whole_on_gloos_transport(pool):
    """Activation recomputation must replay a block's forward to its end: cut short once the tensors
    backward needs were recomputed (torch.utils.checkpoint's early stop), the fused block's schedule
    (branches.py) left its reduce-scatter issued and never waited, and on gloo's isend/irecv a later
    exchange with the same peer and tag was matched against it: a tp2 run hung in step 0."""
    for worst, overlapped in pool.run(_model_parity, "gpt", "parallel", True, True, True, 1, "chunked", 2,
                                      "gloo"):
        assert max(worst.values()) < STEP_TOL, worst
        assert overlapped == 1 + _model_config("gpt", "parallel").n_layers


def test_fused_parallel_block_overlap_at_tp4():
    """branches.py with three peers: their rows and slots in rank order."""
    pool4 = WorkerPool(4)
    try:
        results = pool4.run(_model_parity, "gpt", "parallel", True, True, False, 1, "chunked", 4)
    finally:
        pool4.close()
    for worst, overlapped in results:
        assert max(worst.values()) < STEP_TOL, worst
        assert overlapped == 1 + _model_config("gpt", "parallel").n_layers


def _fused_block_schedules(rank, dropout, branches):
    mcfg = dataclasses.replace(_model_config("gpt", "parallel"), dropout=dropout)
    mesh = Mesh.build(ParallelConfig(tp=2, sequence_parallel=True))
    factory = TPLayerFactory(mesh, sequence_parallel=True, overlap_chunks=1, overlap_branches=branches)
    model = parallelize(GPT(mcfg, factory), factory)
    return [b.branch_schedule is not None for b in model.blocks]


def test_fused_parallel_block_overlaps_only_when_asked_and_without_residual_dropout(pool):
    """parallel.tp_overlap_branches is off by default. branches.py draws the MLP branch per part: with
    residual dropout the masks would not be the fused block's, so there the block runs its one
    all-gather and one reduce-scatter as without the overlap."""
    assert pool.run(_fused_block_schedules, 0.0, True)[0] == [True, True]
    assert pool.run(_fused_block_schedules, 0.0, False)[0] == [False, False]
    assert pool.run(_fused_block_schedules, 0.1, True)[0] == [False, False]


# ---------------------------------------------------------------------------------------
# torch.compile: the overlapped layers run eagerly inside a compiled module


def _compiled(rank):
    torch.manual_seed(0)
    torch._dynamo.reset()
    mesh = Mesh.build(ParallelConfig(tp=2, sequence_parallel=True))
    ov = overlap_settings(mesh, 2)
    col = ColumnParallelLinear(8, 16, True, mesh, input_mode="gather_seq", overlap=ov).to(F64)
    row = RowParallelLinear(16, 8, True, mesh, output_mode="reduce_scatter_seq", overlap=ov).to(F64)
    pair = torch.nn.Sequential(col, torch.nn.GELU(), row)
    x = torch.randn(2, 4, 8, dtype=F64)
    out = []
    for fn in (pair, torch.compile(pair, backend="aot_eager")):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.square().sum().backward()
        out.append((y.detach(), xi.grad, col.weight.grad.clone(), row.weight.grad.clone()))
        pair.zero_grad(set_to_none=True)
    return max(rel(a, b) for a, b in zip(out[1], out[0], strict=True))


def test_overlap_under_torch_compile(pool):
    assert max(pool.run(_compiled)) < TOL
