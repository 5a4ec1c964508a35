"""Smoke test of benchmarks/init_scale.py on a 64-rank mesh: every store, both modes, real servers.

What matters is that the benchmark performs exactly the operations the generator describes (the
replay counts them), that what it extrapolates is the generator's own count, and that its rows are
complete. Wall times are never asserted. Needs redis-server (`make test` installs it): without it
the test fails, it does not skip.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from _bench import load_benchmark

from megascale.distributed.traffic import BACKENDS, MODES, count_ops, startup_traffic
from megascale.parallel.mesh import mesh_group_kinds

bench = load_benchmark("init_scale.py", "init_scale")

MESH = (16, 2, 2)  # dp, pp, tp: 64 ranks
WORLD = 64
KINDS = list(mesh_group_kinds(*MESH).values())
ROW_KEYS = {"ranks", "store", "mode", "backend", "steps", "ops", "wall_s", "replayed_ops", "measured_s",
            "ops_per_s", "extrapolated", "group_steps", "measured_group_steps", "server_cpu_s",
            "client_cpu_s", "server_util", "client_util", "other_util", "store_cpu_s", "connections",
            "connect_s", "refused", "bound", "store_version", "mesh", "threads"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_plan_is_the_generator_with_group_steps_cut(mode, backend):
    max_steps = 3
    plan = bench.make_plan(WORLD, KINDS, mode, backend, max_steps)
    full = list(startup_traffic(WORLD, KINDS, mode, backend))
    assert (plan.steps, plan.ops) == count_ops(iter(full))
    if mode == "local":
        assert not plan.extrapolated and [s.name for s in plan.replay] == [s.name for s in full]
        return
    n_groups = plan.group_steps
    kept = full[:1 + max_steps] + full[1 + n_groups:]  # init, the first groups, the steps after the groups
    assert [s.name for s in plan.replay] == [s.name for s in kept]
    for ours, theirs in zip(plan.replay, kept, strict=True):  # key for key
        assert dict(ours.rounds.items()) == dict(theirs.rounds.items())
    assert plan.skipped_ops == [s.num_ops for s in full[1 + max_steps:1 + n_groups]]
    if backend != "gloo":  # every group step is the same world barrier: what the extrapolation relies on
        assert set(plan.group_step_ops) == {3 * WORLD + 1}


def _replayed_ops(mode: str, max_steps: int, backend: str = "nccl") -> int:
    full = list(startup_traffic(WORLD, KINDS, mode, backend))
    if mode == "local":
        return count_ops(iter(full))[1]
    n_groups = bench.make_plan(WORLD, KINDS, mode, backend, max_steps).group_steps
    return count_ops(iter(full[:1 + max_steps] + full[1 + n_groups:]))[1]


def test_every_store_and_mode_replays_the_generators_operations():
    rows = bench.run_cases([MESH], bench.STORES, ("global", "local"), "nccl", threads=8, max_steps=3,
                           log=lambda _: None)
    cases = [(s, m) for s in bench.STORES for m in ("global", "local")]
    assert [(r["store"], r["mode"]) for r in rows] == cases
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["ranks"] == WORLD and r["connections"] == WORLD and r["refused"] is None
        assert r["ops"] == count_ops(startup_traffic(WORLD, KINDS, r["mode"], "nccl"))[1]
        assert r["replayed_ops"] == _replayed_ops(r["mode"], 3)
        assert r["extrapolated"] == (r["mode"] == "global")
        assert r["measured_group_steps"] == (3 if r["mode"] == "global" else 0)
        assert r["wall_s"] >= r["measured_s"] > 0 and r["ops_per_s"] > 0
        assert r["server_cpu_s"] >= 0 and r["client_cpu_s"] >= 0 and r["bound"] in {"store", "client", "both",
                                                                                       "latency"}
    text = "\n".join(bench.table(rows))
    assert "naive/ours" in text and "3/84*" in text


def test_gloo_replayed_in_full():
    mesh = (2, 2, 2)  # gloo's bootstrap is O(k^2) per group: a smaller mesh keeps this quick
    kinds = list(mesh_group_kinds(*mesh).values())
    rows = bench.run_cases([mesh], ("redis",), ("global", "local"), "gloo", threads=8, max_steps=10_000,
                           log=lambda _: None)
    assert len(rows) == 2
    for r in rows:
        assert not r["extrapolated"] and r["measured_group_steps"] == r["group_steps"]
        assert r["replayed_ops"] == r["ops"] == count_ops(startup_traffic(8, kinds, r["mode"], "gloo"))[1]


def test_a_store_that_refuses_connections_is_shared_round_robin():
    server = bench.RedisServer(max_clients=10)
    clients = []
    try:
        clients, _, refused = bench.connect(server, WORLD)
        assert 0 < len(clients) < WORLD and "max number of clients" in refused
        plan = bench.make_plan(WORLD, KINDS, "global", "nccl", max_steps=2)
        with ThreadPoolExecutor(8) as pool:
            replayer = bench.Replayer(clients, WORLD, pool, 8, server.cpu_seconds)
            row = bench.replay_case(plan, server, replayer, prefix="shared/")
        assert row["replayed_ops"] == _replayed_ops("global", 2)
    finally:
        for c in clients:
            bench.close_client(c)
        server.stop()
