"""Parallel layouts through the Trainer on gloo CPU processes: tokens/s, and the pipeline bubble.

For worlds of 2 and 4 processes, every layout (dp, tp, tp + sequence parallel, pp 1F1B,
pp interleaved, and their products) runs the real `Trainer.train_step` (data loader,
forwards/backwards, gradient sync, clipping, optimizer, the per-step loss all-reduce) on
a small GPT. Printed per layout: the job's tokens/s (median step), relative to one process
at one thread, and for pipelines each rank's measured idle fraction next to the ideal
(p - 1) / (v m + p - 1) with m micro-batches per step on each dp rank
(benchmarks/parallel_pipeline.py measures the schedules alone, without the Trainer).

Read it for what it is: this machine has 2 cores, so a world of 4 shares them, and a
rank's "idle" time in a receive is partly another rank computing; the measured bubble
sits above the theory and the ordering of the layouts is what carries over to GPUs.

    .venv/bin/python benchmarks/parallel.py [--worlds 2 4] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from _gloo import run_on_gloo

from megascale.config import load_config
from megascale.data import ensure_dataset
from megascale.parallel.pipeline import theoretical_bubble

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    1: [("1 process", [])],
    2: [("dp2", ["parallel.dp=2"]), ("tp2", ["parallel.tp=2"]),
        ("tp2 sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("pp2 1f1b", ["parallel.pp=2"]), ("pp2 v2 interleaved", ["parallel.pp=2", "parallel.vpp=2"])],
    4: [("dp4", ["parallel.dp=4"]), ("tp2 x dp2", ["parallel.tp=2", "parallel.dp=2"]),
        ("pp2 x dp2", ["parallel.pp=2", "parallel.dp=2"]), ("pp2 x tp2", ["parallel.pp=2", "parallel.tp=2"]),
        ("pp4 1f1b", ["parallel.pp=4"]),
        ("pp2 v2 x dp2", ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2"])],
}


def base_overrides(args: argparse.Namespace, run_dir: str) -> list[str]:
    return [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", "model.n_heads=4",
        f"model.seq_len={args.seq}", "model.dropout=0.0", f"train.global_batch={args.batch}",
        f"train.micro_batch={args.micro}", "train.steps=1000", "train.eval_interval=0", "log.progress=false",
        "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9", "checkpoint.interval=0",
        f"data.path={json.dumps(str(ROOT / 'data' / 'cache' / 'shakespeare'))}",
        f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}",
        f"train.run_dir={json.dumps(run_dir)}",
    ]


def run_layouts(world: int, args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """On every rank: (layout, median step seconds on rank 0's clock, this rank's mean bubble)."""
    from megascale.train import Trainer

    out = []
    for name, extra in LAYOUTS[world]:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(load_config(None, [*base_overrides(args, run_dir), *extra]), quiet=True)
            times, bubbles = [], []
            for step in range(args.steps + 1):  # the first step warms up
                stats = trainer.train_step()
                if step:
                    times.append(stats.step_time)
                    if trainer.engine is not None and trainer.engine.pipelined:
                        bubbles.append(trainer.engine.bubble)
            trainer.loader.close()
        out.append((name, statistics.median(times), statistics.mean(bubbles) if bubbles else float("nan")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=2)
    args = p.parse_args()
    ensure_dataset(load_config(None, base_overrides(args, "unused")).data, progress=False)  # tokenise once
    tokens = args.batch * args.seq
    print(f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq}; global batch {args.batch} in "
          f"micro-batches of {args.micro}; Trainer.train_step on gloo, one thread per rank, "
          f"{torch.get_num_threads()} threads available")
    print(f"{'world':>5} {'layout':>20} {'tokens/s':>9} {'vs 1':>5} {'theory':>7}  measured bubble per rank")
    reference = None
    for world in [1, *args.worlds]:
        per_rank = run_on_gloo(world, run_layouts, args)
        for i, (name, step_s, _) in enumerate(per_rank[0]):
            tps = tokens / step_s
            reference = reference or tps
            extra = dict(e.split("=") for e in dict(LAYOUTS[world])[name])
            pp, vpp, dp = (int(extra.get(f"parallel.{k}", 1)) for k in ("pp", "vpp", "dp"))
            theory, measured = "", ""
            if pp > 1:
                m = args.batch // (args.micro * dp)
                theory = f"{theoretical_bubble(pp, m, vpp):.2f}"
                measured = " ".join(f"{per_rank[r][i][2]:.2f}" for r in sorted(per_rank))
            print(f"{world:>5} {name:>20} {tps:>9.0f} {tps / reference:>5.2f} {theory:>7}  {measured}",
                  flush=True)


if __name__ == "__main__":
    main()
