"""The driver's hang verdict (fault/hang.py) over synthetic in-flight records of a dp2 x tp2 job on two hosts
(ranks 0-1 on host A, 2-3 on host B): evict the culprits' host only when the diagnosis is clear."""

from __future__ import annotations

import time

from megascale.fault.hang import REPORT, judge_hang
from megascale.observe.inflight import CUR_T0, HEARTBEAT_W, UPDATED_W, InFlight

NOW = time.time_ns()
S = 1_000_000_000
GROUPS = {0: {"tp": [0, 1], "dp": [0, 2]}, 1: {"tp": [0, 1], "dp": [1, 3]},
          2: {"tp": [2, 3], "dp": [0, 2]}, 3: {"tp": [2, 3], "dp": [1, 3]}}


def job(run_dir, hosts=("A", "A", "B", "B"), world=4) -> dict[int, InFlight]:
    recs = {}
    for r in range(world):
        groups = {"world": list(range(world)), **GROUPS.get(r, {})}
        recs[r] = InFlight(run_dir / "trace" / "inflight", r, groups, host=hosts[r], coords={"dp": r // 2,
                                                                                         "tp": r % 2})
        recs[r].words[HEARTBEAT_W] = NOW
    for r in recs.values():  # step 0: one world all-reduce done by all
        r.begin("world", "all_reduce")
        r.end()
    return recs


def wait_in_world(recs, ranks) -> None:
    """`ranks` enter the step's world all-reduce #2 and stay there for 30 s; the others never issue it."""
    for r in ranks:
        recs[r].begin("world", "all_reduce")
        recs[r].words[CUR_T0] = recs[r].words[UPDATED_W] = NOW - 30 * S


def test_one_stuck_rank_evicts_its_host_and_the_diagnosis_is_written(tmp_path):
    recs = job(tmp_path)
    wait_in_world(recs, [0, 1, 2])  # rank 3 computes for good
    v = judge_hang(tmp_path, world=4, now_ns=NOW)
    assert v.evict == "B", v
    assert v.text.startswith("rank 3 (dp1 tp1, host B, pid ") and "is alive but in no collective" in v.text
    assert "culprit" in (tmp_path / "trace" / "hang" / REPORT).read_text()


def test_culprits_on_two_hosts_restart_with_every_host(tmp_path):
    recs = job(tmp_path)
    wait_in_world(recs, [0, 2])  # ranks 1 (host A) and 3 (host B) compute for good
    v = judge_hang(tmp_path, world=4, now_ns=NOW)
    assert v.evict is None and "rank 1" in v.text


def test_a_dead_rank_besides_the_culprit_means_the_job_is_already_restarting(tmp_path):
    recs = job(tmp_path)
    wait_in_world(recs, [0, 1, 2])
    recs[0].words[HEARTBEAT_W] = NOW - 20 * S  # host A's agent already killed its workers
    assert judge_hang(tmp_path, world=4, now_ns=NOW).evict is None


def test_a_stopped_rank_is_a_crash_to_restart_not_a_host_to_evict(tmp_path):
    recs = job(tmp_path)
    wait_in_world(recs, [0, 1, 2])
    recs[3].words[HEARTBEAT_W] = NOW - 20 * S  # SIGSTOPped: no beats
    v = judge_hang(tmp_path, world=4, now_ns=NOW)
    assert v.evict is None and "rank 3 " in v.text and "not responding" in v.text


def test_a_collective_stuck_inside_one_host_restarts_with_every_host(tmp_path):
    """Host B's tp all-reduce holds both its ranks (its link is down?) while host A waits for them in the
    world all-reduce: the network's fault, which the restart's self-check judges, not a hung rank."""
    recs = job(tmp_path)
    wait_in_world(recs, [0, 1])
    for r in (2, 3):
        recs[r].begin("tp", "all_reduce")
    v = judge_hang(tmp_path, world=4, now_ns=NOW)
    assert v.evict is None and "the collective itself is stuck" in v.text, v


def test_a_single_host_job_evicts_nobody(tmp_path):
    recs = job(tmp_path, hosts=("A",) * 4)
    wait_in_world(recs, [0, 1, 2])
    v = judge_hang(tmp_path, world=4, now_ns=NOW)
    assert v.evict is None and v.text.startswith("rank 3 ")


def test_records_of_a_larger_earlier_layout_are_not_this_job(tmp_path):
    """After a shrink to ranks 0-1 the files of ranks 2-3 remain, stale: they must not read as dead ranks
    of this job (which would block every later eviction) nor as its culprits."""
    old = job(tmp_path)
    for r in (2, 3):
        old[r].words[HEARTBEAT_W] = NOW - 600 * S
    recs = {r: InFlight(tmp_path / "trace" / "inflight", r, {"world": [0, 1], "tp": [0, 1]},
                        host=("A", "C")[r], coords={"tp": r}) for r in (0, 1)}
    for f in recs.values():
        f.words[HEARTBEAT_W] = NOW
    wait_in_world(recs, [0])  # rank 1 (host C) computes for good
    v = judge_hang(tmp_path, world=2, now_ns=NOW)
    assert v.evict == "C" and "rank 1 " in v.text


def test_no_records_no_verdict(tmp_path):
    v = judge_hang(tmp_path, world=4)
    assert v.evict is None and "observe.timers" in v.text


def test_the_driver_evicts_the_culprits_host_unless_told_to_keep_it(tmp_path, monkeypatch):
    """The agent's own step after a hang (fault/driver.py `_judge_hang`) on a clear verdict against host B:
    by default B goes on the run's blocklist (its restart then refuses to run); with
    `fault.evict_hung_hosts = false` the blocklist stays empty, so B restarts with the job (README)."""
    from types import SimpleNamespace

    from megascale.config import FaultConfig
    from megascale.fault import blocklist
    from megascale.fault.driver import make_agent_class

    monkeypatch.setitem(globals(), "NOW", time.time_ns())  # the agent judges at the real time
    judge = make_agent_class()._judge_hang
    group = SimpleNamespace(workers=[SimpleNamespace(world_size=4)],
                            spec=SimpleNamespace(rdzv_handler=SimpleNamespace(get_run_id=lambda: "job")))
    for evict, said in ((False, "(fault.evict_hung_hosts = false: host B stays)"),
                        (True, "; evicting host B")):
        run = tmp_path / str(evict)
        wait_in_world(job(run), [0, 1, 2])  # rank 3 (host B) computes for good
        agent = SimpleNamespace(run_dir=str(run), multi_host=True,
                                fault=FaultConfig(evict_hung_hosts=evict))
        text = judge(agent, group)
        assert text.startswith("diagnosis: rank 3 ") and text.endswith(said), text
        assert (blocklist.entry(run, "B") is not None) == evict
        assert blocklist.entry(run, "A") is None
