"""Smoke test of benchmarks/ablation.py: MegaScale's ablation table on a simulated cluster, with the
planner's step time, the step split by cause and the CPU-seconds of each row."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ablation_benchmark_runs_on_a_simulated_cluster():
    from _cluster import require_netns

    from megascale.fault import netns

    require_netns(shaping=True)
    before = set(netns.namespaces())
    tiny = ["--steps", "1", "--sweeps", "1", "--warmup", "1", "--layers", "2", "--d-model", "32",
            "--seq", "16", "--batch", "8", "--bucket", "2000", "--mbit", "200",
            "--rows", "0", "6", "--no-calibrate",  # a job per row: two rows
            "--set", "parallel.dp_tail_buckets=2"]
    r = subprocess.run([sys.executable, "benchmarks/ablation.py", *tiny], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert re.search(r"^links as measured .*: \d+ us per message, \d+ Mbit/s", r.stdout, re.M), r.stdout
    if len(os.sched_getaffinity(0)) < 8:  # 8 ranks time-slice the cores: how much speed a core keeps
        shared = r"^a core time-sliced by \d+ ranks keeps [\d.]+ of its speed"
        assert re.search(shared, r.stdout, re.M), r.stdout
    # measured, then the planner with the links' CPU cost and without, each with its error
    measured_and_planned = (r" +[\d.]+ +\d+ +[\d.]+ +[\d.]+% +[\d.]+ +[+-][\d.]+% +[\d.]+ +[+-][\d.]+%"
                            r" +[\d.]+ +\d+%$")  # ..., then the machine's CPU-seconds per step and busy
    rows = re.findall(r"^(baseline|\+ [\w ,]+?)" + measured_and_planned, r.stdout, re.M)
    assert rows == ["baseline", "+ LAMB, 4x batch"], r.stdout
    # each row's step by cause, measured / planned
    split = r" +[\d.]+/[\d.]+" * 5 + r" +-?[\d.]+$"
    rows = re.findall(r"^(baseline|\+ [\w ,]+?)" + split, r.stdout, re.M)
    assert rows == ["baseline", "+ LAMB, 4x batch"], r.stdout
    # each row's CPU-seconds: the machine's, the ranks', the ranks' with no communication, the planner's
    # (all, compute), and the step with no communication
    rows = re.findall(r"^(baseline|\+ [\w ,]+?)" + r" +[\d.]+" * 6 + "$", r.stdout, re.M)
    assert rows == ["baseline", "+ LAMB, 4x batch"], r.stdout
    assert set(netns.namespaces()) <= before  # torn down
