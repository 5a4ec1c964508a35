"""Smoke test of benchmarks/throughput.py: our train step against the plain PyTorch GPT, and the peak."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_times_ours_the_reference_and_the_peak():
    r = subprocess.run([sys.executable, "benchmarks/throughput.py", "--steps", "1", "--warmup", "1",
                        "model.n_layers=1", "model.d_model=64", "model.n_heads=2", "model.seq_len=32",
                        "train.micro_batch=2", "train.global_batch=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    for row in ("megascale Trainer.train_step", "plain PyTorch GPT"):
        m = re.search(rf"^{row}.*? +([\d.]+) +([\d,]+) +([\d.]+) +([\d.]+)%$", r.stdout, re.M)
        assert m and float(m[1]) > 0 and float(m[4]) > 0, r.stdout
    assert re.search(r"^ours / reference tokens/s: \d+\.\d+$", r.stdout, re.M), r.stdout
