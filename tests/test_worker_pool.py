"""The test harness's process pool (tests/_dist.py) says what went wrong with its workers: a worker
that dies is named at once, and a pool that hangs leaves every worker's stacks in the test's output
(a hang seen once in CI left nothing but "no answer in 300s")."""

from __future__ import annotations

import os
import time

import _dist
import pytest


def die_on_rank_1(rank: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def hang_forever(rank: int) -> None:
    time.sleep(3600)


def test_a_dead_worker_is_named_with_its_exit_code():
    pool = _dist.WorkerPool(2)
    try:
        with pytest.raises(RuntimeError, match=r"die_on_rank_1: workers died \(rank: exit code\) \{1: 3\}"):
            pool.run(die_on_rank_1)
        assert pool.run(abs) == [0, 1]  # and the next run starts a fresh pool
    finally:
        pool.close()


def test_a_hung_pool_dumps_every_workers_stacks(monkeypatch, capfd):
    pool = _dist.WorkerPool(2)
    try:
        assert pool.run(abs) == [0, 1]  # started: the workers' own timeouts stay 300 s
        monkeypatch.setattr(_dist, "TIMEOUT_S", 3)
        monkeypatch.setattr(_dist, "GRACE_S", 0)
        with pytest.raises(TimeoutError, match=r"hang_forever: no answer from ranks \[0, 1\]"):
            pool.run(hang_forever)
    finally:
        pool.close(force=True)
    err = capfd.readouterr().err
    assert err.count("hang_forever") == 2, err[-2000:]  # a frame's name is one write: whole even if
    # a busy machine delays one dump into the next
