"""The distributed optimizer's parts: bucket layout and views, the reduce-scatter / all-gather round
trip, overlap on and off, LAMB's whole-tensor norms from pieces, and the optimizer state round trips.
End-to-end parity with one process is tests/test_dp_parity.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from _dist import WorkerPool

from megascale.config import ModelConfig, OptimConfig, ParallelConfig
from megascale.model import GPT
from megascale.parallel import Mesh
from megascale.parallel.data import DistributedOptimizer, DPBuffers, plan_buckets

MCFG = ModelConfig(vocab_size=61, seq_len=8, n_layers=2, d_model=16, n_heads=2)
OCFG = OptimConfig(name="lamb", lr=1e-2, warmup_steps=1, weight_decay=0.1, grad_clip=0.5)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def tiny(seed: int = 0, dtype=torch.float64) -> GPT:
    torch.manual_seed(seed)
    return GPT(MCFG).to(dtype)


def batch(rank: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    t = torch.randint(0, MCFG.vocab_size, (n, MCFG.seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


# ---------------------------------------------------------------------------------------- layout


def test_plan_buckets_closes_at_size_and_pads_to_dp():
    plan = plan_buckets([5, 7, 3, 10, 1], bucket_size=10, dp=4)
    assert plan == [(0, 12, [0, 1]), (12, 28, [2, 3]), (28, 32, [4])]
    assert [i for _, _, m in plan for i in m] == list(range(5))
    assert plan_buckets([5, 7, 3], bucket_size=10**9, dp=2) == [(0, 16, [0, 1, 2])]
    with pytest.raises(ValueError, match="bucket_size"):
        plan_buckets([1], 0, 1)


def test_tail_buckets_cut_the_last_bucket_size_elements_finer():
    # 20 parameters of 100: the last 500 elements (15..19) in buckets of ~125, the rest at full size
    plan = plan_buckets([100] * 20, bucket_size=500, dp=2, tail_buckets=4)
    assert [m for _, _, m in plan] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14],
                                       [15, 16], [17, 18], [19]]
    assert plan_buckets([100] * 20, 500, 2, tail_buckets=1) == plan_buckets([100] * 20, 500, 2)
    # deferred parameters (18, 19) keep a bucket of their own; the tail is the 500 elements before them,
    # and a full-size bucket stops where it begins
    plan = plan_buckets([100] * 20, 500, 2, break_before=18, tail_buckets=4)
    assert [m for _, _, m in plan] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12], [13, 14], [15, 16],
                                       [17], [18, 19]]
    # a model smaller than one bucket: all of it is the tail
    assert [m for _, _, m in plan_buckets([100] * 8, 10**9, 2, tail_buckets=4)] == [[0, 1], [2, 3], [4, 5],
                                                                                  [6, 7]]
    with pytest.raises(ValueError, match="tail_buckets"):
        plan_buckets([1], 1, 1, tail_buckets=0)


def test_buffers_hold_params_and_grads_as_views_in_backward_order():
    model = tiny()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    bufs = DPBuffers(params, Mesh(1, 1, 1, 0), bucket_size=2000)
    data, grad = bufs.param_buffers[torch.float64], bufs.grad_buffers[torch.float64]
    for p in params:
        assert p.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())  # values kept
    assert bufs.buckets[0].params[0] is params[-1]  # the last parameter's gradient comes first
    assert len(bufs.buckets) > 2 and all(len(b.ready) == 0 for b in bufs.buckets)
    x, y = batch(0)
    model(x, y).backward()  # autograd accumulates into the buffer in place
    assert grad.abs().sum() > 0
    bufs.zero_grad()
    assert grad.abs().sum() == 0


def _pieces_partition(rank):
    mesh = Mesh.build(ParallelConfig(dp=2))
    opt = DistributedOptimizer(tiny(), OCFG, mesh, bucket_size=700)
    return [(pc.start, pc.numel, p.numel()) for pc, p in zip(opt.pieces, opt.params, strict=True)]


def test_shards_cut_through_tensors_and_cover_each_once(pool):
    r0, r1 = pool.run(_pieces_partition)
    cut = 0
    for (s0, n0, total), (s1, n1, _) in zip(r0, r1, strict=True):
        covered = torch.zeros(total, dtype=torch.int64)
        covered[s0:s0 + n0] += 1
        covered[s1:s1 + n1] += 1
        assert torch.equal(covered, torch.ones(total, dtype=torch.int64))
        cut += n0 > 0 and n1 > 0
    assert cut > 0  # at least one tensor is split between the two ranks


# ---------------------------------------------------------------------------------------- collectives


def _round_trip(rank, direct):
    mesh = Mesh.build(ParallelConfig(dp=2, direct_collectives=direct))
    model = tiny()
    bufs = DPBuffers(list(model.parameters()), mesh, bucket_size=700, overlap=False)
    assert mesh.direct_collectives == direct  # gloo: direct sends when asked
    grad = bufs.grad_buffers[torch.float64]
    grad.copy_(torch.arange(grad.numel(), dtype=torch.float64) * (rank + 1))  # rank r: (r + 1) * i
    bufs.finish_grad_sync()
    shards_ok = True
    for b in bufs.buckets:
        offset = (b.grad_shard.data_ptr() - grad.data_ptr()) // grad.element_size()
        want = 1.5 * torch.arange(offset, offset + b.grad_shard.numel(), dtype=torch.float64)
        shards_ok &= torch.equal(b.grad_shard, want)
    for b in bufs.buckets:
        b.param_shard.fill_(rank + 1)
    bufs.gather_params()
    gathered = [b.param_data.view(2, -1)[:, 0].tolist() for b in bufs.buckets]
    return shards_ok, gathered, [p.flatten()[0].item() for p in model.parameters()]


@pytest.mark.parametrize("direct", [False, True], ids=["gloo-collectives", "direct-sends"])
def test_reduce_scatter_averages_and_all_gather_restores(pool, direct):
    (ok0, g0, first0), (ok1, g1, first1) = pool.run(_round_trip, direct)
    assert ok0 and ok1  # each rank's shard holds the mean (1.5 * i) of its elements
    assert g0 == g1 == [[1.0, 2.0]] * len(g0)  # every rank sees both ranks' shards, in rank order
    assert first0 == first1 and set(first0) <= {1.0, 2.0}  # the parameters are views of the gathered data


def _overlap(rank, overlap):
    mesh = Mesh.build(ParallelConfig(dp=2))
    model = tiny()
    opt = DistributedOptimizer(model, OCFG, mesh, bucket_size=700, overlap_grad_reduce=overlap)
    opt.zero_grad()
    for i in range(2):
        x, y = batch(10 * rank + i)
        with opt.no_sync() if i == 0 else contextlib.nullcontext():
            (model(x, y) / 2).backward()
    launched = opt.buffers._next  # buckets reduce-scattered during backward
    opt.finish_grad_sync()
    shards = torch.cat([b.grad_shard for b in opt.buffers.buckets])
    error = None
    if overlap:  # a backward outside no_sync after the buckets went out is an error, not a silent mix-up
        try:
            x, y = batch(99)
            model(x, y).backward()
        except RuntimeError as e:
            error = str(e)
    return launched, len(opt.buffers.buckets), shards, error


def test_overlap_reduces_during_backward_and_equals_no_overlap(pool):
    (launched, n, on, error), _ = pool.run(_overlap, True)
    (launched_off, _, off, _), _ = pool.run(_overlap, False)
    assert launched == n and launched_off == 0
    assert torch.equal(on, off)  # bitwise: the same reduction, only earlier
    assert "no_sync" in error


# ---------------------------------------------------------------------------------------- LAMB norms, state


def _lamb_norms(rank):
    """The reducer's output row 0 must be ||p||^2 of whole tensors, though each rank holds pieces."""
    mesh = Mesh.build(ParallelConfig(dp=2))
    model = tiny()
    opt = DistributedOptimizer(model, OCFG, mesh, bucket_size=700)
    inner, seen = opt.optimizer, []
    reducer = inner.norm_reducer
    inner.norm_reducer = lambda sq: seen.append(reducer(sq)) or seen[-1]
    adapted = [p for p in opt.params if p.ndim >= 2]  # Lamb's columns: the decay group, in order
    want = torch.stack([p.detach().square().sum() for p in adapted])  # before the update
    opt.zero_grad()
    x, y = batch(rank)
    model(x, y).backward()
    opt.step()
    return seen[0][0], want


def test_lamb_reducer_gives_whole_tensor_norms(pool):
    (got0, want), (got1, _) = pool.run(_lamb_norms)
    assert torch.allclose(got0, want, rtol=1e-13) and torch.equal(got0, got1)


def _state_round_trip(rank):
    mesh = Mesh.build(ParallelConfig(dp=2))
    models = [tiny(), tiny()]
    opts = [DistributedOptimizer(m, OCFG, mesh, bucket_size=700) for m in models]

    def step(i):
        opts[i].zero_grad()
        x, y = batch(rank)
        models[i](x, y).backward()
        opts[i].clip_grad_norm_(0.5)
        opts[i].step()

    step(0)
    full = opts[0].full_state_dict()
    opts[1].load_full_state_dict(full)
    models[1].load_state_dict(models[0].state_dict())
    sharded = copy.deepcopy(opts[0].state_dict())  # torch's state_dict holds live references
    step(0), step(1)
    same = all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))
    fresh = DistributedOptimizer(tiny(), OCFG, mesh, bucket_size=700)
    fresh.load_state_dict(sharded)
    reloaded = fresh.state_dict()["inner"]["state"][0]["exp_avg"]
    wrong_layout = DistributedOptimizer(tiny(), OCFG, mesh, bucket_size=10**6)
    with pytest.raises(ValueError, match="layout"):
        wrong_layout.load_state_dict(sharded)
    return same, torch.equal(reloaded, sharded["inner"]["state"][0]["exp_avg"])


def test_state_dicts_round_trip(pool):
    for same, reloaded in pool.run(_state_round_trip):
        assert same and reloaded  # full -> shards resumes bit-exactly; sharded state reloads as saved


def test_low_precision_params_are_refused():
    with pytest.raises(TypeError, match="float32 or float64"):
        DistributedOptimizer(tiny(dtype=torch.bfloat16), OCFG, Mesh(1, 1, 1, 0))


# ---------------------------------------------------------------------------------------- direct sends


def _direct_vs_native(rank):
    import torch.distributed as dist

    from megascale.distributed.direct import start_all_gather, start_reduce_scatter

    n, sizes, world = dist.get_world_size(), (6, 30, 3), dist.group.WORLD
    fulls = [torch.arange(k * n, dtype=torch.float64) * (rank + 1) + rank for k in sizes]
    want = [torch.empty(k, dtype=torch.float64) for k in sizes]
    for w, f in zip(want, fulls, strict=True):
        dist.reduce_scatter_single(w, f.clone())
    # in place into the rank's own chunk (a DP bucket) and into a tensor of its own (TP), three
    # exchanges in flight at once on two tags, waited for out of order
    inplace = [f.clone() for f in fulls[:2]]
    shards = [f.chunk(n)[rank] for f in inplace]
    own = torch.full((sizes[2],), float("nan"), dtype=torch.float64)
    exchanges = [start_reduce_scatter(s, f, world, tag=i) for i, (s, f) in
                 enumerate(zip(shards, inplace, strict=True))]
    exchanges.append(start_reduce_scatter(own, fulls[2].clone(), world))
    # all-gathers: from a tensor of the rank's own (TP) and from its own part of the output (a DP
    # bucket's shard), in flight together with a reduce-scatter on the same tag
    parts = [torch.arange(k, dtype=torch.float64) + 100 * rank for k in sizes[1:]]
    gathered = [torch.full((k * n,), float("nan"), dtype=torch.float64) for k in sizes[1:]]
    gathered[1].chunk(n)[rank].copy_(parts[1])
    exchanges.append(start_all_gather(gathered[0], parts[0], world, tag=1))
    own_part = gathered[1].chunk(n)[rank]
    exchanges.append(start_all_gather(gathered[1], own_part, world))
    for ex in reversed(exchanges):
        ex.wait()
    native = [torch.empty(k * n, dtype=torch.float64) for k in sizes[1:]]
    for out, p in zip(native, parts, strict=True):
        dist.all_gather_single(out, p)
    misuse = []
    for bad in (lambda: start_reduce_scatter(own, fulls[0], world),
                lambda: start_all_gather(gathered[0], parts[1], world)):
        try:
            bad()
        except ValueError as e:
            misuse.append(str(e))
    return ([torch.equal(s, w) for s, w in zip([*shards, own], want, strict=True)]
            + [torch.equal(g, w) for g, w in zip(gathered, native, strict=True)]), misuse


def test_direct_collectives_equal_gloos_on_three_ranks():
    pool = WorkerPool(3)
    try:
        results = pool.run(_direct_vs_native)
    finally:
        pool.close()
    for equal, misuse in results:
        assert equal == [True] * 5  # integer-valued float64: sums exact in any order
        assert "input of 18 elements for 3 outputs of 3" in misuse[0]
        assert "output of 90 elements for 3 inputs of 3" in misuse[1]
