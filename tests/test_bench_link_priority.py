"""Smoke test of benchmarks/link_priority.py: it runs for seconds and prints its three rows."""

from __future__ import annotations

import re

from _cluster import run_benchmark_on_sim_cluster


def test_link_priority_benchmark_runs_on_a_simulated_cluster():
    out = run_benchmark_on_sim_cluster("benchmarks/link_priority.py", "--messages", "5", "--kib", "64",
                                       timeout=300)
    for way in ("link idle", "unmarked", "marked"):
        assert re.search(rf"^{way} +median +[\d.]+  p90 +[\d.]+", out, re.M), out
