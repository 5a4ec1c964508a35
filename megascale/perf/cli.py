"""`megascale plan`: predict and rank layouts of a model on a cluster, before renting it.

megascale plan --config configs/gpt_175b.toml --cluster a100 --gpus 12288 --batch 6144
megascale plan ... --settings megatron          # the Megatron-LM-like baseline
megascale plan ... --settings both              # both, side by side for the best layouts
megascale plan ... --explain [--layout 8,8,6,1] # time breakdown of one layout (tp,pp,vpp,mb)
megascale plan ... --json                       # for scripts
megascale plan --calibrate --cluster cpu        # measure this machine's GEMM curve and bandwidth
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from megascale.errors import UserError
from megascale.perf import report
from megascale.perf.presets import builtin_names, load_preset
from megascale.perf.step import SETTINGS, Layout, predict


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict step time, MFU and memory of layouts on a cluster")
    add_arguments(p)
    p.set_defaults(func=handler)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="model/run config (TOML), e.g. configs/gpt_175b.toml")
    p.add_argument("overrides", nargs="*", help="section.field=value config overrides")
    p.add_argument(
        "--cluster", default="a100", help=f"preset name ({', '.join(builtin_names())}) or a .toml path"
    )
    p.add_argument("--gpus", type=int, help="devices in the job (default: the config's tp*pp*dp)")
    p.add_argument("--batch", type=int, help="global batch in sequences (default: train.global_batch)")
    p.add_argument("--settings", default="megascale", choices=[*SETTINGS, "both"],
                   help="megatron: sequential block, no overlap; megascale: parallel block, all overlaps; "
                        "config: the model's block with all overlaps, and its parallel.pp_warmup_ahead"
                   )  # fmt: skip
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--layout", help="tp,pp,vpp,micro_batch[,rc]: evaluate this layout only")
    p.add_argument("--policy", choices=["fp32", "mixed", "megatron"], help="bytes per parameter (memory.py)")
    p.add_argument("--explain", action="store_true", help="time breakdown of the best (or --layout) layout")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--calibrate", action="store_true", help="measure this machine for --cluster and store it")


def _parse_layout(text: str, gpus: int) -> Layout:
    parts = text.split(",")
    try:
        tp, pp, vpp, mb = (int(x) for x in parts[:4])
    except ValueError:
        raise UserError(f"--layout {text}: expected tp,pp,vpp,micro_batch[,rc], e.g. 8,8,6,1") from None
    if gpus % (tp * pp):
        raise UserError(f"--layout {text}: tp*pp={tp * pp} does not divide --gpus {gpus}")
    return Layout(tp, pp, gpus // (tp * pp), vpp, mb, recompute=len(parts) > 4 and parts[4] == "rc")


def handler(args: argparse.Namespace) -> int:
    from megascale.config import load_config

    preset = load_preset(args.cluster)
    if args.calibrate:
        from megascale.perf.calibrate import calibrate

        res = calibrate(load_preset(args.cluster, use_calibration=False))
        g = res["gemm"]
        print(
            f"calibrated {preset.name}: peak {res['peak_flops'] / 1e9:.1f} GFLOP/s, GEMM max efficiency "
            f"{g['max_efficiency']:.2f}, half_dim {g['half_dim']:.0f}, "
            f"overhead {g['overhead_s'] * 1e6:.1f} us,"
            f" memory {res['memory_bw'] / 1e9:.1f} GB/s -> {res['path']}"
        )
        print(  # perf/host.py: the Trainer's own work beyond its kernels, and its kernels in place
            f"  framework, ms: {(g['host_layer_fwd_s'] + g['host_layer_bwd_s']) * 1e3:.2f} per layer and "
            f"micro-batch (+{g['host_tp_call_s'] * 1e3:.3f} per TP collective), "
            f"{g['host_microbatch_s'] * 1e3:.2f} per micro-batch (+{g['host_tp_microbatch_s'] * 1e3:.2f} "
            f"under TP), {g['host_step_s'] * 1e3:.2f} per step + {g['host_layer_step_s'] * 1e3:.2f} per "
            f"layer; kernels in place x{g['in_place_factor']:.2f} (TP x{g['in_place_factor_tp']:.2f})"
        )
        if not args.config:
            return 0
        preset = load_preset(args.cluster)
    if not args.config:
        raise UserError("plan: --config is required (e.g. configs/gpt_175b.toml)")
    cfg = load_config(args.config, args.overrides)
    gpus = args.gpus or cfg.parallel.world_size
    batch = args.batch or cfg.train.global_batch
    if gpus <= 0 or batch <= 0:
        raise UserError("--gpus and --batch must be > 0")
    if cfg.model.vocab_size <= 0:
        raise UserError("model.vocab_size: the planner needs it set (e.g. model.vocab_size=50304)")
    names = ["megatron", "megascale"] if args.settings == "both" else [args.settings]
    out: dict[str, list] = {}
    t0 = time.perf_counter()
    evaluated = 0
    for name in names:
        st = SETTINGS[name]
        if name == "config":  # the run as configured: its 1F1B run-ahead too (memory for latency)
            st = dataclasses.replace(st, pp_warmup_ahead=cfg.parallel.pp_warmup_ahead)
        if args.layout:
            lay = _parse_layout(args.layout, gpus)
            preds = [predict(cfg.model, lay, preset, st, batch, args.policy, explain=True)]
            evaluated += 1
        else:
            from megascale.perf.planner import search

            res = search(cfg.model, preset, gpus, batch, st, top=args.top, policy=args.policy)
            preds = res.ranked[: args.top]
            evaluated += res.evaluated
        out[name] = preds
    elapsed = time.perf_counter() - t0
    if args.json:
        import json

        doc = {
            "cluster": preset.name, "calibrated": preset.calibrated, "gpus": gpus, "batch": batch,
            "search_seconds": elapsed, "evaluated": evaluated,
            "settings": {k: [p.as_dict() for p in v] for k, v in out.items()},
        }  # fmt: skip
        print(json.dumps(doc, indent=1))
        return 0
    cal = "calibrated" if preset.calibrated else "uncalibrated priors"
    for name, preds in out.items():
        title = f"{name}: {gpus} x {preset.device} ({preset.name}, {cal}), batch {batch}"
        print(report.table(preds, title))
        if args.explain:
            print(report.explain(preds[0]))
        print()
    print(f"{evaluated} layouts evaluated in {elapsed:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megascale plan", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return handler(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
