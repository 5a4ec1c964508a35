"""Snapshots replicated into a peer host's memory (checkpoint/replica.py), on 4 gloo ranks as 2 hosts.

Ranks 0-1 are host "a" and ranks 2-3 host "b" (MEGASCALE_HOST_ID, each host its own memory
directory). Host b then dies whole: its memory directory is deleted, and restarted managers must
bring its ranks' state back from host a's replicas, not from storage.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _dist import WorkerPool

from megascale.checkpoint.replica import ring_peers
from megascale.checkpoint.shards import Chunk
from megascale.config import Config

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(WORLD)
    yield p
    p.close()


def test_the_ring_pairs_each_rank_with_the_next_host():
    hosts = ["a", "a", "b", "b"]
    assert [ring_peers(hosts, r)[0] for r in range(4)] == [2, 3, 0, 1]
    assert [ring_peers(hosts, r)[1] for r in range(4)] == [[2], [3], [0], [1]]
    three = ["a", "a", "b", "c", "c"]  # uneven hosts: every rank sends to one on another host
    dests = [ring_peers(three, r)[0] for r in range(5)]
    assert dests == [2, 2, 3, 0, 1]
    assert all(three[d] != three[r] for r, d in enumerate(dests))
    assert ring_peers(["a", "a"], 0) == (None, [])  # one host: a copy there dies with the original


class _State:
    """The manager's view of a trainer: one weight box and its optimizer."""

    def __init__(self, w: torch.Tensor, rank: int):
        self.w, self.rank = w, rank
        self.optimizer = torch.optim.SGD([w], lr=0.1)

    def model_chunks(self):
        return [Chunk(f"model/w{self.rank}", tuple(self.w.shape), (0, 0), self.w, True)]

    def optimizer_chunks(self):
        return []

    def broadcast_weights(self):
        pass


def _manager(rank: int, tmp: Path, replicas: bool, lines: list):
    from megascale.checkpoint.manager import CheckpointManager

    host = "a" if rank < 2 else "b"
    os.environ["MEGASCALE_HOST_ID"] = host
    cfg = Config()
    cfg.checkpoint.memory_dir = str(tmp / "shm" / host)
    cfg.checkpoint.writer_process = False
    cfg.checkpoint.async_persist = False
    cfg.checkpoint.broadcast_restore = False
    cfg.checkpoint.memory_replicas = replicas
    # the layout is the same on every rank (it is part of each snapshot's identity)
    return CheckpointManager(cfg, tmp / "run", SimpleNamespace(dp=WORLD), rank, WORLD, {"dp": WORLD},
                             lines.append)


def _host_b_dies(rank: int, tmp: str, replicas: bool, damage: bool) -> dict:
    tmp = Path(tmp)
    lines: list[str] = []
    try:
        w = torch.full((5, 3), float(rank), dtype=torch.float64)
        state = _State(w, rank)
        mgr = _manager(rank, tmp, replicas, lines)
        for step in (2, 4):
            w += 1
            mgr.before_update()
            mgr.save(step, state, {"loader": {"step": step}}, persist_it=step == 2)  # step 2 also in storage
        mgr.before_update()
        mgr.wait()
        mgr.wait_replicas()
        mgr.close()
        held = sorted(mgr.replicas.held().items()) if mgr.replicas is not None else []
        dist.barrier()
        if rank == 2:  # host b dies whole: its memory with it
            shutil.rmtree(tmp / "shm" / "b")
        if damage and rank == 0:  # host a's replica of rank 2 is cut short
            for f in (tmp / "shm" / "a").rglob("replica-rank00002-*.bin"):
                os.truncate(f, 8)
        dist.barrier()
        w.zero_()
        again = _manager(rank, tmp, replicas, lines)  # the restarted job
        info = again.restore(state)
        again.close()
        return {"step": info.step, "source": info.source, "from_peers": info.from_peers, "w": w.clone(),
                "held": held, "lines": lines, "loader": info.extra.get("loader")}
    finally:
        os.environ.pop("MEGASCALE_HOST_ID", None)


def test_a_host_lost_whole_restores_from_its_peers_replicas(pool, tmp_path):
    out = pool.run(_host_b_dies, str(tmp_path), True, False)
    for rank, r in enumerate(out):
        assert (r["step"], r["source"], r["from_peers"]) == (4, "memory", 2), r
        assert torch.equal(r["w"], torch.full((5, 3), rank + 2.0, dtype=torch.float64)), rank
        assert r["loader"] == {"step": 4}
    # each rank of host a holds both complete replicas (steps 4 and 2) of its partner on host b, and back
    assert [r["held"] for r in out] == [[(2, [4, 2])], [(3, [4, 2])], [(0, [4, 2])], [(1, [4, 2])]]
    assert any("lost their host-memory snapshot" in x and "ranks 2, 3" not in x and "2, 3" in x
               for x in out[0]["lines"]), out[0]["lines"]
    assert list((tmp_path / "shm" / "b").rglob("rank00002.slot*.json")), "installed as rank 2's own snapshot"


def test_without_replicas_the_lost_host_means_storage(pool, tmp_path):
    out = pool.run(_host_b_dies, str(tmp_path), False, False)
    for rank, r in enumerate(out):
        assert (r["step"], r["source"], r["from_peers"]) == (2, "storage", 0), r
        assert torch.equal(r["w"], torch.full((5, 3), rank + 1.0, dtype=torch.float64)), rank


def test_a_damaged_replica_falls_back_to_storage_on_every_rank(pool, tmp_path):
    out = pool.run(_host_b_dies, str(tmp_path), True, True)
    for rank, r in enumerate(out):
        assert (r["step"], r["source"]) == (2, "storage"), r
        assert torch.equal(r["w"], torch.full((5, 3), rank + 1.0, dtype=torch.float64)), rank
    said = out[0]["lines"] + out[2]["lines"]
    assert any("cannot be used" in x and "shorter than its header" in x for x in said), said


def test_a_memory_snapshot_is_skipped_not_waited_for_while_both_slots_are_taken(tmp_path):
    """Slot A is being persisted (pinned), slot B holds the newest snapshot: a snapshot for memory only
    takes nothing and returns at once (training would otherwise stall for the rest of the persist), and
    both earlier snapshots stay intact; once A is released the next one goes into it."""
    from megascale.checkpoint.snapshot import HostSnapshot

    w = torch.zeros(4, dtype=torch.float64)
    snaps = HostSnapshot(tmp_path, 0, {"rank": 0}, background=False)

    def chunks():
        return [Chunk("model/w", (4,), (0,), w, True)]

    w += 1
    assert snaps.take(1, chunks(), {}, pin=True)  # stage 2 holds it
    w += 1
    assert snaps.take(2, chunks(), {})
    w += 1
    assert not snaps.take(3, chunks(), {}, wait=False)
    assert snaps.find() == [2, 1]
    snaps.release(1)
    assert snaps.take(3, chunks(), {}, wait=False)
    assert snaps.find() == [3, 2]
    snaps.close()
