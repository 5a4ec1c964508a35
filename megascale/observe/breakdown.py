"""Where a step's time went, per rank, from the trace files (observe.timers, observe.trace).

    b = step_breakdown(read_run(run_dir))
    b["rank0"][12]["exposed_tp"]     # seconds rank 0 waited on tensor-parallel collectives in step 12
    b["median"]["slowest"]           # the slowest rank's median step (first step left out)

Categories, in seconds of one step on one rank (they add up to the step's wall time):

* compute: time inside forward / backward / optimizer / clip spans, less the waits nested in
  them (a tp all-reduce inside forward is counted once, as exposed tp, not also as compute);
* exposed_dp, exposed_tp, exposed_pp: the blocked part of that dimension's collectives and
  sends, i.e. the communication the computation did not hide;
* bubble: pipeline receive waits (a stage idle until its neighbour's activations arrive);
* data: waits for the next batch; checkpoint: the training thread blocked by a checkpoint;
* other: the rest of the wall time (Python overhead, launches, anything not timed).

Beside the categories, a row of step_breakdown holds late_dp, late_tp and late_pp: the part of that
dimension's exposed collectives spent waiting for a peer to arrive at them, not for the data
(observe.lateness; part of exposed_*, not added to the wall time again), and the result names the
ranks the others waited for (`kept_waiting`).

A step's wall time runs from its first event's start to its last event's end on that rank;
stage 2 of a checkpoint ("persist") runs on a background thread and is left out of it. An
asynchronous collective (issued at its span's start, waited for at its end) takes its place in
the step by its wait alone: a parameter all-gather issued after one step's update and waited
for in the next step's forward (dp_overlap_param_gather; observe.timers records it under the
waiting step) must not stretch that step back into the one before.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from megascale.observe.lateness import KEYS as LATE_KEYS
from megascale.observe.lateness import late_by_step
from megascale.observe.trace import Event, RankTrace

CATEGORIES = ("compute", "exposed_dp", "exposed_tp", "exposed_pp", "bubble", "data", "checkpoint", "other")
COMPUTE_OPS = frozenset({"forward", "backward", "optimizer", "clip"})
COMM_STREAMS = ("dp", "tp", "pp")
BACKGROUND_OPS = frozenset({"persist"})  # not on the training thread: not part of a step's wall time
NS = 1e9
ROW_KEYS = (*CATEGORIES, *LATE_KEYS, "wall")  # a row's figures: the categories add up to its wall time

Interval = tuple[int, int]


# ---------------------------------------------------------------------- interval arithmetic


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (nested compute spans count once)."""
    out: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> int:
    """Total time in both of two disjoint, sorted interval lists (a two-pointer walk)."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------- one rank


def wait_interval(e: Event) -> Interval | None:
    """The stretch of `e` the rank spent waiting, or None.

    A comm span's blocked part is its end: the whole of a synchronous collective, the `wait`
    of an asynchronous one (issued at t0, waited for at its end); a data span is all wait.
    """
    if e.stream in COMM_STREAMS or (e.stream == "checkpoint" and e.blocked > 0):
        return (e.t1 - e.blocked, e.t1) if e.blocked > 0 else None
    if e.stream == "data" or (e.stream == "checkpoint" and e.op == "blocked"):
        return (e.t0, e.t1)
    return None


def on_thread(e: Event) -> Interval:
    """The stretch of `e` that is the training thread's own: an asynchronous comm op's wait (it
    ran in the background from its issue until then), any other span whole."""
    if e.stream in COMM_STREAMS and e.blocked < e.dur:
        return (e.t1 - e.blocked, e.t1)
    return (e.t0, e.t1)


def category(e: Event) -> str | None:
    """The waiting category an event's blocked time belongs to (None: not a wait)."""
    if e.stream == "pp":
        return "bubble" if e.op == "recv" else "exposed_pp"
    if e.stream in ("dp", "tp"):
        return f"exposed_{e.stream}"
    if e.stream in ("data", "checkpoint"):
        return e.stream
    return None


def one_step(events: list[Event]) -> dict[str, float]:
    """The breakdown (seconds) of one rank's events of one step, plus its "wall" time."""
    timed = [e for e in events if e.op not in BACKGROUND_OPS]
    out = dict.fromkeys((*CATEGORIES, *LATE_KEYS), 0.0)  # late_*: step_breakdown's, from every rank
    if not timed:
        return {**out, "wall": 0.0}
    waits: list[Interval] = []
    for e in timed:
        w, cat = wait_interval(e), category(e)
        if w is None or cat is None:
            continue
        waits.append(w)
        out[cat] += (w[1] - w[0]) / NS
    busy = union((e.t0, e.t1) for e in timed if e.stream == "compute" and e.op in COMPUTE_OPS)
    out["compute"] = (length(busy) - overlap(busy, union(waits))) / NS
    extents = [on_thread(e) for e in timed]
    wall = (max(b for _, b in extents) - min(a for a, _ in extents)) / NS
    # Waits that overlap each other (none on one training thread) could make this negative.
    out["other"] = max(0.0, wall - sum(out[c] for c in CATEGORIES if c != "other"))
    out["wall"] = wall
    return out


def rank_breakdown(events: Iterable[Event]) -> dict[int, dict[str, float]]:
    """{step: breakdown} of one rank (events of step < 0, recorded before training, left out)."""
    by_step: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if e.step >= 0:
            by_step[e.step].append(e)
    return {s: one_step(by_step[s]) for s in sorted(by_step)}


# ---------------------------------------------------------------------- all ranks


def median_step(per_step: dict[int, dict[str, float]]) -> dict[str, float]:
    """Per category, the median over steps, the first left out (warm-up) when there are others."""
    steps = sorted(per_step)
    if len(steps) > 1:
        steps = steps[1:]
    if not steps:
        return dict.fromkeys(ROW_KEYS, 0.0)
    return {k: statistics.median(per_step[s][k] for s in steps) for k in ROW_KEYS}


def max_over_ranks(per_rank: dict[int, dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Per step and category, the largest value any rank had (the columns need not add up)."""
    steps = sorted({s for r in per_rank.values() for s in r})
    out = {}
    for s in steps:
        rows = [r[s] for r in per_rank.values() if s in r]
        out[s] = {k: max(row[k] for row in rows) for k in ROW_KEYS}
    return out


def step_breakdown(ranks: dict[int, RankTrace]) -> dict:
    """The step-time breakdown of a run.

    Returns {"categories", "steps", "ranks": {rank: {step: row}}, "rank0": {step: row},
    "max": {step: row}, "slowest": rank with the largest median wall time,
    "median": {"rank0": row, "max": row, "slowest": row}, "kept_waiting": {rank: seconds}}; a row
    maps each category, each of LATE_KEYS and "wall" to seconds. "rank0" is the lowest rank present
    (rank 0 in a complete run). "kept_waiting": for each rank some collective waited for, how long
    the others waited for it per step (summed over the waiters, averaged over the steps after the
    first), largest first.
    """
    if not ranks:
        raise ValueError("no ranks to break down")
    per_rank = {r: rank_breakdown(t.events) for r, t in sorted(ranks.items())}
    late, kept = late_by_step(ranks)
    for r, rows in per_rank.items():
        for s, row in rows.items():
            row.update(late[r].get(s, {}))
    first = min(per_rank)
    medians = {r: median_step(rows) for r, rows in per_rank.items()}
    slowest = max(medians, key=lambda r: (medians[r]["wall"], -r))
    worst = max_over_ranks(per_rank)
    return {
        "categories": list(CATEGORIES),
        "steps": sorted(worst),
        "ranks": per_rank,
        "rank0": per_rank[first],
        "rank0_id": first,
        "max": worst,
        "slowest": slowest,
        "median": {"rank0": medians[first], "max": median_step(worst), "slowest": medians[slowest]},
        "kept_waiting": _mean_per_step(kept, sorted(worst)),
    }


def _mean_per_step(kept: dict[int, dict[int, float]], steps: list[int]) -> dict[int, float]:
    """{rank: seconds the others waited for it per step}, over the steps after the first (the
    warm-up, as median_step leaves it out), largest first; ranks nobody waited for left out."""
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        return {}
    mean = {r: sum(by_step.get(s, 0.0) for s in steps) / len(steps) for r, by_step in kept.items()}
    return dict(sorted(((r, v) for r, v in mean.items() if v > 0), key=lambda x: (-x[1], x[0])))
