"""Smoke test of benchmarks/paper_scale.py: the planner's 175B jobs, Megatron-LM-like and MegaScale-like."""

import json

from _bench import run_benchmark


def test_paper_scale_predicts_every_job_both_ways():
    jobs = json.loads(run_benchmark("benchmarks/paper_scale.py", "--json", timeout=120))
    assert [j["gpus"] for j in jobs] == [256, 1024, 3072, 12288]
    for j in jobs:
        for side in ("megatron", "megascale"):
            assert 0 < j[side]["mfu"] < 1 and j[side]["step_time"] > 0 and j[side]["fits"], j
        # the overlaps and the parallel block take time off the step, never add to it
        assert j["megascale"]["step_time"] < j["megatron"]["step_time"], j
    assert "12288" in run_benchmark("benchmarks/paper_scale.py", timeout=120)
