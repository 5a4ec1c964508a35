"""Smoke test of benchmarks/observe_overhead.py: timers on vs off in alternating blocks (tiny model)."""

import re

from _bench import run_benchmark


def test_observe_overhead_benchmark_runs(tmp_path):
    out = run_benchmark("benchmarks/observe_overhead.py", "--rounds", "1", "--block", "1", "--warmup", "1",
                        "--layouts", "1,dp2tp2", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
                        "model.seq_len=16", "train.global_batch=8", "train.micro_batch=4",
                        f"data.path={tmp_path}/ds", timeout=600)
    pattern = r"per record .*span \d+\.\d+ us, comm \d+\.\d+ us, launch \d+\.\d+ us"
    assert re.search(pattern, out), out
    for name in ("1", "dp2tp2"):
        assert re.search(rf"{name}: on/off per round median \d+\.\d{{4}} .* records/step", out), out
