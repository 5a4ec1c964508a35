"""Smoke test of benchmarks/attention_scaling.py: banded, full and dense-band attention per length."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_scaling_times_each_path_and_names_the_dispatchers_choice():
    r = subprocess.run([sys.executable, "benchmarks/attention_scaling.py", "--seq", "32", "96", "128",
                        "--window", "24", "--heads", "2", "--head-dim", "8", "--repeats", "1",
                        "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    number = r" +([\d.]+)"
    rows = re.findall(rf"^ +(\d+){number} +[\d.]+{number} +[\d.]+ +[\d.]+x{number} +(\w+) ", r.stdout, re.M)
    paths = [(s, path) for s, *_, path in rows]
    assert paths == [("32", "dense"), ("96", "banded"), ("128", "banded")], r.stdout
    assert all(float(t) > 0 for row in rows for t in row[1:4])
