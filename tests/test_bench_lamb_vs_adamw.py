"""Smoke test of benchmarks/lamb_vs_adamw.py: both optimizers trained on the same tokens, and step times."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    r = subprocess.run([sys.executable, "benchmarks/lamb_vs_adamw.py", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    return r.stdout


def test_lamb_at_4x_batch_and_adamw_train_on_the_same_tokens():
    out = run("--steps", "8", "--batch", "2", "--micro-batch", "2", "--seq-len", "32", "--layers", "1",
              "--d-model", "32", "--heads", "2", "--adamw-lrs", "1e-3", "--lamb-lrs", "1e-2",
              "--eval-batches", "2")
    best = re.findall(r"^ +(adamw|lamb) batch +(\d+) x +(\d+) steps, lr [\d.e+-]+: val (\d+\.\d+)$",
                      out, re.M)
    assert [(o, int(b) * int(s)) for o, b, s, _ in best] == [("adamw", 16), ("lamb", 16)], out
    assert re.search(r"LAMB at 4x batch - AdamW = [+-]\d+\.\d+ nats", out), out


def test_the_optimizer_step_time_of_both():
    out = run("--step-time", "--layers", "1", "--d-model", "64")
    assert re.search(r"AdamW\(foreach=True\) +\d+\.\d ms", out), out
    assert re.search(r"LAMB \(ours\) .*\(\d+\.\d\dx\)", out), out
