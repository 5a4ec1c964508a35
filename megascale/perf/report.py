"""Formatting of plans: a table for people, JSON for scripts, and one layout's time breakdown."""

from __future__ import annotations

import json

from megascale.perf.step import Prediction

GB = 1e9


def _ms(x: float) -> str:
    return f"{x * 1e3:8.1f}"


def table(preds: list[Prediction], title: str = "") -> str:
    head = (
        f"{'layout':<26}{'step s':>8}{'tok/s':>10}{'MFU':>7}{'bubble':>8}"
        f"{'DP ms':>9}{'PP ms':>9}{'TP ms':>9}"
        f"{'param':>7}{'grad':>7}{'optim':>7}{'act':>7}{'act rc':>7}{'total':>7}  fits"
    )
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for p in preds:
        b, m = p.breakdown, p.memory
        bubble = f"{b.bubble / p.step_time:7.1%}" if b else "      ?"
        exposed = (
            "".join(f"{_ms(x):>9}" for x in (b.dp_exposed, b.pp_exposed, b.tp_exposed)) if b else " " * 27
        )
        used = m.activations_recompute if m.recompute else m.activations
        mem = "".join(
            f"{x / GB:7.1f}" for x in (m.params, m.grads, m.optimizer, used, m.activations_recompute)
        )
        lines.append(
            f"{p.layout.label():<26}{p.step_time:8.3f}{p.tokens_per_s:10.4g}{p.mfu:7.1%} {bubble}"
            f"{exposed}{mem}{m.total / GB:7.1f}  {'yes' if p.fits else 'NO'}"
        )
    lines.append("memory in GB per device; DP/PP/TP: communication time left exposed per step; rc: recompute")
    return "\n".join(lines)


def explain(p: Prediction) -> str:
    b = p.breakdown
    assert b is not None
    rows = [
        ("compute (GEMMs, norms, activations)", b.compute),
        ("tensor-parallel communication, exposed", b.tp_exposed),
        ("pipeline bubble", b.bubble),
        ("pipeline point-to-point, exposed", b.pp_exposed),
        ("data-parallel all-gather/reduce-scatter, exposed", b.dp_exposed),
        ("optimizer step", b.optimizer),
        ("embedding-gradient sync, grad-norm all-reduce", b.other_exposed),
    ]
    if b.cpu_contention:  # shared cores: the ranks' CPU work (compute + messages) outlasts the timeline
        rows.append(("cpu contention (shared cores: compute + messages)", b.cpu_contention))
    s = p.settings
    out = [
        f"layout {p.layout.label()}  ({p.settings.name}: parallel block={s.parallel_block}, "
        f"overlap tp={s.tp_overlap} pp={s.pp_overlap} dp={s.dp_overlap})",
        f"batch {p.global_batch} sequences, {p.micro_batches} micro-batches per pipeline",
    ]
    for name, t in rows:
        out.append(f"  {name:<50}{t:10.4f} s {t / p.step_time:7.1%}")
    out.append(f"  {'step time':<50}{p.step_time:10.4f} s")
    out.append(f"  tokens/s {p.tokens_per_s:.4g}   MFU {p.mfu:.1%}")
    total_comm = ", ".join(f"{k.upper()} {v:.3f} s" for k, v in p.comm_total.items())
    out.append(f"  communication issued (hidden or not): {total_comm}")
    m = p.memory
    out.append(
        f"  memory/device: params {m.params / GB:.1f} GB, grads {m.grads / GB:.1f}, optimizer "
        f"{m.optimizer / GB:.1f}, activations {m.activations / GB:.1f} (with recompute "
        f"{m.activations_recompute / GB:.1f}), total {m.total / GB:.1f} GB -> "
        f"{'fits' if p.fits else 'DOES NOT FIT'}"
    )
    return "\n".join(out)


def to_json(preds: list[Prediction], **extra) -> str:
    return json.dumps({**extra, "layouts": [p.as_dict() for p in preds]}, indent=1)
