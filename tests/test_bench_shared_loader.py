"""Smoke test of benchmarks/shared_loader.py: one loader per host vs one per rank, tp2, seconds."""

import re

from _bench import run_benchmark


def test_shared_loader_benchmark_runs(tmp_path):
    out = run_benchmark("benchmarks/shared_loader.py", "--rounds", "1", "--steps", "2", "--warmup", "1",
                        "--tp", "2", "model.seq_len=16", "train.global_batch=64", "train.micro_batch=32",
                        f"data.path={tmp_path}/ds", timeout=600)
    assert re.search(r"round 1 on  \(ring,ring\): loader CPU [\d.]+ ms/step per host", out), out
    off = r"round 1 off \(own,own\): .* read \d+ kB/step per host \(ranks \d+/\d+\)"
    assert re.search(off, out), out
    for label in ("loader CPU per host", "bytes read per host", r"wait for data \(slowest rank\)"):
        line = rf"{label}: on [\d.]+ \S+, off [\d.]+ \S+, on/off (\d+\.\d{{3}}|n/a)"
        assert re.search(line, out), out
    # one reader: the leader reads the rows the two ranks used to read each
    assert re.search(r"bytes read per rank on : ([\d.]+), 0\.000 kB/step", out), out
