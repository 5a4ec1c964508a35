"""Smoke test of benchmarks/init_processes.py: real processes started the naive way and ours."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_init_processes_times_both_ways_of_starting():
    r = subprocess.run([sys.executable, "benchmarks/init_processes.py", "--ranks", "2", "--stores", "tcp",
                        "--modes", "global", "local"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rows = re.findall(r"^ +2 dp1 pp1 tp2 +tcp +(global|local) +([\d.]+) +([\d.]+) ", r.stdout, re.M)
    assert [mode for mode, *_ in rows] == ["global", "local"], r.stdout
    assert all(float(t) > 0 for _, *ts in rows for t in ts)
    assert re.search(r"2 ranks, tcp +: \d+\.\d\dx", r.stdout), r.stdout
