"""Predicted vs measured step time on this machine (world 1 on CPU), side by side.

The planner's CPU preset is calibrated here (`megascale plan --calibrate --cluster cpu`:
matmul curve, dispatch overhead, memory bandwidth), then each small config is trained for a
few steps by the real Trainer and its median step time (first step dropped as warm-up) is
compared with `perf.step.predict` for the same model, batch and layout. The target is
|error| <= 20%.

Several ranks sharing the machine (dp2 x pp2 x tp2 on simulated hosts) are set beside the planner by
`benchmarks/ablation.py`, which also splits their CPU-seconds by cause.

    .venv/bin/python benchmarks/predict_vs_measure.py [--steps 6] [--no-calibrate]

Keep it small: the machine is 2 cores shared with others, and both calibration and
measurement are disturbed by their load. By default both run on one torch thread and are
timed by this process's CPU time (`--clock cpu`): what the wall time would be on an idle
machine, whatever the neighbours do (it still sees their cache and memory-bandwidth traffic).
`--clock wall --threads 0` gives plain wall time on torch's default threads, meaningful only
when the machine is quiet. Both take medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale.config import load_config  # noqa: E402
from megascale.perf.calibrate import calibrate  # noqa: E402
from megascale.perf.presets import load_preset  # noqa: E402
from megascale.perf.step import AS_CONFIGURED, Layout, predict  # noqa: E402

# The model and batch are pinned here (not taken from configs/cpu_default.toml, which may change):
# a 4-layer GPT, d_model 256, 256 tokens, batch 32 in micro-batches of 16, fp32, byte tokenizer.
BASE = [
    "model.seq_len=256", "model.n_layers=4", "model.d_model=256", "model.n_heads=4", 'model.style="gpt"',
    'model.block="sequential"', 'model.attention="full"', "model.bias=true", "model.dropout=0.0",
    "train.global_batch=32", "train.micro_batch=16", 'train.dtype="fp32"', 'train.device="cpu"',
    'data.tokenizer="byte"',
]  # fmt: skip
# (name, overrides on top of BASE): a spread of shapes, one knob at a time.
CASES = [
    ("4L d256 s256, mb16 x2", []),
    ("micro-batch 4 (8 micro-batches)", ["train.micro_batch=4"]),
    (
        "6L d384, mb8 x2",
        [
            "model.n_layers=6",
            "model.d_model=384",
            "model.n_heads=6",
            "train.micro_batch=8",
            "train.global_batch=16",
        ],
    ),  # fmt: skip
    ("parallel block, llama style", ['model.block="parallel"', 'model.style="llama"', "model.bias=false"]),
    ("sliding window 64", ['model.attention="sliding"', "model.window=64"]),
    # the ablation's shapes (benchmarks/ablation.py): short sequences in micro-batches of 2
    ("small: 2L s128, mb2 x8", ["model.n_layers=2", "model.seq_len=128", "train.micro_batch=2",
                               "train.global_batch=16"]),
]


def measure(overrides: list[str], steps: int, run_dir: str) -> tuple[float, float, object]:
    """Median (wall, CPU-clock) seconds of the Trainer's optimizer steps, the first dropped as warm-up."""
    import torch

    from megascale.perf.calibrate import cpu_clock
    from megascale.train import Trainer

    common = [
        f"train.steps={steps}", "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.resume=false",
        "log.tensorboard=false", "log.progress=false", "log.sample_tokens=0", f'train.run_dir="{run_dir}"',
    ]  # fmt: skip
    cfg = load_config("configs/cpu_default.toml", BASE + overrides + common)
    trainer = Trainer(cfg, quiet=True)
    tick = cpu_clock(torch.get_num_threads())
    wall, cpu = [], []
    for _ in range(steps):
        c0 = tick()
        stats = trainer.train_step()
        cpu.append(tick() - c0)
        wall.append(stats.step_time)
    return statistics.median(wall[1:] or wall), statistics.median(cpu[1:] or cpu), cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-calibrate", action="store_true", help="use the stored calibration")
    ap.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: CPU time per thread (robust to other jobs on a shared machine); wall: wall time",
    )
    ap.add_argument("--only", type=int, nargs="*", help="case numbers to run (default: all)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for calibration and training alike (1: on a loaded machine a "
        "descheduled thread stalls every parallel kernel of the others; 0: torch's default)",
    )
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if not args.no_calibrate:
        res = calibrate(load_preset("cpu", use_calibration=False), clock=args.clock)
        g = res["gemm"]
        print(
            f"calibrated cpu: peak {res['peak_flops'] / 1e9:.1f} GFLOP/s, GEMM eff {g['max_efficiency']:.2f} "
            f"half_dim {g['half_dim']:.1f}, overhead {g['overhead_s'] * 1e6:.1f} us, "
            f"memory {res['memory_bw'] / 1e9:.1f} GB/s"
        )
    preset = load_preset("cpu")
    import torch

    print(f"clock: {args.clock}, threads: {torch.get_num_threads()}")
    print(f"{'case':<38}{'world':>6}{'predicted s':>13}{'measured s':>12}{'error':>8}{'(wall s)':>10}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, ov) in enumerate(CASES):
            if args.only and i not in args.only:
                continue
            wall, cpu, cfg = measure(ov, args.steps, f"{tmp}/run{i}")
            measured = cpu if args.clock == "cpu" else wall
            lay = Layout(micro_batch=cfg.train.micro_batch)
            pred = predict(cfg.model, lay, preset, AS_CONFIGURED, cfg.train.global_batch, policy="fp32")
            err = pred.step_time / measured - 1
            worst = max(worst, abs(err))
            print(f"{name:<38}{1:>6}{pred.step_time:13.3f}{measured:12.3f}{err:+8.1%}{wall:10.3f}")
    print(f"worst |error| {worst:.1%} (target 20%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
