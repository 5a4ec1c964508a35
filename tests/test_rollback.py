"""A non-finite loss rolls the run back to its newest snapshot and past the offending batches."""

import json
import math
import shutil
from pathlib import Path

import pytest

from megascale.config import load_config
from megascale.errors import UserError
from megascale.fault import inject
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setattr(inject, "_FIRED", set())
    d = tmp_path / "corpus"
    d.mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    return load_config(None, [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "train.global_batch=8",
        "train.micro_batch=4", "train.steps=10", "train.eval_interval=0", "log.progress=false",
        "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9", "checkpoint.interval=0",
        "checkpoint.memory_interval=2", f"data.source={json.dumps(str(d))}",
        f"data.path={json.dumps(str(tmp_path / 'ds'))}",
        f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"])


def records(cfg, kind):
    lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_nan_loss_rolls_back_and_skips_the_window(cfg, monkeypatch):
    monkeypatch.setenv("MEGASCALE_INJECT", "nan@step:5")  # the 6th step (0-based 5)
    t = Trainer(cfg, quiet=True)
    result = t.fit()
    t.close()
    assert result["steps"] == 10 and t.rollbacks == 1
    (rb,) = records(cfg, "rollback")
    assert rb["step"] == 6 and rb["restored_step"] == 4 and rb["source"] == "memory"
    assert rb["skipped_batches"] == 2 and rb["loss"] == "nan"
    train = records(cfg, "train")
    assert [r["step"] for r in train][-6:] == [5, 6, 7, 8, 9, 10]  # steps 5-6 done again, on new batches
    assert all(math.isfinite(r["loss"]) for r in train)  # the NaN step is not logged as a step


def test_too_many_rollbacks_stop_the_run_with_one_error(cfg, monkeypatch):
    monkeypatch.setenv("MEGASCALE_INJECT", "nan@step:5,nan@step:7")
    cfg.fault.max_nan_rollbacks = 1
    t = Trainer(cfg, quiet=True)
    with pytest.raises(UserError, match="fault.max_nan_rollbacks"):
        t.fit()
    t.close()
