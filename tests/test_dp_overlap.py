"""MegaScale's data-parallel overlap through the engine: the parameter all-gather prefetched into the
next forward, and the gradient reduce-scatter during backward, also under pipeline parallelism.

Each overlap moves when a collective runs, never what it computes, so with the flags on the
run is bit for bit the run with them off (float64), and with them off it is the one-process
run (tests/test_trainer_parallel.py). Each case also checks that the overlap really happened:
gathers still in flight when the step returns and finished by the forward's hooks; buckets
reduce-scattered before backward ended (the hook launched them), the tied matrix's last.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils._pytree as pytree
from _dist import WorkerPool, one_thread_fixture, pools_fixture  # noqa: F401 (fixtures)
from _parity import SyntheticSamples
from torch import nn
from torch.overrides import TorchFunctionMode

from megascale.config import Config
from megascale.data.loader import BatchLoader
from megascale.parallel.engine import ParallelEngine
from megascale.parallel.mesh import Mesh

STEPS, VOCAB, SEQ = 4, 97, 8


def config(dp: int, pp: int, vpp: int, overlap: bool, model: dict) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.model.seq_len, cfg.model.n_layers = VOCAB, SEQ, 4
    cfg.model.d_model, cfg.model.n_heads, cfg.model.dropout = 16, 2, 0.0
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.vpp = dp, pp, vpp
    cfg.parallel.dp_bucket_size = 700  # several buckets, shards that cut through tensors
    cfg.parallel.dp_overlap_grad_reduce = cfg.parallel.dp_overlap_param_gather = overlap
    cfg.train.global_batch, cfg.train.micro_batch = 8, 2
    cfg.optim.lr, cfg.optim.grad_clip = 1e-2, 0.5
    return cfg


def train(rank: int, dp: int, pp: int, vpp: int, overlap: bool, model: dict):
    cfg = config(dp, pp, vpp, overlap, model)
    mesh = Mesh.build(cfg.parallel)
    torch.manual_seed(0)
    engine = ParallelEngine(cfg, mesh, torch.device("cpu"), torch.float64)
    buffers = engine.optimizer.buffers
    samples = SyntheticSamples(64, SEQ, VOCAB)
    loader = BatchLoader(samples, global_batch=8, seed=1, prefetch=0)
    losses, in_flight, launched_early, deferred_last, before_first_block = [], [], [], [], []
    # when the backward reaches this rank's first block, the later layers' buckets must be on the wire
    first_block = next(iter(engine.model.blocks.children()))
    seen: list[int] = []
    first_block.register_full_backward_pre_hook(lambda *_: seen.append(buffers._next))
    for step in range(STEPS):
        seen.clear()
        in_flight.append(len(buffers._gathering))  # gathers the last step left running
        rows = samples.batch(loader.global_indices(step)[loader.local_slice(mesh.dp_rank, dp)])
        loss = engine.forward_backward(rows[:, :-1], rows[:, 1:], contextlib.nullcontext, step)
        assert not buffers._gathering  # the forward's hooks waited for every bucket
        launched_early.append(buffers._next)  # buckets the backward's hooks reduce-scattered
        before_first_block.append(seen[-1])  # (the last micro-batch's backward: the one that syncs)
        last = buffers.buckets[-1]
        deferred_last.append(last.work is None)
        engine.clip_grads(cfg.optim.grad_clip)
        engine.step()
        engine.zero_grad()
        losses.append(engine.agree(loss, None)[0])
    engine.optimizer.wait_params()
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tied = pp > 1 and engine.model.tied
    return losses, weights, in_flight, launched_early, deferred_last, len(buffers.buckets), tied, \
        before_first_block


CASES = {
    # name: (world, dp, pp, vpp, model overrides)
    "dp2-gpt-fused": (2, 2, 1, 1, {"fused_ops": True}),
    "dp2-llama-untied-fused": (2, 2, 1, 1, {"style": "llama", "bias": False, "tie_embeddings": False,
                                            "fused_ops": True}),
    "dp2-pp2-1f1b-tied": (4, 2, 2, 1, {}),
    "dp2-pp2-vpp2-llama": (4, 2, 2, 2, {"style": "llama", "bias": False, "block": "parallel"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_moves_collectives_not_results(pools, name):
    world, dp, pp, vpp, model = CASES[name]
    pool = pools(world)
    off = pool.run(train, dp, pp, vpp, False, model)
    on = pool.run(train, dp, pp, vpp, True, model)
    for rank in range(world):
        losses_off, weights_off, flight_off, early_off, _, n_buckets, _, _ = off[rank]
        losses_on, weights_on, flight_on, early_on, deferred_last, _, tied, before_first = on[rank]
        assert losses_on == losses_off
        assert all(torch.equal(weights_on[k], v) for k, v in weights_off.items())
        assert flight_off == [0] * STEPS and early_off == [0] * STEPS  # off: nothing runs behind
        # on: after step 1, every bucket's gather was still in flight when the step returned
        assert flight_on == [0] + [n_buckets] * (STEPS - 1)
        assert all(e >= 1 for e in early_on), early_on  # backward launched reduce-scatters itself
        # ... while it still had layers to go (in the optimizer's group order, weights then biases,
        # bucket 0 held the first layer's biases and nothing went before backward ended)
        assert all(b >= 1 for b in before_first), before_first
        if tied:  # the tied copy's own bucket waits for the cross-stage sum, after backward
            assert all(deferred_last), deferred_last
            assert all(e < n_buckets for e in early_on)


class _ReadsOnlyGathered(TorchFunctionMode):
    """Fails any torch call that gets a parameter whose bucket the hooks have not waited for."""

    def __init__(self, bucket_of: dict[int, int], ready: set[int]):
        super().__init__()
        self.bucket_of, self.ready, self.reads = bucket_of, ready, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in pytree.tree_leaves((args, kwargs or {})):
            if isinstance(a, nn.Parameter):
                self.reads += 1
                assert self.bucket_of[id(a)] in self.ready, f"{func} read a parameter before its gather"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", [
    {}, {"fused_ops": True}, {"block": "parallel"}, {"recompute": True, "fused_ops": True},
    {"style": "llama", "bias": False, "tie_embeddings": False, "fused_ops": True},
])
def test_each_module_waits_for_the_parameters_it_reads(model, monkeypatch):
    """The forward pre-hooks of overlap_param_gather wait per module, for the parameters it owns
    (plus its subtree's where a fused op reads a child's weight): every parameter a torch op gets
    in forward and backward has been waited for, each in a bucket of its own here, and the first
    layer's later weights are still not waited for when its first weight is read."""
    from megascale.model.gpt import GPT
    from megascale.parallel.data.optimizer import _wait_before_use

    # the fused ops' eager twins: torch.compile cannot trace under a TorchFunctionMode, and a failed
    # compile would leave the op eager for the rest of this process
    monkeypatch.setenv("MEGASCALE_FUSED_CPU", "eager")
    cfg = config(1, 1, 1, True, model).model
    gpt = GPT(cfg)
    params = list(gpt.parameters())
    bucket_of = {id(p): i for i, p in enumerate(params)}
    ready: set[int] = set()
    waits: list[set[int]] = []

    class Buffers:
        def bucket_index(self, p):
            return bucket_of[id(p)]

    def wait(owned: set[int]) -> None:
        waits.append(set(owned))
        ready.update(owned)

    _wait_before_use(gpt, Buffers(), wait)
    x = torch.randint(0, VOCAB, (2, SEQ))
    mode = _ReadsOnlyGathered(bucket_of, ready)
    with mode:
        loss = gpt(x, x)
        loss.backward()
    assert mode.reads > 0 and ready == set(bucket_of.values())
    first = gpt.blocks[0]
    # no wait takes a whole block: the first block's MLP is waited for after its attention's qkv
    qkv = bucket_of[id(first.attn.qkv.weight)]
    mlp = {bucket_of[id(p)] for p in first.mlp.parameters()}
    at_qkv = next(i for i, w in enumerate(waits) if qkv in w)
    assert not mlp & set().union(*waits[:at_qkv + 1])
