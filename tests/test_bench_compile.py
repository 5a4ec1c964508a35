"""Smoke test of benchmarks/compile.py: eager, per-block and whole-model compiled Trainers each run and
print their figures (a tiny model, one round); timings are never asserted."""

from __future__ import annotations

import re

from _bench import run_benchmark


def test_compile_benchmark_prints_every_mode():
    out = run_benchmark("benchmarks/compile.py", "--rounds", "1", "--steps", "1", "model.n_layers=1",
                        "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.global_batch=4",
                        "train.micro_batch=4")
    for mode in ("eager", "blocks", "whole"):
        assert re.search(rf"^  {mode} +median [\d,]+ tok/s, /eager per round \d+\.\d+, first step \d+\.\d s, "
                         r"peak RSS \d+ MiB$", out, re.M), out
