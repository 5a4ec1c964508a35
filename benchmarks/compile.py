"""What `train.compile` buys: tokens/s of the Trainer eager, with each block compiled (what the flag
does, on every layout it allows), and with the whole model compiled (the flag before it allowed
layouts), each in a fresh process, the modes taking turns.

    .venv/bin/python benchmarks/compile.py                       # configs/bench_gpt_19m.toml, 3 rounds
    .venv/bin/python benchmarks/compile.py --rounds 1 --steps 2 model.n_layers=1 model.d_model=64  # smoke

Why per block: a block's forward holds no collective under dp or pp, so each compiled block is one
graph, and its backward ends, with its gradients ready, while earlier blocks' backward still runs:
the distributed optimizer's reduce-scatter of those buckets overlaps it (one graph for the whole
model hands autograd every gradient at its very end). The blocks share one compiled graph (torch
inlines the modules: their parameters are inputs, not constants). `first step` is the compile's cost.
Medians per round; the machine is noisy, so read the ratios of each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trainer_probe import ROOT, measure  # noqa: E402

MODES = {"eager": ([], {}), "blocks": (["train.compile=true"], {}),
         "whole": ([], {"PROBE_WHOLE_MODEL_COMPILE": "1"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench_gpt_19m.toml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed train steps per measurement")
    ap.add_argument("overrides", nargs="*", help="config overrides of every run")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"data.path={json.dumps(str(Path(tmp) / 'ds'))}",
                  f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}", "model.dropout=0",
                  "log.progress=false", "log.tensorboard=false", "log.jsonl=false", "log.peak_flops=1e9",
                  "checkpoint.interval=0", "train.eval_interval=0", *a.overrides]
        measure(a.config, 1, [*common, f"train.run_dir={json.dumps(f'{tmp}/prep')}"], env)  # the dataset
        rows = []
        for r in range(a.rounds):
            row = {mode: measure(a.config, a.steps,
                                 [*common, *flags, f"train.run_dir={json.dumps(f'{tmp}/{mode}')}"],
                                 {**env, **extra}) for mode, (flags, extra) in MODES.items()}
            rows.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{m} {row[m]['tps']:,.0f} tok/s (first step "
                                                 f"{row[m]['first_s']:.1f} s)" for m in MODES)
                  + f"; blocks/eager {row['blocks']['tps'] / row['eager']['tps']:.3f}, whole/eager "
                  f"{row['whole']['tps'] / row['eager']['tps']:.3f}", flush=True)
        print(f"\n{a.config} {' '.join(a.overrides)} ({a.steps} timed steps x {a.rounds} rounds, "
              "taking turns):")
        for m in MODES:
            def med(key: str, m=m) -> float:
                return statistics.median(row[m][key] for row in rows)
            ratio = statistics.median(row[m]["tps"] / row["eager"]["tps"] for row in rows)
            print(f"  {m:6s} median {med('tps'):,.0f} tok/s, /eager per round {ratio:.3f}, first step "
                  f"{med('first_s'):.1f} s, peak RSS {med('rss'):.0f} MiB")


if __name__ == "__main__":
    main()
