"""MFU through the Trainer: the peak's source is logged, a step faster than the peak raises it, and
both conventions (exact, PaLM/Megatron published) are in every train record."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megascale.config import load_config
from megascale.perf import hardware
from megascale.perf.flops import model_flops_per_token, published_flops_per_token
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "corpus"
    d.mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    return load_config(None, [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "train.global_batch=8",
        "train.micro_batch=4", "train.steps=3", "train.eval_interval=0", "log.progress=false",
        "log.tensorboard=false", "log.sample_tokens=0", f"data.source={json.dumps(str(d))}",
        f"data.path={json.dumps(str(tmp_path / 'ds'))}", f"train.run_dir={json.dumps(str(tmp_path / 'run'))}",
        "checkpoint.interval=0"])


def test_a_step_faster_than_a_stale_peak_raises_it(cfg, tmp_path):
    # a cached peak far below what the machine does (a probe taken under load)
    key = hardware._cpu_key(torch, "fp32")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "hw_peaks.json").write_text(json.dumps({key: 1e6}))
    t = Trainer(cfg, quiet=True)
    assert t.peak == 1e6 and t.peak_info.source == "probe"
    s = t.train_step()
    assert s.mfu <= 1.0 + 1e-9  # never more than the peak: the peak became what the step did
    assert t.peak > 1e6 and json.loads((tmp_path / "cache" / "hw_peaks.json").read_text())[key] >= t.peak
    t.close()


def test_train_records_carry_both_conventions_and_the_peak_source(cfg, tmp_path):
    cfg.log.peak_flops = 2e9
    t = Trainer(cfg, quiet=True)
    t.fit()
    t.close()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (peak,) = [r for r in recs if r["kind"] == "peak"]
    assert peak["source"] == "override" and peak["peak_flops"] == 2e9
    assert peak["flops_per_token"] == model_flops_per_token(cfg.model)
    assert peak["flops_per_token_published"] == published_flops_per_token(cfg.model)
    ratio = peak["flops_per_token_published"] / peak["flops_per_token"]
    for r in (r for r in recs if r["kind"] == "train"):
        assert r["mfu_published"] == pytest.approx(r["mfu"] * ratio)
