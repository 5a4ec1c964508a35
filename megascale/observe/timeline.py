"""`megascale timeline RUN_DIR`: every rank's spans in one Chrome/Perfetto trace.

    megascale timeline runs/x                   -> runs/x/timeline.json (open it in ui.perfetto.dev)
    megascale timeline runs/x --group-by pp     processes ordered and labelled by pipeline stage

One process per rank ("rank 5 · dp1 pp0 tp1 · host"), one track per stream (compute, dp, pp, tp,
data, checkpoint), complete events ("ph": "X") in microseconds on rank 0's clock, and a flow
arrow from each send to its matching receive. `--group-by dp|pp|tp` orders the processes by
that coordinate and prefixes their names with it ("[pp 0] rank 2 ..."), so the ranks that share
a pipeline stage (or a tp group, or a data-parallel replica) sit together.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megascale.data.atomic import write_command_output
from megascale.observe.timers import STREAMS
from megascale.observe.trace import RankTrace, p2p_pairs, read_run

GROUPINGS = ("rank", "dp", "pp", "tp")


def build_timeline(ranks: dict[int, RankTrace], group_by: str = "rank",
                   steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """The Chrome trace dict of `ranks` (optionally only steps [lo, hi])."""
    if group_by not in GROUPINGS:
        raise ValueError(f"--group-by: {group_by!r} is not one of {', '.join(GROUPINGS)}")
    starts = [e.t0 for t in ranks.values() for e in t.events]
    if not starts:
        raise ValueError("the trace files hold no events")
    origin = min(starts)
    events: list[dict[str, Any]] = []
    order = sorted(ranks, key=lambda r: (ranks[r].coords.get(group_by, 0) if group_by != "rank" else 0, r))
    for sort_index, r in enumerate(order):
        t = ranks[r]
        c = t.coords
        name = f"rank {r} · dp{c.get('dp', 0)} pp{c.get('pp', 0)} tp{c.get('tp', 0)} · {t.host}"
        if group_by != "rank":
            name = f"[{group_by} {c.get(group_by, 0)}] {name}"
        events.append({"ph": "M", "pid": r, "name": "process_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": r, "name": "process_sort_index", "args": {"sort_index": sort_index}})
        for tid, stream in enumerate(STREAMS):
            events.append({"ph": "M", "pid": r, "tid": tid, "name": "thread_name", "args": {"name": stream}})
            events.append({"ph": "M", "pid": r, "tid": tid, "name": "thread_sort_index",
                           "args": {"sort_index": tid}})
        for e in t.events:
            if steps is not None and not steps[0] <= e.step <= steps[1]:
                continue
            args: dict[str, Any] = {"step": e.step}
            if e.micro >= 0:
                args["micro_batch"] = e.micro
            if e.chunk >= 0:
                args["chunk"] = e.chunk
            if e.group:
                args.update(group=e.group, seq=e.seq)
            if e.peer >= 0:
                args["peer"] = e.peer
            if e.blocked:
                args["blocked_ms"] = round(e.blocked / 1e6, 4)
            if e.nbytes:
                args["bytes"] = e.nbytes
            events.append({"ph": "X", "pid": r, "tid": _tid(e.stream), "name": e.op, "cat": e.stream,
                           "ts": (e.t0 - origin) / 1e3, "dur": e.dur / 1e3, "args": args})
    for i, (s, rv, src, dst) in enumerate(p2p_pairs(ranks)):
        if steps is not None and not steps[0] <= s.step <= steps[1]:
            continue
        events.append({"ph": "s", "id": i, "pid": src, "tid": _tid("pp"), "name": "p2p", "cat": "pp",
                       "ts": (s.t0 - origin) / 1e3})
        events.append({"ph": "f", "bp": "e", "id": i, "pid": dst, "tid": _tid("pp"), "name": "p2p",
                       "cat": "pp", "ts": (rv.t1 - origin) / 1e3})
    clocks = {r: t.clocks[-1] for r, t in ranks.items() if t.clocks}
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "ranks": len(ranks),
            "origin_ns": origin,
            "clock_error_bound_us": max((c["err_ns"] for c in clocks.values()), default=0) / 1e3,
            "group_by": group_by,
        },
    }


def _tid(stream: str) -> int:
    return STREAMS.index(stream) if stream in STREAMS else len(STREAMS)


def write_timeline(run_dir: str | Path, out: str | Path | None = None, group_by: str = "rank",
                   steps: tuple[int, int] | None = None, ranks: dict[int, RankTrace] | None = None) -> Path:
    """The timeline of `run_dir` (of `ranks`, read from it, when given) as Chrome trace JSON at `out`."""
    if ranks is None:
        ranks = read_run(run_dir, steps=steps)
    trace = build_timeline(ranks, group_by, steps)
    out = Path(out) if out else Path(run_dir) / ("timeline.json" if group_by == "rank"
                                                 else f"timeline_by_{group_by}.json")
    write_command_output(out, json.dumps(trace, separators=(",", ":")), "the timeline")
    return out
