"""The (dp, pp, tp) mesh: coordinates and groups (pure), the world-size error, real groups on 2 ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from _dist import WorkerPool

from megascale.config import ParallelConfig
from megascale.errors import UserError
from megascale.parallel.mesh import (
    Mesh,
    check_world_size,
    coordinates,
    group_ranks,
    rank_grid,
    tp_across_hosts,
)

SHAPES = [(1, 1, 1), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2), (3, 2, 4), (2, 4, 1)]


@pytest.mark.parametrize("dp,pp,tp", SHAPES)
def test_coordinates_follow_the_picotron_grid(dp, pp, tp):
    grid = rank_grid(dp, pp, tp)
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        rank = int(grid[d, p, t])
        assert coordinates(rank, dp, pp, tp) == (d, p, t)
    assert grid.flatten().tolist() == list(range(dp * pp * tp))
    # tensor-parallel ranks are adjacent
    assert all(g == list(range(g[0], g[0] + tp)) for g in group_ranks(dp, pp, tp, "tp"))


@pytest.mark.parametrize("dp,pp,tp", SHAPES)
def test_groups_partition_the_world_along_one_axis(dp, pp, tp):
    world = dp * pp * tp
    sizes = {"tp": tp, "pp": pp, "dp": dp, "mp": tp * pp}
    for kind, size in sizes.items():
        groups = group_ranks(dp, pp, tp, kind)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        for g in groups:
            coords = [coordinates(r, dp, pp, tp) for r in g]
            fixed = {"tp": (0, 1), "pp": (0, 2), "dp": (1, 2), "mp": (0,)}[kind]
            assert len({tuple(c[i] for i in fixed) for c in coords}) == 1  # same coordinates elsewhere


def test_concrete_layout_dp2_pp2_tp2():
    assert group_ranks(2, 2, 2, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(2, 2, 2, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(2, 2, 2, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(2, 2, 2, "mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pipeline_neighbours_and_stage_flags():
    # No groups are needed for coordinates: a Mesh can be made directly for any rank.
    meshes = [Mesh(2, 4, 2, r) for r in range(16)]
    m = meshes[rank_grid(2, 4, 2)[1, 0, 1]]
    assert (m.dp_rank, m.pp_rank, m.tp_rank) == (1, 0, 1)
    assert m.is_first_stage and not m.is_last_stage
    assert m.pp_next_rank == int(rank_grid(2, 4, 2)[1, 1, 1])
    assert m.pp_prev_rank == int(rank_grid(2, 4, 2)[1, 3, 1])  # wraps (interleaved schedules)
    last = meshes[rank_grid(2, 4, 2)[0, 3, 0]]
    assert last.is_last_stage and last.pp_next_rank == 0


def test_world_of_one_needs_no_torch_distributed():
    assert not dist.is_initialized()
    mesh = Mesh.build(ParallelConfig())
    assert (mesh.world_size, mesh.coords, mesh.tp_group, mesh.mp_group) == (1, (0, 0, 0), None, None)
    assert mesh.is_first_stage and mesh.is_last_stage


def test_world_size_mismatch_names_the_fields():
    with pytest.raises(UserError, match=r"parallel\.tp \* parallel\.pp \* parallel\.dp = 2 \* 1 \* 2 = 4.*3"):
        check_world_size(ParallelConfig(tp=2, dp=2), 3)
    with pytest.raises(UserError, match="parallel.tp"):
        Mesh.build(ParallelConfig(tp=2))  # two ranks asked for, one process, no torch.distributed


# ---------------------------------------------------------------------------------------
# Real groups on two gloo processes


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _groups_on_two_ranks(rank):
    out = {}
    for name in ("tp", "pp", "dp"):
        mesh = Mesh.build(ParallelConfig(**{name: 2}))
        x = torch.tensor([float(rank + 1)])
        group = {"tp": mesh.tp_group, "pp": mesh.pp_group, "dp": mesh.dp_group}[name]
        dist.all_reduce(x, group=group)
        out[name] = (mesh.coords, x.item(), mesh.mp_group is None, mesh.is_last_stage)
    try:
        Mesh.build(ParallelConfig(tp=4))
    except UserError as e:
        out["error"] = str(e)
    return out


def test_groups_on_two_processes(pool):
    r0, r1 = pool.run(_groups_on_two_ranks)
    assert r0["tp"] == ((0, 0, 0), 3.0, False, True) and r1["tp"] == ((0, 0, 1), 3.0, False, True)
    assert r0["pp"] == ((0, 0, 0), 3.0, False, False) and r1["pp"] == ((0, 1, 0), 3.0, False, True)
    assert r0["dp"] == ((0, 0, 0), 3.0, True, True) and r1["dp"] == ((1, 0, 0), 3.0, True, True)
    assert "must equal the number of processes, 2" in r0["error"]


def test_tp_groups_across_hosts_are_named_with_the_ranks_per_host():
    eight = ["a"] * 4 + ["b"] * 4
    assert tp_across_hosts(eight, 2, 1, 4) is None and tp_across_hosts(eight, 1, 2, 4) is None
    assert tp_across_hosts(["a"] * 8, 1, 1, 8) is None
    said = tp_across_hosts(eight, 1, 1, 8)
    assert said.startswith("parallel.tp = 8: 1 of 1 tensor-parallel groups span hosts (ranks 0-7 on a (4), "
                           "b (4))") and said.endswith("(4 here)"), said
    six = ["a"] * 6 + ["b"] * 6  # 6 ranks a host, tp 4: the second group straddles, the others do not
    said = tp_across_hosts(six, 3, 1, 4)
    assert said.startswith("parallel.tp = 4: 1 of 3 tensor-parallel groups span hosts (ranks 4-7 on a (2), "
                           "b (2))") and said.endswith("(6 here)"), said
