"""Smoke test of benchmarks/one_path.py: old and new trees timed in alternation (seconds, tiny model)."""

import re

from _bench import run_benchmark


def test_one_path_benchmark_runs():
    # --ref HEAD: the smoke test needs only a commit every clone has
    out = run_benchmark("benchmarks/one_path.py", "--ref", "HEAD", "--rounds", "1", "--steps", "1",
                        "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
                        timeout=600)
    assert re.search(r"round 1: old [\d,]+ tok/s, new [\d,]+ tok/s, new/old \d+\.\d{3}", out), out
    assert "new/old per round median" in out, out
