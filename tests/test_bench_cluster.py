"""Smoke test of benchmarks/cluster.py: its self-test builds a 2-host cluster, checks it and tears it down."""

from _cluster import run_benchmark_on_sim_cluster


def test_the_cluster_selftest_passes_every_check_and_leaves_nothing():
    out = run_benchmark_on_sim_cluster("benchmarks/cluster.py", "selftest", timeout=120)
    checks = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert checks and all(line.startswith("ok ") for line in checks), out
    assert any("teardown" in line for line in checks) and any("Mbit/s" in line for line in checks), out
