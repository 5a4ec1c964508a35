"""The fault matrix on a simulated cluster: 2 hosts (network namespaces) x 2 ranks, one agent each.

A dp2 x tp2 job of 14 steps (float64, snapshots in host memory every 2 steps) runs fault-free, then
with a worker on host 1 killed by SIGKILL, then with all of host 1 (agent and workers) killed and
started again, as a cluster manager restarts a failed pod. Each faulty run recovers with no person
involved and ends with the fault-free run's final weights, bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _cluster import make_cluster

from megascale.checkpoint.model_state import read_model_state

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.dropout=0.0",
       "train.global_batch=8", "train.micro_batch=2", "train.steps=14", "train.eval_interval=0",
       "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9",
       "checkpoint.interval=0", "checkpoint.memory_interval=2", "parallel.dp=2", "parallel.tp=2",
       "train.dtype=fp64", "fault.heartbeat_interval_s=1", "fault.heartbeat_timeout_s=5",
       "fault.hang_timeout_s=10", "fault.selfcheck_min_speed=0", "distributed.timeout_s=120"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("corpus")
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]


def _agent(cluster, host: int, run: Path, data: list[str], fault: str = "", job: str = "job"):
    env = {"OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": fault or None}
    argv = [sys.executable, "-m", "megascale", "launch", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-endpoint", f"{cluster.addr(0)}:29400", "--rdzv-id", job,
            "--local-addr", cluster.addr(host), "--config", str(ROOT / "configs" / "cpu_default.toml"), *JOB,
            *data, f"train.run_dir={run}"]
    run.parent.mkdir(parents=True, exist_ok=True)
    log = open(run.parent / f"host{host}.log", "a")  # noqa: SIM115 - the agent's, closed with the test
    return cluster.popen(host, argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs, timeout: float = 300) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        codes.append(p.wait(timeout=max(1, deadline - time.time())))
    return codes


def _logs(run: Path) -> str:
    return "".join((run.parent / f"host{h}.log").read_text() for h in (0, 1)
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


def test_a_worker_killed_on_another_host_is_recovered_exactly(request, tmp_path, data, reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    codes = _wait([_agent(cluster, h, run, data, "kill@step:7:rank=3", job="kill") for h in (0, 1)])
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert re.search(r"crash: worker exit codes .*-9", logs) and "restart 1 of 3" in logs, logs[-4000:]
    _equal(run, reference)


def test_a_dead_host_brought_back_rejoins_and_the_job_ends_exactly(request, tmp_path, data, reference):
    cluster = make_cluster(request, hosts=2)
    run = tmp_path / "run"
    # the first attempt is slowed (0.3 s per forward, ~0.6 s a step) so the machine surely goes mid-run:
    # a fast CI machine once finished all 14 steps before the kill, and nothing was left to recover
    slow = "delay@forward:0.3"
    agents = [_agent(cluster, h, run, data, slow, job="host") for h in (0, 1)]
    metrics = run / "metrics.jsonl"
    deadline, steps = time.time() + 240, 0
    while time.time() < deadline and steps < 5:  # let it train a few steps, then the machine goes
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        steps = sum('"kind": "train"' in x for x in lines)
        time.sleep(0.2)
    cluster.kill_host(1)  # agent and workers: the whole host
    assert 5 <= steps < 14, f"the kill must land mid-run (after {steps} of 14 steps)"
    agents[1].wait(timeout=30)
    time.sleep(5)
    agents[1] = _agent(cluster, 1, run, data, job="host")  # the cluster manager starts it again
    codes = _wait(agents)
    logs = _logs(run)
    assert codes == [0, 0], logs[-4000:]
    assert "restart 1 of 3" in logs, logs[-4000:]
    _equal(run, reference)
