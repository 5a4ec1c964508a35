"""Smoke test of benchmarks/throughput.py: our train step against the plain PyTorch GPT, and the peak."""

import re

from _bench import run_benchmark


def test_throughput_times_ours_the_reference_and_the_peak():
    out = run_benchmark("benchmarks/throughput.py", "--steps", "1", "--warmup", "1", "model.n_layers=1",
                        "model.d_model=64", "model.n_heads=2", "model.seq_len=32", "train.micro_batch=2",
                        "train.global_batch=2")
    for row in ("megascale Trainer.train_step", "plain PyTorch GPT"):
        m = re.search(rf"^{row}.*? +([\d.]+) +([\d,]+) +([\d.]+) +([\d.]+)%$", out, re.M)
        assert m and float(m[1]) > 0 and float(m[4]) > 0, out
    assert re.search(r"^ours / reference tokens/s: \d+\.\d+$", out, re.M), out
