"""Hang diagnosis: the wait-for graph over synthetic in-flight records of a dp2 x pp2 x tp2 mesh, the
`megascale diagnose` verb, and the watchdog's dump (no process group: the real InFlight writer, several
ranks in this one process)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.errors import UserError
from megascale.observe import diagnose as dg
from megascale.observe import watchdog as wdmod
from megascale.observe.inflight import CUR_T0, HEARTBEAT_W, PID_W, UPDATED_W, InFlight
from megascale.parallel.mesh import coordinates, group_ranks

DP, PP, TP = 2, 2, 2
WORLD = DP * PP * TP
KINDS = ("tp", "pp", "dp", "mp", "emb")
NOW = time.time_ns()
S = 1_000_000_000


def groups_of(rank: int) -> dict[str, list[int]]:
    out = {"world": list(range(WORLD))}
    for kind in KINDS:
        out[kind] = next(g for g in group_ranks(DP, PP, TP, kind) if rank in g)
    return out


class Job:
    """Eight ranks' records in RUN_DIR/trace/inflight, driven by hand like the timers would."""

    def __init__(self, run_dir: Path, skip: tuple[int, ...] = (), hosts: dict[int, str] | None = None):
        self.run_dir = run_dir
        self.dir = run_dir / "trace" / "inflight"
        self.r: dict[int, InFlight] = {}
        for rank in range(WORLD):
            if rank in skip:
                continue
            d, p, t = coordinates(rank, DP, PP, TP)
            # host "testhost": not this machine, so the diagnosis judges by heartbeat alone
            self.r[rank] = InFlight(self.dir, rank, groups_of(rank), host=(hosts or {}).get(rank, "testhost"),
                                    coords={"dp": d, "pp": p, "tp": t})
        self.beat_all(NOW)

    def beat_all(self, t_ns: int) -> None:
        for f in self.r.values():
            f.words[HEARTBEAT_W] = t_ns

    def steps(self, step: int, ranks=None) -> None:
        for rank in ranks if ranks is not None else self.r:
            self.r[rank].set_step(step)

    def collective(self, group: str, op: str = "all_reduce", ranks=None) -> None:
        """Every (given) rank runs one op of `group` to completion."""
        for rank in ranks if ranks is not None else self.r:
            self.r[rank].begin(group, op)
            self.r[rank].end()

    def block(self, rank: int, group: str, op: str = "all_reduce", since_s: float = 30.0, **p2p) -> None:
        """`rank` enters an op and stays there, since `since_s` seconds before NOW."""
        f = self.r[rank]
        f.begin(group, op, **p2p)
        f.words[CUR_T0] = f.words[UPDATED_W] = NOW - int(since_s * S)

    def send(self, src: int, dst: int, tag: int = 0, received: bool = True) -> None:
        """An isend src -> dst (counted on src's channel) and, if `received`, dst's matching recv."""
        self.r[src].issue("pp", peer=dst, tag=tag)
        if received:
            self.r[dst].begin("pp", "recv", peer=src, tag=tag)
            self.r[dst].end()

    def warm_up(self) -> None:
        """Steps 0-2 done, step 3 begun: world/tp/dp/pp collectives and one pipeline message each way."""
        for step in range(3):
            self.steps(step)
            self.collective("tp")
            for d in range(DP):
                for t in range(TP):
                    first, last = d * PP * TP + t, d * PP * TP + TP + t
                    if first in self.r and last in self.r:
                        self.send(first, last)
            self.collective("dp", "reduce_scatter")
            self.collective("world")
        self.steps(3)

    def diagnose(self, **kw) -> dg.Diagnosis:
        return dg.diagnose(self.run_dir, now_ns=NOW, **kw)


def text(d: dg.Diagnosis) -> str:
    return dg.format_diagnosis(d)


# ---------------------------------------------------------------------- the verdicts


def sigstop_rank5(job: Job) -> None:
    """Rank 5 (dp1 pp0 tp1) stops while computing step 3, after its first tp all-reduce of the step."""
    job.warm_up()
    job.collective("tp")  # tp #4 done by everyone, then rank 5 stops
    job.block(4, "tp")  # its tp peer waits in tp #5
    job.block(7, "pp", "recv", peer=5, tag=0)  # its next stage waits for its activations (#4; 5 sent 3)
    job.block(6, "pp", "recv", peer=4, tag=0)  # 4 has not sent either: it is blocked in tp
    for r in range(4):  # data-parallel replica 0 ran on to the gradient reduce-scatter
        job.block(r, "dp", "reduce_scatter", since_s=20)


def test_a_stopped_rank_is_the_only_culprit(tmp_path):
    job = Job(tmp_path)
    sigstop_rank5(job)
    job.r[5].words[HEARTBEAT_W] = NOW - 12 * S
    d = job.diagnose()
    assert d.culprits == [5] and d.kinds == {5: "not_responding"}
    line = d.lines[0]
    assert line.startswith("rank 5 (dp1 pp0 tp1, host testhost, pid ")
    assert "not responding: heartbeat 12.0 s old" in line
    assert "last completed: tp all_reduce #4" in line and "in flight: nothing (computing)" in line
    assert "7 ranks wait on it (3 directly)" in line
    assert {(e.waiter, e.waited_for) for e in d.edges} >= {(4, 5), (7, 5), (6, 4), (0, 4), (3, 7)}
    assert not d.states[5].alive and all(d.states[r].alive for r in range(WORLD) if r != 5)
    assert d.why[(4, 5)] == "lag" and d.why[(7, 5)] == "lag"
    assert "culprit: 5" in text(d)


def test_a_rank_stopped_inside_the_collective_its_peer_is_in(tmp_path):
    job = Job(tmp_path)
    job.warm_up()
    job.block(4, "tp")
    job.block(5, "tp")  # both issued tp #4: only liveness tells who holds it up
    job.r[5].words[HEARTBEAT_W] = NOW - 9 * S
    d = job.diagnose()
    assert d.culprits == [5] and d.why == {(4, 5): "not responding"}
    assert "in flight: tp all_reduce #4 for 30.0 s" in d.lines[0]


def test_proc_state_shows_a_sigstopped_process(tmp_path):
    """On this host, /proc/PID/stat says T for a stopped process, even before its heartbeat is stale."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while dg.proc_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        job = Job(tmp_path, hosts={5: socket.gethostname()})
        sigstop_rank5(job)
        job.r[5].words[PID_W] = child.pid
        d = job.diagnose()  # every heartbeat fresh
        assert d.culprits == [5]
        assert d.states[5].evidence == "process stopped (SIGSTOP)"
        assert "heartbeat 0.0 s old, process stopped (SIGSTOP)" in d.lines[0]
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("step_ahead", [True, False])
def test_a_rank_that_skipped_a_collective_is_named_alone(tmp_path, step_ahead):
    """Rank 3 skips the world all-reduce ending step 3: the others wait for it there, it waits in tp for
    rank 2, which is still in the world all-reduce: a cycle {2, 3}, and 3 is the one to blame."""
    job = Job(tmp_path)
    job.warm_up()
    job.collective("tp")
    for r in range(WORLD):
        if r != 3:
            job.block(r, "world")  # world #4
    if step_ahead:
        job.steps(4, [3])
    job.block(3, "tp", since_s=29)  # tp #5 of the next step
    d = job.diagnose()
    assert d.culprits == [3] and d.kinds == {3: "skipped"}
    step = 4 if step_ahead else 3
    assert (f"rank 3 (dp0 pp1 tp1, host testhost, pid {os.getpid()}) skipped or never reached world "
            f"all_reduce #4: it is at #3 there but already in tp all_reduce #5 of step {step}") in d.lines[0]
    assert "7 ranks wait on it" in d.lines[0]
    # a live culprit's hang dump shows where its training thread is
    hang = tmp_path / "trace" / "hang"
    hang.mkdir(parents=True)
    stack = [{"file": "/x/train.py", "line": 10, "func": "train_step"},
             {"file": "/x/tp.py", "line": 5, "func": "fwd"}]
    (hang / "rank_00003.json").write_text(json.dumps({"rank": 3, "wall_ns": NOW, "threads": [
        {"main": True, "stack": stack}]}))
    assert "  rank 3 main thread: tp.py:5 fwd <- train.py:10 train_step" in job.diagnose().lines


def test_a_receive_from_a_sender_that_never_sent_names_the_sender(tmp_path):
    job = Job(tmp_path)
    job.warm_up()
    job.r[4].issue("pp", peer=6, tag=1)  # a message on another tag does not count
    job.block(6, "pp", "recv", peer=4, tag=0)  # its 4th receive on tag 0; 4 sent 3
    d = job.diagnose()
    assert d.culprits == [4] and d.kinds == {4: "idle"}
    assert [tuple(e) for e in d.edges] == [(6, 4, "pp", "recv", 4)]
    assert "rank 4 (dp1 pp0 tp0" in d.lines[0] and "in no collective" in d.lines[0]
    assert "pp recv #4" in d.lines[0] and "1 rank waits on it (1 directly)" in d.lines[0]


def test_a_healthy_snapshot_names_nobody(tmp_path):
    job = Job(tmp_path)
    job.warm_up()
    d = job.diagnose()
    assert d.culprits == [] and d.edges == []
    assert d.lines == ["no rank is in a collective: nothing is blocked (8 ranks, all alive)"]
    assert "culprit: none" in text(d)


def test_a_group_all_in_one_op_and_alive_is_the_collective_itself(tmp_path):
    job = Job(tmp_path)
    job.warm_up()
    job.block(0, "tp")
    job.block(1, "tp")
    d = job.diagnose()
    assert d.culprits == [] and d.edges == []
    assert d.stuck_groups == [{"group": "tp", "members": [0, 1], "op": "all_reduce", "seq": 4,
                               "waiting_s": 30.0}]
    assert "group tp [0-1]: every member is alive and in tp all_reduce #4" in d.lines[0]
    assert "network or backend" in d.lines[0]


def test_a_rank_without_a_record_is_missing(tmp_path):
    job = Job(tmp_path, skip=(7,))
    for r in job.r:
        job.block(r, "world")
    d = job.diagnose()
    assert d.culprits == [7] and d.kinds == {7: "missing"}
    assert d.lines[0].startswith("rank 7 has no in-flight record") and "7 ranks wait on it" in d.lines[0]


def test_after_the_job_ended_the_rank_that_stopped_first_is_named(tmp_path):
    job = Job(tmp_path)
    sigstop_rank5(job)
    job.beat_all(NOW - 100 * S)  # the launcher killed everyone 100 s ago ...
    job.r[5].words[HEARTBEAT_W] = NOW - 130 * S  # ... 30 s after rank 5 stopped beating
    d = job.diagnose()
    assert d.culprits == [5]
    assert "heartbeat 30.0 s old" in d.lines[0]
    assert any("the job is not running" in n for n in d.notes)


def test_flight_recorder_dumps_corroborate(tmp_path):
    job = Job(tmp_path)
    sigstop_rank5(job)
    job.r[5].words[HEARTBEAT_W] = NOW - 12 * S
    hang = tmp_path / "trace" / "hang"
    hang.mkdir(parents=True)
    fr = {"pg_status": {"3": {"last_enqueued_collective": "9", "last_completed_collective": "8",
                              "last_started_collective": "-1"}}, "pg_ranks": {"3": [4, 5]}}
    (hang / "rank_00004.json").write_text(json.dumps({"rank": 4, "wall_ns": NOW, "flight_recorder": fr,
                                                      "threads": []}))
    d = job.diagnose()
    assert d.culprits == [5]
    assert any("ranks 4 on tp: last enqueued #9, last completed #8: one collective in flight" in n
               for n in d.notes)


def test_graph_algorithms():
    # two cycles, one feeding the other, and a chain into a sink
    succ = {0: [1], 1: [0, 2], 2: [3], 3: [2], 4: [5], 5: []}
    comps = sorted(dg.strongly_connected(list(range(6)), succ))
    assert comps == [[0, 1], [2, 3], [4], [5]]
    chain = {i: [i + 1] for i in range(5000)}  # no recursion limit
    assert len(dg.strongly_connected(list(range(5001)), chain)) == 5001
    assert dg._ranks_text([0, 1, 2, 3, 6, 9, 10]) == "0-3,6,9-10"


# ---------------------------------------------------------------------- the CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megascale")
    dg.register(p.add_subparsers(dest="verb", required=True))
    return p


def test_cli_without_records_is_a_clear_error(tmp_path, capsys):
    args = parser().parse_args(["diagnose", str(tmp_path)])
    with pytest.raises(UserError) as e:
        args.func(args)
    assert e.value.exit_code == 2
    assert "no in-flight records" in str(e.value) and "\n" not in str(e.value)


def test_cli_prints_the_verdict_and_json(tmp_path, capsys):
    job = Job(tmp_path)
    sigstop_rank5(job)
    job.beat_all(time.time_ns())  # the CLI judges against the real clock
    job.r[5].words[HEARTBEAT_W] = NOW - 3600 * S
    args = parser().parse_args(["diagnose", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "culprit: 5" in out and "wait-for graph" in out
    args = parser().parse_args(["diagnose", str(tmp_path / "trace"), "--json", "--stale-s", "60"])
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["culprits"] == [5] and doc["kinds"] == {"5": "not_responding"}


# ---------------------------------------------------------------------- the watchdog


def stuck_rank0(tmp_path: Path) -> InFlight:
    f = InFlight(tmp_path / "trace" / "inflight", 0, groups_of(0), host="testhost",
                 coords={"dp": 0, "pp": 0, "tp": 0})
    f.set_step(3)
    f.begin("tp", "all_reduce")
    f.words[CUR_T0] = f.words[UPDATED_W] = time.time_ns() - 10 * S  # in flight for 10 s already
    return f


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_watchdog_dumps_once_per_stuck_op(tmp_path):
    f = stuck_rank0(tmp_path)
    hang = tmp_path / "trace" / "hang"
    logs: list[str] = []
    wd = wdmod.Watchdog(f, hang, 0, hang_timeout_s=0.5, action="dump", log=logs.append, interval_s=0.05,
                        collect_s=0.2).start()
    try:
        assert wait_for(lambda: (hang / "diagnosis.txt").exists())
        beat = int(f.words[HEARTBEAT_W])
        time.sleep(0.3)
        assert int(f.words[HEARTBEAT_W]) > beat  # still beating after the hang
    finally:
        wd.stop()
    assert wd.dumps == 1 and wd._thread is None
    doc = json.loads((hang / "rank_00000.json").read_text())
    assert doc["reason"].startswith("no progress for 1") and doc["rank"] == 0
    assert doc["record"]["current"]["op"] == "all_reduce" and doc["record"]["current"]["group"] == "tp"
    main = doc["threads"][0]
    assert main["main"] and any(fr["func"] == "wait_for" for fr in main["stack"])  # the test thread, blocked
    assert any(t["name"] == "megascale-watchdog" for t in doc["threads"])
    assert logs[0].startswith("megascale: rank 0: no progress for 1")
    assert "in tp all_reduce #1 (step 3); stacks and in-flight ops in " in logs[0]
    assert logs[0].endswith(f"rank_00000.json; run: megascale diagnose {tmp_path}")
    assert "megascale diagnose: 1 ranks" in (hang / "diagnosis.txt").read_text()
    f.close()


def test_watchdog_takes_over_the_diagnosis_from_a_rank_that_stops(tmp_path):
    """Rank 0 (no watchdog here) is in flight and beating, so rank 1 waits for its verdict; once rank 0's
    heartbeat goes stale, rank 1 diagnoses itself, long before its wait would have run out."""
    inflight = tmp_path / "trace" / "inflight"
    hang = tmp_path / "trace" / "hang"
    f0, f1 = (InFlight(inflight, r, {"world": [0, 1]}, host="testhost", coords={}) for r in (0, 1))
    for f in (f0, f1):
        f.begin("world", "all_reduce")
        f.words[CUR_T0] = f.words[UPDATED_W] = time.time_ns() - 10 * S
    logs: list[str] = []
    wd = wdmod.Watchdog(f1, hang, 1, hang_timeout_s=0.5, action="dump", log=logs.append, interval_s=0.05,
                        collect_s=0.2, stale_s=0.5).start()
    t0 = time.monotonic()
    try:
        for _ in range(20):  # rank 0 alive for 1 s ...
            f0.heartbeat()
            time.sleep(0.05)
        assert not (hang / "diagnosis.txt").exists()  # ... and rank 1 waits for it
        assert wait_for(lambda: (hang / "diagnosis.txt").exists())  # ... then stops
    finally:
        wd.stop()
    assert time.monotonic() - t0 < 5
    verdict = (hang / "diagnosis.txt").read_text()
    assert "culprit: 0" in verdict and "rank 0 (host testhost, pid" in verdict and "not responding" in verdict
    f0.close()
    f1.close()


def test_watchdog_sigusr1_and_dump_from_outside(tmp_path):
    f = InFlight(tmp_path / "trace" / "inflight", 0, groups_of(0), host="testhost", coords={})
    hang = tmp_path / "trace" / "hang"
    logs: list[str] = []
    wd = wdmod.Watchdog(f, hang, 0, hang_timeout_s=60, action="dump", log=logs.append,
                        interval_s=0.05).start()
    try:
        assert wd._stacks_file is not None  # else SIGUSR1 would end this process
        os.kill(os.getpid(), signal.SIGUSR1)  # faulthandler writes the stacks, the thread the JSON
        assert wait_for(lambda: (hang / "rank_00000.json").exists())
        assert "File " in (hang / "stacks_rank_00000.txt").read_text()
        assert json.loads((hang / "rank_00000.json").read_text())["reason"] == "SIGUSR1"
        path = wd.dump("collective timed out", diagnose=False)
        assert json.loads(path.read_text())["reason"] == "collective timed out"
    finally:
        wd.stop()
    assert signal.getsignal(signal.SIGUSR1) != signal.SIG_IGN
    f.close()


def test_flight_recorder_helpers(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    assert wdmod.flight_recorder() == (None, "off (TORCH_FR_BUFFER_SIZE unset or 0)")
    assert not wdmod.enable_flight_recorder(0) and "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert wdmod.enable_flight_recorder(100) and os.environ["TORCH_FR_BUFFER_SIZE"] == "100"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "7")
    wdmod.enable_flight_recorder(100)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"  # the user's setting wins
    import torch  # noqa: F401 - the dump only uses an already imported torch

    fr, note = wdmod.flight_recorder()
    assert note == "ok" and "pg_ranks" in fr and "entries" in fr


ABORT = """
import sys, time
from pathlib import Path
from megascale.observe.inflight import InFlight, CUR_T0, UPDATED_W
from megascale.observe.watchdog import Watchdog
run = Path(sys.argv[1])
f = InFlight(run / "trace" / "inflight", 0, {"world": [0]}, host="h", coords={})
f.begin("world", "barrier")
f.words[CUR_T0] = f.words[UPDATED_W] = time.time_ns() - 5 * 10**9
Watchdog(f, run / "trace" / "hang", 0, 0.2, "abort", interval_s=0.05, collect_s=0.1).start()
time.sleep(20)
"""


def test_watchdog_abort_exits_3(tmp_path):
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", ABORT, str(tmp_path)], capture_output=True, text=True,
                       timeout=30, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 3, p.stderr
    assert "rank 0: no progress for 5 s in world barrier #1 (step 0)" in p.stderr
    assert "aborting" in p.stderr and (tmp_path / "trace" / "hang" / "diagnosis.txt").exists()
