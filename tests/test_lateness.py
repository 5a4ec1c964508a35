"""observe.lateness: the part of a collective wait spent waiting for a peer to arrive, on events with
known answers, and through the step breakdown. (A real run with a slowed rank: tests/test_observe.py.)"""

from __future__ import annotations

import pytest

from megascale.observe.breakdown import median_step, step_breakdown
from megascale.observe.lateness import late_by_step, late_waits
from megascale.observe.trace import Event, RankTrace

MS = 1_000_000  # ns


def coll(op, t0_ms, dur_ms, blocked_ms, seq, group="dp", stream="dp", step=0):
    """A collective of `group` (its seq-th on this rank) issued at t0, its last `blocked` ms a wait."""
    return Event(op, stream, int(t0_ms * MS), int(dur_ms * MS), step, -1, -1, group, seq, -1,
                 int(blocked_ms * MS), 0, -1)


def compute(op, t0_ms, dur_ms, step=0):
    return Event(op, "compute", int(t0_ms * MS), int(dur_ms * MS), step, -1, -1, None, -1, -1, 0, 0, -1)


def trace(rank, events, groups):
    return RankTrace(rank, {"rank": rank, "groups": {"world": [0, 1, 2, 3], **groups}},
                     sorted(events, key=lambda e: e.t0))


def late_ms(ranks, rank):
    return [(round(late / MS, 3), peer) for _, late, peer in late_waits(ranks)[rank]]


def test_a_blocking_collective_waits_for_the_last_member_to_arrive():
    # rank 0 enters at 0 and is released at 50; rank 1 enters at 10, rank 2 at 40 (the last)
    g = {"dp": [0, 1, 2]}
    ranks = {0: trace(0, [coll("all_reduce", 0, 50, 50, 1)], g),
             1: trace(1, [coll("all_reduce", 10, 40, 40, 1)], g),
             2: trace(2, [coll("all_reduce", 40, 10, 10, 1)], g)}
    assert late_ms(ranks, 0) == [(40, 2)]
    assert late_ms(ranks, 1) == [(30, 2)]
    assert late_ms(ranks, 2) == [(0, -1)]  # the last one in waited only for the data


def test_an_async_collective_counts_only_its_wait_before_the_peer_issued():
    # issued at 0, waited for from 30 to 50; the peer issued at 45: 15 ms of the 20 ms wait were its lateness
    g = {"dp": [0, 1]}
    ranks = {0: trace(0, [coll("reduce_scatter", 0, 50, 20, 1)], g),
             1: trace(1, [coll("reduce_scatter", 45, 6, 1, 1)], g)}
    assert late_ms(ranks, 0) == [(15, 1)]
    # a peer that issued before the wait began: the whole wait is the data's
    ranks[1] = trace(1, [coll("reduce_scatter", 20, 31, 1, 1)], g)
    assert late_ms(ranks, 0) == [(0, -1)]
    # a peer that issued after the wait ended (misaligned clocks): never more than the wait itself
    ranks[1] = trace(1, [coll("reduce_scatter", 70, 1, 1, 1)], g)
    assert late_ms(ranks, 0) == [(20, 1)]


def test_collectives_match_by_group_members_and_sequence_number():
    # two tp groups, both named "tp": rank 1's lateness must not show in group {2, 3}; the 2nd collective
    # of a group matches the peer's 2nd, not its 1st
    def tp(t0, dur, seq):
        return coll("all_reduce", t0, dur, dur, seq, "tp", "tp")

    ranks = {0: trace(0, [tp(0, 5, 1), tp(10, 30, 2)], {"tp": [0, 1]}),
             1: trace(1, [tp(1, 4, 1), tp(35, 5, 2)], {"tp": [0, 1]}),
             2: trace(2, [tp(0, 5, 1), tp(10, 30, 2)], {"tp": [2, 3]}),
             3: trace(3, [tp(4, 1, 1), tp(12, 28, 2)], {"tp": [2, 3]})}
    assert late_ms(ranks, 0) == [(1, 1), (25, 1)]
    assert late_ms(ranks, 2) == [(4, 3), (2, 3)]


def test_a_collective_with_a_member_missing_is_left_out_and_a_restart_matches_the_nearest():
    g = {"dp": [0, 1]}
    ranks = {0: trace(0, [coll("all_reduce", 0, 10, 10, 1)], g), 1: trace(1, [compute("forward", 0, 5)], g)}
    assert late_ms(ranks, 0) == []
    # a restarted process numbers its collectives from 1 again: the same key twice, 1 s apart
    ranks = {0: trace(0, [coll("all_reduce", 0, 10, 10, 1), coll("all_reduce", 1000, 10, 10, 1, step=5)], g),
             1: trace(1, [coll("all_reduce", 8, 2, 2, 1), coll("all_reduce", 1003, 7, 7, 1, step=5)], g)}
    assert late_ms(ranks, 0) == [(8, 1), (3, 1)]


def test_late_waits_per_step_and_stream_and_who_kept_the_others_waiting():
    g = {"dp": [0, 1], "tp": [0, 1]}
    r0 = [coll("all_reduce", 0, 20, 20, 1, "tp", "tp", step=0), coll("reduce_scatter", 30, 10, 10, 1, step=0),
          coll("all_reduce", 100, 20, 20, 2, "tp", "tp", step=1)]
    r1 = [coll("all_reduce", 15, 5, 5, 1, "tp", "tp", step=0), coll("reduce_scatter", 25, 15, 15, 1, step=0),
          coll("all_reduce", 112, 8, 8, 2, "tp", "tp", step=1)]
    late, kept = late_by_step({0: trace(0, r0, g), 1: trace(1, r1, g)})
    assert late[0][0] == pytest.approx({"late_dp": 0.0, "late_tp": 0.015, "late_pp": 0.0})
    assert late[0][1] == pytest.approx({"late_dp": 0.0, "late_tp": 0.012, "late_pp": 0.0})
    assert late[1][0] == pytest.approx({"late_dp": 0.005, "late_tp": 0.0, "late_pp": 0.0})
    assert set(kept) == {0, 1}
    assert kept[1] == pytest.approx({0: 0.015, 1: 0.012}) and kept[0] == pytest.approx({0: 0.005})


def test_the_step_breakdown_carries_the_late_part_of_each_exposed_dimension():
    g = {"dp": [0, 1]}
    # three steps: rank 1 arrives 10 ms late at the reduce-scatter each time (rank 0's whole wait is 12 ms)
    r0 = [e for s in range(3) for e in (compute("backward", 100 * s, 50, s),
                                        coll("reduce_scatter", 100 * s + 50, 12, 12, s + 1, step=s))]
    r1 = [e for s in range(3) for e in (compute("backward", 100 * s, 60, s),
                                        coll("reduce_scatter", 100 * s + 60, 2, 2, s + 1, step=s))]
    bd = step_breakdown({0: trace(0, r0, g), 1: trace(1, r1, g)})
    med0, med1 = median_step(bd["ranks"][0]), median_step(bd["ranks"][1])
    assert med0["exposed_dp"] == pytest.approx(0.012) and med0["late_dp"] == pytest.approx(0.010)
    assert med1["exposed_dp"] == pytest.approx(0.002) and med1["late_dp"] == 0
    # the late part is inside exposed_dp: the categories still add up to the wall time
    assert sum(med0[c] for c in bd["categories"]) == pytest.approx(med0["wall"])
    assert bd["kept_waiting"] == pytest.approx({1: 0.010})
