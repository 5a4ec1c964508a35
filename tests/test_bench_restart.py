"""Smoke test of benchmarks/restart.py: one kill per mode, each restart measured and printed."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_restart_benchmark_runs(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/restart.py", "--nproc", "2", "--kills", "1",
                        "--rounds", "1", "--settle", "3", "model.n_layers=1", "model.d_model=32",
                        "model.n_heads=2", "model.seq_len=32", f"data.path={tmp_path}/ds"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for mode in ("prefork", "new interpreters"):
        assert re.search(rf"round 1, {mode}: [\d.]+ s$", r.stdout, re.M), r.stdout
        assert re.search(rf"^{mode} +1 +[\d.]+ +[\d.]+ +[\d.]+$", r.stdout, re.M), r.stdout
