"""benchmarks/gpu.sh, the prepared GPU run of issue 13: it parses, says so and exits 0 without CUDA, and
its 1.3B config loads and fits one H200 by the planner (the run itself needs a lent device)."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_parses_and_exits_cleanly_without_a_gpu(tmp_path):
    r = subprocess.run(["bash", "-n", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if torch.cuda.is_available():  # a GPU machine runs the real thing by hand: minutes, not a test
        return
    r = subprocess.run(["bash", "benchmarks/gpu.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "PY": sys.executable})
    assert r.returncode == 0 and "no CUDA device" in r.stdout, r.stdout + r.stderr


def test_the_gpu_reference_model_fits_one_h200():
    r = subprocess.run([sys.executable, "-m", "megascale", "plan", "--config", "configs/gpu_gpt_1_3b.toml",
                        "--cluster", "h200", "--gpus", "1", "--settings", "config"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.rstrip() for line in r.stdout.splitlines() if line.startswith("tp1 pp1")]
    fits = [row for row in rows if row.endswith("yes")]
    assert fits, r.stdout
