"""One training path for every world size costs a single process nothing: tokens/s, old vs new.

    python benchmarks/one_path.py [--ref b0ccd0d] [--rounds 5] [--steps 6] [--config FILE] [overrides]

The Trainer once had a serial half and a parallel half; now a single process is a mesh of one
through the same engine. This checks out `--ref` (the last commit with the serial half) into a
temporary git worktree and times `Trainer.train_step` of both trees on the same config, in
alternation (old, new, old, new, ...), one fresh subprocess per measurement, so machine noise
falls on both alike. Each measurement is the median step time after one warm-up step; the
figure is the ratio of the medians over rounds (new / old tokens/s; 1.00 = the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run inside each tree: the Trainer's train_step, timed; prints one JSON line.
_PROBE = r"""
import json, sys, time, statistics
import torch
from megascale.config import load_config
from megascale.train import Trainer
config, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
torch.set_num_threads(max(1, torch.get_num_threads()))
t = Trainer(load_config(config, overrides), quiet=True)
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    t.train_step()
    if i:
        times.append(time.perf_counter() - t0)
t.loader.close()
import megascale
print(json.dumps({"step_s": statistics.median(times), "tokens": t.tokens_per_step,
                  "tree": megascale.__file__}))
"""


def measure(tree: Path, config: str, steps: int, overrides: list[str]) -> float:
    """tokens/s of one fresh process of the tree at `tree`."""
    out = subprocess.run([sys.executable, "-c", _PROBE, config, str(steps), *overrides], cwd=tree,
                         capture_output=True, text=True, timeout=1800,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the probe failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(r["tree"]).resolve().is_relative_to(tree.resolve()):  # the editable install must not win
        raise SystemExit(f"the probe imported megascale from {r['tree']}, not from {tree}")
    return r["tokens"] / r["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="b0ccd0d", help="the old tree's commit (default: before the one path)")
    ap.add_argument("--config", default="configs/bench_gpt_19m.toml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*", help="config overrides for both trees")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), a.ref],
                       check=True)
        try:
            data = Path(tmp) / "data"
            common = [f"data.path={json.dumps(str(data / 'ds'))}",
                      f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}",
                      "log.progress=false", "log.tensorboard=false", "log.jsonl=false",
                      "log.peak_flops=1e9", "checkpoint.interval=0", *a.overrides]
            ratios, rows = [], []
            for r in range(a.rounds):
                o = measure(old, a.config, a.steps, [*common, f"train.run_dir={json.dumps(f'{tmp}/o')}"])
                n = measure(ROOT, a.config, a.steps, [*common, f"train.run_dir={json.dumps(f'{tmp}/n')}"])
                ratios.append(n / o)
                rows.append((r + 1, o, n, n / o))
                print(f"round {r + 1}: old {o:,.0f} tok/s, new {n:,.0f} tok/s, new/old {n / o:.3f}",
                      flush=True)
            olds, news = [x[1] for x in rows], [x[2] for x in rows]
            print(f"\n{a.config} ({a.steps} timed steps x {a.rounds} rounds, alternating, ref {a.ref}):")
            print(f"  old median {statistics.median(olds):,.0f} tok/s, new median "
                  f"{statistics.median(news):,.0f} tok/s; new/old per round median "
                  f"{statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


if __name__ == "__main__":
    main()
