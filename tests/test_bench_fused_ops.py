"""Smoke test of benchmarks/fused_ops.py: each op against its twin, then fused_ops off vs on (tiny, eager)."""

import re

from _bench import run_benchmark

OPS = ("add + LayerNorm", "add + RMSNorm", "bias + GeLU", "SwiGLU", "rotary", "head + cross-entropy (V=96)")


def test_fused_ops_benchmark_runs():
    # --cpu-impl eager --no-compile: no compile time in a smoke test; the figures themselves don't matter
    out = run_benchmark("benchmarks/fused_ops.py", "--rounds", "1", "--tokens", "64", "--d-model", "32",
                        "--heads", "2", "--vocab", "96", "--no-compile", "--cpu-impl", "eager",
                        "--e2e-rounds", "1", "--steps", "1", "model.n_layers=1", "model.d_model=32",
                        "model.n_heads=2", "model.seq_len=16", "train.global_batch=2", "train.micro_batch=2",
                        timeout=600)
    number = r"(\d+\.\d+|nan)"  # eager ms, (no compile) -, fused ms, ratio, eager MiB, fused MiB, ratio
    for op in OPS:
        assert re.search(rf"{re.escape(op)}\s+{number}\s+-\s+{number}(\s+{number}){{4}}", out), out
    assert re.search(r"round 1: off [\d,]+ tok/s, on [\d,]+ tok/s, on/off \d+\.\d{3}", out), out
    assert re.search(r"on/off per round median \d+\.\d{3}", out), out
