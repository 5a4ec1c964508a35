"""Pipeline schedules on gloo CPU processes: tokens/s, and each rank's measured bubble vs the theory.

For each world (pp = 2, 4), a tiny GPT runs a few training steps (forwards + backwards of
m micro-batches; no optimizer, which the schedule does not change) under all-forward-all-
backward, 1F1B and interleaved 1F1B (vpp = 2). Printed per schedule: tokens/s of the
pipeline, the fraction of the step each rank spent blocked in point-to-point receives
(StepResult.bubble), and the ideal (p - 1) / (v m + p - 1).

On a machine with fewer cores than ranks the processes share cores, so a rank's "wait" is
partly another rank computing and the measured bubble sits above the theory; the ordering
of the schedules is what to read there. One process (world 1) is the reference for tokens/s.

    .venv/bin/python benchmarks/parallel_pipeline.py [--worlds 2 4] [--steps 3] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _gloo import run_on_gloo

from megascale.config import ModelConfig, ParallelConfig
from megascale.parallel.mesh import Mesh
from megascale.parallel.pipeline import PipelineStage, pipeline_step, theoretical_bubble

SCHEDULES = (("afab", 1), ("1f1b", 1), ("interleaved", 2))


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, seq_len=args.seq, n_layers=args.layers, d_model=args.d_model,
                       n_heads=4, tie_embeddings=False)


def run_schedules(pp: int, args: argparse.Namespace) -> list[tuple[str, int, float, list[float]]]:
    """On every rank: (schedule, vpp, median step seconds, this rank's mean bubble) per schedule."""
    cfg, m = model_config(args), args.microbatches
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (m, 1, cfg.seq_len + 1), generator=gen)
    mbs = [(t[:, :-1], t[:, 1:]) for t in tokens]
    out = []
    for name, vpp in SCHEDULES if pp > 1 else (("1f1b", 1),):
        mesh = Mesh.build(ParallelConfig(pp=pp, vpp=vpp))
        stage = PipelineStage(cfg, mesh, vpp)
        times, bubbles = [], []
        for step in range(args.steps + 1):  # the first step warms up
            if mesh.pp > 1:
                dist.barrier(group=mesh.pp_group)
            t0 = time.perf_counter()
            result = pipeline_step(stage, mbs, micro_batch=1, schedule=name)
            stage.zero_grad(set_to_none=True)
            if step:
                times.append(time.perf_counter() - t0)
                bubbles.append(result.bubble)
        out.append((name, vpp, sorted(times)[len(times) // 2], sum(bubbles) / len(bubbles)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()
    m, tokens = args.microbatches, args.microbatches * args.seq
    print(f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq}; {m} micro-batches of 1 "
          f"sequence per step; gloo, one thread per rank")
    print(f"{'world':>5} {'schedule':>12} {'tokens/s':>9} {'theory':>7}  measured bubble per rank")
    for world in [1, *args.worlds]:
        per_rank = run_on_gloo(world, run_schedules, args)
        for i, (name, vpp, _, _) in enumerate(per_rank[0]):
            step_s = max(per_rank[r][i][2] for r in per_rank)
            bubbles = " ".join(f"{per_rank[r][i][3]:.2f}" for r in sorted(per_rank))
            label = f"{name}" + (f" v{vpp}" if vpp > 1 else "")
            theory = theoretical_bubble(world, m, vpp)
            print(f"{world:>5} {label:>12} {tokens / step_s:>9.0f} {theory:>7.2f}  {bubbles}")


if __name__ == "__main__":
    main()
