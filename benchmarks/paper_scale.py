"""Predicted MFU of the 175B model on A100s, Megatron-LM-like vs MegaScale-like (MegaScale Table 3's setup).

The layout is the paper's (tp 8, pp 8, 6 virtual stages, micro-batch 1, dp = gpus / 64) and the
batch is 768 sequences up to 1024 GPUs, 6144 above. Nothing is fitted to the paper's results: the
figures come from the A100 preset (datasheet peaks and link speeds, chosen GEMM-efficiency priors,
see megascale/perf/presets/a100.toml) and, if present, its calibration.

    .venv/bin/python benchmarks/paper_scale.py [--cluster a100] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale.config import load_config  # noqa: E402
from megascale.perf.presets import load_preset  # noqa: E402
from megascale.perf.step import MEGASCALE, MEGATRON, Layout, predict  # noqa: E402

JOBS = [(256, 768), (1024, 768), (3072, 6144), (12288, 6144)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="a100")
    ap.add_argument("--config", default="configs/gpt_175b.toml")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    preset = load_preset(args.cluster)
    par = cfg.parallel
    rows = []
    for gpus, batch in JOBS:
        lay = Layout(par.tp, par.pp, gpus // (par.tp * par.pp), par.vpp, cfg.train.micro_batch)
        row = {"gpus": gpus, "batch": batch, "layout": lay.label()}
        for st in (MEGATRON, MEGASCALE):
            p = predict(cfg.model, lay, preset, st, batch, explain=True)
            b = p.breakdown
            row[st.name] = {
                "mfu": p.mfu, "step_time": p.step_time, "tokens_per_s": p.tokens_per_s,
                "bubble": b.bubble, "tp_exposed": b.tp_exposed, "pp_exposed": b.pp_exposed,
                "dp_exposed": b.dp_exposed, "memory_gb": p.memory.total / 1e9, "fits": p.fits,
            }  # fmt: skip
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cal = "calibrated" if preset.calibrated else "uncalibrated priors"
    print(f"175B on {preset.device} ({preset.name}, {cal}); layout tp{par.tp} pp{par.pp} v{par.vpp} mb1")
    hdr = f"{'GPUs':>6}{'batch':>7}  {'Megatron-LM-like':>28}  {'MegaScale-like':>28}{'speed-up':>10}"
    print(hdr)
    print(f"{'':>13}  {'MFU   step s   exposed TP/PP/DP s':>28}  {'MFU   step s   exposed TP/PP/DP s':>28}")
    print("-" * len(hdr))
    for r in rows:
        cells = []
        for name in ("megatron", "megascale"):
            c = r[name]
            exp = f"{c['tp_exposed']:.2f}/{c['pp_exposed']:.2f}/{c['dp_exposed']:.2f}"
            cells.append(f"{c['mfu']:5.1%} {c['step_time']:7.2f}  {exp:>15}")
        speed = r["megatron"]["step_time"] / r["megascale"]["step_time"]
        print(f"{r['gpus']:>6}{r['batch']:>7}  {cells[0]:>28}  {cells[1]:>28}{speed:9.2f}x")
    print("Megatron-LM-like: sequential block, no overlap; MegaScale-like: parallel block, TP/PP/DP overlap.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
