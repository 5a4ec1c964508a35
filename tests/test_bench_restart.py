"""Smoke test of benchmarks/restart.py: one kill per mode, each restart measured and printed."""

import re

from _bench import run_benchmark


def test_restart_benchmark_runs(tmp_path):
    out = run_benchmark("benchmarks/restart.py", "--nproc", "2", "--kills", "1", "--rounds", "1", "--settle",
                        "3", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
                        f"data.path={tmp_path}/ds")
    for mode in ("prefork", "new interpreters"):
        assert re.search(rf"round 1, {mode}: [\d.]+ s$", out, re.M), out
        assert re.search(rf"^{mode} +1 +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out
