"""The fault matrix on a simulated cluster: 2 hosts (network namespaces) x 2 ranks, one agent each.

A dp2 x tp2 job of 14 steps (float64, snapshots in host memory every 2 steps) runs fault-free, then
with a worker on host 1 killed by SIGKILL, then with all of host 1 (agent and workers) killed, its host
memory lost, and started again, as a cluster manager restarts a failed pod (its ranks' state then
comes from the replicas host 0 keeps). Each faulty run recovers with no person
involved and ends with the fault-free run's final weights, bit for bit. Then host 1 crashes and fails
its self-check at the restart: it is evicted, and a replacement host takes its place (exact again),
or, with `--nnodes 1:2` and `parallel.dp = 0`, the job goes on with dp 1 on one host (equal to
rounding: the same sums in another order).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _cluster import make_cluster

from megascale.checkpoint.model_state import read_model_state
from megascale.fault import blocklist
from megascale.observe.metrics import read_metrics
from megascale.observe.stragglers import costliest

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.dropout=0.0",
       "train.global_batch=8", "train.micro_batch=2", "train.steps=14", "train.eval_interval=0",
       "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9",
       "checkpoint.interval=0", "checkpoint.memory_interval=2", "parallel.dp=2", "parallel.tp=2",
       "train.dtype=fp64", "fault.heartbeat_interval_s=1", "fault.heartbeat_timeout_s=8",
       "fault.hang_timeout_s=10", "fault.selfcheck_min_speed=0", "distributed.timeout_s=120"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("corpus")
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]


def _agent(cluster, host: int, run: Path, data: list[str], fault: str = "", job: str = "job",
           nnodes: str = "2", extra: tuple[str, ...] = (), endpoint: str | None = None,
           wrap: tuple[str, ...] | list[str] = ()):
    env = {"OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": fault or None}
    argv = [sys.executable, "-m", "megascale", "launch", "--nnodes", nnodes, "--nproc-per-node", "2",
            "--rdzv-endpoint", endpoint or f"{cluster.addr(0)}:29400", "--rdzv-id", job,
            "--local-addr", cluster.addr(host), "--config", str(ROOT / "configs" / "cpu_default.toml"), *JOB,
            *data, f"train.run_dir={run}", *extra]
    run.parent.mkdir(parents=True, exist_ok=True)
    log = open(run.parent / f"host{host}.log", "a")  # noqa: SIM115 - the agent's, closed with the test
    return cluster.popen(host, [*wrap, *argv], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs, timeout: float = 300) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        codes.append(p.wait(timeout=max(1, deadline - time.time())))
    return codes


def _logs(run: Path) -> str:
    return "".join((run.parent / f"host{h}.log").read_text() for h in (0, 1, 2)
                   if (run.parent / f"host{h}.log").exists())


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return read_model_state(run)[1]


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory, data) -> Path:
    cluster = make_cluster(request, hosts=2)
    run = tmp_path_factory.mktemp("ref") / "run"
    codes = _wait([_agent(cluster, h, run, data, job="ref") for h in (0, 1)])
    assert codes == [0, 0], _logs(run)[-4000:]
    return run


def _equal(run: Path, reference: Path) -> None:
    ref, got = _weights(reference), _weights(run)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def _close(run: Path, reference: Path) -> None:
    """Final weights equal to rounding (float64): a shrunk job does the same sums in another order."""
    ref, got = _weights(reference), _weights(run)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)


# a 1:2 job's round waits this long for a second host (both start together here); after an eviction,
# with no spare coming, the survivor waits it out
SHRINK = ("parallel.dp=0", "fault.rendezvous_last_call_s=3")


def _shrinking(cluster, run: Path, data, tmp_path: Path, fault: str, job: str, *extra: str) -> list[int]:
    """Hosts 0 and 1 in a `--nnodes 1:2`, `parallel.dp = 0` job (each its own host memory) with `fault`;
    their exit codes."""
    return _wait([_agent(cluster, h, run, data, fault, job=job, nnodes="1:2",
                         extra=(*_own_memory(tmp_path, h), *SHRINK, *extra)) for h in (0, 1)])


def test_a_worker_killed_on_another_host_is_recovered_exactly(request, tmp_path, data, reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    codes = _wait([_agent(cluster, h, run, data, "kill@step:7:rank=3", job="kill") for h in (0, 1)])
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert re.search(r"crash: worker exit codes .*-9", logs) and "restart 1 of 3" in logs, logs[-4000:]
    # each surviving rank says in one line which peer it lost, in which op; no traceback under them (they
    # buried those lines: 100 lines in host 0's log, 18 now)
    assert re.search(r"megascale: rank \d: collective failed: .* lost .* in \w+ \w+ #\d+", logs), logs[-4000:]
    assert "Traceback" not in logs, logs[-4000:]
    _equal(run, reference)


def _host_1_dies_mid_run(cluster, run: Path, data, job: str, extra=lambda h: (), lose_memory=None) -> str:
    """Hosts 0 and 1 train; after 5 steps host 1 dies whole (agent and workers; `lose_memory`, a
    directory, with it) and its pod is started again 5 s later. Returns the agents' logs."""
    # the first attempt is slowed (0.3 s per forward, ~0.6 s a step) so the machine surely goes mid-run:
    # a fast CI machine once finished all 14 steps before the kill, and nothing was left to recover
    slow = "delay@forward:0.3"
    agents = [_agent(cluster, h, run, data, slow, job=job, extra=extra(h)) for h in (0, 1)]
    metrics = run / "metrics.jsonl"
    deadline, steps = time.time() + 240, 0
    while time.time() < deadline and steps < 5:  # let it train a few steps, then the machine goes
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        steps = sum('"kind": "train"' in x for x in lines)
        time.sleep(0.2)
    cluster.kill_host(1)  # agent and workers: the whole host
    assert 5 <= steps < 14, f"the kill must land mid-run (after {steps} of 14 steps)"
    agents[1].wait(timeout=30)
    if lose_memory is not None:
        shutil.rmtree(lose_memory)
    time.sleep(5)
    agents[1] = _agent(cluster, 1, run, data, job=job, extra=extra(1))  # the cluster manager starts it again
    codes = _wait(agents)
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert "restart 1 of 3" in logs, logs[-4000:]
    return logs


def test_a_dead_host_brought_back_rejoins_and_resumes_from_the_replicas_on_its_peer(request, tmp_path, data,
                                                                                   reference):
    """Host 1 dies whole and its pod is started again. Each host has its own host memory and there is no
    storage checkpoint before the end: host 1's snapshots die with it, and its ranks' state comes back
    from the copies host 0 keeps (checkpoint.memory_replicas), at the newest snapshot, not from
    scratch; the job ends with the fault-free run's weights."""
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"

    def memory(h: int) -> tuple[str, ...]:
        return (f"checkpoint.memory_dir={tmp_path / 'shm' / f'host{h}'}",)

    lost = tmp_path / "shm" / "host1"
    logs = _host_1_dies_mid_run(cluster, run, data, "replicas", memory, lose_memory=lost)
    assert "rank(s) 2, 3 lost their host-memory snapshot" in logs, logs[-4000:]
    resumed = re.search(r"resumed from memory at step (\d+) .*2 rank\(s\) from peer hosts", logs)
    assert resumed and int(resumed.group(1)) >= 4, logs[-4000:]
    _equal(run, reference)


def _own_memory(tmp_path: Path, host: int) -> tuple[str, ...]:
    """Storage checkpoints every 2 steps, and each host its own host memory (the simulated hosts share
    one /dev/shm; a real replacement machine does not have the evicted one's snapshots)."""
    return ("checkpoint.interval=2", f"checkpoint.memory_dir={tmp_path / 'shm' / f'host{host}'}")


def _evicted_after_a_crash(cluster, run: Path, data, tmp_path: Path, more: tuple[str, ...] = (),
                           **kw) -> list:
    """Hosts 0 and 1 train; host 1's workers die at step 7 and at the restart its self-check fails: it
    must be evicted (exit 4, on the blocklist) while host 0's agent restarts. Returns the agents."""
    a1 = cluster.addr(1)
    faults = f"kill@step:7:host={a1},fail@selfcheck:1:host={a1}:attempt=1"
    agents = [_agent(cluster, h, run, data, faults, extra=(*_own_memory(tmp_path, h), *more), **kw)
              for h in (0, 1)]
    assert agents[1].wait(timeout=240) == 4, _logs(run)[-4000:]
    assert "injected" in blocklist.entry(run, a1)["reason"], blocklist.read(run)
    return agents


def test_a_host_failing_its_selfcheck_is_evicted_and_a_replacement_takes_its_place(request, tmp_path, data,
                                                                                    reference):
    cluster = make_cluster(request, hosts=3)
    run = tmp_path / "run"
    agents = _evicted_after_a_crash(cluster, run, data, tmp_path, job="evict")
    # the survivor waits in a new rendezvous round; the cluster manager brings up a replacement machine
    spare = _agent(cluster, 2, run, data, job="evict", extra=_own_memory(tmp_path, 2))
    codes = _wait([agents[0], spare])
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert "is evicted (failed self-check, straggler or hang" in logs, logs[-4000:]
    # host 0 restarts on its workers' exit 5, or, if the replacement's join is seen first, for it
    assert "evict: another host was evicted" in logs or "membership: a host waits to join" in logs
    _equal(run, reference)  # resumed from storage (the replacement has no snapshot), same layout: exact
    # the evicted machine, started again by its pod's restart policy, is refused with the reason
    again = _agent(cluster, 1, run, data, job="evict")
    assert again.wait(timeout=60) == 4
    assert f"this host ({cluster.addr(1)}) was evicted from this run" in _logs(run)


def test_with_the_store_outside_the_job_the_first_host_is_evicted_and_replaced_too(request, tmp_path, data,
                                                                                  reference):
    """`megascale rdzv-store` on a host of its own: host 0, whose agent would otherwise serve the store
    (and could not leave without ending the job), crashes, fails its self-check, and is replaced."""
    cluster = make_cluster(request, hosts=4)
    run = tmp_path / "run"
    run.parent.mkdir(parents=True, exist_ok=True)
    out = run.parent / "store.log"
    with open(out, "w") as f:
        store = cluster.popen(3, [sys.executable, "-m", "megascale", "rdzv-store", "--bind", cluster.addr(3)],
                              cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while "serving on" not in out.read_text() and time.time() < deadline and store.poll() is None:
        time.sleep(0.1)
    assert "serving on" in out.read_text(), out.read_text()
    endpoint, a0 = f"{cluster.addr(3)}:29400", cluster.addr(0)
    faults = f"kill@step:7:host={a0},fail@selfcheck:1:host={a0}:attempt=1"
    agents = [_agent(cluster, h, run, data, faults, job="outside", endpoint=endpoint,
                     extra=_own_memory(tmp_path, h)) for h in (0, 1)]
    assert agents[0].wait(timeout=240) == 4, _logs(run)[-4000:]
    spare = _agent(cluster, 2, run, data, job="outside", endpoint=endpoint, extra=_own_memory(tmp_path, 2))
    codes = _wait([agents[1], spare])
    assert codes == [0, 0], _logs(run)[-4000:]
    assert f"this host ({a0}) is evicted" in _logs(run)
    _equal(run, reference)
    # the store outlives the job, and with it the job's closed rendezvous: the same command run again (two
    # more steps) ended in elastic's RendezvousClosedError; both hosts move on to the id's next generation,
    # the same one (a job of both hosts to step 16)
    again = _wait([_agent(cluster, h, run, data, job="outside", endpoint=endpoint,
                          extra=(*_own_memory(tmp_path, h), "train.steps=16")) for h in (1, 2)])
    logs = _logs(run)
    assert again == [0, 0], logs[-4000:]
    # the first host there moves it on; the other joins that generation (it may find it already moved)
    assert "closed by an earlier launch of this job; joining outside.1" in logs, logs[-4000:]
    assert "outside.2" not in logs, logs[-4000:]
    assert read_metrics(run / "metrics.jsonl", "train")[-1]["step"] == 16, logs[-4000:]
    store.terminate()
    assert store.wait(timeout=10) == 0 and "stopped by SIGTERM" in out.read_text(), out.read_text()


def test_without_a_replacement_the_job_shrinks_dp_and_ends_like_the_fault_free_run(request, tmp_path, data,
                                                                                   reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    agents = _evicted_after_a_crash(cluster, run, data, tmp_path, SHRINK, job="shrink", nnodes="1:2")
    codes = _wait([agents[0]])
    logs = _logs(run)
    assert codes == [0], logs[-4000:]
    layouts = [r["dp"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "layout"]
    assert layouts[0] == 2 and layouts[-1] == 1, layouts  # dp2 x tp2 on 2 hosts, then dp1 x tp2 on one
    # one host does the same arithmetic in another order (dp=1 sums the micro-batches, dp=2 all-reduces
    # them): equal to rounding, in float64
    _close(run, reference)
    def losses(r):
        return {m["step"]: m["loss"] for m in read_metrics(r / "metrics.jsonl") if m.get("kind") == "train"}
    want, have = losses(reference), losses(run)
    assert set(want) == set(have)
    for step in want:
        assert abs(want[step] - have[step]) <= 1e-9 * abs(want[step]), step


def test_a_straggling_host_is_evicted_when_asked_and_the_job_goes_on_without_it(request, tmp_path, data,
                                                                                reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    slow = f"delay@forward:0.1:host={cluster.addr(1)}"  # both of host 1's ranks: a slow machine
    codes = _shrinking(cluster, run, data, tmp_path, slow, "straggler", "fault.evict_stragglers=true",
                       "observe.straggler_window=2", "observe.straggler_windows=2")
    logs = _logs(run)
    assert codes == [0, 4], logs[-4000:]
    reason = blocklist.entry(run, cluster.addr(1))["reason"]
    assert reason.startswith("straggler: rank ") and "slower in" in reason, reason
    stragglers = read_metrics(run / "metrics.jsonl", "straggler")
    # host 1's ranks are flagged (on this loaded machine a host-0 rank may be too, far less slow: the
    # slowest one's host is the one evicted)
    assert cluster.addr(1) in {s["host"] for s in stragglers}, stragglers
    assert costliest(stragglers)["host"] == cluster.addr(1), stragglers
    layouts = [r["dp"] for r in read_metrics(run / "metrics.jsonl", "layout")]
    assert layouts[0] == 2 and layouts[-1] == 1, layouts
    _close(run, reference)


def test_a_straggling_host_that_serves_the_store_stays_and_the_job_goes_on(request, tmp_path, data,
                                                                          reference):
    """Host 0's agent serves the rendezvous store: evicting it for being slow would end the job, so it
    stays, with a warning saying why. (A shrinkable job: should host 1's ranks be flagged too, by a
    preemption on this shared machine, host 1 is evicted and host 0 finishes alone.)"""
    cluster = make_cluster(request, hosts=2)
    run, a0 = tmp_path / "run", cluster.addr(0)
    codes = _shrinking(cluster, run, data, tmp_path, f"delay@forward:0.1:host={a0}", "slowstore",
                       "fault.evict_stragglers=true", "observe.straggler_window=2",
                       "observe.straggler_windows=2")
    logs = _logs(run)
    assert codes[0] == 0 and codes[1] in (0, 4), logs[-4000:]
    assert re.search(rf"host {re.escape(a0)} is not evicted \(straggler: rank [01] .*serves the "
                     r"rendezvous store", logs), logs[-4000:]
    assert blocklist.entry(run, a0) is None
    stragglers = read_metrics(run / "metrics.jsonl", "straggler")
    assert costliest(stragglers)["host"] == a0, stragglers
    (_equal if codes[1] == 0 else _close)(run, reference)


def test_a_host_that_does_not_share_the_run_directory_is_refused_before_training(request, tmp_path, data):
    """Host 1 has a disk of its own at the run directory's path (a local disk, not the shared file system):
    its blocklist, hang diagnosis and checkpoints would be a host's, not the job's. Every rank stops at
    start-up (exit 2, not restarted) with one line naming the directory and the host that cannot see it."""
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    run.mkdir()
    private = ["sh", "-c", f'mount -t tmpfs tmpfs {run} && exec "$0" "$@"']  # in host 1's mount namespace
    agents = [_agent(cluster, 0, run, data, job="local")]
    agents.append(_agent(cluster, 1, run, data, job="local", wrap=private))
    codes = _wait(agents)
    logs = _logs(run)
    assert codes == [2, 2], logs[-4000:]
    said = (f"megascale train: error: train.run_dir {run}: host(s) {cluster.addr(1)} do not see the "
            f"directory rank 0 (host {cluster.addr(0)}) writes to.")
    for host in (0, 1):  # in each host's own log, once
        assert (run.parent / f"host{host}.log").read_text().count(said) == 1, logs[-4000:]
    assert "restarting" not in logs and not list(run.glob(".shared-*")), logs[-4000:]


def test_a_host_whose_copy_of_the_data_differs_is_refused_before_training(request, tmp_path, data):
    """Each host keeps its own copy of the corpus (data.path and data.source are host-local), and host 1's
    is from an older, shorter dump: its replica would train on another corpus with nothing failing (it
    did, to the end, exit 0 on both). Every rank stops at start-up (exit 2, not restarted) with one line
    naming the dataset, the host and both copies' sizes. Host 1's workers take 2 s longer to exit: host 0's
    agent, which serves the rendezvous store, waits for host 1's before it ends (it used to end first,
    and host 1's log filled with C++ connection errors, frames of stack each, under the line that said
    why)."""
    cluster = make_cluster(request, hosts=2)
    older = tmp_path / "older"
    older.mkdir()
    text = (ROOT / "data" / "shakespeare" / "sonnets_gut.txt").read_text()
    (older / "sonnets.txt").write_text(text[: len(text) * 2 // 3])
    stale = [f"data.source={json.dumps(str(older))}", f"data.path={json.dumps(str(older / 'ds'))}"]
    run = tmp_path / "run"
    slow = f"delay@exit:2:host={cluster.addr(1)}"
    codes = _wait([_agent(cluster, h, run, data if h == 0 else stale, slow, job="stale") for h in (0, 1)])
    logs = _logs(run)
    assert codes == [2, 2], logs[-4000:]
    host1 = (run.parent / "host1.log").read_text()
    assert not re.search(r"TCPStore|socket\.cpp|unreachable|frame #", host1), host1[-4000:]
    said = (f"megascale train: error: data.path: rank 2 (host {cluster.addr(1)}) reads other data than "
            f"rank 0 (host {cluster.addr(0)}): {older / 'ds'} there (1 document, ")
    for host in (0, 1):  # in each host's own log, once
        assert (run.parent / f"host{host}.log").read_text().count(said) == 1, logs[-4000:]
    assert "restarting" not in logs and not (run / "checkpoints").exists(), logs[-4000:]


def test_a_host_launched_with_another_nnodes_is_refused_before_training(request, tmp_path, data):
    """With parallel.dp = 0 no config field holds the host count: host 1, started with --nnodes 1:2 while
    the job is --nnodes 2, may close a round of its own and train alone. When the hosts meet, every rank
    stops at start-up (exit 2, not restarted) with one line naming the launch argument and the host."""
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    codes = _wait([_agent(cluster, h, run, data, job="nnodes", nnodes="2" if h == 0 else "1:2",
                          extra=("parallel.dp=0",)) for h in (0, 1)])
    logs = _logs(run)
    assert codes == [2, 2], logs[-4000:]
    said = (f"megascale train: error: the ranks' configs differ: rank 2 (host {cluster.addr(1)}; 2 of 4 "
            f"ranks differ from rank 0, host {cluster.addr(0)}): --nnodes = '1:2' there, '2' on rank 0. "
            "Launch every host with the same config, overrides, --nnodes and --nproc-per-node")
    for host in (0, 1):  # in each host's own log, once
        assert (run.parent / f"host{host}.log").read_text().count(said) == 1, logs[-4000:]
    assert "restarting" not in logs and not (run / "checkpoints").exists(), logs[-4000:]


@pytest.mark.parametrize("bad", [0, 1])
def test_a_host_that_cannot_start_its_agent_tells_the_others_why(request, tmp_path, data, bad):
    """One host's config file is missing (its shared file system not mounted): its `megascale launch`
    ends before its agent starts. The other host waited out the rendezvous timeout (120 s) and ended with
    "fewer than 2 host(s) joined" (exit 1); now it reads the refusal from the rendezvous store and ends at
    once, exit 2, with the bad host's line, whether the bad host is the one whose agent would have served
    the store (it serves one just for this) or not."""
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    missing = ("--config", str(tmp_path / "unmounted" / "job.toml"))
    codes = _wait([_agent(cluster, h, run, data, job=f"refuse{bad}", extra=missing if h == bad else ())
                   for h in (0, 1)], timeout=60)
    logs = _logs(run)
    assert codes == [2, 2], logs[-4000:]
    said = re.search(r"megascale launch: error: (config file .* does not exist)", logs).group(1)
    other = (run.parent / f"host{1 - bad}.log").read_text()
    told = f"megascale launch: host {cluster.addr(bad)} will not join this job: {said}; ending here"
    assert told in other, logs
    assert not re.search(r"TCPStore|socket\.cpp|unreachable|frame #|Traceback", logs), logs[-4000:]


def test_when_the_store_host_is_evicted_the_others_end_at_once_saying_why(request, tmp_path, data):
    """Host 0, whose agent serves the store, crashes and fails its self-check: it leaves (exit 4) and
    the store with it. Host 1 does not wait out the 120 s join timeout: the store's host is on the
    blocklist and does not come back, so its agent ends (exit 1) naming the cause and the way out."""
    cluster = make_cluster(request, hosts=2)
    run, a0 = tmp_path / "run", cluster.addr(0)
    faults = f"kill@step:7:host={a0},fail@selfcheck:1:host={a0}:attempt=1"
    codes = _wait([_agent(cluster, h, run, data, faults, job="storegone", extra=_own_memory(tmp_path, h))
                   for h in (0, 1)], timeout=240)
    logs = _logs(run)
    assert codes == [4, 1], logs[-4000:]
    # it gave up at its first failed call in the new round, not after a line every 10 s for 120 s
    retries = (run.parent / "host1.log").read_text().count("unreachable (joining the next round)")
    assert retries <= 1, logs[-4000:]
    assert re.search(rf"the rendezvous store at {re.escape(a0)}:29400 is gone \(.*\): its host "
                     rf"{re.escape(a0)} was evicted \(.*injected.*\) and does not come back\. .*megascale "
                     "rdzv-store", logs), logs[-4000:]
    assert "Traceback" not in logs.split("is gone (")[-1], logs[-4000:]


def test_a_hung_rank_is_named_and_the_job_goes_on_without_its_host(request, tmp_path, data, reference):
    """The second rank of host 1 blocks in step 7 (a stuck kernel: its threads beat, its step stays): the
    agents see no new step for the hang timeout, the diagnosis names that rank, its host is evicted, and
    the job goes on with dp 1 on host 0, ending like the fault-free run."""
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    a1 = cluster.addr(1)
    codes = _shrinking(cluster, run, data, tmp_path, f"hang@step:7:host={a1}:local=1", "hang")
    logs = _logs(run)
    assert codes == [0, 4], logs[-4000:]
    reason = blocklist.entry(run, a1)["reason"]
    # the culprit named is a rank of host 1 that was in no collective (tp1: the host's second rank) while
    # the others waited for it
    assert re.match(rf"hang: rank \d+ \(dp\d pp0 tp1, host {re.escape(a1)}, pid \d+\) is alive but in no "
                    "collective", reason), reason
    assert f"evicting host {a1}" in logs, logs[-4000:]
    assert (run / "trace" / "hang" / "driver_diagnosis.txt").exists()
    layouts = [r["dp"] for r in read_metrics(run / "metrics.jsonl", "layout")]
    assert layouts[0] == 2 and layouts[-1] == 1, layouts
    _close(run, reference)
    # each agent's own event log in the shared run directory (fault/events.py), and the report's account
    from megascale.fault.events import log_path, read_events
    from megascale.observe.report import section_faults

    by_host = {h: [e for e in read_events(run) if e["host"] == h] for h in (cluster.addr(0), a1)}
    assert all(log_path(run, h).is_file() for h in by_host)
    kinds = {h: [e["kind"] for e in events] for h, events in by_host.items()}
    assert kinds[a1][0] == "start" and "evicted" in kinds[a1] and by_host[a1][-1]["code"] == 4, kinds
    assert kinds[cluster.addr(0)][0] == "start" and "restart" in kinds[cluster.addr(0)], kinds
    assert by_host[cluster.addr(0)][-1] == {**by_host[cluster.addr(0)][-1], "kind": "end", "code": 0}, kinds
    assert any(k == "hang" for ks in kinds.values() for k in ks), kinds
    page = section_faults(run, {k: read_metrics(run / "metrics.jsonl", k) for k in ("train", "layout")})
    assert "2 agent start(s) on 2 host(s)" in page and "1 host(s) evicted" in page and "ETTR " in page, page
    # the hang's time: the steps since the newest snapshot (under the half second the line shows, when the
    # hang came soon after it), the hang timeout (10 s from the step that did not end), then the restart
    noticed = re.search(r"the rest: [\d.]+ s start-up, (?:[\d.]+ s lost steps, )?([\d.]+) s detection, "
                        r"[\d.]+ s recovery", page)
    assert noticed and float(noticed[1]) >= 9.5, page


def test_a_full_disk_and_a_rotten_shard_cost_checkpoints_not_the_run(request, tmp_path, data, reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    a1 = cluster.addr(1)
    # storage only (no host memory), written before the next step: the step-4 write fails as on a full
    # disk, a shard of step 6 rots once committed, and host 1's workers die at step 7. The restart finds
    # step 6 damaged and step 4 never written, and resumes from step 2.
    faults = f"full@write:4,corrupt@committed:6:host={a1},kill@step:7:host={a1}"
    disk = ("checkpoint.interval=2", "checkpoint.memory=false", "checkpoint.async_persist=false")
    codes = _wait([_agent(cluster, h, run, data, faults, job="disk", extra=disk) for h in (0, 1)])
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    # (the metrics of steps after the resume point are rewritten by the resumed run: the log keeps these)
    assert re.search(r"persisting step 4 .* failed \(OSError: \[Errno 28\] No space left on device", logs)
    assert re.search(r"step_000006/__\d_0.distcp: checksum mismatch \(corrupted\); falling back", logs)
    assert "restart 1 of 3" in logs and "resumed from storage at step 2" in logs, logs[-4000:]
    starts = [r["step"] for r in read_metrics(run / "metrics.jsonl", "layout")]
    assert starts == [0, 2], starts  # resumed from step 2
    _equal(run, reference)


def test_a_link_down_longer_than_the_hang_timeout_is_recovered_exactly(request, tmp_path, data, reference):
    # (a link down for 8 s is absorbed by TCP's retransmissions: the job stalls and goes on with no restart;
    # 14 s is past fault.hang_timeout_s = 10 s, so host 0's agent restarts, and host 1's once it is back)
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    agents = [_agent(cluster, h, run, data, "delay@forward:0.3", job="link") for h in (0, 1)]
    metrics = run / "metrics.jsonl"
    deadline, steps = time.time() + 240, 0
    while time.time() < deadline and steps < 5:
        steps = len(read_metrics(metrics, "train")) if metrics.exists() else 0
        time.sleep(0.2)
    cluster.link_down(1)  # `ip link set eth down` inside host 1: its route goes, nothing gets through
    assert 5 <= steps < 14, f"the link must fail mid-run (after {steps} of 14 steps)"
    time.sleep(14)
    cluster.link_up(1)
    codes = _wait(agents)
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert "restart 1 of 3" in logs, logs[-4000:]
    _equal(run, reference)


def test_a_redis_store_restarted_mid_run_serves_the_next_restart(request, tmp_path, data, reference):
    cluster = make_cluster(request, hosts=2)
    url = cluster.start_store("redis", host=0)
    run = tmp_path / "run"
    # the ranks meet through a Redis outside the job; it crashes (its keys gone) and is started again
    # mid-run, then host 1's workers die: the restart meets through the new Redis
    faults = f"delay@forward:0.3,kill@step:9:host={cluster.addr(1)}"
    agents = [_agent(cluster, h, run, data, faults, job="redis", extra=(f"distributed.store={url}",))
              for h in (0, 1)]
    metrics = run / "metrics.jsonl"
    deadline, steps = time.time() + 240, 0
    while time.time() < deadline and steps < 4:
        steps = len(read_metrics(metrics, "train")) if metrics.exists() else 0
        time.sleep(0.2)
    cluster.stop_store(url)
    assert cluster.start_store("redis", host=0) == url
    assert 4 <= steps < 9, f"the store must restart before the crash (after {steps} steps)"
    codes = _wait(agents)
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    where = url.split("//")[1].rsplit("/", 1)[0]
    assert "restart 1 of 3" in logs and f"redis at {where}" in logs, logs[-4000:]
    _equal(run, reference)


@pytest.mark.parametrize("preempted", [0, 1])
def test_sigterm_to_one_hosts_agent_stops_every_host_with_a_checkpoint_and_quiet_logs(request, tmp_path, data,
                                                                                      preempted):
    """A scheduler preempts one host's pod (SIGTERM to its agent): host 0's, which serves the rendezvous
    store, or host 1's. Every rank saves at the agreed step and every agent ends 143, not restarted. The
    store's agent ends last, after the other has said it is done with the store: when it ended first,
    the other's log filled with C++ connection errors under its "stopped" line; when the other, being
    signalled, did not say so, the store's agent waited for it."""
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    agents = [_agent(cluster, h, run, data, "delay@forward:0.2", job=f"pre{preempted}",
                     extra=("train.steps=400",)) for h in (0, 1)]
    deadline = time.time() + 240
    while time.time() < deadline and len(read_metrics(run / "metrics.jsonl", "train")
                                         if (run / "metrics.jsonl").exists() else []) < 3:
        time.sleep(0.2)
    agents[preempted].send_signal(signal.SIGTERM)
    codes = _wait(agents, timeout=120)
    logs = _logs(run)
    assert codes == [143, 143], logs[-4000:]
    step = int(re.search(r"stopped by SIGTERM after step (\d+); checkpoint", logs).group(1))
    assert (run / "checkpoints" / f"step_{step:06d}" / "COMMIT.json").exists(), logs[-4000:]
    assert "restarting" not in logs and "did not say within" not in logs, logs[-4000:]
    assert not re.search(r"TCPStore|socket\.cpp|unreachable|frame #", logs), logs[-4000:]


def test_a_stopped_host_is_seen_by_its_own_beats_and_recovered_exactly(request, tmp_path, data, reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    # host 1's workers SIGSTOP themselves at step 7 (a frozen machine): their beats stop, and host 1's agent,
    # reading its own beat store, restarts; host 0's workers, blocked on them, are restarted with it
    codes = _wait([_agent(cluster, h, run, data, f"stop@step:7:host={cluster.addr(1)}", job="stop")
                   for h in (0, 1)])
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert re.search(r"no heartbeat: rank [23] \(pid \d+\) sent no heartbeat", logs), logs[-4000:]
    _equal(run, reference)


def test_a_nan_loss_on_one_host_rolls_the_job_back_like_one_process(request, tmp_path, data, monkeypatch):
    """Host 1's loss of step 5 turns NaN: the all-reduced loss is NaN on every rank, so every rank rolls
    back to the step-4 snapshot in host memory and skips the window's batches, with no restart; the run
    ends like the same rollback in one process (float64, to rounding: dp2 x tp2 sums in another order)."""
    from megascale.config import load_config
    from megascale.fault import inject
    from megascale.train import Trainer

    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    codes = _wait([_agent(cluster, h, run, data, f"nan@step:5:host={cluster.addr(1)}", job="nan")
                   for h in (0, 1)])
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert "restart 1 of" not in logs, logs[-4000:]  # rolled back inside the job
    (rb,) = read_metrics(run / "metrics.jsonl", "rollback")
    assert rb["step"] == 6 and rb["restored_step"] == 4 and rb["source"] == "memory", rb

    one = tmp_path / "one"
    monkeypatch.setenv("MEGASCALE_INJECT", "nan@step:5")
    monkeypatch.setattr(inject, "_FIRED", set())
    cfg = load_config(ROOT / "configs" / "cpu_default.toml",
                      [*JOB, "parallel.dp=1", "parallel.tp=1", *data, f"train.run_dir={one}"])
    t = Trainer(cfg, quiet=True)
    t.fit()
    t.close()
    assert read_metrics(one / "metrics.jsonl", "rollback")[0]["skipped_batches"] == rb["skipped_batches"]

    def losses(r):
        return [(m["step"], m["loss"]) for m in read_metrics(r / "metrics.jsonl", "train")]
    want, have = losses(one), losses(run)
    assert [s for s, _ in want] == [s for s, _ in have]
    for (step, a), (_, b) in zip(want, have, strict=True):
        assert abs(a - b) <= 1e-9 * abs(a), step
    _close(run, one)
