"""Smoke test of benchmarks/attention_scaling.py: banded, full and dense-band attention per length."""

import re

from _bench import run_benchmark


def test_attention_scaling_times_each_path_and_names_the_dispatchers_choice():
    out = run_benchmark("benchmarks/attention_scaling.py", "--seq", "32", "96", "128", "--window", "24",
                        "--heads", "2", "--head-dim", "8", "--repeats", "1", "--threads", "1", timeout=120)
    number = r" +([\d.]+)"
    rows = re.findall(rf"^ +(\d+){number} +[\d.]+{number} +[\d.]+ +[\d.]+x{number} +(\w+) ", out, re.M)
    paths = [(s, path) for s, *_, path in rows]
    assert paths == [("32", "dense"), ("96", "banded"), ("128", "banded")], out
    assert all(float(t) > 0 for row in rows for t in row[1:4])
