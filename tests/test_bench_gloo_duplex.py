"""Smoke test of benchmarks/gloo_duplex.py: every exchange timed between two simulated hosts."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gloo_duplex_benchmark_times_every_exchange():
    from _cluster import require_netns

    from megascale.fault import netns

    require_netns(shaping=True)
    before = set(netns.namespaces())
    r = subprocess.run([sys.executable, "benchmarks/gloo_duplex.py", "--mib", "0.25", "--repeats", "1",
                        "--mbit", "200"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    cases = re.findall(r"^([\w ,-]+?) +[\d.]+ ms +x *[\d.]+ the floor +\d+ Mbit/s each way$", r.stdout, re.M)
    assert cases == ["swap, receive first", "swap, send first", "raw TCP", "all-gather, gloo",
                     "all-gather, direct", "reduce-scatter, gloo", "reduce-scatter, direct"], r.stdout
    assert set(netns.namespaces()) <= before  # torn down
