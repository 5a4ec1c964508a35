"""Smoke test of benchmarks/soak.py: a short launched job, one crash and one hang, both recovered."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_soak_benchmark_runs(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/soak.py", "--minutes", "1.5", "--faults", "2", "--first",
                        "0", "--gap", "0:0", "--kinds", "kill,stop", "--cycle", "model.n_layers=1",
                        "model.d_model=32",
                        "model.n_heads=2", "model.seq_len=32", f"data.path={tmp_path}/ds"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    faults = re.findall(r"fault at .*: (kill|stop) of rank \d: detected in [\d.]+ s", r.stdout)
    assert faults[:2] == ["kill", "stop"], r.stdout
    assert re.search(r"run: \d+ s wall, \d+ steps that count .* ETTR [\d.]+%", r.stdout), r.stdout


def test_soak_benchmark_runs_on_a_simulated_cluster(tmp_path):
    """--hosts 2: one agent per simulated host; host 1 dies whole and its pod comes back: detected,
    trained again, the night's figures printed, and the cluster gone afterwards."""
    from _cluster import require_netns

    from megascale.fault import netns

    require_netns()
    before = set(netns.namespaces())
    r = subprocess.run([sys.executable, "benchmarks/soak.py", "--hosts", "2", "--nproc", "1", "--minutes",
                        "1.5", "--faults", "1", "--first", "0", "--kinds", "host", "model.n_layers=1",
                        "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
                        f"data.path={tmp_path}/ds"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert re.search(r"fault at .*: host of host 1: detected in [\d.]+ s, training again after [\d.]+ s",
                     r.stdout), r.stdout
    assert re.search(r"run: \d+ s wall, \d+ steps that count .* ETTR [\d.]+%", r.stdout), r.stdout
    assert set(netns.namespaces()) <= before  # torn down
