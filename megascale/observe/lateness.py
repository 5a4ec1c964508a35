"""Of each collective wait, the part spent waiting for a peer to arrive (imbalance), not for the data.

A rank blocked in its k-th collective of group G cannot be released before every member of G has
issued its own k-th collective of G. Until the last of them did, the rank waited for that peer (a
slower device, a preempted host, a stage with more work, a peer itself held up elsewhere); only after
it for the transfer and the peers' send path. So each wait splits at the last member's issue:

    late = clamp(last member's issue - wait start, 0, blocked)      charged to that member
    the rest of the wait                                              the data's own time

Exposed communication that is mostly `late` will not shrink with a faster network or a better overlap:
it is the ranks' skew, which a synchronous step pays at every collective (MegaScale §4.3 finds slow
hosts the same way, by who the collectives wait for). The attribution is direct: a rank that arrived
late because it waited for a third is charged, not the third; `kept_waiting` over all ranks still
puts the root cause first, since everybody downstream of it waits too.

Matching: observe.timers numbers each rank's collectives per group (observe.inflight), so the k-th
of a group on every member is one collective, as `megascale diagnose` matches them; a group is its
name and its members (the header's `groups`: two tp groups are both "tp"). A restarted process counts
from 1 again, so where a key occurs more than once the peer's event nearest in time is taken.
Point-to-point waits (the pipeline's receives: the bubble) are the breakdown's own category.
Times are on rank 0's clock (observe.trace), whose alignment error (tens of us) bounds the split.
"""

from __future__ import annotations

from collections import defaultdict

from megascale.observe.trace import Event, RankTrace

STREAMS = ("dp", "tp", "pp")  # a collective's stream: which dimension's exposed time it is part of
KEYS = tuple(f"late_{s}" for s in STREAMS)
NS = 1e9

Key = tuple[tuple[int, ...], str, int]  # (members, group name, sequence number)


def _collectives(ranks: dict[int, RankTrace]) -> dict[Key, dict[int, list[Event]]]:
    """{key: {rank: its events of that key}} of every group collective in the traces (a group of one
    rank waits for nobody)."""
    out: dict[Key, dict[int, list[Event]]] = defaultdict(lambda: defaultdict(list))
    for r, t in ranks.items():
        groups = {name: tuple(m) for name, m in t.header.get("groups", {}).items() if len(m) > 1}
        for e in t.events:
            if e.stream in STREAMS and e.peer < 0 and e.seq > 0 and (m := groups.get(e.group)):
                out[(m, e.group, e.seq)][r].append(e)
    return out


def late_waits(ranks: dict[int, RankTrace]) -> dict[int, list[tuple[Event, int, int]]]:
    """{rank: [(event, ns of its wait spent before its last peer arrived, that peer)]} for every
    collective wait of a group whose every member's event is in the traces; a wait with nothing late
    is listed with 0 (and peer -1)."""
    out: dict[int, list[tuple[Event, int, int]]] = defaultdict(list)
    for (members, _, _), by_rank in _collectives(ranks).items():
        if any(m not in by_rank for m in members):
            continue  # a member's trace is missing or cut short: nobody to time the wait against
        for r, events in by_rank.items():
            for e in events:
                if e.blocked <= 0:
                    continue
                # each peer's issue of this collective: the one nearest in time (a restart repeats keys)
                issues = [(min(by_rank[m], key=lambda x: abs(x.t0 - e.t0)).t0, m) for m in members if m != r]
                last, peer = max(issues)
                late = min(e.blocked, max(0, last - (e.t1 - e.blocked)))
                out[r].append((e, late, peer if late > 0 else -1))
    return out


def late_by_step(ranks: dict[int, RankTrace]) -> tuple[dict[int, dict[int, dict[str, float]]],
                                                       dict[int, dict[int, float]]]:
    """({rank: {step: {"late_dp", "late_tp", "late_pp": seconds}}}: each rank's waits for late peers per
    step, by the stream of the collective; {peer: {step: seconds}}: how long the others waited for each
    rank, summed over the waiters). Steps as the trace numbers them (< 0, before training, left out)."""
    per_rank: dict[int, dict[int, dict[str, float]]] = {r: {} for r in ranks}
    kept: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r, waits in late_waits(ranks).items():
        for e, late, peer in waits:
            if e.step < 0:
                continue
            row = per_rank[r].setdefault(e.step, dict.fromkeys(KEYS, 0.0))
            row[f"late_{e.stream}"] += late / NS
            if peer >= 0:
                kept[peer][e.step] += late / NS
    return per_rank, {p: dict(steps) for p, steps in kept.items()}
