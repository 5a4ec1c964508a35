"""Trainer steps timed in a fresh process (shared by the end-to-end rows of fused_ops.py and compile.py).

A fresh interpreter per measurement: what one run compiled, cached or allocated does not help the
next, and the modes can take turns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import json, os, sys, time, statistics
import torch
from megascale.config import load_config
from megascale.train import Trainer
config, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t = Trainer(load_config(config, overrides), quiet=True)
if os.environ.get("PROBE_WHOLE_MODEL_COMPILE"):  # torch.compile of the whole model, to compare
    t.engine.forward = torch.compile(t.engine.model)
times = []
for i in range(steps + 2):
    t0 = time.perf_counter()
    t.train_step()
    times.append(time.perf_counter() - t0)
t.loader.close()
peak = 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        peak = int(line.split()[1]) * 1024
print(json.dumps({"step_s": statistics.median(times[2:]), "best_s": min(times[2:]), "first_s": times[0],
                  "tokens": t.tokens_per_step, "peak_rss": peak}))
"""


def measure(config: str, steps: int, overrides: list[str], env: dict) -> dict:
    """One fresh process's `steps` timed train steps (after two untimed ones): tokens/s from the median
    and from the best step, the first step's seconds (a compile's), and the peak RSS (MiB)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, config, str(steps), *overrides], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600, env=env)
    if out.returncode != 0:
        raise SystemExit(f"the probe failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tps": r["tokens"] / r["step_s"], "best": r["tokens"] / r["best_s"], "first_s": r["first_s"],
            "rss": r["peak_rss"] / 2**20}
