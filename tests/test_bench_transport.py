"""Smoke test of benchmarks/transport.py: both transports timed at one size."""

import re

from _bench import run_benchmark


def test_transport_benchmark_times_both_transports():
    out = run_benchmark("benchmarks/transport.py", "--kib", "64", "--repeats", "1", "--burst", "3")
    num = r" +(-?[\d.]+)"
    rows = re.findall(r"^ +64 (gloo|sockets|ratio)" + 7 * num, out, re.M)
    assert [name for name, *_ in rows] == ["gloo", "sockets", "ratio"], out
    # swap, all-gather, cpu, the issuing thread's CPU and all-reduce of both transports (stolen and one:
    # differences of two timings, which noise can make negative)
    assert all(float(x) > 0 for x in rows[0][1:4] + rows[1][1:4] + rows[0][5:7] + rows[1][5:7]), out
