"""Eviction's parts that need no cluster: the blocklist, `megascale launch` refusing an evicted host and
`--unblock`, `parallel.dp = 0`, and where injected faults fire (rank, host, attempt).

The eviction itself, a replacement host and a job that shrinks are tested on the simulated cluster in
test_cluster_faults.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megascale.config import ConfigError, check_world_size, load_config
from megascale.fault import blocklist, inject

ROOT = Path(__file__).resolve().parents[1]


def _launch(*args: str, run: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascale", "launch", *args, "--config",
                           "configs/cpu_default.toml", f"train.run_dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_blocklist_keeps_every_host_written_at_once(tmp_path):
    threads = [threading.Thread(target=blocklist.add, args=(tmp_path, f"10.0.0.{i}", f"bad {i}"))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    listed = blocklist.read(tmp_path)
    assert sorted(listed) == sorted(f"10.0.0.{i}" for i in range(16))
    assert listed["10.0.0.3"]["reason"] == "bad 3"
    assert blocklist.remove(tmp_path, "10.0.0.3") and not blocklist.remove(tmp_path, "10.0.0.3")
    assert blocklist.entry(tmp_path, "10.0.0.3") is None and blocklist.entry(tmp_path, "10.0.0.4")


def test_an_evicted_host_is_refused_until_unblocked(tmp_path):
    run = tmp_path / "run"
    blocklist.add(run, "198.18.9.9", "host 198.18.9.9 rank 2: self-check failed: memory: pattern 0xAA")
    r = _launch("--local-addr", "198.18.9.9", run=run)
    assert r.returncode == 4, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "this host (198.18.9.9) was evicted from this run" in line and "pattern 0xAA" in line
    assert "--unblock 198.18.9.9" in line
    from megascale.fault.events import read_events

    (refused,) = read_events(run)  # the run's event log keeps the refusal, on the host's own file
    assert (refused["kind"], refused["host"]) == ("refused", "198.18.9.9") and "0xAA" in refused["detail"]
    r = _launch("--unblock", "198.18.9.9", run=run)
    assert r.returncode == 0 and "is off the blocklist" in r.stdout, r.stderr
    assert blocklist.read(run) == {}


def test_a_host_count_that_may_change_needs_dp_from_the_world(tmp_path):
    r = _launch("--nnodes", "1:2", "--nproc-per-node", "2", "parallel.dp=2", run=tmp_path / "run")
    assert r.returncode == 2 and "parallel.dp = 0" in r.stderr, r.stderr[-2000:]


def test_dp_zero_takes_the_world_that_tp_and_pp_leave():
    cfg = load_config(ROOT / "configs" / "cpu_default.toml",
                      ["parallel.dp=0", "parallel.tp=2", "train.global_batch=8", "train.micro_batch=2"])
    check_world_size(cfg, 4, "WORLD_SIZE")
    assert cfg.parallel.dp == 2
    cfg = load_config(ROOT / "configs" / "cpu_default.toml", ["parallel.dp=0", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="parallel.dp = 0 .* 3 is not a multiple"):
        check_world_size(cfg, 3, "WORLD_SIZE")
    # the batch must still split over the dp it gets: checked again once dp is known
    cfg = load_config(ROOT / "configs" / "cpu_default.toml",
                      ["parallel.dp=0", "train.global_batch=6", "train.micro_batch=2"])
    with pytest.raises(ConfigError, match="train.global_batch"):
        check_world_size(cfg, 2, "WORLD_SIZE")


def test_injected_faults_fire_on_their_rank_host_and_attempt(monkeypatch):
    monkeypatch.setenv("MEGASCALE_HOST_ID", "h1")
    f, = inject._parse("kill@step:7:host=h1:rank=2")
    assert (f.rank, f.host, f.attempt) == (2, "h1", None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert inject.here(f, 2) and not inject.here(f, 3)
    monkeypatch.setenv("MEGASCALE_HOST_ID", "h0")
    assert not inject.here(f, 2)
    g, = inject._parse("fail@selfcheck:1:host=h0:attempt=1")
    assert not inject.here(g, 0)  # attempt 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert inject.here(g, 0) and not inject.here(f._replace(host="h0"), 2)  # step faults: attempt 0 only
    assert inject.here(f._replace(host="h0"), 2, default_attempt=None)
    h, = inject._parse("hang@step:7:host=h0:local=1")  # the second rank of host h0, whatever its rank
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert inject.here(h, 3)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not inject.here(h, 3)
    with pytest.raises(ValueError, match="'node=1' is not rank=R, host=H, local=L or attempt=K"):
        inject._parse("kill@step:3:node=1")
