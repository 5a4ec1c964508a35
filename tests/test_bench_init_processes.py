"""Smoke test of benchmarks/init_processes.py: real processes started the naive way and ours."""

import re

from _bench import run_benchmark


def test_init_processes_times_both_ways_of_starting():
    out = run_benchmark("benchmarks/init_processes.py", "--ranks", "2", "--stores", "tcp",
                        "--modes", "global", "local")
    rows = re.findall(r"^ +2 dp1 pp1 tp2 +tcp +(global|local) +([\d.]+) +([\d.]+) ", out, re.M)
    assert [mode for mode, *_ in rows] == ["global", "local"], out
    assert all(float(t) > 0 for _, *ts in rows for t in ts)
    assert re.search(r"2 ranks, tcp +: \d+\.\d\dx", out), out
