"""Each tensor-parallel layer and collective on 2 gloo ranks, forward and backward, against
nn.Linear / nn.Embedding / F.cross_entropy on the full tensors (float64, so any slip shows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import WorkerPool
from torch import nn

from megascale.config import ConfigError, ModelConfig, ParallelConfig
from megascale.model import GPT
from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor import comm
from megascale.parallel.tensor.apply import TPLayerFactory, check_tp, parallelize, tp_loss
from megascale.parallel.tensor.grads import sync_partial_grads
from megascale.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelPositions,
    VocabParallelEmbedding,
)
from megascale.parallel.tensor.loss import vocab_parallel_cross_entropy
from megascale.parallel.tensor.state import full_state_dict, load_full_state_dict, shard

F64 = torch.float64
B, S = 2, 6


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _mesh():
    torch.manual_seed(0)  # identical full tensors on every rank
    return Mesh.build(ParallelConfig(tp=2))


def _local_seq(x, mesh):
    return x.chunk(mesh.tp, dim=1)[mesh.tp_rank].detach().requires_grad_()


# ---------------------------------------------------------------------------------------
# Linear layers


def _column(rank, sp, gather_output):
    mesh = _mesh()
    ref = nn.Linear(8, 6, dtype=F64)
    x, r = torch.randn(B, S, 8, dtype=F64, requires_grad=True), torch.randn(B, S, 6, dtype=F64)
    (ref(x) * r).sum().backward()

    layer = ColumnParallelLinear(8, 6, True, mesh, input_mode="gather_seq" if sp else "copy",
                                 gather_output=gather_output).to(F64)
    with torch.no_grad():
        layer.weight.copy_(shard(ref.weight, 0, mesh, 3))
        layer.bias.copy_(shard(ref.bias, 0, mesh, 3))
    xl = _local_seq(x, mesh) if sp else x.detach().requires_grad_()
    y = layer(xl)
    rl = r if gather_output else shard(r, 2, mesh, 3)
    close(y, ref(x).detach() if gather_output else shard(ref(x).detach(), 2, mesh, 3))
    (y * rl).sum().backward()
    close(layer.weight.grad, shard(ref.weight.grad, 0, mesh, 3))
    close(layer.bias.grad, shard(ref.bias.grad, 0, mesh, 3))
    close(xl.grad, x.grad.chunk(2, dim=1)[rank] if sp else x.grad)


def _row(rank, sp, input_is_parallel):
    mesh = _mesh()
    ref = nn.Linear(8, 6, dtype=F64)
    x, r = torch.randn(B, S, 8, dtype=F64, requires_grad=True), torch.randn(B, S, 6, dtype=F64)
    (ref(x) * r).sum().backward()

    layer = RowParallelLinear(8, 6, True, mesh, output_mode="reduce_scatter_seq" if sp else "reduce",
                              input_is_parallel=input_is_parallel).to(F64)
    with torch.no_grad():
        layer.weight.copy_(shard(ref.weight, 1, mesh, 4))
        layer.bias.copy_(ref.bias)
    xl = (shard(x, 2, mesh, 4) if input_is_parallel else x).detach().requires_grad_()
    y = layer(xl)
    want, rl = ref(x).detach(), r
    if sp:
        want, rl = want.chunk(2, dim=1)[rank], rl.chunk(2, dim=1)[rank]
    close(y, want)
    (y * rl).sum().backward()
    assert layer.bias.tp_partial_grad == sp
    sync_partial_grads(layer, mesh)
    close(layer.weight.grad, shard(ref.weight.grad, 1, mesh, 4))
    close(layer.bias.grad, ref.bias.grad)
    close(xl.grad, shard(x.grad, 2, mesh, 4) if input_is_parallel else x.grad)


@pytest.mark.parametrize("sp,gather_output", [(False, False), (False, True), (True, False)])
def test_column_parallel_linear(pool, sp, gather_output):
    pool.run(_column, sp, gather_output)


@pytest.mark.parametrize("sp,input_is_parallel", [(False, True), (False, False), (True, True)])
def test_row_parallel_linear(pool, sp, input_is_parallel):
    pool.run(_row, sp, input_is_parallel)


# ---------------------------------------------------------------------------------------
# Vocab-parallel embedding and cross-entropy, with a vocab tp does not divide


V = 257  # 129 rows per rank, the last one padding


def _ids():
    ids = torch.randint(0, V, (B, S))
    ids[0, :4] = torch.tensor([0, 128, 129, 256])  # both sides of the shard boundary, and the last id
    return ids


def _embedding(rank, sp):
    mesh = _mesh()
    ref = nn.Embedding(V, 5, dtype=F64)
    ids, r = _ids(), torch.randn(B, S, 5, dtype=F64)
    (ref(ids) * r).sum().backward()

    emb = VocabParallelEmbedding(V, 5, mesh, sequence_parallel=sp).to(F64)
    assert emb.weight.shape == (129, 5) and emb.weight.tp_full_size == V
    if rank == 1:
        assert emb.weight[-1].abs().sum() == 0  # padding starts at zero
    with torch.no_grad():
        emb.weight.copy_(shard(ref.weight, 0, mesh, 129))
    y = emb(ids)
    want, rl = ref(ids).detach(), r
    if sp:
        want, rl = want.chunk(2, dim=1)[rank], rl.chunk(2, dim=1)[rank]
    close(y, want)
    (y * rl).sum().backward()
    close(emb.weight.grad, shard(ref.weight.grad, 0, mesh, 129))


def _cross_entropy(rank):
    mesh = _mesh()
    logits = torch.randn(B * S, V, dtype=F64, requires_grad=True)
    target = _ids().flatten()
    target[[3, 7]] = -1  # ignored positions
    want = F.cross_entropy(logits, target, ignore_index=-1)
    want.backward()

    local = shard(logits.detach(), 1, mesh, 129).clone()
    if rank == 1:
        local[:, -1] = 1e4  # garbage in the padded column must not reach the softmax
    local.requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, mesh, V)
    close(loss, want.detach())
    (loss * 3.0).backward()
    grad = shard(logits.grad * 3.0, 1, mesh, 129)
    close(local.grad, grad)  # the padded column's gradient is exactly zero


def _head_and_loss(rank, sp):
    """The LM head (vocab-padded column layer) into the vocab-parallel loss, end to end."""
    mesh = _mesh()
    ref = nn.Linear(8, V, bias=False, dtype=F64)
    x = torch.randn(B, S, 8, dtype=F64, requires_grad=True)
    target = _ids()
    F.cross_entropy(ref(x).flatten(0, 1), target.flatten()).backward()

    mode = "gather_seq" if sp else "copy"
    head = ColumnParallelLinear(8, V, False, mesh, input_mode=mode, pad=True).to(F64)
    with torch.no_grad():
        head.weight.copy_(shard(ref.weight, 0, mesh, 129))
    xl = _local_seq(x, mesh) if sp else x.detach().requires_grad_()
    vocab_parallel_cross_entropy(head(xl).flatten(0, 1), target.flatten(), mesh, V).backward()
    close(head.weight.grad, shard(ref.weight.grad, 0, mesh, 129))
    close(xl.grad, x.grad.chunk(2, dim=1)[rank] if sp else x.grad)


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding(pool, sp):
    pool.run(_embedding, sp)


def test_vocab_parallel_cross_entropy_masks_padding(pool):
    pool.run(_cross_entropy)


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_head_and_loss(pool, sp):
    pool.run(_head_and_loss, sp)


# ---------------------------------------------------------------------------------------
# The collectives themselves, and sequence-parallel positions


def _collectives(rank):
    mesh = _mesh()
    x = torch.randn(B, S, 4, dtype=F64, requires_grad=True)
    w = torch.randn(B, S, 4, dtype=F64)
    # scatter then gather along features is the identity, and so is its gradient
    (comm.gather_from_tp(comm.scatter_to_tp(x, mesh), mesh) * w).sum().backward()
    close(x.grad, w)
    # the same along the sequence
    x.grad = None
    (comm.gather_seq(comm.scatter_seq(x, mesh), mesh) * w).sum().backward()
    close(x.grad, 2 * w)  # gather_seq's backward reduce-scatters: both ranks' (equal) grads add
    # reduce_scatter_seq of per-rank different inputs sums them, gather_seq reassembles
    xr = (x.detach() * (rank + 1)).requires_grad_()
    y = comm.reduce_scatter_seq(xr, mesh)
    close(y, 3 * x.detach().chunk(2, dim=1)[rank])
    (comm.gather_seq(y, mesh) * w).sum().backward()
    close(xr.grad, 2 * w)
    # reduce_from_tp / copy_to_tp are each other's transpose
    xc = x.detach().requires_grad_()
    (comm.reduce_from_tp(comm.copy_to_tp(xc, mesh) * (rank + 1), mesh) * w).sum().backward()
    close(xc.grad, 3 * w)  # each rank scales by rank + 1; the backward all-reduce sums 1 + 2


def _positions(rank):
    mesh = _mesh()
    ref = nn.Embedding(S, 4, dtype=F64)
    r = torch.randn(S, 4, dtype=F64)
    (ref(torch.arange(S)) * r).sum().backward()
    pos = SequenceParallelPositions(S, 4, mesh).to(F64)
    with torch.no_grad():
        pos.weight.copy_(ref.weight)
    y = pos(torch.arange(S))
    close(y, ref.weight.detach().chunk(2)[rank])
    (y * r.chunk(2)[rank]).sum().backward()
    sync_partial_grads(pos, mesh)
    close(pos.weight.grad, ref.weight.grad)


def test_collectives_and_their_gradients(pool):
    pool.run(_collectives)


def test_sequence_parallel_positions(pool):
    pool.run(_positions)


# ---------------------------------------------------------------------------------------
# Without processes


def test_layers_on_one_rank_are_the_plain_layers():
    torch.manual_seed(0)
    mesh = Mesh(1, 1, 1, 0)
    ref = nn.Linear(8, 6, dtype=F64)
    x = torch.randn(B, S, 8, dtype=F64)
    for layer in (ColumnParallelLinear(8, 6, True, mesh), RowParallelLinear(8, 6, True, mesh)):
        layer.to(F64).load_state_dict(ref.state_dict())
        close(layer(x), ref(x))
    logits, target = torch.randn(B * S, V, dtype=F64), _ids().flatten()
    close(vocab_parallel_cross_entropy(logits, target, mesh, V), F.cross_entropy(logits, target))


def test_shapes_tp_cannot_split_are_config_errors():
    mesh = Mesh(1, 1, 4, 0)
    with pytest.raises(ConfigError, match="parallel.tp: 4 ranks do not split model.n_heads=6"):
        check_tp(ModelConfig(vocab_size=11, d_model=48, n_heads=6), mesh, False)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: model.seq_len=30"):
        check_tp(ModelConfig(vocab_size=11, d_model=48, n_heads=4, seq_len=30), mesh, True)


# ---------------------------------------------------------------------------------------
# The whole model: padding after parallelize, and one rank through the TP factory


def _tiny(style="gpt"):
    return ModelConfig(vocab_size=V, seq_len=8, n_layers=1, d_model=16, n_heads=2, style=style,
                       bias=style == "gpt")


def _padding_after_parallelize(rank):
    mesh = _mesh()
    factory = TPLayerFactory(mesh)
    model = parallelize(GPT(_tiny(), factory), factory)  # GPT.init_weights draws every row, padding too
    assert model.head.weight is model.embed.tok.weight and model.head.weight.shape == (129, 16)
    return model.embed.tok.weight[-1].abs().sum().item(), model.embed.tok.weight[0].abs().sum().item()


def test_parallelize_zeroes_the_vocab_padding(pool):
    (_, first0), (last1, _) = pool.run(_padding_after_parallelize)
    assert last1 == 0.0 and first0 > 0  # rank 1's last row is padding


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_tp_factory_on_one_rank_equals_the_serial_model(style):
    cfg, mesh = _tiny(style), Mesh(1, 1, 1, 0)
    torch.manual_seed(0)
    serial = GPT(cfg).to(F64)
    factory = TPLayerFactory(mesh, sequence_parallel=True)  # SP on one rank is a no-op
    model = parallelize(GPT(cfg, factory), factory).to(F64)
    load_full_state_dict(model, serial.state_dict(), mesh)
    idx = torch.randint(0, V, (2, 8))
    close(tp_loss(model, factory, idx, idx), serial(idx, idx))
    full = full_state_dict(model, mesh)
    assert full.keys() == serial.state_dict().keys()
    for k, v in serial.state_dict().items():
        close(full[k], v)
