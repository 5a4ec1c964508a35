"""Tensor (+ sequence) parallelism equals one process: tp=2 vs serial, same model, data and optimizer.

Each case trains a tiny GPT (vocab 257, which tp=2 does not divide) for 12 steps with
warm-up, cosine lr, weight decay and global grad-norm clipping, on batches chosen by
BatchLoader.global_indices, once on this process and once on 2 gloo ranks. Per-step losses
and grad norms must match (relative), and the final weights gathered from the shards must
equal the serial ones (absolute, max over elements).

Tolerances: float64 is the strict check, where reduction-order noise is ~1e-15 and a real
bug (a missing all-reduce, a wrong shard) is off by orders of magnitude. In float32 the
tp=2 run sums matmul partials in a different order (row-parallel layers, vocab-parallel
softmax), so differences start at ~1e-7 relative and Adam/LAMB amplify them in
near-zero gradients over the steps; 1e-4 stays above what 12 steps of that produce (up to
2.2e-5 measured on an AVX-512 Xeon, whose kernels block the sums differently from AVX2's)
and far below what any bug produces. One tensor is apart in float32: the attention's key
bias, whose exact gradient is zero (adding b_k to every key adds q.b_k to all of a query's
scores, which the softmax ignores). Its float32 gradient is pure rounding noise, which
AdamW normalises into steps of up to lr each, different on each layout; float64 still
checks it strictly (noise 1e-17 is far below eps, so the steps vanish).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import WorkerPool
from _parity import SyntheticSamples, optim_config, split_key_bias

from megascale.config import ModelConfig, ParallelConfig
from megascale.data.loader import BatchLoader
from megascale.model import GPT
from megascale.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from megascale.parallel import (
    Mesh,
    TPLayerFactory,
    full_state_dict,
    grad_norm_reducer,
    lamb_norm_reducer,
    load_full_state_dict,
    parallelize,
    sync_partial_grads,
    tp_loss,
)

STEPS, BATCH, VOCAB, SEQ = 12, 4, 257, 16
TOL = {torch.float32: 1e-4, torch.float64: 1e-11}


def model_config(style: str, block: str, attention: str) -> ModelConfig:
    llama = style == "llama"
    return ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layers=2, d_model=32, n_heads=4, style=style,
                       block=block, attention=attention, window=5, bias=not llama, tie_embeddings=not llama)


# ---------------------------------------------------------------------------------------
# Data: a learnable token stream, read through the loader's global order


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    samples = SyntheticSamples(64, SEQ, VOCAB)
    loader = BatchLoader(samples, global_batch=BATCH, seed=1, prefetch=0)
    out = []
    for step in range(STEPS):
        tokens = samples.batch(loader.global_indices(step))
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


# ---------------------------------------------------------------------------------------
# The training loop, built from the same pieces as the Trainer


def train(model, loss_of, optimizer, ocfg, *, after_backward=None, clip_reducer=None):
    params = list(model.parameters())
    losses, norms = [], []
    for step, (idx, targets) in enumerate(batches()):
        set_lr(optimizer, lr_at(step, ocfg, STEPS))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(idx, targets)
        loss.backward()
        if after_backward is not None:
            after_backward()
        norms.append(clip_grad_norm_(params, ocfg.grad_clip, norm_reducer=clip_reducer).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def serial_run(mcfg, ocfg, dtype, fused):
    torch.manual_seed(1234)
    model = GPT(mcfg)
    model.to(dtype)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    losses, norms = train(model, model, build_optimizer(model, ocfg), ocfg)
    return init, losses, norms, model.state_dict()


def tp_run(rank, mcfg, ocfg, dtype, sp, fused):
    torch.manual_seed(1234)
    init = GPT(mcfg).to(dtype).state_dict()  # the serial model's initial weights (same seed)
    mesh = Mesh.build(ParallelConfig(tp=2, sequence_parallel=sp))
    factory = TPLayerFactory(mesh, sequence_parallel=sp)
    model = GPT(mcfg, factory)
    parallelize(model, factory, fuse_parallel_block=fused).to(dtype)
    load_full_state_dict(model, init, mesh)
    optimizer = build_optimizer(model, ocfg)
    if ocfg.name == "lamb":
        optimizer.norm_reducer = lamb_norm_reducer(optimizer, mesh)
    losses, norms = train(
        model, lambda idx, t: tp_loss(model, factory, idx, t), optimizer, ocfg,
        after_backward=lambda: sync_partial_grads(model, mesh),
        clip_reducer=grad_norm_reducer(model.parameters(), mesh),
    )
    full = full_state_dict(model, mesh)
    return losses, norms, {k: v.numpy() for k, v in full.items()} if rank == 0 else None


# ---------------------------------------------------------------------------------------

CASES = {
    # name: (style, block, attention, sequence_parallel, fused parallel block, optimizer)
    "gpt-tp": ("gpt", "sequential", "full", False, False, "adamw"),
    "gpt-tp-sp-lamb": ("gpt", "sequential", "full", True, False, "lamb"),
    "gpt-parallel-sp": ("gpt", "parallel", "full", True, False, "adamw"),
    "gpt-parallel-sp-fused-lamb": ("gpt", "parallel", "full", True, True, "lamb"),
    "llama-sliding-sp-lamb": ("llama", "sequential", "sliding", True, False, "lamb"),
    "llama-parallel-sliding-fused": ("llama", "parallel", "sliding", False, True, "adamw"),
    "llama-parallel-sliding-sp-fused": ("llama", "parallel", "sliding", True, True, "lamb"),
}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_one_process(pool, case, dtype):
    style, block, attention, sp, fused, opt = CASES[case]
    mcfg, ocfg = model_config(style, block, attention), optim_config(opt)
    _, want_losses, want_norms, want_weights = serial_run(mcfg, ocfg, dtype, fused)
    (losses, norms, weights), (losses1, _, _) = pool.run(tp_run, mcfg, ocfg, dtype, sp, fused)

    assert losses == losses1  # both tp ranks report the same loss
    want_l, got_l = torch.tensor(want_losses, dtype=torch.float64), torch.tensor(losses, dtype=torch.float64)
    loss_rel = ((got_l - want_l).abs() / want_l.abs()).max().item()
    norm_rel = max(abs(a - b) / b for a, b in zip(norms, want_norms, strict=True))
    got = split_key_bias({k: torch.from_numpy(v) for k, v in weights.items()}, mcfg)
    want_weights = split_key_bias(want_weights, mcfg)
    diffs = {k: got[k] - v for k, v in want_weights.items()}
    key_bias_max = max((d.abs().max().item() for k, d in diffs.items() if k.endswith("#key")), default=0.0)
    if dtype == torch.float32:
        diffs = {k: d for k, d in diffs.items() if not k.endswith("#key")}
        assert key_bias_max < 1e-3  # noise-driven, bounded by the lr; exact in the float64 run
    weight_max = max(d.abs().max().item() for d in diffs.values())
    print(f"\n{case} {dtype}: loss rel {loss_rel:.2e}, grad-norm rel {norm_rel:.2e}, "
          f"weight max abs {weight_max:.2e} (key bias {key_bias_max:.1e}), "
          f"losses {want_losses[0]:.4f} -> {want_losses[-1]:.4f}, first grad norm {want_norms[0]:.3f}")
    assert want_losses[-1] < want_losses[0]  # it trains
    assert loss_rel < TOL[dtype] and norm_rel < TOL[dtype]
    assert weight_max < TOL[dtype]  # weights are O(0.01..5): an absolute bound, fair to tiny biases


def _count_collectives(rank, fused):
    """Collectives in one forward of an SP parallel-block model: fused shares them per block."""
    calls = {"all_gather": 0, "reduce_scatter": 0}
    real = dist.all_gather_single, dist.reduce_scatter_single

    def gather(*a, **k):
        calls["all_gather"] += 1
        return real[0](*a, **k)

    def scatter(*a, **k):
        calls["reduce_scatter"] += 1
        return real[1](*a, **k)

    mcfg = model_config("gpt", "parallel", "full")
    # gloo's own collectives, so that every one is a call counted here (direct sends are isends)
    mesh = Mesh.build(ParallelConfig(tp=2, sequence_parallel=True, direct_collectives=False))
    factory = TPLayerFactory(mesh, sequence_parallel=True)
    model = GPT(mcfg, factory)
    parallelize(model, factory, fuse_parallel_block=fused)
    idx, targets = batches()[0]
    dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    try:
        tp_loss(model, factory, idx, targets)
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real
    return calls


def test_fused_parallel_block_shares_one_gather_and_one_reduce_scatter(pool):
    layers = model_config("gpt", "parallel", "full").n_layers
    # embedding: one reduce-scatter; LM head: one all-gather; per block: 2 + 2 unfused, 1 + 1 fused
    unfused, fused = pool.run(_count_collectives, False)[0], pool.run(_count_collectives, True)[0]
    assert unfused == {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1}
    assert fused == {"all_gather": layers + 1, "reduce_scatter": layers + 1}
