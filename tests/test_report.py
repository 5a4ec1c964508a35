"""`megascale report`: the step-time breakdown on events with known answers, the HTML report of a
synthetic run (every section, self-contained, absent data said in one line), and the page opened
in headless Chromium: every chart drawn, and a screenshot.

The Chromium test fails (does not skip) when no browser is installed: `make test` installs
Debian's chromium. Deselect it explicitly with `-k "not browser"`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from megascale.errors import UserError
from megascale.observe import ettr, report
from megascale.observe.breakdown import (
    CATEGORIES,
    LATE_KEYS,
    max_over_ranks,
    median_step,
    one_step,
    overlap,
    rank_breakdown,
    step_breakdown,
    union,
)
from megascale.observe.timeline import write_timeline
from megascale.observe.timers import FIELDS
from megascale.observe.trace import Event, RankTrace, read_run

MS = 1_000_000  # ns
BROWSERS = ("chromium", "chromium-headless-shell", "chrome", "google-chrome")


def ev(op, stream, t0_ms, dur_ms, step=0, blocked_ms=0.0, peer=-1):
    return Event(op, stream, int(t0_ms * MS), int(dur_ms * MS), step, -1, -1, None, -1, peer,
                 int(blocked_ms * MS), 0, -1)


# ---------------------------------------------------------------------- breakdown: known answers


def test_interval_helpers():
    assert union([(5, 9), (0, 2), (1, 3), (9, 10), (4, 4)]) == [(0, 3), (5, 10)]
    assert overlap([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert overlap([(0, 10)], [(10, 20)]) == 0


def one_rank_step(step: int = 0, base: float = 0.0, fwd: float = 20.0) -> list[Event]:
    """One step of a pipeline-parallel rank with every category, times in ms from `base`:

    data 0-2 | forward 2-(2+fwd) with a tp all-reduce 10-13 nested | recv waits 8 (bubble) |
    send (async, 0.5 of it waited) | backward with a nested tp wait of 2 | dp reduce-scatter
    issued inside backward, its 5 ms wait after it | optimizer 10 with clip nested | checkpoint
    blocked 5 | a 3 ms untimed gap | a background persist that must not stretch the step.
    """
    b, f = base, 2 + fwd
    return [
        ev("next_batch", "data", b + 0, 2, step),
        ev("forward", "compute", b + 2, fwd, step),
        ev("all_reduce", "tp", b + 10, 3, step, blocked_ms=3),
        ev("recv", "pp", b + f, 8, step, blocked_ms=8, peer=1),
        ev("send", "pp", b + f + 8, 1, step, blocked_ms=0.5, peer=1),
        ev("backward", "compute", b + f + 9, 30, step),
        ev("all_reduce", "tp", b + f + 19, 2, step, blocked_ms=2),
        ev("reduce_scatter", "dp", b + f + 29, 15, step, blocked_ms=5),  # wait: the 5 ms after backward
        ev("optimizer", "compute", b + f + 44, 10, step),
        ev("clip", "compute", b + f + 45, 2, step),  # nested in optimizer: counted once
        ev("blocked", "checkpoint", b + f + 54, 5, step),
        ev("persist", "checkpoint", b + f + 62, 500, step),
        ev("optimizer", "compute", b + f + 62, 0, step),  # the step's last span, after a 3 ms gap
    ]


def test_one_step_categories_add_up_to_the_wall_time():
    row = one_step(one_rank_step())
    ms = {k: round(v * 1e3, 6) for k, v in row.items()}
    # forward 20 - 3 (tp) + backward 30 - 2 (tp) + optimizer 10 (clip inside it)
    assert ms["compute"] == 55
    assert ms["exposed_tp"] == 5
    assert ms["exposed_dp"] == 5
    assert ms["exposed_pp"] == 0.5
    assert ms["bubble"] == 8
    assert ms["data"] == 2
    assert ms["checkpoint"] == 5
    assert ms["wall"] == 84  # 0 .. 22+62: the persist (background) is left out
    assert ms["other"] == pytest.approx(84 - 55 - 5 - 5 - 0.5 - 8 - 2 - 5)
    assert sum(row[c] for c in CATEGORIES) == pytest.approx(row["wall"])


def test_comm_wait_inside_compute_is_not_counted_twice():
    # An async dp all-gather waited for inside the optimizer span: the wait is exposed dp, not compute.
    row = one_step([ev("optimizer", "compute", 0, 10), ev("all_gather", "dp", 1, 8, blocked_ms=4)])
    assert row["compute"] * 1e3 == pytest.approx(6)
    assert row["exposed_dp"] * 1e3 == pytest.approx(4)
    assert row["other"] == pytest.approx(0)


def test_an_async_op_issued_in_the_step_before_does_not_stretch_the_wall():
    # a parameter all-gather issued 40 ms before this step began (after the last update), 3 ms of it
    # waited for inside this step's forward: the step runs 0 .. 20, as without it
    row = one_step([ev("all_gather", "dp", -40, 45, blocked_ms=3), ev("forward", "compute", 0, 20)])
    assert row["wall"] * 1e3 == pytest.approx(20)
    assert row["exposed_dp"] * 1e3 == pytest.approx(3)
    assert row["compute"] * 1e3 == pytest.approx(17)


def test_steps_median_max_and_slowest():
    fast = [e for s in range(4) for e in one_rank_step(s, base=100 * s)]
    slow = [e for s in range(4) for e in one_rank_step(s, base=100 * s, fwd=20 + (50 if s == 0 else 6))]
    per = rank_breakdown(fast)
    assert sorted(per) == [0, 1, 2, 3]
    ranks = {r: RankTrace(r, {"rank": r}, events) for r, events in ((0, fast), (1, slow))}
    bd = step_breakdown(ranks)
    assert bd["slowest"] == 1 and bd["rank0_id"] == 0
    assert bd["median"]["slowest"]["compute"] * 1e3 == pytest.approx(61)  # the slow first step is left out
    assert bd["median"]["rank0"]["compute"] * 1e3 == pytest.approx(55)
    assert bd["max"][0]["compute"] * 1e3 == pytest.approx(105)
    assert max_over_ranks(bd["ranks"])[2]["wall"] == bd["ranks"][1][2]["wall"]
    assert median_step({}) == {**dict.fromkeys((*CATEGORIES, *LATE_KEYS), 0.0), "wall": 0.0}


# ---------------------------------------------------------------------- a synthetic run on disk

DP, PP, TP = 2, 2, 2
WORLD = DP * PP * TP
SLOW_RANK = 6  # dp 1, pp 1 (a stage that waits for activations), tp 0
STEPS = 60


def coords_of(rank: int) -> tuple[int, int, int]:
    """(dp, pp, tp): tp fastest, then pp, then dp."""
    return rank // (PP * TP), (rank // TP) % PP, rank % TP


def write_trace(run_dir: Path, steps: int = 6) -> None:
    """Trace files in the timers' format: header, clock line, event arrays (offset rank clocks)."""
    tdir = run_dir / "trace"
    tdir.mkdir(parents=True)
    for r in range(WORLD):
        dp, pp, tp = coords_of(r)
        offset = 7 * MS * r  # a rank's clock off rank 0's: read_run moves it back
        header = {"type": "header", "version": 1, "rank": r, "world": WORLD,
                  "coords": {"dp": dp, "pp": pp, "tp": tp}, "mesh": {"dp": DP, "pp": PP, "tp": TP},
                  "host": f"node{r // 4}", "fields": list(FIELDS), "clock": "monotonic_ns", "device": "cpu"}
        lines = [json.dumps(header), json.dumps({"type": "clock", "mono_ns": 0, "offset_ns": offset,
                                                 "err_ns": 20_000})]
        for s in range(steps):
            fwd = 20 + (8 if r == SLOW_RANK else 0) + (30 if s == 0 else 0)
            for e in one_rank_step(s, base=1000 + 120 * s, fwd=fwd):
                if pp == 0 and e.op == "recv":
                    continue  # the first stage waits for no activations
                row = list(e)
                row[2] -= offset
                lines.append(json.dumps(row))
        lines.append('["forward","compute",12')  # a line cut short by a crash
        (tdir / f"rank_{r:05d}.jsonl").write_text("\n".join(lines) + "\n")


def metrics_records(steps: int = STEPS) -> list[dict]:
    """Every kind of metrics.jsonl record, shaped as the trainer writes them."""
    recs: list[dict] = [
        {"kind": "startup", "step": 0, "imports": 1.8, "rendezvous": 0.6, "groups": 0.9,
         "first_collective": 0.35, "model_init": 2.4, "restore": 0.7, "data": 1.1, "time": T0 + 8},
        {"kind": "peak", "step": 0, "peak_flops": 3.12e14, "source": "probe", "detail": "bf16 GEMM 8192^3",
         "flops_per_token": 1.15e9, "flops_per_token_published": 1.18e9},
        {"kind": "layout", "step": 0, "dp": DP, "pp": PP, "tp": TP, "world": WORLD,
         "hosts": [f"node{r // 4}" for r in range(WORLD)],
         "coords": [list(coords_of(r)) for r in range(WORLD)]},
    ]
    for s in range(1, steps + 1):
        loss = 4.2 * math.exp(-s / 25) + 1.6 + 0.05 * math.sin(s)
        tps = 11000 + 600 * math.sin(s / 3) - (4000 if s == 1 else 0)
        mfu = 0.34 * tps / 11000
        recs.append({"kind": "train", "step": s, "loss": loss, "lr": 1e-3, "grad_norm": 0.8,
                     "step_time": 0.37, "tokens_per_s": tps, "mfu": mfu, "mfu_published": mfu * 1.18 / 1.15,
                     "tokens": 4096 * s, "bubble": 0.11, "time": T0 + 5 + 6 * s})
        if s % 20 == 0:
            recs.append({"kind": "val", "step": s, "loss": loss + 0.1, "ppl": math.exp(loss + 0.1)})
            recs += ranks_records(s - 19, s)
            recs.append({"kind": "straggler", "step": s, "rank": SLOW_RANK, "host": "node1",
                         **dict(zip(("dp", "pp", "tp"), coords_of(SLOW_RANK), strict=True)), "op": "forward",
                         "slower_by": 0.4, "seconds": 0.56, "median_s": 0.40, "windows": s // 20})
            if s < steps:
                recs.append({"kind": "checkpoint", "step": s, "blocked_s": 0.05 + 0.01 * s / 20})
        if s % 20 == 0:
            recs.append({"kind": "persist", "step": s, "ok": s != 40, "persist_s": 1.2 + s / 100,
                         "bytes": 123_000_000, "error": None if s != 40 else "disk full"})
    return recs


def ranks_records(first: int, last: int) -> list[dict]:
    out = []
    for op, base in (("forward", 0.4), ("backward", 0.8), ("optimizer", 0.1)):
        secs = [base * (1.4 if r == SLOW_RANK and op == "forward" else 1 + 0.01 * (r % 3))
                for r in range(WORLD)]
        med = sorted(secs)[WORLD // 2]
        out.append({"kind": "ranks", "step": last, "window": [first, last], "op": op, "seconds": secs,
                    "relative": [x / med for x in secs]})
    return out


CONFIG_TOML = """[model]
vocab_size = 50304
seq_len = 1024
n_layers = 12
d_model = 768
n_heads = 12
style = "gpt"

[parallel]
tp = 2
pp = 2
dp = 2
vpp = 1
schedule = "1f1b"

[train]
steps = 60
global_batch = 32
micro_batch = 4
dtype = "bf16"
"""


T0 = 1_765_000_000.0  # the launch agents' events: host node1 sees a crash, both restart, a hang on node0


def agent_events() -> dict[str, list[dict]]:
    def ev(t, host, kind, **kw):
        return {"t": T0 + t, "host": host, "kind": kind, **kw}

    phases = {"stopped": 0.2, "rendezvous": 1.1, "workers started": 0.4}
    return {
        "node0": [ev(0, "node0", "start", run_id="j", nnodes="2", nproc_per_node=4, pid=11),
                  ev(63.5, "node0", "membership", detail="a host waits to join"),
                  ev(65, "node0", "restart", phases=phases),
                  ev(200, "node0", "hang", detail="rank 2 (pid 9) beats but has made no new step",
                     restart=2, max_restarts=3),
                  ev(209, "node0", "restart", phases=phases), ev(400, "node0", "end", code=0, seconds=400)],
        "node1": [ev(0.4, "node1", "start", run_id="j", nnodes="2", nproc_per_node=4, pid=12),
                  ev(60, "node1", "crash", detail="worker exit codes {5: -9}", restart=1,
                     max_restarts=3),
                  ev(64, "node1", "restart", phases=phases),
                  ev(400.2, "node1", "end", code=0, seconds=399.8)],
    }


def make_run(run_dir: Path, trace: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_records()))
    (run_dir / "events").mkdir()
    for host, events in agent_events().items():
        (run_dir / "events" / f"{host}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events)
                                                          + '{"t": 1765000401, "ho')  # a cut last line
    (run_dir / "config.toml").write_text(CONFIG_TOML)
    if trace:
        write_trace(run_dir)
        write_timeline(run_dir)
    return run_dir


# ---------------------------------------------------------------------- the report


def test_breakdown_of_trace_files_read_back(tmp_path):
    run = make_run(tmp_path / "run")
    bd = step_breakdown(read_run(run))
    assert bd["slowest"] == SLOW_RANK and bd["steps"] == list(range(6))
    r0, slow = bd["median"]["rank0"], bd["median"]["slowest"]
    assert r0["bubble"] == 0 and slow["bubble"] * 1e3 == pytest.approx(8)  # rank 0 is on the first stage
    assert slow["compute"] * 1e3 == pytest.approx(63)
    assert r0["compute"] * 1e3 == pytest.approx(55)


def static_figures(text: str) -> int:
    return text.count('class="plotly-graph-div"')


def test_report_has_every_section_and_is_self_contained(tmp_path):
    run = make_run(tmp_path / "run")
    out = report.write_report(run)
    assert out == run / "report.html" and not list(run.glob("*.tmp"))
    text = out.read_text()
    for s in report.SECTIONS:
        assert f'<section id="{s}">' in text
    # loss, throughput, start-up, two breakdown charts, heat map, checkpoints
    assert static_figures(text) == 7
    assert 'class="absent"' not in text  # the synthetic run has every kind of data
    for needle in ("312 TFLOP/s", "measured by a GEMM probe", "tp 2 × pp 2 × dp 2 = 8 ranks",
                   "124 M parameters", "published convention", "exact model FLOPs",
                   f"rank {SLOW_RANK} (slowest", "disk full", 'href="timeline.json"', "ui.perfetto.dev",
                   "node1", "Flagged stragglers",
                   # the agents' events: 3 faults, each followed by its host's restart (4, 1.5 and 9 s later)
                   "2 agent start(s) on 2 host(s); 3 fault(s) (1 crash, 1 hang, 1 membership); 3 restart(s); "
                   "from a fault seen to the workers started again: median 4.0 s, longest 9.0 s, 14.5 s in "
                   "all",
                   "worker exit codes {5: -9}; restart 1 of 3", "stopped 0.20 s, rendezvous 1.10 s",
                   "exit 0 (done) after 400 s", "+209.0",
                   "The phases of the latest start add up to 7.85 s.",  # not its wall clock (time)
                   # 60 steps of 0.37 s in the 400.2 s from node0's start to node1's end
                   "ETTR 5.5% (22 s of training steps in 400 s from the first agent&#x27;s start to the last "
                   "one&#x27;s end)"):
        assert needle in text, needle
    # Nothing to fetch: no external script or stylesheet, and plotly.js is inlined exactly once.
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I)
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?https?:", text, re.I)
    assert text.count("window.PlotlyConfig") == 1
    assert len(text) > 3_000_000  # the bundle itself


def test_absent_data_is_said_in_one_line(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    train = [r for r in metrics_records(5) if r["kind"] == "train"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train) + '{"kind": "tr')
    out = report.write_report(run, tmp_path / "elsewhere.html")
    text = out.read_text()
    assert out == tmp_path / "elsewhere.html"
    for s in report.SECTIONS:
        assert f'<section id="{s}">' in text
    for needle in ("No validation records", "No start-up record", "No trace files", "No per-rank timing",
                   "No checkpoint was saved", "no config.toml", "no peak record", "No event log in events/"):
        assert needle in text, needle
    assert static_figures(text) == 2  # loss and throughput
    assert "window.PlotlyConfig" in text  # the first figure still carries plotly.js


def test_ettr_of_a_job_that_has_not_ended_runs_to_its_newest_step():
    events = [{"t": 100.0, "kind": "start"}, {"t": 150.0, "kind": "crash"}, {"t": 160.0, "kind": "restart"}]
    train = [{"step": s, "step_time": 2.0, "time": 100.0 + 4 * s} for s in range(1, 26)]  # to t = 200
    assert ettr.ettr_text(events, train) == ("ETTR 50.0% (50 s of training steps in 100 s from the first "
                                               "agent's start to the newest step)")
    # steps from before the launch (a run begun by `megascale train`) are not the job's
    early = [{"step": 0, "step_time": 40.0, "time": 10.0}]
    assert ettr.ettr_text(events, early + train) == ettr.ettr_text(events, train)
    assert ettr.ettr_text(events, [{"step": 1, "step_time": 2.0}]) == ""  # records without `time`


def test_ettr_leaves_out_the_wait_between_launches_and_keeps_a_killed_agents_steps():
    """A job requeued by its scheduler: its first launch ran 100 s and was killed with its machine (no `end`
    line: its last step is its last sign of life), then 1000 s in a queue, then a second launch of 100 s.
    The queue is not the job's to lose; the first launch's 100 s are."""
    first = [{"t": 0.0, "host": "a", "kind": "start"}]
    second = [{"t": 1100.0, "host": "a", "kind": "start"},
              {"t": 1200.0, "host": "a", "kind": "end", "code": 0}]
    train = [{"step": s, "step_time": 2.0, "time": 4.0 * s} for s in range(1, 26)]  # to t = 100
    train += [{"step": 25 + s, "step_time": 2.0, "time": 1100.0 + 4 * s} for s in range(1, 26)]
    times = sorted(r["time"] for r in train)
    assert ettr.agent_spans(first + second, times) == [(0.0, 100.0), (1100.0, 1200.0)]
    assert ettr.ettr_text(first + second, train) == (
        "ETTR 50.0% (100 s of training steps in 200 s from the first agent's start to the last one's end, "
        "less 1000 s between launches with no agent running)")
    # two hosts' agents overlap: their time counts once; one host's restarted agent does not split it
    two = [{"t": 0.0, "host": "a", "kind": "start"}, {"t": 1.0, "host": "b", "kind": "start"},
           {"t": 60.0, "host": "b", "kind": "end", "code": 4}, {"t": 70.0, "host": "b", "kind": "start"},
           {"t": 100.0, "host": "a", "kind": "end", "code": 0},
           {"t": 100.0, "host": "b", "kind": "end", "code": 0}]
    assert ettr.agent_spans(two, [50.0]) == [(0.0, 100.0)]
    assert ettr.ettr_text(two, train[:25]) == ("ETTR 50.0% (50 s of training steps in 100 s from the first "
                                                 "agent's start to the last one's end)")


def test_the_time_that_was_no_step_is_cut_by_cause_and_adds_up():
    """A job of two hosts, 40 s: 10 s to its first step; an evaluation after step 4 (2 s) and step 7 (1 s);
    checkpoint saves after steps 5 (0.5 s) and 7 (1 s, after that evaluation); host b's workers crash
    after t = 23 (its agent's tick before saw them run) and it sees that at t = 25: the job lost step 6's
    successors and restarts from it, its next step begins at t = 30; 0.2 s between steps 8 and 9; the
    agents end 4.8 s after the last step."""
    events = [{"t": 0.0, "host": "a", "kind": "start"}, {"t": 0.5, "host": "b", "kind": "start"},
              {"t": 25.0, "host": "b", "kind": "crash", "since": 23.0},
              {"t": 26.0, "host": "b", "kind": "restart"},
              {"t": 26.0, "host": "a", "kind": "restart"},
              {"t": 40.0, "host": "a", "kind": "end", "code": 0},
              {"t": 40.0, "host": "b", "kind": "end", "code": 0}]
    starts = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 16.0, 6: 17.5, 7: 30.0, 8: 33.0, 9: 34.2}
    train = [{"step": s, "step_time": 1.0, "time": t + 1.0} for s, t in starts.items()]
    val = [{"step": 4, "seconds": 2.0}, {"step": 7, "seconds": 1.0}]
    saves = [{"step": 5, "blocked_s": 0.5}, {"step": 7, "blocked_s": 1.0}]
    lost = ettr.lost_time(events, {"train": train, "val": val, "checkpoint": saves})
    # from step 6's end (t = 18.5): its successors trained until the crash (lost), then 2 s to see it
    want = {"start-up": 10.0, "lost steps": 4.5, "detection": 2.0, "recovery": 5.0, "evaluation": 3.0,
            "checkpoints": 1.5, "between steps": 0.2, "the end": 4.8}
    assert lost == pytest.approx(want)
    assert sum(lost.values()) == pytest.approx(40.0 - 9.0)  # the wall less the 9 steps: nothing twice
    assert ettr.lost_text(lost) == ("the rest: 10.0 s start-up, 4.5 s lost steps, 2.0 s detection, 5.0 s "
                                    "recovery, 3.0 s evaluation, 1.5 s checkpoints, 4.8 s the end")  # not 0.2
    # a fault that began before the newest step kept (a rank silent since t = 10) was all detection; one
    # whose start the agent does not know (an older agent's event), all lost steps
    for since, split in ((10.0, (0.0, 6.5)), (None, (6.5, 0.0))):
        other = [*events[:2], {**events[2], "since": since}, *events[3:]]
        lost = ettr.lost_time(other, {"train": train, "val": val, "checkpoint": saves})
        assert (lost["lost steps"], lost["detection"]) == pytest.approx(split)
    # a validation record of an older run (no seconds) before a save: the gap is the save's
    lost = ettr.lost_time(events, {"train": train, "val": [{"step": 7}], "checkpoint": saves})
    assert lost["evaluation"] == 0 and lost["checkpoints"] == pytest.approx(0.5 + 2.0)
    # a requeued job: the second launch's start-up counts, the queue between them does not
    later = [{"t": 100.0, "host": "a", "kind": "start"}, {"t": 110.0, "host": "a", "kind": "end", "code": 0}]
    more = [{"step": 10, "step_time": 1.0, "time": 105.0}]
    lost = ettr.lost_time(events + later, {"train": train + more, "val": val, "checkpoint": saves})
    assert lost["start-up"] == pytest.approx(10.0 + 4.0) and lost["the end"] == pytest.approx(4.8 + 5.0)
    # a fault before the first step that counts: the first attempt began training at t = 3 (its layout
    # record), its steps were truncated by the resume, a rank died at t = 4
    early = [*events[:2], {"t": 4.0, "host": "a", "kind": "crash", "since": 3.5}, *events[2:]]
    lost = ettr.lost_time(early, {"train": train, "layout": [{"step": 0, "time": 3.0}], "val": val,
                                  "checkpoint": saves})
    assert (lost["start-up"], lost["lost steps"], lost["detection"], lost["recovery"]) == pytest.approx(
        (3.0, 0.5 + 4.5, 0.5 + 2.0, 6.0 + 5.0))
    lost = ettr.lost_time(early, {"train": train, "val": val, "checkpoint": saves})  # never began: start-up
    assert (lost["start-up"], lost["recovery"]) == pytest.approx((4.0, 6.0 + 5.0))


def test_a_nan_rollback_costs_its_lost_steps_and_they_do_not_count_twice():
    """One agent, steps of 1 s back to back from t = 1; step 4's loss is NaN at t = 5 and the job rolls back
    to its step-2 snapshot in the same process (no restart): steps 3 and 4 are trained again from t = 5.5,
    logged a second time. The first pass of step 3 (and the NaN step 4, never logged) is work lost."""
    events = [{"t": 0.0, "host": "a", "kind": "start"}, {"t": 10.5, "host": "a", "kind": "end", "code": 0}]
    first = [{"step": s, "step_time": 1.0, "time": 1.0 + s} for s in (1, 2, 3)]  # to t = 4
    again = [{"step": s, "step_time": 1.0, "time": 3.5 + s} for s in (3, 4, 5, 6)]  # t = 5.5 .. 9.5
    train = first + again
    rollback = [{"step": 4, "restored_step": 2, "time": 5.1}]
    # 6 steps count (1, 2 and the second 3 to 6), not 7
    assert ettr.ettr_text(events, train).startswith("ETTR 57.1% (6 s of training steps in 10 s")
    lost = ettr.lost_time(events, {"train": train, "rollback": rollback})
    # after step 2 (t = 3): the lost step 3 and the NaN step 4 to the rollback, then its restore
    # (the step that saw the NaN loss was the last lost: no time to notice)
    assert lost == pytest.approx({"start-up": 1.0, "lost steps": 2.1, "detection": 0.0, "recovery": 0.4,
                                  "evaluation": 0.0, "checkpoints": 0.0, "between steps": 0.0,
                                  "the end": 1.0})


def test_an_agents_end_says_what_its_exit_code_means():
    def end(code):
        return report.event_text({"kind": "end", "code": code, "seconds": 25.1})

    assert [end(c) for c in (0, 4, 143, 1)] == [
        "exit 0 (done) after 25 s", "exit 4 (this host evicted) after 25 s", "exit 143 (SIGTERM) after 25 s",
        "exit 1 after 25 s"]


def test_heat_map_mesh_without_a_layout_record():
    rec = ranks_records(1, 20)[0]
    traced = report.Mesh({r: coords_of(r) for r in range(WORLD)}, {r: f"h{r}" for r in range(WORLD)})
    z, text, hover, ylab, xlab = report.heatmap_grid(rec, report.mesh_of({}, traced, WORLD))
    assert ylab == ["dp 0 · pp 0", "dp 0 · pp 1", "dp 1 · pp 0", "dp 1 · pp 1"] and xlab == ["tp 0", "tp 1"]
    assert z[3][0] == pytest.approx(rec["relative"][SLOW_RANK]) and "h6" in hover[3][0]
    # Neither a layout record nor trace headers: rows of GRID_ROW ranks, said to be made up.
    mesh = report.mesh_of({}, None, 12)
    assert not mesh.named
    rec12 = {"relative": [1.0] * 11 + [1.5], "seconds": [0.1] * 12}
    z, text, hover, ylab, xlab = report.heatmap_grid(rec12, mesh)
    assert ylab == ["ranks 0–7", "ranks 8–15"] and len(xlab) == 8
    assert z[1][3] == 1.5 and z[1][4] is None and "r11" in text[1][3]


def test_no_metrics_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        report.write_report(tmp_path)
    from megascale.cli import main

    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl" in err


def test_an_output_that_cannot_be_written_is_one_clear_error(tmp_path, capsys):
    from megascale.cli import main

    run = make_run(tmp_path / "run")
    (tmp_path / "file").write_text("")
    for verb in ("report", "timeline"):
        out = tmp_path / "file" / f"{verb}.out"  # under a file: no such directory can be made
        assert main([verb, str(run), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(f"megascale {verb}: error: cannot write the {verb} to {out} ("), err


def test_cli_parser(tmp_path, capsys):
    import argparse

    run = make_run(tmp_path / "run", trace=False)
    parser = argparse.ArgumentParser()
    report.add_parser(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["report", str(run), "-o", str(tmp_path / "r.html")])
    assert args.func(args) == 0
    assert (tmp_path / "r.html").is_file() and str(tmp_path / "r.html") in capsys.readouterr().out
    assert "No trace files" in (tmp_path / "r.html").read_text()


# ---------------------------------------------------------------------- in a real browser


def chromium() -> str:
    for name in BROWSERS:
        exe = shutil.which(name)
        if exe:
            return exe
    pytest.fail("no Chromium (tried " + ", ".join(BROWSERS) + "): `make test` installs Debian's chromium "
                "(apt-get install chromium); deselect this test with -k 'not browser'")


def headless(exe: str, page: Path, profile: Path, *flags: str) -> subprocess.CompletedProcess:
    """One headless Chromium run on a local file, its scripts given time to draw the charts.

    --virtual-time-budget lets the page's timers and rendering run to completion before the DOM
    is dumped or the screenshot taken; --user-data-dir keeps it off any real profile; a container's
    small /dev/shm would crash it without --disable-dev-shm-usage.
    """
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=20000", *flags,
           page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def render_in_browser(page: Path, workdir: Path, png: Path, height: int = 4000) -> str:
    exe = chromium()
    dom = headless(exe, page, workdir / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = headless(exe, page, workdir / "profile-shot", f"--screenshot={png}",
                    f"--window-size=1400,{height}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    return dom.stdout


def test_browser_renders_every_chart(tmp_path):
    run = make_run(tmp_path / "run")
    page = report.write_report(run)
    expected = static_figures(page.read_text())
    png = tmp_path / "report.png"
    dom = render_in_browser(page, tmp_path, png)
    # plotly replaces each empty figure div by a plot container holding its SVG layers
    assert dom.count('class="plot-container plotly"') >= expected
    chunks = dom.split('id="figure-')[1:]
    assert len(chunks) == expected
    for i, chunk in enumerate(chunks):
        assert 'class="main-svg"' in chunk, f"figure {i} was not drawn"
        drawn = ('class="js-line"' in chunk or 'class="trace bars"' in chunk and 'class="point"' in chunk
                 or 'class="hm"' in chunk and "<image" in chunk)
        assert drawn, f"figure {i} has axes but no lines, bars or heat-map cells"
    # Loss (train, val) + tokens/s + MFU twice: a line each.
    assert dom.count('class="js-line"') >= 5
    # Start-up 1, the two per-step breakdowns and the medians 8 + 8 + 8, checkpoint stalls and persists 2.
    assert dom.count('class="trace bars"') == 27
    assert dom.count('class="heatmap-label"') == 3 * WORLD  # every rank's cell labelled, for each op
    w, h = png_size(png)
    assert (w, h) == (1400, 4000)
    assert png.stat().st_size > 100_000  # a blank page of that size compresses to a few kB
