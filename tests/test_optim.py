"""Tests for megascale.optim: LAMB against the math, the sharding property, resume, schedule, clip, groups."""

from __future__ import annotations

import copy
import io
import math
import threading

import pytest
import torch
from torch import nn

from megascale.config import OptimConfig
from megascale.optim import Lamb, build_optimizer, clip_grad_norm_, lr_at, set_lr

F64 = torch.float64


# ---------------------------------------------------------------------------------------
# LAMB against the math


def test_lamb_first_step_by_hand():
    # p = [3, 4] (||p|| = 5), g = [1, -1], eps = 0, wd = 0, lr = 0.1. At step 1 the bias-corrected
    # moments are m_hat = g and v_hat = g^2, so u = g / |g| = [1, -1], ||u|| = sqrt(2), r = 5 / sqrt(2):
    # p <- p - 0.1 * (5 / sqrt(2)) * [1, -1] = [3 - 0.5/sqrt(2), 4 + 0.5/sqrt(2)].
    p = nn.Parameter(torch.tensor([3.0, 4.0], dtype=F64))
    p.grad = torch.tensor([1.0, -1.0], dtype=F64)
    Lamb([p], lr=0.1, eps=0.0).step()
    s = 0.5 / math.sqrt(2.0)
    torch.testing.assert_close(p.detach(), torch.tensor([3.0 - s, 4.0 + s], dtype=F64), rtol=0, atol=1e-15)


def reference_lamb(p, grads, lr, beta1, beta2, eps, wd, adapt):
    """The paper's update, one tensor at a time, written out with plain tensor ops."""
    p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        u = m_hat / (torch.sqrt(v_hat) + eps) + wd * p
        p_norm, u_norm = torch.linalg.norm(p), torch.linalg.norm(u)
        r = p_norm / u_norm if adapt and p_norm > 0 and u_norm > 0 else 1.0
        p = p - lr * r * u
    return p


def _grads(shape, steps, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=F64).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-14), (torch.float32, 2e-6)])
def test_lamb_matches_reference_over_steps(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    init = {
        "w": torch.randn(3, 4, generator=gen, dtype=F64),  # adapted, decayed
        "z": torch.zeros(5, dtype=F64),  # adapted, ||p|| = 0 at step 1: r = 1
        "b": torch.randn(4, generator=gen, dtype=F64),  # no trust ratio, no decay
    }
    steps = 3
    grads = {k: _grads(v.shape, steps, seed=i + 1, dtype=dtype) for i, (k, v) in enumerate(init.items())}
    params = {k: nn.Parameter(v.to(dtype, copy=True)) for k, v in init.items()}
    hp = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8)
    opt = Lamb(
        [
            {"params": [params["w"], params["z"]], "weight_decay": 0.1},
            {"params": [params["b"]], "weight_decay": 0.0, "adapt": False},
        ],
        **hp,
    )
    for t in range(steps):
        for k, p in params.items():
            p.grad = grads[k][t]
        opt.step()
    settings = {"w": (0.1, True), "z": (0.1, True), "b": (0.0, False)}
    for k, (wd, adapt) in settings.items():
        gs = [g.to(F64) for g in grads[k]]
        want = reference_lamb(init[k], gs, hp["lr"], *hp["betas"], hp["eps"], wd, adapt)
        assert params[k].dtype == dtype
        got = params[k].detach().to(F64)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")


def test_lamb_zero_update_keeps_ratio_one():
    # A zero gradient and no decay give u = 0: r falls back to 1 and p does not move.
    p = nn.Parameter(torch.randn(4, dtype=F64))
    before = p.detach().clone()
    p.grad = torch.zeros(4, dtype=F64)
    Lamb([p], lr=0.1).step()
    assert torch.equal(p.detach(), before)


def test_lamb_without_trust_ratio_is_adamw():
    # adapt=False leaves p - lr * (adam + wd * p), which is exactly AdamW's decoupled update.
    torch.manual_seed(1)
    a = nn.Parameter(torch.randn(6, 5, dtype=F64))
    b = nn.Parameter(a.detach().clone())
    ours = Lamb([a], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adapt=False)
    theirs = torch.optim.AdamW([b], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    for g in _grads((6, 5), 4, seed=3, dtype=F64):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------
# The reducer hook: what the distributed optimizer relies on


def _model_params(dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 6, generator=gen, dtype=dtype),
        "v": torch.randn(8, generator=gen, dtype=dtype),
        "b": torch.randn(6, generator=gen, dtype=dtype),
    }


def _lamb_groups(w, v, b):
    return [
        {"params": [w], "weight_decay": 0.1},
        {"params": [v], "weight_decay": 0.0},  # adapted without decay
        {"params": [b], "weight_decay": 0.0, "adapt": False},
    ]


def test_identity_reducer_is_bit_exact():
    init = _model_params()
    runs = []
    for reducer in (None, lambda sq: sq):
        ps = [nn.Parameter(t.clone()) for t in init.values()]
        opt = Lamb(_lamb_groups(*ps), lr=0.02, norm_reducer=reducer)
        for step in range(3):
            for i, p in enumerate(ps):
                p.grad = _grads(p.shape, 1, seed=10 * step + i, dtype=F64)[0]
            opt.step()
        runs.append(ps)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


class ThreadAllReduce:
    """An all-reduce (sum) between optimizer instances stepping in threads, as ranks would."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world

    def reducer(self, rank: int):
        def reduce(sq: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = sq.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())  # same order on every rank
            self.barrier.wait()
            return total

        return reduce


def test_sharded_lamb_equals_unsharded():
    """Each of two 'ranks' holds half of w and v (rows) and a full copy of b; the reducer sums
    the squared norms over both. The halves must follow the unsharded update."""
    init = _model_params()
    full = {k: nn.Parameter(t.clone()) for k, t in init.items()}
    full_opt = Lamb(_lamb_groups(full["w"], full["v"], full["b"]), lr=0.02, betas=(0.9, 0.95))
    comm = ThreadAllReduce(2)
    shards, opts = [], []
    for rank in range(2):
        shard = {k: nn.Parameter(t.chunk(2)[rank].clone()) for k, t in init.items() if k != "b"}
        shard["b"] = nn.Parameter(init["b"].clone())  # replicated: counted twice in both rows
        shards.append(shard)
        groups = _lamb_groups(shard["w"], shard["v"], shard["b"])
        opts.append(Lamb(groups, lr=0.02, betas=(0.9, 0.95), norm_reducer=comm.reducer(rank)))

    for step in range(3):
        grads = {
            k: _grads(t.shape, 1, seed=100 * step + i, dtype=F64)[0] for i, (k, t) in enumerate(init.items())
        }
        for k, p in full.items():
            p.grad = grads[k].clone()
        full_opt.step()
        for rank, shard in enumerate(shards):
            for k, p in shard.items():
                p.grad = grads[k].clone() if k == "b" else grads[k].chunk(2)[rank].clone()
        threads = [threading.Thread(target=o.step) for o in opts]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    for k in ("w", "v"):
        joined = torch.cat([shards[0][k].detach(), shards[1][k].detach()])
        torch.testing.assert_close(joined, full[k].detach(), rtol=1e-14, atol=1e-14, msg=k)
    for rank in range(2):
        torch.testing.assert_close(shards[rank]["b"].detach(), full["b"].detach(), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------------------------------
# Resume


def test_state_dict_round_trip_is_bit_exact():
    init = _model_params(dtype=torch.float32)

    def fresh():
        ps = [nn.Parameter(t.clone()) for t in init.values()]
        return ps, Lamb(_lamb_groups(*ps), lr=0.02)

    def run(ps, opt, steps):
        for step in steps:
            for i, p in enumerate(ps):
                p.grad = _grads(p.shape, 1, seed=10 * step + i, dtype=torch.float32)[0]
            opt.step()

    ref_ps, ref_opt = fresh()
    run(ref_ps, ref_opt, range(6))

    ps, opt = fresh()
    run(ps, opt, range(3))
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in ps], "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    new_ps = [nn.Parameter(t.clone()) for t in saved["params"]]
    new_opt = Lamb(_lamb_groups(*new_ps), lr=0.02)
    new_opt.load_state_dict(saved["optim"])
    assert new_opt.state[new_ps[0]]["step"].item() == 3
    run(new_ps, new_opt, range(3, 6))
    for a, b in zip(ref_ps, new_ps, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# Schedule


def test_schedule_key_steps():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="cosine")
    total = 110
    assert lr_at(0, cfg, total) == pytest.approx(1e-4)  # lr / warmup
    assert lr_at(4, cfg, total) == pytest.approx(5e-4)
    assert lr_at(9, cfg, total) == pytest.approx(1e-3)  # end of warm-up
    assert lr_at(10, cfg, total) == pytest.approx(1e-3)  # top of the cosine
    assert lr_at(60, cfg, total) == pytest.approx(5.5e-4)  # half way: (lr + min_lr) / 2
    assert lr_at(110, cfg, total) == pytest.approx(1e-4)
    assert lr_at(500, cfg, total) == pytest.approx(1e-4)
    values = [lr_at(s, cfg, total) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_schedule_constant_and_no_warmup():
    cfg = OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=0, schedule="constant")
    assert [lr_at(s, cfg, 100) for s in (0, 50, 99, 1000)] == [2e-3] * 4
    cos = OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=0, schedule="cosine")
    assert lr_at(0, cos, 100) == pytest.approx(2e-3)
    assert lr_at(100, cos, 100) == pytest.approx(0.0)


def test_schedule_linear_and_warmup_stable_decay():
    lin = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="linear")
    got = [lr_at(s, lin, 110) for s in (9, 10, 60, 110, 500)]
    assert got == pytest.approx([1e-3, 1e-3, 5.5e-4, 1e-4, 1e-4])
    # wsd: warm-up to step 10, lr held to step 80, the last 20% (steps 80-100) fall as 1 - sqrt
    wsd = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lr_at(4, wsd, 100) == pytest.approx(5e-4) and lr_at(10, wsd, 100) == lr_at(79, wsd, 100) == 1e-3
    assert lr_at(85, wsd, 100) == pytest.approx(1e-4 + 9e-4 * 0.5)  # a quarter of the way: 1 - sqrt(1/4)
    assert lr_at(100, wsd, 100) == pytest.approx(1e-4) and lr_at(500, wsd, 100) == pytest.approx(1e-4)
    values = [lr_at(s, wsd, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    # extended on resume (train.steps 100 -> 200): the steps so far had the same lr, the decay moved
    assert [lr_at(s, wsd, 200) for s in range(80)] == [lr_at(s, wsd, 100) for s in range(80)]
    assert lr_at(150, wsd, 200) == 1e-3 and lr_at(200, wsd, 200) == pytest.approx(1e-4)
    # a decay longer than what follows the warm-up starts right after it
    short = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=1.0)
    assert lr_at(10, short, 20) == 1e-3 and lr_at(15, short, 20) == pytest.approx(1e-3 * (1 - 0.5 ** 0.5))


def test_set_lr_sets_every_group():
    opt = build_optimizer(nn.Linear(3, 3), OptimConfig(name="lamb"))
    set_lr(opt, 0.123)
    assert [g["lr"] for g in opt.param_groups] == [0.123, 0.123]


# ---------------------------------------------------------------------------------------
# Clipping


def _grad_params(scale: float):
    gen = torch.Generator().manual_seed(7)
    ps = [nn.Parameter(torch.zeros(s)) for s in ((5, 4), (4,), (3, 3, 2))]
    for p in ps:
        p.grad = scale * torch.randn(p.shape, generator=gen)
    return ps


@pytest.mark.parametrize("scale,max_norm", [(1.0, 0.5), (1.0, 100.0), (10.0, 1.0)])
def test_clip_matches_torch(scale, max_norm):
    ours, theirs = _grad_params(scale), _grad_params(scale)
    n_ours = clip_grad_norm_(ours, max_norm)
    n_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=True)
    torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_clip_non_finite_returns_norm_and_leaves_grads():
    ps = _grad_params(1.0)
    ps[1].grad[0] = float("inf")
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm_(ps, 1.0)
    assert not torch.isfinite(norm)
    for p, g in zip(ps, before, strict=True):
        assert torch.equal(p.grad, g)  # not scaled by 0 or NaN


def test_clip_reducer_and_off_switch():
    ps = _grad_params(1.0)
    local = clip_grad_norm_(ps, 0.0)  # max_norm 0: measure only
    assert torch.equal(ps[0].grad, _grad_params(1.0)[0].grad)
    # Two identical 'ranks' each holding these grads: global norm is sqrt(2) times the local one.
    twice = clip_grad_norm_(ps, 0.0, norm_reducer=lambda sq: 2 * sq.sum())
    torch.testing.assert_close(twice, local * math.sqrt(2.0))


# ---------------------------------------------------------------------------------------
# build_optimizer


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: must be listed once

    def forward(self, x):
        return self.head(self.fc(self.ln(self.emb(x))))


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_build_optimizer_groups(name):
    model = Tiny()
    opt = build_optimizer(model, OptimConfig(name=name, lr=3e-3, weight_decay=0.1))
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"decay", "no_decay"}
    ids = lambda g: {id(p) for p in g["params"]}  # noqa: E731
    assert ids(groups["decay"]) == {id(model.emb.weight), id(model.fc.weight)}
    assert ids(groups["no_decay"]) == {id(model.ln.weight), id(model.ln.bias), id(model.fc.bias)}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert all(g["lr"] == 3e-3 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    if name == "lamb":
        assert isinstance(opt, Lamb)
        assert groups["decay"]["adapt"] and not groups["no_decay"]["adapt"]
    else:
        assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"]
    before = copy.deepcopy(model.state_dict())
    model(torch.arange(10)).square().mean().backward()
    opt.step()
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items())
