"""Smoke test of benchmarks/gloo_duplex.py: every exchange timed between two simulated hosts."""

import re

from _cluster import run_benchmark_on_sim_cluster


def test_gloo_duplex_benchmark_times_every_exchange():
    out = run_benchmark_on_sim_cluster("benchmarks/gloo_duplex.py", "--mib", "0.25", "--repeats", "1",
                                       "--mbit", "200", timeout=300)
    cases = re.findall(r"^([\w ,-]+?) +[\d.]+ ms +x *[\d.]+ the floor +\d+ Mbit/s each way$", out, re.M)
    assert cases == ["swap, receive first", "swap, send first", "raw TCP", "all-gather, gloo",
                     "all-gather, direct", "reduce-scatter, gloo", "reduce-scatter, direct"], out
