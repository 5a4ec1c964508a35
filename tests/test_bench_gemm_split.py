"""Smoke test of benchmarks/gemm_split.py: every GEMM of the block timed whole and in pieces."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gemm_split_benchmark_times_every_gemm_whole_and_in_pieces():
    r = subprocess.run([sys.executable, "benchmarks/gemm_split.py", "--d-model", "64", "128", "--seq", "16",
                        "--repeats", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rows = re.findall(r"^d_model +(\d+) +(\w+) .* one GEMM +[\d.]+ ms +pieces x(\d+\.\d\d)$", r.stdout, re.M)
    assert [(d, name) for d, name, _ in rows] == [(d, n) for d in ("64", "128")
                                                  for n in ("qkv", "proj", "fc_in", "fc_out")], r.stdout
    assert all(float(x) > 0 for *_, x in rows)
