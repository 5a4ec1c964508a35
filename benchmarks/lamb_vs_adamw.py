"""LAMB at 4x the batch vs AdamW, on the same number of tokens: the claim MegaScale relies on.

MegaScale (NSDI 2024, section 3.1) trains with LAMB to grow the batch 4x, which cuts the
data-parallel communication per token by 4x, and reports no loss in quality. This script
checks that on the bundled Shakespeare with a small CPU model: AdamW at batch B for N steps
against LAMB at batch k*B for N/k steps (k = 4 by default), each at a few learning rates,
then prints the validation losses side by side. Warm-up is the same fraction of the run
for both, and the schedule decays to lr/10. Validation uses the same fixed held-out set.

    .venv/bin/python benchmarks/lamb_vs_adamw.py                  # the default sweep, ~6-8 min
    .venv/bin/python benchmarks/lamb_vs_adamw.py --steps 100 --adamw-lrs 2e-3 --lamb-lrs 1e-2
    .venv/bin/python benchmarks/lamb_vs_adamw.py --step-time      # optimizer step time only

`--step-time` times one optimizer step (AdamW foreach vs our LAMB) on ~20M parameters
shaped like a 6-layer d=512 GPT (`--layers`, `--d-model`), interleaving the two and keeping each
one's best median.

Threads default to 1: on a machine shared with other jobs, more intra-op threads than free
cores make PyTorch's CPU kernels spin and run many times slower.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="AdamW global batch B (sequences)")
    ap.add_argument("--scale", type=int, default=4, help="LAMB batch is scale*B, its steps N/scale")
    ap.add_argument("--steps", type=int, default=400, help="AdamW steps N")
    ap.add_argument("--micro-batch", type=int, default=8, help="micro-batch (also the eval batch) for both")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, help="default 2 (--step-time: 6)")
    ap.add_argument("--d-model", type=int, help="default 128 (--step-time: 512)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--adamw-lrs", default="1e-3,2e-3,4e-3", help="comma-separated peak lrs for AdamW")
    ap.add_argument("--lamb-lrs", default="1e-2,2e-2,4e-2", help="comma-separated peak lrs for LAMB")
    ap.add_argument(
        "--control-lrs", default="", help="AdamW at LAMB's batch and steps, as a control (off by default)"
    )
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up as a fraction of each run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--step-time", action="store_true", help="time the optimizer step instead")
    return ap.parse_args()


def train(args: argparse.Namespace, name: str, lr: float, batch: int, steps: int) -> dict:
    from megascale.config import load_config
    from megascale.train import Trainer

    with tempfile.TemporaryDirectory(prefix="lamb_vs_adamw_") as run_dir:
        overrides = {
            "model.seq_len": args.seq_len,
            "model.n_layers": args.layers,
            "model.d_model": args.d_model,
            "model.n_heads": args.heads,
            "optim.name": f'"{name}"',
            "optim.lr": lr,
            "optim.min_lr": lr / 10,
            "optim.weight_decay": args.weight_decay,
            "optim.warmup_steps": max(1, round(args.warmup_frac * steps)),
            "optim.schedule": '"cosine"',
            "data.path": f'"{ROOT / "data/cache/shakespeare"}"',
            "data.source": f'"{ROOT / "data/shakespeare"}"',
            "train.steps": steps,
            "train.global_batch": batch,
            "train.micro_batch": args.micro_batch,
            "train.seed": args.seed,
            "train.device": '"cpu"',
            "train.eval_interval": steps,  # once, at the end
            "train.eval_batches": args.eval_batches,
            "train.run_dir": f'"{run_dir}"',
            "checkpoint.interval": 0,
            "log.tensorboard": "false",
            "log.progress": "false",
            "log.sample_tokens": 0,
        }
        cfg = load_config(ROOT / "configs/cpu_default.toml", [f"{k}={v}" for k, v in overrides.items()])
        result = Trainer(cfg, resume=False, quiet=True).fit()
    return {"optim": name, "lr": lr, "batch": batch, **result}


def _lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def compare(args: argparse.Namespace) -> None:
    big, lamb_steps = args.batch * args.scale, args.steps // args.scale
    plan = [("adamw", lr, args.batch, args.steps) for lr in _lrs(args.adamw_lrs)]
    plan += [("lamb", lr, big, lamb_steps) for lr in _lrs(args.lamb_lrs)]
    plan += [("adamw", lr, big, lamb_steps) for lr in _lrs(args.control_lrs)]
    print(
        f"model: {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}; "
        f"AdamW batch {args.batch} x {args.steps} steps vs LAMB batch {big} x {lamb_steps} steps "
        f"({args.batch * args.steps * args.seq_len:,} tokens each); {args.threads} thread(s)",
        flush=True,
    )
    cols = [("optimizer", 9), ("batch", 5), ("steps", 5), ("tokens", 9), ("lr", 8), ("train", 7), ("val", 7)]
    print(" ".join(f"{c:>{w}}" for c, w in cols + [("sec", 6)]), flush=True)
    rows = []
    for name, lr, batch, steps in plan:
        r = train(args, name, lr, batch, steps)
        rows.append(r)
        print(
            f"{name:>9} {batch:5d} {r['steps']:5d} {r['tokens']:9,d} {lr:8.1e} {r['train_loss']:7.4f} "
            f"{r['val_loss']:7.4f} {r['seconds']:6.1f}",
            flush=True,
        )
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["optim"], r["batch"])
        if key not in best or r["val_loss"] < best[key]["val_loss"]:
            best[key] = r
    print("\nbest lr per optimizer and batch (same tokens):")
    for (name, batch), r in best.items():
        print(
            f"  {name:>5} batch {batch:3d} x {r['steps']:4d} steps, lr {r['lr']:.1e}: val {r['val_loss']:.4f}"
        )
    a, b = best.get(("adamw", args.batch)), best.get(("lamb", big))
    if a and b:
        print(f"  LAMB at {args.scale}x batch - AdamW = {b['val_loss'] - a['val_loss']:+.4f} nats")
    print("(the best lr is picked on the same validation set it is reported on, for both optimizers)")


def step_time(d: int, layers: int, repeats: int = 4, steps: int = 15) -> None:
    from megascale.optim import Lamb

    shapes = [(1024, d)]
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d)] + [(d,)] * 5

    def make(name: str):
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen)) for s in shapes]
        for p in ps:
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
        decay = {"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1}
        no_decay = {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}
        if name == "adamw":
            return ps, torch.optim.AdamW([decay, no_decay], lr=1e-3, foreach=True)
        return ps, Lamb([decay, {**no_decay, "adapt": False}], lr=1e-3)

    n = sum(torch.Size(s).numel() for s in shapes)
    best: dict[str, float] = {}
    for name in ["adamw", "lamb"] * repeats:
        _, opt = make(name)
        for _ in range(3):
            opt.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        median = sorted(times)[len(times) // 2]
        best[name] = min(best.get(name, float("inf")), median)
    print(
        f"optimizer step on {n / 1e6:.1f}M fp32 params in {len(shapes)} tensors, "
        f"{torch.get_num_threads()} thread(s), best of {repeats} medians of {steps}:"
    )
    print(f"  AdamW(foreach=True) {1e3 * best['adamw']:7.1f} ms")
    print(f"  LAMB (ours)         {1e3 * best['lamb']:7.1f} ms   ({best['lamb'] / best['adamw']:.2f}x)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.step_time:
        step_time(args.d_model or 512, args.layers or 6)
    else:
        args.d_model, args.layers = args.d_model or 128, args.layers or 2
        compare(args)


if __name__ == "__main__":
    main()
