"""Smoke test of benchmarks/predict_vs_measure.py: one small case trained and set beside the planner."""

import os
import re

from _bench import run_benchmark


def test_predict_vs_measure_runs_one_case(tmp_path):
    # the stored calibration (none in a fresh cache) is used as it is: calibrating takes half a minute
    env = {**os.environ, "MEGASCALE_CACHE": str(tmp_path)}
    out = run_benchmark("benchmarks/predict_vs_measure.py", "--steps", "2", "--only", "5", "--no-calibrate",
                        env=env)
    # world, predicted, measured, error, wall
    row = r"^small: 2L s128, mb2 x8 +1 +[\d.]+ +[\d.]+ +[+-][\d.]+% +[\d.]+$"
    assert re.search(row, out, re.M), out
    assert re.search(r"^worst \|error\| [\d.]+%", out, re.M), out
