"""Smoke test of benchmarks/soak.py: a short launched job, one crash and one hang, both recovered."""

import re

from _bench import run_benchmark
from _cluster import run_benchmark_on_sim_cluster


def test_soak_benchmark_runs(tmp_path):
    out = run_benchmark("benchmarks/soak.py", "--minutes", "1.5", "--faults", "2", "--first", "0", "--gap",
                        "0:0", "--kinds", "kill,stop", "--cycle", "model.n_layers=1", "model.d_model=32",
                        "model.n_heads=2", "model.seq_len=32", f"data.path={tmp_path}/ds")
    faults = re.findall(r"fault at .*: (kill|stop) of rank \d: detected in [\d.]+ s", out)
    assert faults[:2] == ["kill", "stop"], out
    assert re.search(r"run: \d+ s wall, \d+ steps that count .* ETTR [\d.]+%", out), out
    # the report's ETTR from the agents' event logs, and the time the faults cost in it (the stopped rank:
    # 4 s of heartbeat timeout from its last beat, detection; the recoveries themselves may take under the
    # half second the line shows)
    assert re.search(r"^agents' view: ETTR [\d.]+% .*; the rest: .*[\d.]+ s detection", out, re.M), out


def test_soak_benchmark_runs_on_a_simulated_cluster(tmp_path):
    """--hosts 2: one agent per simulated host; host 1 dies whole and its pod comes back: detected,
    trained again, the night's figures printed, and the cluster gone afterwards."""
    out = run_benchmark_on_sim_cluster("benchmarks/soak.py", "--hosts", "2", "--nproc", "1", "--minutes",
                                       "1.5", "--faults", "1", "--first", "0", "--kinds", "host",
                                       "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                                       "model.seq_len=32", f"data.path={tmp_path}/ds", timeout=300,
                                       shaping=False)
    assert re.search(r"fault at .*: host of host 1: detected in [\d.]+ s, training again after [\d.]+ s",
                     out), out
    assert re.search(r"run: \d+ s wall, \d+ steps that count .* ETTR [\d.]+%", out), out
