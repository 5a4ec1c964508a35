"""Dropout masks from seeds derived from (seed, step, micro-batch, site, coordinates): parallel/rng.py.

One process: the same (seed, step, micro) draws the same masks (resume needs no generator state),
recomputation replays them, dropout 0 touches no generator. On 2 gloo ranks: dp replicas draw
different masks (and each the one-process masks of its micro-batch); under tp the replicated
regions agree across the tp ranks (tp equals one process there) while the attention-probability
dropout (split) differs; a pp=2 pipeline with recomputation equals one process exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import WorkerPool

from megascale.config import ModelConfig, ParallelConfig
from megascale.model import GPT
from megascale.model.attention import Attention
from megascale.model.factory import Dropout, current_stream, forked_rng, site_id
from megascale.parallel.mesh import Mesh
from megascale.parallel.pipeline import PipelineStage, load_stage_state_dict, pipeline_step
from megascale.parallel.rng import DropoutSeeds
from megascale.parallel.tensor.apply import TPLayerFactory, parallelize
from megascale.parallel.tensor.state import load_full_state_dict

F64 = torch.float64
SEED = 7
ONE = Mesh(1, 1, 1, 0)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, seq_len=8, n_layers=2, d_model=16, n_heads=2, dropout=0.2)
    return ModelConfig(**{**base, **kw})


def build(cfg, factory=None) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg, factory).to(F64)


def batch(cfg, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def record_masks(model) -> dict:
    """name -> the keep-mask of each Dropout module's last call under a stream, filled by hooks.

    The mask is redrawn from the site's seed and checked against what the module did (out != 0
    alone is not the mask: a partial sum or an attention row that dropout emptied may be 0)."""
    masks = {}

    def hook(mod, args, out, name):
        stream = current_stream()
        with forked_rng(out.device, stream.seed(mod.dropout_site, mod.dropout_split)):
            scale = F.dropout(torch.ones_like(args[0]), mod.p, True)
        assert torch.equal(out, args[0] * scale), name
        masks[name] = scale != 0

    for name, m in model.named_modules():
        if isinstance(m, Dropout):
            m.register_forward_hook(lambda mod, args, out, name=name: hook(mod, args, out, name))
    return masks


def loss_and_grads(model, x, y, seeds, step, micro=0):
    with seeds.step(step, micro):
        loss = model(x, y)
    loss.backward()  # outside the context, as a pipeline's backward is: recomputation must cope
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def equal_grads(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------
# One process


def test_same_step_and_micro_draw_the_same_masks_without_saved_state():
    cfg = tiny()
    model = build(cfg)
    masks = record_masks(model)
    x, y = batch(cfg)
    rng = torch.get_rng_state()
    seeds = DropoutSeeds(SEED, ONE, micro_batches=2)
    loss, grads = loss_and_grads(model, x, y, seeds, step=3, micro=1)
    first = dict(masks)
    assert torch.equal(rng, torch.get_rng_state())  # the global generator is untouched: nothing to save
    torch.manual_seed(1234)  # whatever the global stream, a fresh DropoutSeeds (a resumed run) agrees
    resumed = DropoutSeeds(SEED, ONE, micro_batches=2)
    again, grads_again = loss_and_grads(model, x, y, resumed, step=3, micro=1)
    assert torch.equal(loss, again)
    equal_grads(grads, grads_again)
    assert all(torch.equal(first[k], masks[k]) for k in first)
    assert len(first) == 1 + 2 * cfg.n_layers and not all(m.all() for m in first.values())  # drops happen

    other_step, _ = loss_and_grads(model, x, y, seeds, step=4, micro=1)
    other_micro, _ = loss_and_grads(model, x, y, seeds, step=3, micro=0)
    other_seed, _ = loss_and_grads(model, x, y, DropoutSeeds(SEED + 1, ONE, 2), step=3, micro=1)
    assert len({loss.item(), other_step.item(), other_micro.item(), other_seed.item()}) == 4
    # every site draws its own mask: the two branches of a block, the layers
    flat = [m.flatten() for m in masks.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(flat) for b in flat[i + 1:] if a.shape == b.shape)
    with pytest.raises(ValueError, match="micro-batch 2"):
        seeds.stream(0, 2)


@pytest.mark.parametrize("kw", [dict(), dict(block="parallel", style="llama"),
                                dict(attention="sliding", window=3)])
def test_recompute_replays_the_masks(kw):
    cfg = tiny(**kw)
    x, y = batch(cfg)
    seeds = DropoutSeeds(SEED, ONE)
    plain = loss_and_grads(build(cfg), x, y, seeds, step=2)
    recomputed = loss_and_grads(build(tiny(recompute=True, **kw)), x, y, seeds, step=2)
    assert torch.equal(plain[0], recomputed[0])
    equal_grads(plain[1], recomputed[1])
    with torch.no_grad():  # and the attention dropout is active: eval mode gives another loss
        model = build(cfg).eval()
        with seeds.step(2):
            assert model(x, y).item() != plain[0].item()


def test_dropout_zero_touches_no_generator(monkeypatch):
    cfg = tiny(dropout=0.0)
    model = build(cfg)
    assert not any(isinstance(m, Dropout) for m in model.modules())

    def forbidden(*args, **kwargs):
        raise AssertionError("a generator was forked at dropout 0")

    monkeypatch.setattr("megascale.model.attention.forked_rng", forbidden)
    x, y = batch(cfg)
    plain = model(x, y)
    with DropoutSeeds(SEED, ONE).step(0):
        assert torch.equal(model(x, y), plain)


def test_seed_rule_replicated_over_tp_split_per_tp_rank_different_over_dp():
    site = site_id("blocks.0.attn")
    meshes = {(d, t): Mesh(2, 1, 2, Mesh(2, 1, 2, 0).rank_at(d, 0, t)) for d in (0, 1) for t in (0, 1)}
    streams = {c: DropoutSeeds(SEED, m, micro_batches=2).stream(5, 1) for c, m in meshes.items()}
    for d in (0, 1):
        assert streams[d, 0].seed(site, False) == streams[d, 1].seed(site, False)  # replicated
        assert streams[d, 0].seed(site, True) != streams[d, 1].seed(site, True)  # split
    for t in (0, 1):
        assert streams[0, t].seed(site, False) != streams[1, t].seed(site, False)
        assert streams[0, t].seed(site, True) != streams[1, t].seed(site, True)
    # dp rank 1's micro-batch 1 is the global batch's micro-batch 3: one process's seeds
    serial = DropoutSeeds(SEED, ONE, micro_batches=4).stream(5, 3)
    assert serial.seed(site, False) == streams[1, 0].seed(site, False)
    assert serial.seed(site, True) == streams[1, 0].seed(site, True)
    assert site != site_id("blocks.1.attn") and site_id("blocks.0.attn") == site


# ---------------------------------------------------------------------------------------
# Two gloo ranks


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _dp(rank):
    cfg = tiny()
    mesh = Mesh.build(ParallelConfig(dp=2))
    model = build(cfg)
    masks = record_masks(model)
    x, y = batch(cfg)  # the same rows on both replicas
    with DropoutSeeds(SEED, mesh, micro_batches=1).step(0, 0):
        loss = model(x, y).item()
    drawn = dict(masks)
    serial = []  # one process, two micro-batches: replica r trains the global micro-batch r
    for i in range(2):
        with DropoutSeeds(SEED, ONE, micro_batches=2).step(0, i):
            serial.append(model(x, y).item())
    return loss, drawn, serial


def test_dp_replicas_draw_different_masks(pool):
    (loss0, masks0, serial), (loss1, masks1, _) = pool.run(_dp)
    assert loss0 != loss1
    assert masks0.keys() == masks1.keys() and all(not torch.equal(masks0[k], masks1[k]) for k in masks0)
    assert [loss0, loss1] == serial  # each replica draws the one-process masks of its rows


def _tp(rank, block, sp, attention_dropout):
    """The tp=2 loss, the Dropout masks, layer 0's attention output (heads made identical on the two
    ranks, so only the attention masks can tell them apart) and the one-process loss."""
    cfg = tiny(block=block)
    full = build(cfg).state_dict()
    hd = cfg.head_dim
    for name in ("weight", "bias"):  # head 1 := head 0 in layer 0
        t = full[f"blocks.0.attn.qkv.{name}"]
        t[3 * hd:6 * hd] = t[:3 * hd]
    mesh = Mesh.build(ParallelConfig(tp=2, sequence_parallel=sp))
    factory = TPLayerFactory(mesh, sp)
    model = parallelize(build(cfg, factory), factory)
    load_full_state_dict(model, full, mesh)
    serial = build(cfg)
    serial.load_state_dict(full)
    for m in (*model.modules(), *serial.modules()):
        if isinstance(m, Attention) and not attention_dropout:
            m.dropout = 0.0
    split = {n: m.dropout_split for n, m in model.named_modules() if isinstance(m, Dropout)}
    masks = record_masks(model)
    heads = []
    model.blocks[0].attn.proj.register_forward_pre_hook(lambda mod, args: heads.append(args[0].detach()))
    x, y = batch(cfg)
    seeds = DropoutSeeds(SEED, mesh)
    with seeds.step(3, 0):
        loss = model(x, y)
    loss.backward()
    with DropoutSeeds(SEED, ONE).step(3, 0):
        ref = serial(x, y).item()
    return loss.item(), dict(masks), heads[0], split, ref


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_tp_replicated_regions_agree_and_attention_masks_differ(pool, block):
    (loss0, masks0, heads0, split, ref), (loss1, masks1, heads1, _, _) = pool.run(_tp, block, False, True)
    assert torch.isfinite(torch.tensor(loss0)) and loss0 == loss1
    assert not any(split.values())  # residual and embedding dropout without SP: replicated
    assert masks0.keys() == masks1.keys() and all(torch.equal(masks0[k], masks1[k]) for k in masks0)
    assert not torch.equal(heads0, heads1)  # same head, same input: only the split masks differ
    # with the attention dropout off, tp draws exactly one process's masks
    (tp_loss, *_, ref), (tp_loss1, *_) = pool.run(_tp, block, False, False)
    assert tp_loss == tp_loss1
    torch.testing.assert_close(tp_loss, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_tp_sequence_parallel_splits_what_holds_part_of_the_sequence(pool, block):
    (loss0, masks0, _, split, _), (loss1, masks1, _, _, _) = pool.run(_tp, block, True, True)
    assert torch.isfinite(torch.tensor(loss0)) and loss0 == loss1
    # the embedding holds this rank's half of the sequence; so do the sequential block's branch
    # outputs, while the fused parallel block drops the full-sequence partial sums before its one
    # reduce-scatter, which need the same mask on every rank
    want = {k: k == "embed.drop" or block == "sequential" for k in masks0}
    assert split == want
    for k in masks0:
        assert torch.equal(masks0[k], masks1[k]) != want[k], k


def _pp(rank):
    cfg = tiny(recompute=True, tie_embeddings=False, n_layers=3)
    serial = build(cfg)
    full = serial.state_dict()
    mesh = Mesh.build(ParallelConfig(pp=2))
    stage = PipelineStage(cfg, mesh).to(F64)
    load_stage_state_dict(stage, full)
    mbs = [batch(cfg, seed=1), batch(cfg, seed=2)]
    result = pipeline_step(stage, mbs, 2, "1f1b", dropout=DropoutSeeds(SEED, mesh, 2).for_step(5))
    stage.finish_grads()
    ref = 0.0
    for i, (x, y) in enumerate(mbs):
        with DropoutSeeds(SEED, ONE, 2).step(5, i):
            loss = serial(x, y) / 2
        loss.backward()
        ref += loss.item()
    grads = {n: (p.grad, dict(serial.named_parameters())[n].grad) for n, p in stage.named_parameters()}
    return result.loss, ref, grads


def test_pipeline_with_recompute_draws_the_one_process_masks(pool):
    for loss, ref, grads in pool.run(_pp):
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
        for name, (got, want) in grads.items():
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
