"""Start-up through the real CLI and launcher: each store and each group-init mode trains.

`megascale train --nproc N` with `distributed.store` = redis:// (a real redis-server started
here), tcp-legacy, and a Redis that is not there; and `distributed.group_init` local and
global, which must give the same losses (the way groups are made changes no arithmetic).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _redis import free_port, redis_server_fixture  # noqa: F401 - the fixture is found by its name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("sonnets")
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets.txt")
    cache = tmp_path_factory.mktemp("sonnets_cache")  # its own: another module's dataset may sit at ../cache
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(cache / 'ds'))}"]


def _args(data: list[str], run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", "configs/cpu_default.toml", "model.n_layers=2", "model.d_model=32",
            "model.n_heads=4", "model.seq_len=16", "train.global_batch=8", "train.micro_batch=2",
            "train.steps=3", "train.eval_interval=0", "log.progress=false", "log.tensorboard=false",
            "log.sample_tokens=0", "log.peak_flops=1e9", "checkpoint.interval=0", *data,
            f"train.run_dir={json.dumps(str(run_dir))}", *extra]


def _start(nproc: int, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megascale", "train", "--nproc", str(nproc), *args[1:]],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out, err


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_four_processes_train_through_redis(data, tmp_path, redis_server):
    client = redis_server.client()
    before = set(client.keys("megascale/*"))
    out, _ = _finish(_start(4, _args(data, tmp_path / "run", "parallel.dp=2", "parallel.tp=2",
                                     f"distributed.store={redis_server.url}")))
    startup = next(line for line in out.splitlines() if "start-up (rank 0):" in line)
    assert f"redis at 127.0.0.1:{redis_server.port}/0" in startup and "local group init" in startup
    for phase in ("store", "init process group", "groups", "first collective"):
        assert phase in startup
    assert len(_losses(tmp_path / "run")) == 3
    record, = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "startup"]
    assert {"imports", "store", "init_process_group", "groups", "first_collective"} <= record.keys()
    # the job's keys are in Redis, under one prefix of its own (job = the launcher's run id, attempt 0)
    new = {k.decode() for k in set(client.keys("megascale/*")) - before}
    prefixes = {k.split("/kv")[0] for k in new if k.endswith("/kv")}
    assert len(prefixes) == 1 and prefixes.pop().endswith("/0"), new


def test_two_jobs_share_one_redis_and_the_modes_agree(data, tmp_path, redis_server):
    """Two jobs at once on one Redis (different run ids, so different prefixes) do not see each
    other's keys: both train, with the losses of the same job started the naive way on tcp-legacy."""
    store = f"distributed.store={redis_server.url}"
    jobs = [_start(2, _args(data, tmp_path / f"job{i}", "parallel.dp=2", store)) for i in range(2)]
    for job in jobs:
        _finish(job)
    naive = _args(data, tmp_path / "naive", "parallel.dp=2", "distributed.store=tcp-legacy",
                  "distributed.group_init=global")
    out, _ = _finish(_start(2, naive))
    assert "tcp-legacy (hosted by rank 0" in out and "global group init" in out
    assert _losses(tmp_path / "job0") == _losses(tmp_path / "job1") == _losses(tmp_path / "naive")


def test_unreachable_redis_is_one_clear_error(data, tmp_path):
    port = free_port()  # nothing listens there
    t0 = time.perf_counter()
    proc = _start(2, _args(data, tmp_path / "run", "parallel.dp=2", f"distributed.store=redis://127.0.0.1:{port}/0",
                           "distributed.timeout_s=20"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"distributed.store: cannot reach Redis at 127.0.0.1:{port}/0" in lines[0], err
    assert time.perf_counter() - t0 < 90  # imports, then a refused connection: no wait for the timeout
    assert not (tmp_path / "run").exists()
