"""`data.shared_loader`: one reader per host, its ranks' rows from a ring in shared memory.

* the ring itself (one process): a slot is taken only complete and for its own position (stamp,
  position and checksum), a file of another job is refused, stale files of dead leaders are removed, a
  consumer whose leader is gone or whose batch never comes raises instead of waiting; a host's two
  consumers (threads) stepping in lockstep and repositioned at random (rollbacks, skips) get every
  batch, with no stall;
* the loader on 4 gloo processes (synthetic samples that count their reads): the same batches as
  `BatchLoader` on every rank for tp4, dp2 x tp2 (one host and two simulated hosts) and pp4 (the
  middle stages read nothing), through a reposition; each sample read once per host, by its leader;
  a failed read stops every rank of the host with the same error;
* the real Trainer, flag on vs off, float64: per-step losses, grad norms and the final weights
  equal exactly for dp2 x tp2 (over a blend of two datasets), pp4 and tp2; exact resume with the flag
  on (and from a checkpoint taken with it off); `megascale train --nproc 2` with the flag on gives
  the flag-off run's losses and weights;
* config: a bad value is one error naming data.shared_loader.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from _dist import one_thread_fixture, pools_fixture  # noqa: F401 - the fixtures are found by their names
from _parity import SyntheticSamples

from megascale.checkpoint import list_checkpoints, read_model_state
from megascale.config import ConfigError, load_config
from megascale.data import preprocess
from megascale.data.loader import BatchLoader
from megascale.data.shared_loader import (
    _NAME,
    PREFIX,
    W_PID,
    Ring,
    SharedBatchLoader,
    _alive,
    _produce,
    default_dir,
    remove_stale,
)
from megascale.errors import UserError
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
B, SEQ = 8, 16


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------ the ring, one process


def _ring(path: Path, **kw) -> Ring:
    layout = {"nonce": 0xABC, "batch": B, "per": 4, "seq": SEQ, "replicas": 2, "slots": 3, "consumers": 2,
              "num_samples": 100, "seed": 7} | kw
    return Ring.create(path, **layout)


def test_a_slot_is_taken_only_complete_and_for_its_own_position(tmp_path):
    ring = _ring(tmp_path / f"{PREFIX}t-p{os.getpid()}")
    tokens = np.arange(2 * 4 * (SEQ + 1), dtype=np.int64).reshape(8, SEQ + 1)
    assert ring.try_take(0, 0) is None  # never written
    ring.put(0, tokens)
    for replica, rows in ((0, tokens[:4]), (1, tokens[4:])):  # (inputs, targets) of each replica's rows
        x, y = ring.try_take(0, replica)
        assert np.array_equal(x, rows[:, :-1]) and np.array_equal(y, rows[:, 1:])
    assert ring.slot_of(3 * B) == ring.slot_of(0)
    assert ring.try_take(3 * B, 0) is None  # the same slot, another position: stale for this reader
    ring.slot_rows[0][1, 1, 2, 3] += 1  # a half-written (or torn) replica: its checksum no longer matches
    assert ring.try_take(0, 1) is None and ring.try_take(0, 0) is not None
    ring.put(0, tokens)
    ring.slot_words[0][0] = 0  # the stamp while the producer writes
    assert ring.try_take(0, 0) is None
    # the producer's window: every consumer attached, and none needing the batch a slot still holds
    assert not ring.window_open(0)  # no consumer attached yet
    ring.ack(0, 0), ring.ack(1, 0)
    assert ring.window_open(0) and ring.window_open(2 * B) and not ring.window_open(3 * B)
    ring.ack(1, B)  # one consumer moved on, the other still needs position 0
    assert not ring.window_open(3 * B) and not ring.window_open(0)  # (0 is behind the one that moved on)


def test_a_ring_of_another_job_or_layout_is_refused(tmp_path):
    path = tmp_path / f"{PREFIX}t-p{os.getpid()}"
    _ring(path)
    want = {"nonce": 0xABC, "batch": B, "per": 4, "seq": SEQ, "replicas": 2, "slots": 3, "consumers": 2,
            "num_samples": 100, "seed": 7}
    Ring.attach(path, want)
    with pytest.raises(UserError, match=r"data.shared_loader: .* not this job's batch ring: nonce 2748"):
        Ring.attach(path, want | {"nonce": 0xABD})
    with pytest.raises(UserError, match="seed 7 .expected 8."):
        Ring.attach(path, want | {"seed": 8})


def test_stale_ring_files_of_dead_leaders_are_removed(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    stale = [tmp_path / f"{PREFIX}run-a0-0123456789ab-r0-p{dead}",
             tmp_path / f"{PREFIX}run-a1-0123456789ab-r4-p{dead}.part"]
    keep = [tmp_path / f"{PREFIX}run-a2-0123456789ac-r0-p{live}", tmp_path / "other-p1"]
    for p in stale + keep:
        p.write_bytes(b"x")
    assert sorted(remove_stale(tmp_path)) == sorted(stale)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in stale)


def _on_ring(ring: Ring, samples: SyntheticSamples, me: int = 0, leader: bool = True,
             **kw) -> SharedBatchLoader:
    """A one-process loader wired to `ring` as the host's consumer `me` of replica 0 would be (the leader,
    rank 0, produces too), without the start-up's collectives."""
    loader = SharedBatchLoader(samples, B, seed=7, **kw)
    loader.ring, loader.mode, loader.replicas, loader._me, loader._replica = ring, "ring", [0], me, 0
    loader.is_leader, loader.leader = leader, 0
    return loader


def _consumer_of(ring: Ring, timeout_s: float) -> SharedBatchLoader:
    """A one-process loader wired to `ring` as a non-leader consumer would be."""
    return _on_ring(ring, SyntheticSamples(100, SEQ, 50), leader=False, dp_size=2, timeout_s=timeout_s)


def test_a_consumer_never_waits_for_ever(tmp_path):
    ring = _ring(tmp_path / f"{PREFIX}t-p{os.getpid()}")
    ring.put(3 * B, np.zeros((8, SEQ + 1), dtype=np.int64))  # slot 0 holds a later batch: not position 0's
    with pytest.raises(RuntimeError, match="sample 0 not in the host's ring after 0 s"):
        _consumer_of(ring, 0.2).next_batch()
    ring.words[W_PID] = _dead_pid()
    with pytest.raises(RuntimeError, match=r"the host's loader \(rank 0, pid \d+\) is gone"):
        _consumer_of(ring, 60).next_batch()


def test_the_producer_looks_at_a_full_ring_a_few_times_a_step(tmp_path):
    # a host's leader that is also its one consumer, taking a batch every 0.2 s: the producer's window
    # opens once a step, and in between it looks at the ring a few times a step (about every 25 ms
    # here), not every 2 ms (500 looks a second, idle included)
    ring = _ring(tmp_path / f"{PREFIX}t-p{os.getpid()}", consumers=1, replicas=1, per=B)
    samples = SyntheticSamples(100, SEQ, 50)
    shared, plain = _on_ring(ring, samples), BatchLoader(samples, B, seed=7)
    ring.ack(0, 0)
    looks, window_open = [], ring.window_open
    ring.window_open = lambda position: looks.append(position) or window_open(position)
    try:
        for _ in range(6):  # the same batches as the plain loader
            got, want = shared.next_batch(), plain.next_batch()
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            time.sleep(0.2)
        before = len(looks)
        time.sleep(1.0)  # idle: the ring stays full
        idle = len(looks) - before
    finally:
        shared.close(), plain.close()
    print(f"\nthe producer looked {idle} times in an idle second")
    assert 0 < idle < 150


def test_the_producer_passes_a_batch_the_consumers_took_from_before_a_reposition(tmp_path):
    """After a rollback the ring may still hold a batch (2B here) the consumers take before the producer
    gets to it; the producer, restarted behind them, must not wait for them to come back (they never
    will): it passes the held batch and writes the next one (3B). Before, it waited for ever at 2B."""
    ring = _ring(tmp_path / f"{PREFIX}t-p{os.getpid()}", consumers=1, replicas=1, per=B)
    samples = SyntheticSamples(100, SEQ, 50)
    shared = _on_ring(ring, samples)
    ring.ack(0, 2 * B)
    shared._fill(2 * B)  # written before the reposition
    ring.ack(0, 3 * B)  # the consumer took it from the ring and needs 3B next
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(weakref.ref(shared), ring, 2 * B, stop), daemon=True)
    producer.start()
    try:
        deadline = time.monotonic() + 10
        while not ring.holds(3 * B) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ring.holds(3 * B)
        want = BatchLoader(samples, B, seed=7)
        want.load_state_dict({"consumed_samples": 3 * B})
        got = ring.try_take(3 * B, 0)
        assert got is not None and np.array_equal(got[0], want.next_batch()[0].numpy())
        want.close()
    finally:
        stop.set()
        producer.join()
        shared.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_a_tp_pair_repositioned_at_random_gets_every_batch_and_never_waits_for_ever(tmp_path, seed):
    """The ring's protocol under what a job does to it: a host's two consumers of one replica (a tp pair:
    the leader, which also produces, and a peer) take a batch a step in lockstep, each a little late now
    and then, and every few steps both reposition (a rollback or a skip, up to past the ring's length,
    the peer a little after the leader, as ranks reach an agreed step). Every batch must be the plain
    loader's at its position, and none may wait past the loader's timeout (10 s here, where a step
    takes ms). With the producer waiting for a batch the ring already held (before d219b5a) 11 of 12
    such seeds stalled."""
    ring = _ring(tmp_path / f"{PREFIX}t-p{os.getpid()}", consumers=2, replicas=1, per=B)
    samples = SyntheticSamples(100, SEQ, 50)
    rng = random.Random(seed)
    steps, plan, want, at = 150, [], {}, 0  # plan[s]: where both reposition before step s (None: nowhere)
    plain = BatchLoader(samples, B, seed=7, prefetch=0)
    for _ in range(steps):
        plan.append(max(0, at + B * rng.choice([-6, -3, -2, -1, 1, 2, 5])) if rng.random() < 0.08 else None)
        at = plan[-1] if plan[-1] is not None else at
        plain.load_state_dict({"consumed_samples": at})
        want[at] = plain.next_batch()[0]
        at += B
    plain.close()

    loaders = [_on_ring(ring, samples, me, leader=me == 0, timeout_s=10) for me in (0, 1)]
    for me in (0, 1):
        ring.ack(me, 0)
    step_done = threading.Barrier(2, timeout=60)  # the step's collective
    failures: list[str] = []

    def rank(me: int) -> None:
        loader, jitter = loaders[me], random.Random(10 * seed + me)
        try:
            for s in range(steps):
                step_done.wait()
                if plan[s] is not None:
                    time.sleep(jitter.random() * 0.01)
                    loader.load_state_dict({"consumed_samples": plan[s]})
                time.sleep(jitter.random() * 0.004)
                p = loader.consumed_samples
                if not torch.equal(loader.next_batch()[0], want[p]):
                    failures.append(f"rank {me}, step {s}: not the batch at {p}")
                    step_done.abort()
                    return
        except threading.BrokenBarrierError:
            return
        except Exception as e:  # a timeout: the other rank's barrier breaks too
            failures.append(f"rank {me}: {e}")
            step_done.abort()

    threads = [threading.Thread(target=rank, args=(me,), daemon=True) for me in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank still waits after 120 s"
        assert not failures, failures
    finally:
        for loader in loaders:
            loader.close()


def test_one_process_loads_as_the_plain_loader():
    samples = SyntheticSamples(40, SEQ, 50)
    shared, plain = SharedBatchLoader(samples, B, seed=3), BatchLoader(samples, B, seed=3)
    assert shared.mode == "local"
    for _ in range(7):
        assert all(torch.equal(a, b) for a, b in zip(shared.next_batch(), plain.next_batch(), strict=True))
    assert shared.state_dict() == plain.state_dict()
    shared.close(), plain.close()


@pytest.mark.parametrize("override, expect", [
    ("data.shared_loader=maybe", "data.shared_loader: expected bool, got 'maybe'"),
    ("data.shared_loader=1", "data.shared_loader: expected bool, got 1"),
])
def test_a_bad_value_names_the_field(override, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(None, [override])
    assert load_config(None, ["data.shared_loader=true"]).data.shared_loader is True


def test_validation_names_the_field(tmp_path):
    from megascale.config import validate

    cfg = load_config(None, [])
    cfg.data.shared_loader = "yes"
    with pytest.raises(ConfigError, match="data.shared_loader: must be true or false, got 'yes'"):
        validate(cfg)
    toml = tmp_path / "c.toml"
    toml.write_text("[data]\nshared_loader = 2\n")
    with pytest.raises(ConfigError, match="data.shared_loader"):
        load_config(toml)


# ----------------------------------------------------------------------- the loader, 4 gloo processes


class CountingSamples(SyntheticSamples):
    """Synthetic samples that record every index read (one list per process)."""

    def __init__(self, *a, fail_at_call: int | None = None):
        super().__init__(*a)
        self.read: list[int] = []
        self.calls, self.fail_at_call = 0, fail_at_call

    def batch(self, indices):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise UserError("data: the disk is on fire")
        self.read.extend(int(i) for i in indices)
        return super().batch(indices)


# rank -> (dp_rank, dp_size, consumer, host); tp varies fastest, as in the mesh
GRIDS = {
    "tp4": lambda r: (0, 1, True, "h"),
    "dp2-tp2": lambda r: (r // 2, 2, True, "h"),
    "dp2-tp2-two-hosts": lambda r: (r // 2, 2, True, f"h{r // 2}"),
    "pp4": lambda r: (0, 1, r in (0, 3), "h"),
    "dp4": lambda r: (r, 4, True, "h"),  # nothing read twice on the host: no ring, each reads its own
}
STEPS, BACK_TO = 12, 5  # steps, then a reposition to the batch of step BACK_TO, then STEPS - BACK_TO more


def loader_on_rank(rank: int, grid: str):
    dp_rank, dp_size, consumer, host = GRIDS[grid](rank)
    samples = CountingSamples(512, SEQ, 50)  # more than the run reads: every index appears once in the stream
    shared = SharedBatchLoader(samples, B, seed=11, dp_rank=dp_rank, dp_size=dp_size, consumer=consumer,
                               host=host)
    if shared.is_leader:  # the name is gone once everyone mapped the ring: a crash leaves nothing
        assert shared.ring_path is None or not shared.ring_path.exists()
    plain = BatchLoader(SyntheticSamples(512, SEQ, 50), B, seed=11, dp_rank=dp_rank, dp_size=dp_size)
    same, before = [], 0
    for step in range(2 * STEPS - BACK_TO):
        if step == STEPS:  # every rank at the same point, as a resume or a rollback does
            state = {**plain.state_dict(), "consumed_samples": BACK_TO * B}
            shared.load_state_dict(state), plain.load_state_dict(state)  # (the producer stops here)
            before = len(samples.read)
        got, want = shared.next_batch(), plain.next_batch()
        if consumer:
            same.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
        else:  # a middle stage: a placeholder of the right shape
            same.append(got[0].shape == want[0].shape and not got[0].any())
    assert shared.state_dict() == plain.state_dict()
    shared.close(), plain.close()
    stream = plain.stream_indices(0, (STEPS + shared.slots) * B)  # what was consumed, and the look-ahead
    return {"same": same, "read": samples.read, "before": before, "mode": shared.mode,
            "leader": shared.is_leader, "host": host, "dp_rank": dp_rank, "stream": stream.tolist(),
            "per": B // dp_size}


@pytest.mark.parametrize("grid", list(GRIDS))
def test_the_host_reads_each_sample_once_and_every_rank_gets_its_rows(pools, grid):
    results = pools(4).run(loader_on_rank, grid)
    assert all(all(r["same"]) for r in results)
    modes = {"tp4": ["ring"] * 4, "dp2-tp2": ["ring"] * 4, "dp2-tp2-two-hosts": ["ring"] * 4,
             "pp4": ["ring", "idle", "idle", "ring"], "dp4": ["local"] * 4}
    assert [r["mode"] for r in results] == modes[grid]
    for host in sorted({r["host"] for r in results}):
        mine = [r for r in results if r["host"] == host]
        readers = [r for r in mine if r["read"]]
        if grid == "dp4":  # each reads its own replica's rows, as BatchLoader (check rank 0's)
            assert len(readers) == 4
            mine = readers = readers[:1]
        assert len(readers) == 1 and readers[0]["leader"]  # one reader per host: its leader
        read, first = readers[0]["read"], readers[0]["read"][:readers[0]["before"]]
        assert len(first) == len(set(first))  # up to the reposition: no sample twice
        per, stream = mine[0]["per"], np.array(mine[0]["stream"]).reshape(-1, B)
        replicas = sorted({r["dp_rank"] for r in mine})
        needed = {int(i) for step in range(STEPS) for d in replicas
                  for i in stream[step, d * per:(d + 1) * per]}
        assert needed <= set(first)  # ... all of the host's replicas' rows, and nothing else's
        assert set(read) <= {int(i) for d in replicas for i in stream[:, d * per:(d + 1) * per].ravel()}


def failing_on_rank(rank: int):
    samples = CountingSamples(512, SEQ, 50, fail_at_call=3)
    loader = SharedBatchLoader(samples, B, seed=11, dp_rank=rank // 2, dp_size=2)
    try:
        for _ in range(10):
            loader.next_batch()
    except UserError as e:
        return str(e)
    finally:
        loader.close()
    return None


def test_a_failed_read_stops_every_rank_of_the_host(pools):
    assert pools(4).run(failing_on_rank) == ["data: the disk is on fire"] * 4


# ------------------------------------------------------------------------------- the real Trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, list[str]]:
    """Overrides for a one-dataset run and for a blend of two (built here, once)."""
    d = tmp_path_factory.mktemp("corpus")
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "sonnets_gut.txt"):
        shutil.copy(ROOT / "data" / "shakespeare" / name, d / name)
    preprocess([d / "hamlet_gut.txt"], d / "hamlet", "byte", workers=1, progress=False)
    preprocess([d / "macbeth_gut.txt", d / "sonnets_gut.txt"], d / "rest", "byte", workers=1, progress=False)
    blend = json.dumps([[0.7, str(d / "hamlet")], [0.3, str(d / "rest")]])
    return {"one": [f"data.path={json.dumps(str(d / 'hamlet'))}", "data.source="],
            "blend": [f"data.blend={blend}", "data.source="]}


def overrides(data: list[str], run_dir: Path, *extra: str) -> list[str]:
    return [
        "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.dropout=0.0",
        "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=3", "optim.grad_clip=0.5",
        "train.dtype=fp64", "train.global_batch=8", "train.micro_batch=2", "train.steps=8",
        "train.eval_interval=0", "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0",
        "log.peak_flops=1e9", "checkpoint.interval=0", *data, f"train.run_dir={json.dumps(str(run_dir))}",
        *extra,
    ]


def trainer_on_rank(rank: int, args: list[str], split_at: int | None = None, resume_args=None):
    """Trainer(cfg).fit() on every rank: (losses, one-process weights on rank 0, loader stats, mode);
    with split_at, stop there and resume in a fresh Trainer (of resume_args, if given)."""
    if split_at is None:
        trainer = Trainer(load_config(None, args), quiet=True)
        losses = trainer.fit()["losses"]
    else:
        losses = Trainer(load_config(None, args), quiet=True).fit(max_steps=split_at)["losses"]
        trainer = Trainer(load_config(None, resume_args or args), quiet=True)
        assert trainer.step == split_at
        losses += trainer.fit()["losses"]
    full = trainer.engine.full_model_state()  # collective
    mode = getattr(trainer.loader, "mode", None)
    return losses, full if rank == 0 else None, dict(trainer.loader.stats), mode


def metrics(run_dir: Path, field: str) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r[field] for r in map(json.loads, lines) if r["kind"] == "train"]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# name: (world, data, parallel overrides, the modes with the flag on, replicas on the host)
TRAINER_LAYOUTS = {
    "dp2-tp2-blend": (4, "blend", ["parallel.dp=2", "parallel.tp=2", "parallel.dp_bucket_size=3000"],
                      ["ring"] * 4, 2),
    # (observe.timers=false: the Observer cannot place a middle stage in an "emb" group yet, session.py)
    "pp4": (4, "one", ["parallel.pp=4", "observe.timers=false"], ["ring", "idle", "idle", "ring"], 1),
    "tp2": (2, "one", ["parallel.tp=2", "parallel.sequence_parallel=true"], ["ring"] * 2, 1),
}
REFERENCE: dict[str, tuple] = {}  # name -> the flag-off run's (losses, weights), for the CLI test


@pytest.mark.parametrize("name", list(TRAINER_LAYOUTS))
def test_trainer_flag_on_equals_off(pools, data, tmp_path, name):
    world, which, parallel, modes, replicas = TRAINER_LAYOUTS[name]
    pool = pools(world)
    off = pool.run(trainer_on_rank, overrides(data[which], tmp_path / "off", *parallel,
                                              "data.shared_loader=false"))
    on = pool.run(trainer_on_rank, overrides(data[which], tmp_path / "on", *parallel,
                                             "data.shared_loader=true"))
    assert on[0][0] == off[0][0] and all(r[0] == on[0][0] for r in on)  # every step's loss, exactly
    assert metrics(tmp_path / "on", "grad_norm") == metrics(tmp_path / "off", "grad_norm")
    assert _same_weights(on[0][1], off[0][1])  # the final weights, bit for bit
    assert [r[3] for r in on] == modes
    reads_on, reads_off = [r[2]["rows_read"] for r in on], [r[2]["rows_read"] for r in off]
    assert all(n > 0 for n in reads_off)  # without it every rank reads (middle pipeline stages too)
    # with it the leader alone, each of the host's rows once: 1 / (ranks per replica) of what they read
    assert reads_on[0] > 0 and not any(reads_on[1:])
    assert reads_on[0] <= sum(reads_off) * replicas // world + B, (reads_on, reads_off)
    REFERENCE[name] = (off[0][0], off[0][1])

    if name == "dp2-tp2-blend":  # exact resume with the flag on, and from a flag-off checkpoint
        split = pool.run(trainer_on_rank, overrides(data[which], tmp_path / "split", *parallel,
                                                    "data.shared_loader=true"), 3)
        assert split[0][0] == off[0][0] and _same_weights(split[0][1], off[0][1])
        args_off = overrides(data[which], tmp_path / "mixed", *parallel, "data.shared_loader=false")
        mixed = pool.run(trainer_on_rank, args_off, 5, [*args_off, "data.shared_loader=true"])
        assert mixed[0][0] == off[0][0] and [r[3] for r in mixed] == modes


def test_cli_nproc_2_with_the_flag_gives_the_flag_off_run(pools, data, tmp_path):
    """`megascale train --nproc 2` (torch elastic, LOCAL_RANK set) with the flag on: the flag-off tp2 run
    of the pool, loss for loss and weight for weight; no ring file is left behind."""
    parallel = TRAINER_LAYOUTS["tp2"][2]
    if "tp2" not in REFERENCE:  # run alone (-k): make the reference here
        off = pools(2).run(trainer_on_rank, overrides(data["one"], tmp_path / "off", *parallel,
                                                      "data.shared_loader=false"))
        REFERENCE["tp2"] = (off[0][0], off[0][1])
    losses, weights = REFERENCE["tp2"]
    run = tmp_path / "cli"
    args = overrides(data["one"], run, *parallel, "data.shared_loader=true")
    r = subprocess.run([sys.executable, "-m", "megascale", "train", "--nproc", "2", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(run, "loss") == losses
    (_, ckpt), = list_checkpoints(run)
    assert _same_weights(read_model_state(ckpt)[1], weights)
    left = [p for p in default_dir().glob(f"{PREFIX}*")
            if (m := _NAME.match(p.name)) and not _alive(int(m[1]))]
    assert not left  # the job's processes are gone, and so is its ring
