"""Smoke test of benchmarks/gpu_check.py: on a machine without CUDA it says so and exits 0 (the real
check runs on a lent GPU; see the closing notes)."""

import torch
from _bench import run_benchmark


def test_gpu_check_runs_without_a_gpu():
    if torch.cuda.is_available():  # a GPU machine runs the real check by hand: minutes, not a test
        return
    out = run_benchmark("benchmarks/gpu_check.py", "--steps", "1")
    assert "no CUDA device" in out, out
