"""What parallel.tp_overlap hides, one layer's pass at a time, on two simulated hosts.

Why: benchmarks/overlap.py times whole steps, whose hidden fraction swings by 15 points between runs
minutes apart on a 2-core VM (docs/overlap.md), more than most changes to the overlap move it. Here
each sequence-parallel layer of a GPT block (qkv and fc_in: all-gather + column GEMM; proj and
fc_out: row GEMM + reduce-scatter) runs its forward and its backward three ways, pass by pass in
turn over the same link: the plain layer (a blocking collective and the GEMM), the overlapped one,
and the layer's GEMMs alone (the same shapes, no collective). Per pass the hidden fraction

    H = (plain - overlap) / (plain - GEMMs alone)

from medians over `--iters` passes. The passes run back to back, as a step's do, so the link's
token bucket stays as drained as in training.

    .venv/bin/python benchmarks/tp_layers.py [--mbit 1000] [--d-model 256] [--seq 128] [--batch 2]

Needs root (namespaces, tc); where they cannot be made it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from overlap import hidden_fraction, pin_to_core, run_job  # noqa: E402 (benchmarks/: this script's directory)

VARIANTS = ("plain", "overlap", "alone")


def layer_shapes(d: int) -> dict[str, tuple[str, int, int]]:
    """A GPT block's SP layers: (kind, in features, out features), in the order a forward runs them."""
    return {"qkv": ("column", d, 3 * d), "proj": ("row", d, d), "fc_in": ("column", d, 4 * d),
            "fc_out": ("row", 4 * d, d)}


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from megascale.config import ParallelConfig
    from megascale.parallel.mesh import Mesh
    from megascale.parallel.tensor.flight import overlap_settings
    from megascale.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    rank, tp = int(os.environ["RANK"]), 2
    pin_to_core(argparse.Namespace(pin=True), tp)  # a host's core each, as overlap.py's ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = Mesh.build(ParallelConfig(tp=tp, sequence_parallel=True, transport=a.transport))
    ov = overlap_settings(mesh, a.chunks)
    b, s = a.batch, a.seq
    out = {}
    for name, (kind, fin, fout) in layer_shapes(a.d_model).items():
        torch.manual_seed(0)  # the same weights on every rank and in both layers
        if kind == "column":
            plain, overlapped = (ColumnParallelLinear(fin, fout, True, mesh, input_mode="gather_seq",
                                                      overlap=o) for o in (None, ov))
            # the local sequence in; the GEMM alone on the gathered one
            alone, x = nn.Linear(fin, fout // tp), torch.randn(b, s // tp, fin)
            x_alone = torch.randn(b, s, fin)
        else:
            plain, overlapped = (RowParallelLinear(fin, fout, True, mesh, output_mode="reduce_scatter_seq",
                                                   overlap=o) for o in (None, ov))
            alone, x = nn.Linear(fin // tp, fout), torch.randn(b, s, fin // tp)
            x_alone = x.clone()
        overlapped.load_state_dict(plain.state_dict())
        x.requires_grad_(True)
        x_alone.requires_grad_(True)
        runs = {"plain": (plain, x), "overlap": (overlapped, x), "alone": (alone, x_alone)}
        times = {(v, p): [] for v in VARIANTS for p in ("fwd", "bwd")}
        # the GEMMs alone in a block of their own: passes with no traffic between the others' would let
        # the link's token bucket refill, and a collective after them go at the line's speed
        turns = [("alone",)] * (a.warmup + a.iters) + [("plain", "overlap"), ("overlap", "plain")] * (
            (a.warmup + a.iters + 1) // 2)
        for it, order in enumerate(turns):
            for v in order:  # the two with collectives alternate which goes first
                layer, inp = runs[v]
                t0 = time.perf_counter()
                y = layer(inp)
                t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                t2 = time.perf_counter()
                layer.zero_grad(set_to_none=True)
                inp.grad = None
                if it % (a.warmup + a.iters) >= a.warmup:
                    times[v, "fwd"].append(t1 - t0)
                    times[v, "bwd"].append(t2 - t1)
        out[name] = {f"{v} {p}": statistics.median(t) for (v, p), t in times.items()}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbit", type=float, default=1000.0, help="each host's link, tc tbf")
    p.add_argument("--d-model", type=int, default=256, help="the block's width (overlap.py's default)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--chunks", type=int, default=1, help="parallel.tp_overlap_chunks")
    p.add_argument("--transport", choices=("sockets", "gloo"), default="sockets", help="parallel.transport")
    p.add_argument("--iters", type=int, default=200, help="timed passes per layer and variant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--port", type=int, default=29560)
    p.add_argument("--worker", choices=("layers",), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.iters < 1 or a.seq % 2 or a.d_model % 2:
        p.error("--iters must be at least 1, --seq and --d-model even (they split over tp 2)")
    if a.worker:
        worker(a)
        return 0

    from megascale.fault import netns

    ok, why = netns.available(shaping=True)
    if not ok:
        print(f"tp_layers: skipped, {why}")
        return 0
    a.forward, a.timeout = sys.argv[1:], 1200  # what run_job hands the ranks, and how long it waits
    with netns.SimCluster(2, mbit=a.mbit) as cluster:
        result = run_job(cluster, a, __file__, "layers", 2, a.port)
    print(f"2 hosts, {a.mbit:.0f} Mbit/s tbf links, {a.transport}; tp 2, sequence parallel, "
          f"{a.chunks} chunk(s); micro-batch {a.batch} x {a.seq}, d_model {a.d_model}; medians of {a.iters} "
          f"passes, ms")
    print(f"{'layer':7} {'pass':4} {'plain':>7} {'overlap':>8} {'GEMMs alone':>12} {'H':>7}")
    total = dict.fromkeys(VARIANTS, 0.0)
    for name, r in result.items():
        for pas in ("fwd", "bwd"):
            t = [r[f"{v} {pas}"] for v in VARIANTS]
            for v, x in zip(VARIANTS, t, strict=True):
                total[v] += x
            print(f"{name:7} {pas:4} {t[0] * 1e3:7.3f} {t[1] * 1e3:8.3f} {t[2] * 1e3:12.3f} "
                  f"{hidden_fraction(*t):7.1%}")
    t = [total[v] for v in VARIANTS]
    print(f"{'block':7} {'all':4} {t[0] * 1e3:7.3f} {t[1] * 1e3:8.3f} {t[2] * 1e3:12.3f} "
          f"{hidden_fraction(*t):7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
