"""Smoke test of benchmarks/parallel_pipeline.py: each schedule's tokens/s and bubble on gloo processes."""

import re

from _bench import run_benchmark


def test_parallel_pipeline_runs_every_schedule_and_measures_each_ranks_bubble():
    out = run_benchmark("benchmarks/parallel_pipeline.py", "--worlds", "2", "--steps", "1",
                        "--microbatches", "4", "--layers", "4", "--d-model", "32", "--seq", "16",
                        "--vocab", "64")
    rows = re.findall(r"^ +(\d) +(.+?) +(\d+) +([\d.]+) +([\d. ]+)$", out, re.M)
    assert [(w, s) for w, s, *_ in rows] == [("1", "1f1b"), ("2", "afab"), ("2", "1f1b"),
                                             ("2", "interleaved v2")], out
    for world, _, tokens, _theory, measured in rows:
        assert int(tokens) > 0 and len(measured.split()) == int(world)
    assert float(rows[3][3]) < float(rows[2][3])  # interleaving shrinks the theoretical bubble
