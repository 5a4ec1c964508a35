"""Process-group creation: both modes give working groups, and the store traffic they cause is
exactly what `megascale.distributed.traffic` generates for the scale benchmark.

Eight real gloo processes start a job over a RecordingStore for each (mesh, mode), create the
mesh's groups through the real code path, run a collective on every group, and return every
store operation they performed. The test process hosts the stores (on ports the OS picks), so no
port is chosen, released and then taken by another test's job before a rank binds it.
"""

from __future__ import annotations

import collections
import datetime
import math
import multiprocessing as mp
import queue
import time

import pytest
import torch
import torch.distributed as dist
from _dist import mp_context

from megascale.distributed.groups import create_groups
from megascale.distributed.recording_store import RecordingStore
from megascale.distributed.traffic import count_ops, startup_traffic
from megascale.parallel.mesh import GROUP_KINDS, create_mesh_groups, group_ranks, mesh_group_kinds

WORLD = 8
CASES = [((2, 2, 2), "local"), ((2, 2, 2), "global"), ((1, 4, 2), "local"), ((1, 4, 2), "global"),
         ((2, 1, 4), "local")]


def _record(rank: int, ports: list[int], results: mp.Queue) -> None:
    from megascale.distributed.groups import init_barrier

    torch.set_num_threads(1)
    out = []
    try:
        for ((dp, pp, tp), mode), port in zip(CASES, ports, strict=True):
            inner = dist.TCPStore("127.0.0.1", port, WORLD, False,
                                  timeout=datetime.timedelta(seconds=120))
            store = RecordingStore(inner)
            with init_barrier(mode == "global"):
                dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
            groups = create_mesh_groups(dp, pp, tp, rank, mode)
            ops = list(store.ops)
            sums = {}
            for kind, group in groups.items():
                if group is not None:
                    x = torch.tensor([float(rank)])
                    dist.all_reduce(x, group=group)
                    sums[kind] = x.item()
            out.append((ops, sums))
            dist.barrier()
            dist.destroy_process_group()
        results.put((rank, out))
    except BaseException as e:  # pragma: no cover - reported by the test
        results.put((rank, repr(e)))
        raise


@pytest.fixture(scope="module")
def recorded():
    ctx = mp_context()
    results = ctx.Queue()
    # held here, so the port stays bound from before any rank starts until every rank is done
    servers = [dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) for _ in CASES]
    procs = [ctx.Process(target=_record, args=(r, [s.port for s in servers], results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    by_rank: dict[int, object] = {}
    deadline = time.monotonic() + 300
    try:
        while len(by_rank) < WORLD:
            try:
                rank, out = results.get(timeout=1)
            except queue.Empty:
                # a rank that died without a word (killed, or crashed in C++) fails the test now
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                assert not dead, f"ranks died (rank, exit code): {dead}"
                silent = set(range(WORLD)) - set(by_rank)
                assert time.monotonic() < deadline, f"no answer in 300 s from ranks {silent}"
                continue
            # one rank's error is the cause; the others would only time out behind it
            assert not isinstance(out, str), f"rank {rank}: {out}"
            by_rank[rank] = out
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del servers
    return by_rank


@pytest.mark.parametrize("case", range(len(CASES)))
def test_groups_work_and_traffic_matches_the_generator(recorded, case):
    (dp, pp, tp), mode = CASES[case]
    kinds = mesh_group_kinds(dp, pp, tp)
    # every group is real: the sum over it of the ranks equals the sum of its members
    for r in range(WORLD):
        _, sums = recorded[r][case]
        for kind in GROUP_KINDS:
            expect = [sum(g) for g in kinds.get(kind, []) if r in g]
            assert sums.get(kind) == (float(expect[0]) if expect else None), (kind, r)
    # every rank's store operations are the generated ones, key for key
    generated = {r: [] for r in range(WORLD)}
    barrier_keys = collections.Counter()
    for step in startup_traffic(WORLD, list(kinds.values()), mode, "gloo"):
        for r, rounds in step.rounds.items():
            generated[r] += [(o.op, o.key) for ops in rounds for o in ops if o.op != "set_if_last"]
            barrier_keys.update(o.key for ops in rounds for o in ops if o.op == "set_if_last")
    last_worker_sets = collections.Counter()
    for r in range(WORLD):
        ops, _ = recorded[r][case]
        real = [op for op in ops if not (op[0] == "set" and op[1].endswith(":last_worker"))]
        last_worker_sets.update(k for op, k in ops if op == "set" and k.endswith(":last_worker"))
        assert collections.Counter(real) == collections.Counter(generated[r]), f"rank {r}"
        assert [op for op in real if op[0] in ("set", "add")] == \
            [op for op in generated[r] if op[0] in ("set", "add")], f"rank {r}: order of writes"
    # the barrier's last arrival is timing: some rank (at least one) sets each last_worker key
    assert set(last_worker_sets) == set(barrier_keys)
    total = sum(len(recorded[r][case][0]) for r in range(WORLD))
    steps, counted = count_ops(startup_traffic(WORLD, list(kinds.values()), mode, "gloo"))
    assert counted - len(barrier_keys) == total - sum(last_worker_sets.values())


def test_local_mode_is_linear_global_is_quadratic():
    """The point of the ordering: O(N) store operations instead of O(N^2), as N grows at fixed tp, pp."""
    def ops(world, mode):
        kinds = list(mesh_group_kinds(world // 16, 2, 8).values())
        return count_ops(startup_traffic(world, kinds, mode, "nccl"))[1]

    def exponent(mode):  # d log(ops) / d log(N) from N = 256 to 1024
        return math.log(ops(1024, mode) / ops(256, mode), 4)

    assert exponent("local") == pytest.approx(1.0, abs=0.02)
    assert exponent("global") > 1.9  # G groups x N ranks, G ~ N (less a few groups of fixed count)


def test_duplicate_rank_lists_are_created_once():
    # pp = 1: the model-parallel group is the tensor-parallel one
    assert group_ranks(2, 1, 4, "mp") == group_ranks(2, 1, 4, "tp")
    kinds = mesh_group_kinds(2, 1, 4)
    assert list(kinds) == ["tp", "dp", "mp"]
    steps = list(startup_traffic(8, list(kinds.values()), "local", "gloo"))
    assert [s.name for s in steps] == ["init_process_group", "kind 0", "kind 1", "kind 2"]
    assert steps[-1].rounds == {}  # the mp kind creates nothing new


def test_create_groups_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="group_init"):
        create_groups([[[0]]], 0, "fast")
