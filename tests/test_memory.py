"""memory_per_rank against what a run really allocates.

Parameters, gradients and optimizer state must match the storage bytes of the distributed
optimizer's flat buffers and its state shards exactly (dp = 1, 2; tp = 2 with its padded
vocab). Activations are compared with the bytes autograd saves for backward, counted with
saved_tensors_hooks (each storage once, parameters excluded), plus, under recompute, the
block inputs that checkpoint holds outside autograd's saved tensors. The formula counts
per token and leaves out a few per-micro-batch constants (position ids, rotary tables, the
scalar loss), so it must agree within 1% on these tiny models, where those constants weigh
most; on real sizes they vanish.
"""

from __future__ import annotations

import pytest
import torch
from _dist import WorkerPool

from megascale.config import ModelConfig, OptimConfig, ParallelConfig
from megascale.model import GPT
from megascale.parallel import Mesh, TPLayerFactory, parallelize
from megascale.parallel.data import DistributedOptimizer
from megascale.parallel.memory import memory_per_rank

MICRO, BUCKET = 2, 2000


def model_config(style="gpt", block="sequential", recompute=False) -> ModelConfig:
    return ModelConfig(vocab_size=97, seq_len=16, n_layers=2, d_model=32, n_heads=4, style=style, block=block,
                       bias=style == "gpt", tie_embeddings=style == "gpt", recompute=recompute)


def allocated(model, parallel: ParallelConfig, mesh: Mesh, dtype) -> dict[str, int]:
    """Real storage bytes of the flat buffers and of the optimizer state after one step."""
    opt = DistributedOptimizer(model, OptimConfig(name="adamw"), mesh, bucket_size=BUCKET)
    opt.zero_grad()
    x = torch.randint(0, model.cfg.vocab_size, (MICRO, model.cfg.seq_len + 1))
    loss = model(x[:, :-1], x[:, 1:]) if parallel.tp == 1 else None
    if loss is not None:
        loss.backward()
    opt.step()  # creates the state
    state = [t for s in opt.optimizer.state.values() for t in s.values()]
    return {
        "params": sum(b.untyped_storage().nbytes() for b in opt.buffers.param_buffers.values()),
        "grads": sum(b.untyped_storage().nbytes() for b in opt.buffers.grad_buffers.values()),
        "optimizer": sum(t.untyped_storage().nbytes() for t in state),
        # the direct reduce-scatter's receive buffers (gloo), kept by each bucket
        "comm_buffers": sum(t.untyped_storage().nbytes() for b in opt.buffers.buckets
                            for t in b._inbox or []),
    }


def _allocated_on_ranks(rank, parallel, dtype):
    torch.manual_seed(0)
    mcfg = model_config()
    mesh = Mesh.build(parallel)
    if parallel.tp > 1:
        factory = TPLayerFactory(mesh, parallel.sequence_parallel)
        model = parallelize(GPT(mcfg, factory), factory).to(dtype)
    else:
        model = GPT(mcfg).to(dtype)
    return allocated(model, parallel, mesh, dtype)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _check_states(got: dict, want) -> None:
    print(f"\nallocated {got}, predicted params {want.params}, grads {want.grads}, "
          f"optimizer {want.optimizer}, comm buffers {want.comm_buffers}")
    assert got == {"params": want.params, "grads": want.grads, "optimizer": want.optimizer,
                   "comm_buffers": want.comm_buffers}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_states_match_allocation_on_one_rank(dtype):
    torch.manual_seed(0)
    parallel = ParallelConfig()
    got = allocated(GPT(model_config()).to(dtype), parallel, Mesh(1, 1, 1, 0), dtype)
    _check_states(got, memory_per_rank(model_config(), parallel, MICRO, dtype, bucket_size=BUCKET))


@pytest.mark.parametrize("layout", [dict(dp=2), dict(tp=2, sequence_parallel=True)], ids=["dp2", "tp2"])
def test_states_match_allocation_on_two_ranks(pool, layout):
    parallel = ParallelConfig(**layout)
    results = pool.run(_allocated_on_ranks, parallel, torch.float32)
    want = memory_per_rank(model_config(), parallel, MICRO, torch.float32, bucket_size=BUCKET)
    for got in results:
        _check_states(got, want)


def saved_activation_bytes(model: GPT, micro_batch: int) -> int:
    """Bytes autograd keeps for backward after one forward (each storage once, parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()

    def pack(t):
        keep(t)
        return t

    hooks = [b.register_forward_pre_hook(lambda m, args: keep(args[0])) for b in model.blocks] \
        if model.cfg.recompute else []
    x = torch.randint(0, model.cfg.vocab_size, (micro_batch, model.cfg.seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x[:, :-1], x[:, 1:])
    for h in hooks:
        h.remove()
    del loss
    return sum(seen.values())


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
@pytest.mark.parametrize("style,block", [("gpt", "sequential"), ("gpt", "parallel"), ("llama", "sequential"),
                                         ("llama", "parallel")])
def test_activations_match_saved_tensors(style, block, recompute):
    cfg = model_config(style, block, recompute)
    torch.manual_seed(0)
    measured = saved_activation_bytes(GPT(cfg), MICRO)
    predicted = memory_per_rank(cfg, ParallelConfig(), MICRO).activations
    rel = abs(predicted - measured) / measured
    print(f"\n{style} {block} recompute={recompute}: saved {measured} B, predicted {predicted} B, "
          f"rel {rel:.2%}")
    assert rel < 0.01
