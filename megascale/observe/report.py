"""`megascale report RUN_DIR`: one self-contained HTML page about a run.

    megascale report runs/x                  -> runs/x/report.html
    megascale report runs/x -o /tmp/x.html

Sections: the run (config, layout, peak FLOP/s and where it came from), loss and validation,
tokens/s and MFU in both conventions, the start-up breakdown, where a step's time went
(compute vs exposed communication per dimension, pipeline bubble; rank 0 and the slowest
rank, from the trace files), the straggler heat map on the device mesh, checkpoint stalls,
the faults and restarts of a launched job (its agents' event logs), and a link to the Perfetto
timeline. A section whose data the run does not have says so in
one line. Charts are plotly figures with plotly.js inlined once, so the file opens offline
(on a cluster's login node, attached to a ticket, years later).
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import os
import signal
import statistics
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from megascale.data.atomic import write_command_output
from megascale.errors import UserError
from megascale.observe.ettr import FAULTS, ettr_text, lost_text, lost_time

SECTIONS = ("summary", "loss", "throughput", "startup", "breakdown", "stragglers", "checkpoints", "faults",
            "timeline")
COLOURS = {  # fixed per category, so the two breakdown charts read alike
    "compute": "#4c78a8", "exposed_dp": "#f58518", "exposed_tp": "#e45756", "exposed_pp": "#72b7b2",
    "bubble": "#b279a2", "data": "#54a24b", "checkpoint": "#eeca3b", "other": "#bab0ac",
}  # fmt: skip
LABELS = {
    "compute": "compute", "exposed_dp": "exposed DP comm", "exposed_tp": "exposed TP comm",
    "exposed_pp": "exposed PP comm", "bubble": "pipeline bubble", "data": "data wait",
    "checkpoint": "checkpoint stall", "other": "other (untimed)",
}  # fmt: skip
PUBLISHED = "published convention (6N + 12·L·d·s)"
EXACT = "exact model FLOPs"
MAX_TABLE_ROWS = 50
GRID_ROW = 8  # ranks per heat-map row when the run logged no coordinates


# ---------------------------------------------------------------------- reading the run


def read_records(path: Path) -> dict[str, list[dict[str, Any]]]:
    """metrics.jsonl by kind, in file order; a line cut short by a crash is skipped."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out[str(rec.get("kind", "?"))].append(rec)
    return out


def read_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.toml"
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError:
        return None


def model_params(model: dict[str, Any]) -> int | None:
    """The parameter count of the config's model (None without a vocabulary size or if unreadable)."""
    import dataclasses

    from megascale.config import ModelConfig
    from megascale.perf.memory import total_params

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        cfg = ModelConfig(**{k: v for k, v in model.items() if k in known})
        return total_params(cfg) if cfg.vocab_size > 0 else None
    except (TypeError, ValueError, ZeroDivisionError):
        return None


REPORT_STEPS = 200  # the traces' steps a report reads by default, the newest


class Mesh(NamedTuple):
    """Where each rank sits: (dp, pp, tp) coordinates and host; `named` False when they are made up."""

    coords: dict[int, tuple[int, int, int]]
    hosts: dict[int, str]
    named: bool = True


def read_trace(run_dir: Path, steps: tuple[int, int] | None = None) -> tuple[dict | None, str, Mesh | None]:
    """The step-time breakdown from the trace files (of `steps` only, when given; or None and why not),
    and the mesh their headers describe (for a run that logged no "layout" record)."""
    from megascale.observe.breakdown import step_breakdown
    from megascale.observe.trace import read_run

    try:
        ranks = read_run(run_dir, steps=steps)
    except ValueError as e:
        return None, f"No trace files: {e}", None
    mesh = None
    if all({"dp", "pp", "tp"} <= t.coords.keys() for t in ranks.values()):
        mesh = Mesh({r: (t.coords["dp"], t.coords["pp"], t.coords["tp"]) for r, t in ranks.items()},
                    {r: t.host for r, t in ranks.items()})
    if not any(t.events for t in ranks.values()):
        return None, "The trace files hold no events.", mesh
    return step_breakdown(ranks), "", mesh


# ---------------------------------------------------------------------- small formatting helpers


def esc(x: Any) -> str:
    return html.escape(str(x))


def si(x: float, unit: str) -> str:
    """3.12e14, "FLOP/s" -> "312 TFLOP/s"."""
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def absent(text: str) -> str:
    return f'<p class="absent">{esc(text)}</p>'


def table(header: list[str] | None, rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{esc(h)}</th>" for h in header or [])
    head = f"<thead><tr>{cells}</tr></thead>" if header is not None else ""
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def median_after_first(values: list[float]) -> float:
    """The steady-state median: the first value (warm-up, compilation) left out when there are others."""
    vals = [v for v in values if v is not None]
    vals = vals[1:] if len(vals) > 1 else vals
    return statistics.median(vals) if vals else float("nan")


class Page:
    """The figures of one page: plotly.js goes inline with the first one only."""

    def __init__(self):
        self.figures = 0

    def figure(self, fig, height: int, legend: bool = True) -> str:
        import plotly.io as pio

        # Title, then the legend under it, then the plot (and its subplot titles): laid out in pixels
        # from the top of the figure, so a wide legend never covers a title.
        fig.update_layout(
            height=height, template="plotly_white", margin=dict(l=70, r=30, t=110 if legend else 70, b=50),
            title=dict(yref="container", y=1 - 12 / height, yanchor="top", x=0.01),
            legend=dict(orientation="h", yref="container", y=1 - 46 / height, yanchor="top", x=0))
        out = pio.to_html(fig, full_html=False, include_plotlyjs=self.figures == 0,
                          div_id=f"figure-{self.figures}", default_height=f"{height}px",
                          config={"displaylogo": False, "responsive": True})
        self.figures += 1
        return f'<div class="figure">{out}</div>'


# ---------------------------------------------------------------------- sections


def section_summary(run_dir: Path, recs: dict, cfg: dict | None) -> str:
    rows = [["run directory", str(run_dir.resolve())],
            ["report written", datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")]]
    train = recs.get("train", [])
    if train:
        rows.append(["steps logged", f"{train[0]['step']} … {train[-1]['step']} ({len(train)} records)"])
    rows += config_rows(cfg) if cfg else [["config", "no config.toml in the run directory"]]
    rows += layout_rows(recs.get("layout", []))
    rows += peak_rows(recs.get("peak", []))
    return table(None, rows)


def config_rows(cfg: dict) -> list[list[str]]:
    p, m, t = cfg.get("parallel", {}), cfg.get("model", {}), cfg.get("train", {})
    tp, pp, dp = p.get("tp", 1), p.get("pp", 1), p.get("dp", 1)
    layout = f"tp {tp} × pp {pp} × dp {dp} = {tp * pp * dp} ranks"
    if p.get("vpp", 1) > 1:
        layout += f", {p['vpp']} virtual stages per rank"
    if pp > 1:
        layout += f", schedule {p.get('schedule', 'auto')}"
    n = model_params(m)
    g = lambda k: m.get(k, "?")
    model = (f"{g('style')}, {g('n_layers')} layers, d_model {g('d_model')}, {g('n_heads')} heads, "
             f"seq_len {g('seq_len')}, vocab {g('vocab_size')}")
    if n:
        model += f" — {si(n, '').strip()} parameters"
    batch = (f"global batch {t.get('global_batch', '?')} sequences, micro-batch {t.get('micro_batch', '?')}, "
             f"{t.get('steps', '?')} steps, {t.get('dtype', '?')}")
    return [["layout (config)", layout], ["model", model], ["training", batch]]


def layout_rows(layouts: list[dict]) -> list[list[str]]:
    if not layouts:
        return []
    lay = layouts[-1]
    hosts = lay.get("hosts") or []
    return [["layout (run)", f"dp {lay.get('dp')} × pp {lay.get('pp')} × tp {lay.get('tp')} = "
                             f"{lay.get('world')} ranks on {len(set(hosts))} host(s)"]]


def peak_rows(peaks: list[dict]) -> list[list[str]]:
    if not peaks:
        return [["peak FLOP/s", "no peak record (MFU uses the trainer's own figure)"]]
    pk = peaks[-1]
    source = {"probe": "measured by a GEMM probe", "table": "from the device table",
              "override": "set in the config"}.get(pk.get("source"), str(pk.get("source")))
    detail = f" ({pk['detail']})" if pk.get("detail") else ""
    rows = [["peak FLOP/s per device", f"{si(float(pk.get('peak_flops', 0)), 'FLOP/s')}, {source}{detail}"]]
    if pk.get("flops_per_token"):
        pub = pk.get("flops_per_token_published")
        text = f"{si(pk['flops_per_token'], 'FLOP')} ({EXACT})"
        if pub:
            text += f", {si(pub, 'FLOP')} ({PUBLISHED})"
        rows.append(["training FLOPs per token", text])
    return rows


def section_loss(page: Page, recs: dict) -> str:
    import plotly.graph_objects as go

    train, val = recs.get("train", []), recs.get("val", [])
    if not train and not val:
        return absent("No train or val records in metrics.jsonl.")
    fig = go.Figure()
    if train:
        fig.add_scatter(x=[r["step"] for r in train], y=[r.get("loss") for r in train], name="train loss",
                        mode="lines", line=dict(color="#4c78a8"))
    if val:
        fig.add_scatter(x=[r["step"] for r in val], y=[r.get("loss") for r in val], name="validation loss",
                        mode="lines+markers", line=dict(color="#e45756"),
                        customdata=[r.get("ppl") for r in val],
                        hovertemplate="step %{x}<br>val loss %{y:.4f}<br>ppl %{customdata:.2f}"
                                      "<extra></extra>")
    fig.update_layout(title="Loss", xaxis_title="step", yaxis_title="cross-entropy (nats/token)")
    note = "" if val else absent("No validation records (train.eval_interval = 0?).")
    return page.figure(fig, 420) + note


def mfu_published(train: list[dict], peaks: list[dict]) -> tuple[list[float | None], str]:
    """MFU in the published convention: logged, else scaled from the exact one by the peak record's
    FLOPs per token in both conventions (the same tokens and peak, only the FLOP count differs)."""
    if any("mfu_published" in r for r in train):
        return [r.get("mfu_published") for r in train], ""
    pk = peaks[-1] if peaks else {}
    exact, pub = pk.get("flops_per_token"), pk.get("flops_per_token_published")
    if exact and pub:
        return [r["mfu"] * pub / exact if r.get("mfu") is not None else None for r in train], " (derived)"
    return [], ""


def section_throughput(page: Page, recs: dict) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    train = recs.get("train", [])
    if not train:
        return absent("No train records in metrics.jsonl.")
    steps = [r["step"] for r in train]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=("Throughput (tokens/s)", "MFU (% of peak)"))
    fig.add_trace(go.Scatter(x=steps, y=[r.get("tokens_per_s") for r in train], name="tokens/s",
                             mode="lines", line=dict(color="#54a24b")), row=1, col=1)
    exact = [100 * r["mfu"] if r.get("mfu") is not None else None for r in train]
    fig.add_trace(go.Scatter(x=steps, y=exact, name=f"MFU, {EXACT}", mode="lines",
                             line=dict(color="#4c78a8")), row=2, col=1)
    pub, how = mfu_published(train, recs.get("peak", []))
    if pub:
        fig.add_trace(go.Scatter(x=steps, y=[100 * v if v is not None else None for v in pub],
                                 name=f"MFU, {PUBLISHED}{how}", mode="lines",
                                 line=dict(color="#f58518", dash="dash")), row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=1)
    fig.update_yaxes(title_text="MFU %", rangemode="tozero", row=2, col=1)
    tps = median_after_first([r.get("tokens_per_s") for r in train])
    mfu = median_after_first([r.get("mfu") for r in train])
    text = f"Median over steps after the first: {tps:,.0f} tokens/s, MFU {100 * mfu:.2f}% ({EXACT})"
    if pub:
        text += f", {100 * median_after_first(pub):.2f}% ({PUBLISHED})"
    return f"<p>{esc(text)}.</p>" + page.figure(fig, 560)


def section_startup(page: Page, recs: dict) -> str:
    import plotly.graph_objects as go

    starts = recs.get("startup", [])
    if not starts:
        return absent("No start-up record in metrics.jsonl.")
    fig = go.Figure()
    for rec in starts[-3:]:  # the latest starts of a resumed run, side by side
        phases = startup_phases(rec)
        fig.add_bar(y=phases, x=[rec[k] for k in phases], orientation="h",
                    name=f"start at step {rec['step']}", text=[f"{rec[k]:.2f} s" for k in phases],
                    textposition="auto",
                    marker_color=None if len(starts) > 1 else "#4c78a8")
    fig.update_layout(title="Start-up, seconds per phase (rank 0)", xaxis_title="seconds", barmode="group",
                      yaxis=dict(autorange="reversed"))
    height = 180 + 30 * max(len(r) for r in starts[-3:]) * (1 + (len(starts[-3:]) > 1))
    total = sum(starts[-1][k] for k in startup_phases(starts[-1]))
    return (f"<p>The phases of the latest start add up to {total:.2f} s.</p>"
            + page.figure(fig, min(height, 700), legend=len(starts) > 1))


def startup_phases(rec: dict) -> list[str]:
    """A start-up record's phases: its numeric fields but the step and the wall clock it was logged at."""
    return [k for k, v in rec.items() if k not in ("kind", "step", "time") and isinstance(v, (int, float))
            and not isinstance(v, bool)]


def section_breakdown(page: Page, recs: dict, bd: dict | None, why: str,
                      steps: tuple[int, int] | None = None) -> str:
    note = bubble_note(recs.get("train", []))
    if bd is None:
        return absent(why) + note
    if steps is not None:
        note += (f"<p>From the traces of steps {steps[0]}–{steps[1]} (by default the newest {REPORT_STEPS}: "
                 "<code>megascale report RUN_DIR --steps A:B</code> or <code>--steps all</code> for "
                 "others).</p>")
    r0, slow = bd["rank0_id"], bd["slowest"]
    parts = [note, page.figure(per_step_figure(bd), 620 if slow != r0 else 400),
             page.figure(median_figure(bd), 240 if slow != r0 else 200, legend=False), median_table(bd)]
    return "".join(parts)


def bubble_note(train: list[dict]) -> str:
    bubbles = [r["bubble"] for r in train if r.get("bubble") is not None]
    if not bubbles:
        return ""
    return (f"<p>Rank 0's pipeline bubble, as the trainer logs it: median "
            f"{100 * median_after_first(bubbles):.1f}% of the step.</p>")


def per_step_figure(bd: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    r0, slow = bd["rank0_id"], bd["slowest"]
    who = [(f"rank {r0}", bd["rank0"])]
    if slow != r0:
        who.append((f"rank {slow} (slowest: largest median step)", bd["ranks"][slow]))
    fig = make_subplots(rows=len(who), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[f"{name}: seconds per step" for name, _ in who])
    for row, (_, per_step) in enumerate(who, start=1):
        steps = sorted(per_step)
        for cat in bd["categories"]:
            fig.add_trace(go.Bar(x=steps, y=[per_step[s][cat] for s in steps], name=LABELS[cat],
                                 marker_color=COLOURS[cat], legendgroup=cat, showlegend=row == 1,
                                 hovertemplate=f"{LABELS[cat]}: %{{y:.4f}} s<extra>step %{{x}}</extra>"),
                          row=row, col=1)
        fig.update_yaxes(title_text="seconds", row=row, col=1)
    fig.update_layout(barmode="stack", title="Step time by category")
    fig.update_xaxes(title_text="step", row=len(who), col=1)
    return fig


def median_figure(bd: dict):
    import plotly.graph_objects as go

    r0, slow = bd["rank0_id"], bd["slowest"]
    rows = [(f"rank {r0}", bd["median"]["rank0"])]
    if slow != r0:
        rows.append((f"rank {slow} (slowest)", bd["median"]["slowest"]))
    fig = go.Figure()
    for cat in bd["categories"]:
        fig.add_bar(y=[n for n, _ in rows], x=[1e3 * m[cat] for _, m in rows], orientation="h",
                    name=LABELS[cat], marker_color=COLOURS[cat], showlegend=False,
                    hovertemplate=f"{LABELS[cat]}: %{{x:.2f}} ms<extra>%{{y}}</extra>")
    fig.update_layout(barmode="stack", title="Median step (first step left out), milliseconds",
                      xaxis_title="ms", yaxis=dict(autorange="reversed"))
    return fig


def median_table(bd: dict) -> str:
    med = bd["median"]
    header = ["category", f"rank {bd['rank0_id']} (ms)", f"slowest: rank {bd['slowest']} (ms)",
              "max over ranks (ms)", f"share of rank {bd['rank0_id']}'s step"]
    wall = med["rank0"]["wall"] or float("nan")
    rows = []
    for c in bd["categories"]:
        rows.append([LABELS[c], f"{1e3 * med['rank0'][c]:.2f}", f"{1e3 * med['slowest'][c]:.2f}",
                     f"{1e3 * med['max'][c]:.2f}", f"{100 * med['rank0'][c] / wall:.1f}%"])
        late = c.replace("exposed_", "late_")  # its part spent waiting for a peer to arrive (lateness.py)
        if late != c and late in med["max"] and med["max"][late] > 0:
            ms = [f"{1e3 * med[k][late]:.2f}" for k in ("rank0", "slowest", "max")]
            rows.append(["… of it, waiting for a late peer", *ms, f"{100 * med['rank0'][late] / wall:.1f}%"])
    rows.append(["step wall time", f"{1e3 * med['rank0']['wall']:.2f}", f"{1e3 * med['slowest']['wall']:.2f}",
                 f"{1e3 * med['max']['wall']:.2f}", "100%"])
    return ('<p class="caption">Medians over steps after the first. "Max over ranks" is per category '
            "(different ranks), so its column does not add up to a step. A collective's wait until its last "
            "member arrived is that member's lateness (the ranks' skew), not the network's; the rows "
            "\"of it, waiting for a late peer\" are that part of the exposed communication above them.</p>"
            + table(header, rows) + kept_waiting_note(bd.get("kept_waiting", {})))


def kept_waiting_note(kept: dict[int, float], shown: int = 5) -> str:
    """The ranks whose collectives the others waited for the longest (observe.lateness)."""
    if not kept:
        return ""
    top = ", ".join(f"rank {r} ({1e3 * s:.1f} ms)" for r, s in list(kept.items())[:shown])
    more = f" and {len(kept) - shown} more" if len(kept) > shown else ""
    return (f"<p>The ranks the others waited for at collectives, by their waiting time per step summed "
            f"over the waiters: {esc(top)}{esc(more)}. A rank held up by a late peer arrives late itself, "
            f"so a slow rank's neighbours follow it in this list.</p>")


# ---------------------------------------------------------------------- stragglers


def mesh_of(recs: dict, traced: Mesh | None, world: int) -> Mesh:
    """The newest layout record's mesh, else the trace headers', else rows of GRID_ROW ranks."""
    layouts = recs.get("layout", [])
    if layouts and layouts[-1].get("coords"):
        lay = layouts[-1]
        hosts = dict(enumerate(lay.get("hosts") or []))
        return Mesh({r: tuple(c) for r, c in enumerate(lay["coords"])}, hosts)
    if traced is not None:
        return traced
    return Mesh({r: (0, r // GRID_ROW, r % GRID_ROW) for r in range(world)}, {}, named=False)


def latest_windows(ranks_recs: list[dict]) -> tuple[list[int] | None, dict[str, dict]]:
    """The newest window and, per op, its "ranks" record."""
    if not ranks_recs:
        return None, {}
    last = max(ranks_recs, key=lambda r: (r.get("window") or [0, r["step"]])[1])
    window = last.get("window") or [last["step"], last["step"]]
    ops = {r["op"]: r for r in ranks_recs if (r.get("window") or [r["step"], r["step"]]) == window}
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    return window, dict(sorted(ops.items(), key=lambda kv: order.get(kv[0], 9)))


def heatmap_grid(rec: dict, mesh: Mesh):
    """z, text, hover and axis labels of one op on the mesh: a row per (dp, pp), a column per tp rank."""
    rel, secs = rec.get("relative") or [], rec.get("seconds") or []
    coords, hosts = mesh.coords, mesh.hosts
    ranks = range(len(rel))
    rows = sorted({coords.get(r, (0, 0, r))[:2] for r in ranks})
    cols = sorted({coords.get(r, (0, 0, r))[2] for r in ranks})
    z = [[None] * len(cols) for _ in rows]
    text = [[""] * len(cols) for _ in rows]
    hover = [[""] * len(cols) for _ in rows]
    for r in ranks:
        dp, pp, tp = coords.get(r, (0, 0, r))
        i, j = rows.index((dp, pp)), cols.index(tp)
        z[i][j] = rel[r]
        text[i][j] = f"r{r}<br>{rel[r]:.2f}×"
        s = f", {secs[r]:.3f} s" if r < len(secs) else ""
        where = f"dp {dp} pp {pp} tp {tp}" if mesh.named else "coordinates unknown"
        hover[i][j] = f"rank {r} on {hosts.get(r, '?')}<br>{where}<br>{rel[r]:.3f}× median{s}"
    if mesh.named:
        ylab, xlab = [f"dp {d} · pp {p}" for d, p in rows], [f"tp {t}" for t in cols]
    else:
        ylab = [f"ranks {GRID_ROW * p}–{GRID_ROW * (p + 1) - 1}" for _, p in rows]
        xlab = [f"+{t}" for t in cols]
    return z, text, hover, ylab, xlab


def heatmap_figure(window: list[int], ops: dict[str, dict], mesh: Mesh):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(ops), subplot_titles=list(ops), horizontal_spacing=0.08)
    spread = max((abs(v - 1) for rec in ops.values() for v in rec.get("relative") or []), default=0)
    spread = max(spread, 0.05)  # a flat run still gets a readable (not saturated) scale
    n_rows = 0
    for j, rec in enumerate(ops.values(), start=1):
        z, text, hover, ylab, xlab = heatmap_grid(rec, mesh)
        n_rows = max(n_rows, len(ylab))
        cells = len(ylab) * len(xlab)
        fig.add_trace(go.Heatmap(z=z, x=xlab, y=ylab, text=text, customdata=hover, coloraxis="coloraxis",
                                 texttemplate="%{text}" if cells <= 256 else None, xgap=2, ygap=2,
                                 hovertemplate="%{customdata}<extra></extra>"), row=1, col=j)
        fig.update_yaxes(autorange="reversed", row=1, col=j, showticklabels=j == 1)
    fig.update_layout(
        title=f"Time relative to the ranks doing the same work (same pp stage), "
              f"steps {window[0]}–{window[1]}",
        coloraxis=dict(colorscale="RdBu_r", cmin=1 - spread, cmax=1 + spread,
                       colorbar=dict(title="× median")))
    return fig, min(220 + 36 * n_rows, 1100)


def section_stragglers(page: Page, recs: dict, traced: Mesh | None) -> str:
    window, ops = latest_windows(recs.get("ranks", []))
    flagged = recs.get("straggler", [])
    if window is None and not flagged:
        return absent("No per-rank timing records (\"ranks\", \"straggler\") in metrics.jsonl.")
    parts = []
    if window is not None:
        n = max(len(r.get("relative") or []) for r in ops.values())
        fig, height = heatmap_figure(window, ops, mesh_of(recs, traced, n))
        parts.append(page.figure(fig, height, legend=False))
    else:
        parts.append(absent("No per-rank timing windows (\"ranks\" records) for the heat map."))
    parts.append(straggler_table(flagged))
    return "".join(parts)


def straggler_table(flagged: list[dict]) -> str:
    if not flagged:
        return "<p>No rank was flagged as a straggler.</p>"
    rows = [[r.get("step"), r.get("rank"), r.get("host", "?"),
             f"dp {r.get('dp')} pp {r.get('pp')} tp {r.get('tp')}", r.get("op"),
             f"{100 * float(r.get('slower_by', 0)):.1f}%", f"{float(r.get('seconds', 0)):.4f}",
             f"{float(r.get('median_s', 0)):.4f}", r.get("windows", "")]
            for r in reversed(flagged[-MAX_TABLE_ROWS:])]
    more = f" (the newest {MAX_TABLE_ROWS} of {len(flagged)})" if len(flagged) > MAX_TABLE_ROWS else ""
    return (f'<h3>Flagged stragglers{esc(more)}, newest first</h3>'
            + table(["step", "rank", "host", "coords", "op", "slower by", "seconds", "median s", "windows"],
                    rows))


# ---------------------------------------------------------------------- checkpoints and timeline


def section_checkpoints(page: Page, recs: dict) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    stalls, persists = recs.get("checkpoint", []), recs.get("persist", [])
    if not stalls and not persists:
        return absent("No checkpoint was saved in this run (no checkpoint or persist records).")
    panels = [p for p, have in (("stall", stalls), ("persist", persists)) if have]
    titles = {"stall": "Training blocked per checkpoint (s)", "persist": "Persist to storage, background (s)"}
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[titles[p] for p in panels])
    col = 1
    if stalls:
        fig.add_trace(go.Bar(x=[r["step"] for r in stalls], y=[r.get("blocked_s", 0) for r in stalls],
                             name="blocked (training thread)", marker_color="#eeca3b"), row=1, col=col)
        col += 1
    if persists:
        ok = [bool(r.get("ok", True)) for r in persists]
        fig.add_trace(go.Bar(x=[r["step"] for r in persists], y=[r.get("persist_s", 0) for r in persists],
                             name="persist", marker_color=["#4c78a8" if o else "#e45756" for o in ok],
                             customdata=[r.get("error") or "ok" for r in persists],
                             hovertemplate="step %{x}: %{y:.3f} s, %{customdata}<extra></extra>"),
                      row=1, col=col)
    fig.update_xaxes(title_text="checkpoint step", type="category")
    fig.update_yaxes(title_text="seconds")
    fig.update_layout(showlegend=False)
    return checkpoint_note(stalls, persists) + page.figure(fig, 360, legend=False)


def checkpoint_note(stalls: list[dict], persists: list[dict]) -> str:
    bits = []
    if stalls:
        b = [float(r.get("blocked_s", 0)) for r in stalls]
        bits.append(f"{len(b)} checkpoint(s) blocked training for {sum(b):.3f} s in all "
                    f"(at most {max(b):.3f} s)")
    if persists:
        failed = sum(not r.get("ok", True) for r in persists)
        bits.append(f"{len(persists)} persist(s) to storage" + (f", {failed} failed (red)" if failed else ""))
    return f"<p>{esc('; '.join(bits))}.</p>"


def section_faults(run_dir: Path, metrics: dict[str, list[dict]]) -> str:
    """The launch agents' event logs: what went wrong, when, on which host, how long until the workers ran
    again, and the job's ETTR, with where the rest of its time went (ettr.py)."""
    from megascale.fault.events import read_events

    events = read_events(run_dir)
    if not events:
        return absent("No event log in events/: the run was not started with `megascale launch` (whose "
                      "agents write one per host).")
    t0 = events[0]["t"]
    count = defaultdict(int)
    for e in events:
        count[e["kind"]] += 1
    faults = [e for e in events if e["kind"] in FAULTS]
    back = restart_seconds(events)
    bits = [f"{count['start']} agent start(s) on {len({e.get('host') for e in events})} host(s)",
            f"{len(faults)} fault(s)" + (" (" + ", ".join(f"{count[k]} {k}" for k in FAULTS if count[k]) + ")"
                                         if faults else ""),
            f"{count['restart']} restart(s)"]
    if count["evicted"]:
        bits.append(f"{count['evicted']} host(s) evicted")
    if back:
        bits.append(f"from a fault seen to the workers started again: median {statistics.median(back):.1f} "
                    f"s, longest {max(back):.1f} s, {sum(back):.1f} s in all")
    ettr = ettr_text(events, metrics.get("train", []))
    if ettr:
        bits.append(ettr)
        rest = lost_text(lost_time(events, metrics))
        if rest:
            bits.append(rest)
    shown = events[-MAX_TABLE_ROWS:]
    more = (f" The newest {MAX_TABLE_ROWS} of {len(events)} events are shown; all are in "
            f"{run_dir / 'events'}." if len(events) > MAX_TABLE_ROWS else "")
    rows = [[datetime.datetime.fromtimestamp(e["t"], datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
             f"+{e['t'] - t0:.1f}", e.get("host", "?"), e["kind"], event_text(e)] for e in shown]
    return (f"<p>{esc('; '.join(bits))}.{esc(more)}</p>"
            + table(["time (UTC)", "s since the first start", "host", "event", "what"], rows))


def restart_seconds(events: list[dict]) -> list[float]:
    """Per fault a host's agent saw, the seconds until its workers were started again (its next restart)."""
    out, seen = [], {}
    for e in events:
        host = e.get("host")
        if e["kind"] in FAULTS and host not in seen:
            seen[host] = e["t"]
        elif e["kind"] == "restart" and host in seen:
            out.append(e["t"] - seen.pop(host))
        elif e["kind"] in ("start", "end"):
            seen.pop(host, None)  # a new agent (or none): what the old one saw got no restart
    return out


def event_text(e: dict) -> str:
    if e["kind"] == "restart":
        phases = e.get("phases") or {}
        return ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if isinstance(v, (int, float)))
    if e["kind"] == "start":
        return f"job {e.get('run_id', '?')}, hosts {e.get('nnodes', '?')}, {e.get('nproc_per_node', '?')} " \
               f"workers, agent pid {e.get('pid', '?')}"
    if e["kind"] == "end":
        code = e.get("code", "?")
        why = {0: " (done)", 2: " (a user error)", 4: " (this host evicted)"}.get(code, "")
        if isinstance(code, int) and code > 128:  # the agent was stopped: 143 is a scheduler's SIGTERM
            try:
                why = f" ({signal.Signals(code - 128).name})"
            except ValueError:
                pass
        return f"exit {code}{why} after {e.get('seconds', 0):.0f} s"
    then = ""
    if isinstance(e.get("max_restarts"), int):
        then = (f"; restart {e['restart']} of {e['max_restarts']}" if isinstance(e.get("restart"), int)
                else f"; no restarts left (fault.max_restarts={e['max_restarts']}): the job fails")
    return f"{e.get('detail', '')}{then}"


def section_timeline(run_dir: Path, out: Path, have_trace: bool) -> str:
    files = sorted(run_dir.glob("timeline*.json"), key=lambda p: (p.name != "timeline.json", p.name))
    if not files:
        if have_trace:
            return absent(f"No timeline yet: `megascale timeline {run_dir}` writes "
                          f"{run_dir / 'timeline.json'}.")
        return absent("No trace files, so no timeline (observe.timers was off).")
    links = "".join(f'<li><a href="{esc(os.path.relpath(f, out.parent))}">{esc(f.name)}</a> '
                    f"({f.stat().st_size / 1e6:.1f} MB)</li>" for f in files)
    return (f"<ul>{links}</ul><p>Every rank's spans, one track per stream. Open "
            '<a href="https://ui.perfetto.dev">ui.perfetto.dev</a> and drop the file on it (or "Open trace '
            'file"); the trace is read in the browser and not uploaded. chrome://tracing reads it too.</p>')


# ---------------------------------------------------------------------- the page

CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0; color: #222;
       background: #fafafa; }
header { background: #263238; color: #fff; padding: 14px 28px; }
header h1 { margin: 0; font-size: 22px; } header p { margin: 4px 0 0; color: #b0bec5; }
nav { padding: 8px 28px; background: #eceff1; position: sticky; top: 0; z-index: 10; font-size: 14px; }
nav a { margin-right: 16px; color: #37474f; text-decoration: none; }
main { max-width: 1320px; margin: 0 auto; padding: 0 28px 40px; }
section { background: #fff; border: 1px solid #e0e0e0; border-radius: 6px; margin: 18px 0;
          padding: 6px 20px 14px; }
h2 { font-size: 18px; border-bottom: 1px solid #eee; padding-bottom: 6px; } h3 { font-size: 15px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #e0e0e0; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } .absent { color: #8d6e63; font-style: italic; }
.caption { color: #666; font-size: 13px; }
"""

TITLES = {
    "summary": "Run", "loss": "Loss and validation", "throughput": "Throughput and MFU",
    "startup": "Start-up", "breakdown": "Step-time breakdown", "stragglers": "Stragglers",
    "checkpoints": "Checkpoint stalls", "faults": "Faults and restarts", "timeline": "Timeline",
}  # fmt: skip


def render(run_dir: Path, out: Path, steps: tuple[int, int] | None = None) -> str:
    """The whole page as a string (its trace sections from `steps` only, when given)."""
    recs = read_records(run_dir / "metrics.jsonl")
    bd, why, traced = read_trace(run_dir, steps)
    page = Page()
    bodies = {
        "summary": section_summary(run_dir, recs, read_config(run_dir)),
        "loss": section_loss(page, recs),
        "throughput": section_throughput(page, recs),
        "startup": section_startup(page, recs),
        "breakdown": section_breakdown(page, recs, bd, why, steps),
        "stragglers": section_stragglers(page, recs, traced),
        "checkpoints": section_checkpoints(page, recs),
        "faults": section_faults(run_dir, recs),
        "timeline": section_timeline(run_dir, out, (run_dir / "trace").is_dir()),
    }
    nav = "".join(f'<a href="#{s}">{TITLES[s]}</a>' for s in SECTIONS)
    sections = "".join(f'<section id="{s}"><h2>{TITLES[s]}</h2>{bodies[s]}</section>' for s in SECTIONS)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>megascale report: {esc(run_dir.name)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>megascale report: {esc(run_dir.name)}</h1><p>{esc(run_dir.resolve())}</p></header>"
            f'<nav>{nav}</nav><main>{sections}</main><!-- figures: {page.figures} --></body></html>\n')


def write_report(run_dir: str | Path, out: str | Path | None = None, steps: str | None = None) -> Path:
    """Write the report of `run_dir` (default RUN_DIR/report.html, atomically) and return its path.
    `steps`: the traces' steps it reads, "A:B" or "all" (default: the newest REPORT_STEPS)."""
    from megascale.observe.trace import step_window

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl here; give a run directory (train.run_dir of a run)")
    try:
        window = step_window(run_dir, steps, REPORT_STEPS)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = Path(out) if out else run_dir / "report.html"
    text = render(run_dir, out, window)
    write_command_output(out, text, "the report")  # a browser refreshing it never sees half a page
    return out


# ---------------------------------------------------------------------- command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="one self-contained HTML report of a run (RUN_DIR/report.html)")
    add_arguments(p)
    p.set_defaults(func=handler)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    p.add_argument("-o", "--out", metavar="FILE", help="where to write it (default: RUN_DIR/report.html)")
    p.add_argument("--steps", help=f"the traces' steps A:B (inclusive, 0-based optimizer steps) or all "
                   f"(default: the newest {REPORT_STEPS}; a long run's traces are GBs)")


def handler(args: argparse.Namespace) -> int:
    path = write_report(args.run_dir, args.out, args.steps)
    print(f"report: {path}")
    return 0
