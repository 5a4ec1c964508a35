"""Smoke test of benchmarks/predict_vs_measure.py: one small case trained and set beside the planner."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_predict_vs_measure_runs_one_case(tmp_path):
    # the stored calibration (none in a fresh cache) is used as it is: calibrating takes half a minute
    env = {**os.environ, "MEGASCALE_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "benchmarks/predict_vs_measure.py", "--steps", "2", "--only", "5",
                        "--no-calibrate"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    # world, predicted, measured, error, wall
    row = r"^small: 2L s128, mb2 x8 +1 +[\d.]+ +[\d.]+ +[+-][\d.]+% +[\d.]+$"
    assert re.search(row, r.stdout, re.M), r.stdout
    assert re.search(r"^worst \|error\| [\d.]+%", r.stdout, re.M), r.stdout
