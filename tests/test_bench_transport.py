"""Smoke test of benchmarks/transport.py: both transports timed at one size."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_transport_benchmark_times_both_transports():
    r = subprocess.run([sys.executable, "benchmarks/transport.py", "--kib", "64", "--repeats", "1",
                        "--burst", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    num = r" +(-?[\d.]+)"
    rows = re.findall(r"^ +64 (gloo|sockets|ratio)" + 7 * num, r.stdout, re.M)
    assert [name for name, *_ in rows] == ["gloo", "sockets", "ratio"], r.stdout
    # swap, all-gather, cpu, the issuing thread's CPU and all-reduce of both transports (stolen and one:
    # differences of two timings, which noise can make negative)
    assert all(float(x) > 0 for x in rows[0][1:4] + rows[1][1:4] + rows[0][5:7] + rows[1][5:7]), r.stdout
