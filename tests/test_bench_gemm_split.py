"""Smoke test of benchmarks/gemm_split.py: every GEMM of the block timed whole and in pieces."""

import re

from _bench import run_benchmark


def test_gemm_split_benchmark_times_every_gemm_whole_and_in_pieces():
    out = run_benchmark("benchmarks/gemm_split.py", "--d-model", "64", "128", "--seq", "16", "--repeats", "2",
                        timeout=120)
    rows = re.findall(r"^d_model +(\d+) +(\w+) .* one GEMM +[\d.]+ ms +pieces x(\d+\.\d\d)$", out, re.M)
    assert [(d, name) for d, name, _ in rows] == [(d, n) for d in ("64", "128")
                                                  for n in ("qkv", "proj", "fc_in", "fc_out")], out
    assert all(float(x) > 0 for *_, x in rows)
