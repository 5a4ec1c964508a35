"""Resume on another layout: a checkpoint of any (dp, pp, tp, vpp, sp) layout loads into any other.

Each case trains SPLIT steps on layout A, saves (every rank its own boxes, DCP), and a fresh
Trainer on layout B resumes and trains to STEPS. The losses of the two halves, and the final
weights, must equal those of one uninterrupted process, in float64 (noise ~1e-15, a wrong
box or a lost moment is off by orders of magnitude). The optimizer state moves with the
weights (AdamW and LAMB moments, step counts), as do the loader position and the tied
embedding (pipeline layouts hold two copies, the checkpoint one).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _dist import one_thread_fixture, pools_fixture  # noqa: F401 - fixtures

from megascale.checkpoint import read_model_state
from megascale.config import load_config
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
STEPS, SPLIT = 8, 4

LAYOUTS = {
    "1": [],
    "dp2-pp2-tp2-sp": ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                       "parallel.dp_bucket_size=3000"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
    "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "dp2-tp2": ["parallel.dp=2", "parallel.tp=2", "parallel.dp_bucket_size=2000"],
    "dp2": ["parallel.dp=2", "parallel.dp_bucket_size=5000"],
    "dp4": ["parallel.dp=4", "parallel.dp_bucket_size=3000"],
}
WORLD = {"1": 1, "dp2-pp2-tp2-sp": 8, "tp2": 2, "pp2": 2, "pp2-vpp2": 2, "dp2-tp2": 4, "dp2": 2, "dp4": 4}

# (from, to, optimizer, model variant)
CASES = [
    ("1", "dp2-pp2-tp2-sp", "adamw", []),
    ("dp2-pp2-tp2-sp", "1", "lamb", []),
    ("tp2", "pp2", "lamb", ["model.style=llama", "model.bias=false"]),
    ("pp2-vpp2", "dp2-tp2", "adamw", ["model.block=parallel"]),
    ("dp2", "dp4", "adamw", ["model.tie_embeddings=false"]),
    ("dp4", "dp2", "lamb", []),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("reshard-corpus")
    for name in ("hamlet_gut.txt", "macbeth_gut.txt"):
        shutil.copy(ROOT / "data" / "shakespeare" / name, d / name)
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]


def overrides(data: list[str], run_dir: Path, optim: str, model: list[str], layout: str) -> list[str]:
    return [
        "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", *model,
        f"optim.name={optim}", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2",
        "optim.grad_clip=0.5",
        "train.dtype=fp64", "train.global_batch=8", "train.micro_batch=2", f"train.steps={STEPS}",
        "train.eval_interval=0", "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0",
        "log.peak_flops=1e9", "checkpoint.interval=0",
        f"checkpoint.memory_dir={json.dumps(str(run_dir / 'shm'))}",
        *data, f"train.run_dir={json.dumps(str(run_dir))}", *LAYOUTS[layout],
    ]


def train_on_rank(rank: int, args: list[str], max_steps: int | None):
    """Every rank: Trainer(cfg).fit(max_steps); the losses, where it resumed from, and (rank 0) weights."""
    trainer = Trainer(load_config(None, args), quiet=True)
    start, restored = trainer.step, trainer.restored
    result = trainer.fit(max_steps=max_steps)
    full = trainer.engine.full_model_state()
    return result["losses"], start, restored.same_layout if restored else None, full if rank == 0 else None


def run(pools, layout: str, args: list[str], max_steps: int | None):  # noqa: F811
    if WORLD[layout] == 1:
        return train_on_rank(0, args, max_steps)
    return pools(WORLD[layout]).run(train_on_rank, args, max_steps)[0]


@pytest.mark.parametrize("src, dst, optim, model", CASES, ids=[f"{a}-to-{b}" for a, b, _, _ in CASES])
def test_resume_on_another_layout_equals_one_process(pools, data, tmp_path, src, dst, optim, model):  # noqa: F811
    want, _, _, want_weights = train_on_rank(0, overrides(data, tmp_path / "serial", optim, model, "1"), None)
    run_dir = tmp_path / "resharded"
    first, start, _, _ = run(pools, src, overrides(data, run_dir, optim, model, src), SPLIT)
    assert start == 0 and len(first) == SPLIT
    rest, start, same, weights = run(pools, dst, overrides(data, run_dir, optim, model, dst), None)
    assert start == SPLIT and same is False  # restored from storage, resharded
    losses = first + rest
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True))
    assert rel < 1e-12, (losses, want)
    assert weights.keys() == want_weights.keys()
    diff = max((weights[k] - v).abs().max().item() for k, v in want_weights.items())
    assert diff < 1e-11
    # and the final checkpoint, read as one process would (generate, export), holds the same weights
    _, saved = read_model_state(run_dir)
    assert max((saved[k] - want_weights[k]).abs().max().item() for k in want_weights) < 1e-11
    print(f"\n{src} -> {dst} ({optim}): loss rel {rel:.1e}, weight max abs {diff:.1e}")


def test_bf16_resumed_on_another_layout_continues_smoothly(pools, data, tmp_path):  # noqa: F811
    """bf16 autocast (fp32 master weights): dp2 for 4 steps, then tp2 to 8; the loss curve continues
    where the uninterrupted one-process curve is (bf16 matmuls differ by layout: a tolerance)."""
    base = ["train.dtype=bf16"]
    args = lambda run_dir, layout: [a for a in overrides(data, run_dir, "adamw", [], layout)  # noqa: E731
                                    if not a.startswith("train.dtype")] + base
    want, _, _, _ = train_on_rank(0, args(tmp_path / "serial", "1"), None)
    first, _, _, _ = run(pools, "dp2", args(tmp_path / "r", "dp2"), SPLIT)
    rest, start, same, _ = run(pools, "tp2", args(tmp_path / "r", "tp2"), None)
    assert start == SPLIT and same is False
    losses = first + rest
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(losses, want, strict=True)), (losses, want)
    assert abs(rest[0] - first[-1]) < abs(want[0] - want[-1])  # no jump at the resume
    assert losses[-1] < losses[0]
    assert torch.isfinite(torch.tensor(losses)).all()
