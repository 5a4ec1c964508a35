"""Smoke test of benchmarks/one_path.py: old and new trees timed in alternation (seconds, tiny model)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_one_path_benchmark_runs():
    # --ref HEAD: the smoke test needs only a commit every clone has
    r = subprocess.run([sys.executable, "benchmarks/one_path.py", "--ref", "HEAD", "--rounds", "1",
                        "--steps", "1", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                        "model.seq_len=16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert re.search(r"round 1: old [\d,]+ tok/s, new [\d,]+ tok/s, new/old \d+\.\d{3}", r.stdout), r.stdout
    assert "new/old per round median" in r.stdout
