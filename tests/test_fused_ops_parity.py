"""model.fused_ops=true trains the same model as model.fused_ops=false, through the real Trainer.

The same tiny model (2 layers, d_model 32, seq 16, a vocabulary of 259 that tp=2 must pad, byte
tokenizer over three Shakespeare files) trains 6 steps of 4 micro-batches with warm-up, cosine
lr, weight decay, active grad-norm clipping and two validation passes in float64, once with
the fused ops and once without; per-step losses, per-step grad norms, the validation losses and
the final weights must agree to float64 rounding. Both styles: GPT (LayerNorm, the fused add +
LayerNorm, bias + GeLU) and Llama (RMSNorm, SwiGLU, rotary), with dropout on in the serial runs
(the fused path draws the same masks). The head + cross-entropy runs in chunks of 5 to 16 tokens
(CHUNK_ELEMENTS made small), so every micro-batch's loss is several chunks.

Tensor parallelism: tp=2 with the fused ops on 2 gloo ranks equals the serial unfused run, with
and without sequence parallelism (the head's input stage, copy or sequence all-gather, ahead of
the chunked vocab-parallel loss; the MLP's moved ahead of the fused bias + GeLU) and with the
parallel block (its shared regions); the pipeline's last stage takes the chunked loss too (pp=2).
float64 throughout: the strict check, where only summation order differs (1e-12 relative on
losses and norms, as tests/test_trainer_parallel.py). The vocab-parallel chunked loss itself is
also checked on its own against parallel/tensor/loss.py's, values and both gradients, per rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import one_thread_fixture, pools_fixture  # noqa: F401 - the fixtures are found by their names

from megascale.config import load_config
from megascale.ops import cross_entropy as ce
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["hamlet_gut.txt", "macbeth_gut.txt", "sonnets_gut.txt"]
STEPS, VOCAB = 6, 259
CHUNK_ELEMENTS = 5 * VOCAB  # 5 tokens a chunk serially, 10 at tp=2 (130 local columns)
TOL = 1e-12

MODELS = {
    "gpt": [],
    "gpt-parallel": ["model.block=parallel"],
    "llama": ["model.style=llama", "model.bias=false", "model.tie_embeddings=false"],
    "llama-parallel": ["model.style=llama", "model.bias=false", "model.block=parallel"],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS:
        shutil.copy(ROOT / "data" / "shakespeare" / name, d / name)
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]


def overrides(data, run_dir: Path, model: str, fused: bool, *extra: str) -> list[str]:
    return [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
        f"model.vocab_size={VOCAB}", *MODELS[model], f"model.fused_ops={str(fused).lower()}",
        "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2", "optim.grad_clip=0.5",
        "train.dtype=fp64", "train.global_batch=8", "train.micro_batch=2", f"train.steps={STEPS}",
        "train.eval_interval=3", "train.eval_batches=2", "log.progress=false", "log.tensorboard=false",
        "log.sample_tokens=0", "log.peak_flops=1e9", "checkpoint.interval=0", *data,
        f"train.run_dir={json.dumps(str(run_dir))}", *extra,
    ]


def fit(args: list[str]):
    """Trainer(cfg).fit() with small loss chunks: (losses, val loss, the one-process weights or None)."""
    default, ce.CHUNK_ELEMENTS = ce.CHUNK_ELEMENTS, CHUNK_ELEMENTS
    trainer = None
    try:
        trainer = Trainer(load_config(None, args), quiet=True)
        result = trainer.fit()
        full = trainer.engine.full_model_state()  # collective in a parallel run
    finally:
        ce.CHUNK_ELEMENTS = default
        if trainer is not None:
            trainer.close()  # its trace recorder out of the way of the next task on this worker
    return result["losses"], result["val_loss"], full


def run_on_rank(rank: int, args: list[str]):
    losses, val, full = fit(args)
    return losses, val, full if rank == 0 else None


def metrics(run_dir: Path, kind: str, field: str) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r[field] for r in map(json.loads, lines) if r["kind"] == kind]


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def compare(got_dir: Path, want_dir: Path, got, want) -> str:
    (losses, val, weights), (want_losses, want_val, want_weights) = got, want
    loss_rel = rel(losses, want_losses)
    norm_rel = rel(metrics(got_dir, "train", "grad_norm"), metrics(want_dir, "train", "grad_norm"))
    val_rel = rel(metrics(got_dir, "val", "loss"), metrics(want_dir, "val", "loss"))
    assert weights.keys() == want_weights.keys()
    weight_max = max((weights[k] - v).abs().max().item() for k, v in want_weights.items())
    report = (f"loss rel {loss_rel:.1e}, grad-norm rel {norm_rel:.1e}, val rel {val_rel:.1e}, "
              f"weight max abs {weight_max:.1e}")
    assert want_losses[-1] < want_losses[0]  # it trains
    assert metrics(want_dir, "train", "grad_norm")[0] > 0.5  # clipping is active
    assert loss_rel < TOL and norm_rel < TOL and val_rel < TOL and weight_max < 1e-10, report
    assert abs(val - want_val) <= TOL * abs(want_val)
    return report


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_trainer_fused_equals_unfused(data, tmp_path, model):
    extra = ["model.dropout=0.1"]
    want = fit(overrides(data, tmp_path / "off", model, False, *extra))
    got = fit(overrides(data, tmp_path / "on", model, True, *extra))
    print(f"\n{model} fused vs unfused: {compare(tmp_path / 'on', tmp_path / 'off', got, want)}")


LAYOUTS = {  # name: (parallel overrides, model)
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], "gpt"),
    "tp2": (["parallel.tp=2"], "gpt"),
    "tp2-parallel-block": (["parallel.tp=2"], "llama-parallel"),
    "tp2-sp-llama": (["parallel.tp=2", "parallel.sequence_parallel=true"], "llama"),
    "pp2": (["parallel.pp=2"], "gpt-parallel"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_fused_layout_equals_serial_unfused(pools, data, tmp_path, name):
    parallel, model = LAYOUTS[name]
    want = fit(overrides(data, tmp_path / "serial", model, False))
    results = pools(2).run(run_on_rank, overrides(data, tmp_path / "par", model, True, *parallel))
    assert all(r[0] == results[0][0] and r[1] == results[0][1] for r in results)  # one job, one loss
    report = compare(tmp_path / "par", tmp_path / "serial", results[0], want)
    print(f"\n{name} fused vs serial unfused: {report}")


# ---------------------------------------------------------------------------------------
# The vocab-parallel chunked loss on its own


def vocab_parallel_case(rank: int, chunk: int):
    from megascale.config import ParallelConfig
    from megascale.ops.cross_entropy import vocab_parallel_chunked_cross_entropy
    from megascale.parallel import Mesh, vocab_parallel_cross_entropy

    mesh = Mesh.build(ParallelConfig(tp=2))
    n, d, vocab = 23, 6, 13  # 7 columns a rank, the last one padding
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_full = torch.randn(vocab, d, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[[0, 4, 9]] = -1
    target[1], target[2] = vocab - 1, 6  # the last real column, the first rank's last column
    w_pad = torch.cat([w_full, torch.zeros(1, d, dtype=torch.float64)])
    w = w_pad[rank * 7:(rank + 1) * 7].clone()
    out = []
    for fused in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss = vocab_parallel_chunked_cross_entropy(hh, ww, target, mesh, vocab, chunk=chunk)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(hh, ww), target, mesh, vocab)
        loss.backward()
        out.append((loss.detach(), hh.grad, ww.grad))
    serial = F.cross_entropy(h @ w_full.T, target, ignore_index=-1)
    return out, serial


@pytest.mark.parametrize("chunk", [1, 4, 23])
def test_vocab_parallel_chunked_equals_vocab_parallel(pools, chunk):
    for (fused, unfused), serial in pools(2).run(vocab_parallel_case, chunk):
        torch.testing.assert_close(fused[0], serial, rtol=1e-12, atol=0)
        for got, want in zip(fused, unfused, strict=True):  # the loss, dh (this rank's partial), dW
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def all_padding_case(rank: int):
    """tp 3 over a vocab of 4: 2 columns a rank, so rank 2 holds padding only."""
    from megascale.config import ParallelConfig
    from megascale.parallel import Mesh

    mesh = Mesh.build(ParallelConfig(tp=3))
    exchanges, real = [], {name: getattr(Mesh, name) for name in ("all_gather", "all_reduce")}
    for name, fn in real.items():  # counted on the class (a Mesh is frozen)
        setattr(Mesh, name, lambda *a, _fn=fn, _name=name, **k: (exchanges.append(_name), _fn(*a, **k))[1])
    try:
        return _padding_losses(rank, mesh, exchanges)
    finally:
        for name, fn in real.items():
            setattr(Mesh, name, fn)


def _padding_losses(rank: int, mesh, exchanges: list[str]):
    from megascale.ops.cross_entropy import vocab_parallel_chunked_cross_entropy
    from megascale.parallel import vocab_parallel_cross_entropy

    n, d, vocab = 9, 5, 4
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_full = torch.randn(vocab, d, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[2] = -1
    w = torch.cat([w_full, torch.zeros(2, d, dtype=torch.float64)])[rank * 2:(rank + 1) * 2].clone()
    out = []
    for fused in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss = vocab_parallel_chunked_cross_entropy(hh, ww, target, mesh, vocab, chunk=4)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(hh, ww), target, mesh, vocab)
        loss.backward()
        out.append((loss.detach(), ww.grad))
    hs = h.clone().requires_grad_()
    ws = w_full.clone().requires_grad_()
    serial = F.cross_entropy(hs @ ws.T, target, ignore_index=-1)
    serial.backward()
    want_grad = torch.cat([ws.grad, torch.zeros(2, d, dtype=torch.float64)])[rank * 2:(rank + 1) * 2]
    return out, serial.detach(), want_grad, exchanges


def test_vocab_parallel_losses_take_one_exchange_and_a_rank_of_padding_only(pools):
    """The whole vocab's logsumexp and target logit in one exchange per loss (Megatron-LM: three
    all-reduces), and a rank whose columns are all padding adds nothing and gets zero gradients."""
    for rank, (out, serial, want_grad, exchanges) in enumerate(pools(3).run(all_padding_case)):
        assert exchanges == ["all_gather", "all_gather"]  # one per loss, fused and unfused
        for loss, grad in out:
            torch.testing.assert_close(loss, serial, rtol=1e-12, atol=0)
            torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
            if rank == 2:
                assert torch.equal(grad, torch.zeros_like(grad))
