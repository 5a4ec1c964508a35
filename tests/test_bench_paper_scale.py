"""Smoke test of benchmarks/paper_scale.py: the planner's 175B jobs, Megatron-LM-like and MegaScale-like."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_paper_scale_predicts_every_job_both_ways():
    r = subprocess.run([sys.executable, "benchmarks/paper_scale.py", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = json.loads(r.stdout)
    assert [j["gpus"] for j in jobs] == [256, 1024, 3072, 12288]
    for j in jobs:
        for side in ("megatron", "megascale"):
            assert 0 < j[side]["mfu"] < 1 and j[side]["step_time"] > 0 and j[side]["fits"], j
        # the overlaps and the parallel block take time off the step, never add to it
        assert j["megascale"]["step_time"] < j["megatron"]["step_time"], j
    r = subprocess.run([sys.executable, "benchmarks/paper_scale.py"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "12288" in r.stdout, r.stderr[-3000:]
