"""The (dp, pp, tp) mesh: a rank's coordinates and its process groups, built once.

Ranks are laid out as picotron's `arange(world).view(dp, pp, tp)`: tensor-parallel ranks
are adjacent (tp is the fastest-varying coordinate), so a tp group lives inside one
machine where its per-layer collectives can use NVLink, then pipeline stages, then
data-parallel replicas, which talk least often.

One `Mesh` is built per process and passed explicitly to whatever needs a group; there are
no module-level process groups. The coordinate maths is pure (`coordinates`,
`group_ranks`) so it is tested, and used by planners, without any processes.

A dimension of size 1 gets no process group (None): every collective in megascale checks
the size first and does nothing, because None means the *world* group to torch.distributed.
A world of one therefore needs no `torch.distributed` at all and costs nothing.

Under NCCL a pipeline has a second group of the pp ranks, `pp_bwd_group`, for the gradients that
flow backward: one communicator per direction, so that the two streams between a pair of ranks
neither match each other's messages (NCCL ignores tags) nor queue behind each other's pending
receives (see pipeline/comm.py). Gloo matches by tag and runs a pair's messages independently,
so it does without, and its start-up creates exactly the groups `mesh_group_kinds` lists
(tests/test_group_init.py checks that traffic key for key).
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.config import ParallelConfig
from megascale.distributed import direct, p2p
from megascale.distributed.groups import create_groups
from megascale.errors import UserError

# The tag of the mesh's own sums and gathers on our transport: none of the overlapped exchanges that
# may be in flight on the same group (a DP bucket's, tagged with its index) can ever match them.
SUMS_TAG = (1 << 31) - 1

DIMS = ("dp", "pp", "tp")
GROUP_KINDS = ("tp", "pp", "dp", "mp", "emb")  # the order every rank creates its groups in


def rank_grid(dp: int, pp: int, tp: int) -> torch.Tensor:
    """The global rank at each (dp, pp, tp) coordinate."""
    return torch.arange(dp * pp * tp).view(dp, pp, tp)


def coordinates(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of a global rank: tp varies fastest, dp slowest."""
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * pp * tp} ranks")
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def group_ranks(dp: int, pp: int, tp: int, kind: str) -> list[list[int]]:
    """Every group of one kind, as lists of global ranks, in the order all ranks create them.

    kind: "tp", "pp", "dp", "mp" (model parallel: the tp x pp ranks of one data-parallel
    replica, which together hold one copy of the model, the group a global grad norm sums over),
    or "emb" (the first and last pipeline stage of each (dp, tp) coordinate, which sum the
    gradients of a tied embedding; none when pp = 1).
    """
    g = rank_grid(dp, pp, tp)
    if kind == "tp":
        groups = g.reshape(-1, tp)
    elif kind == "pp":
        groups = g.permute(0, 2, 1).reshape(-1, pp)
    elif kind == "dp":
        groups = g.permute(1, 2, 0).reshape(-1, dp)
    elif kind == "mp":
        groups = g.reshape(dp, pp * tp)
    elif kind == "emb":
        groups = g[:, [0, pp - 1], :].permute(0, 2, 1).reshape(-1, 2) if pp > 1 else g.reshape(-1, 1)
    else:
        raise ValueError(f"group kind must be tp, pp, dp, mp or emb, got {kind!r}")
    return groups.tolist()


def tp_across_hosts(hosts: list[str], dp: int, pp: int, tp: int) -> str | None:
    """Why this layout's tensor-parallel groups leave their machine, or None: given each global rank's
    host, the groups that span several. A tp group makes several collectives in every layer, in the
    critical path, sized for NVLink inside a machine; across hosts they go over the network, and a
    job that runs is then many times slower (tp larger than --nproc-per-node, or not a divisor of it)."""
    spanning = [g for g in group_ranks(dp, pp, tp, "tp") if len({hosts[r] for r in g}) > 1]
    if not spanning:
        return None
    first = spanning[0]
    where = ", ".join(f"{h} ({n})" for h, n in Counter(hosts[r] for r in first).items())
    per_host = min(Counter(hosts).values())
    return (f"parallel.tp = {tp}: {len(spanning)} of {dp * pp} tensor-parallel groups span hosts (ranks "
            f"{first[0]}-{first[-1]} on {where}): every layer's tp collectives cross the network instead of "
            f"staying inside a machine. Keep parallel.tp a divisor of the ranks per host ({per_host} here)")


def check_world_size(cfg: ParallelConfig, world_size: int) -> None:
    if cfg.world_size != world_size:
        raise UserError(
            f"parallel.tp * parallel.pp * parallel.dp = {cfg.tp} * {cfg.pp} * {cfg.dp} = {cfg.world_size} "
            f"must equal the number of processes, {world_size}"
        )


# every live Mesh of this process by its key (the planner makes thousands, each let go)
_MESHES: weakref.WeakValueDictionary[int, Mesh] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@dataclass(frozen=True, eq=False)
class Mesh:
    """This rank's place in the (dp, pp, tp) grid and its groups (None where a size is 1)."""

    dp: int
    pp: int
    tp: int
    rank: int
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mp_group: dist.ProcessGroup | None = None
    emb_group: dist.ProcessGroup | None = None  # first + last stage (pp > 1): tied-embedding gradients
    pp_bwd_group: dist.ProcessGroup | None = None  # the pp ranks again (pp > 1, NCCL): backward p2p
    # reduce-scatters and all-gathers by direct sends (distributed/direct.py): gloo with the flag on only
    direct_collectives: bool = False
    # what the tp collectives inside a compiled graph carry to find this mesh (custom ops take tensors and
    # plain values; parallel/tensor/comm.py)
    key: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", next(_KEYS))
        _MESHES[self.key] = self

    @staticmethod
    def by_key(key: int) -> Mesh:
        return _MESHES[key]

    @classmethod
    def build(cls, cfg: ParallelConfig, group_init: str = "local", p2p_groups: bool | None = None) -> Mesh:
        """The mesh of this process. Every rank must call it, in the same order as the others.

        With cfg.world_size == 1 torch.distributed is not needed; otherwise it must already be
        initialised (by the launcher) with a world of exactly tp * pp * dp processes.
        group_init: how the groups are created, "local" (ours) or "global" (the naive way);
        see `megascale.distributed.groups`. p2p_groups: whether pp > 1 gets `pp_bwd_group`; None
        (the default): under NCCL only, which needs it (tests ask for it on gloo).
        """
        if cfg.world_size == 1 and not dist.is_initialized():
            return cls(1, 1, 1, 0)
        if not dist.is_initialized():
            check_world_size(cfg, 1)  # raises: a multi-rank layout on a single process
        check_world_size(cfg, dist.get_world_size())
        rank = dist.get_rank()
        groups = create_mesh_groups(cfg.dp, cfg.pp, cfg.tp, rank, group_init)
        if p2p_groups is None:
            p2p_groups = "nccl" in str(dist.get_backend())
        bwd = create_pp_bwd_group(cfg.dp, cfg.pp, cfg.tp, rank, group_init) if p2p_groups else None
        gloo = dist.get_backend() == dist.Backend.GLOO
        mesh = cls(cfg.dp, cfg.pp, cfg.tp, rank, *(groups[k] for k in GROUP_KINDS), pp_bwd_group=bwd,
                   direct_collectives=cfg.direct_collectives and gloo)
        if gloo and cfg.transport == "sockets":  # p2p messages over our transport (distributed/p2p.py)
            p2p.use_sockets(mesh.groups())
            if cfg.transport_priority:
                p2p.prioritise(interactive=(mesh.tp_group, mesh.pp_group), bulk=(mesh.dp_group,))
        return mesh

    def all_reduce(self, t: Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> None:
        """Sum (op="max": the maximum of) t over one of this mesh's groups, in place: by direct messages
        where our transport carries the group (distributed/direct.py all_reduce), else the backend's."""
        if self.direct_collectives and p2p.routed(group):
            direct.all_reduce(t, group, tag=SUMS_TAG, op=op)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)

    def all_gather(self, t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        """Every rank's t over one of this mesh's groups, stacked in group rank order: (n, *t.shape).
        By direct messages where our transport carries the group, else the backend's all-gather."""
        if self.direct_collectives and p2p.routed(group):
            return direct.gather_rows(t, group, tag=SUMS_TAG)
        rows = t.new_empty((dist.get_world_size(group), *t.shape))
        dist.all_gather_into_tensor(rows.view(-1), t.reshape(-1).contiguous(), group=group)
        return rows

    def groups(self) -> tuple[dist.ProcessGroup | None, ...]:
        """This rank's groups, in creation order (None where there is none)."""
        return self.tp_group, self.pp_group, self.dp_group, self.mp_group, self.emb_group, self.pp_bwd_group

    # ---- coordinates

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def coords(self) -> tuple[int, int, int]:
        return coordinates(self.rank, self.dp, self.pp, self.tp)

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    def rank_at(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    # ---- pipeline neighbours

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next stage (wrapping around: interleaved schedules send last -> first)."""
        d, p, t = self.coords
        return self.rank_at(d, (p + 1) % self.pp, t)

    @property
    def pp_prev_rank(self) -> int:
        d, p, t = self.coords
        return self.rank_at(d, (p - 1) % self.pp, t)

    def __repr__(self) -> str:
        d, p, t = self.coords
        return f"Mesh(rank={self.rank}, dp={d}/{self.dp}, pp={p}/{self.pp}, tp={t}/{self.tp})"



def create_mesh_groups(dp: int, pp: int, tp: int, rank: int, mode: str = "local"
                       ) -> dict[str, dist.ProcessGroup | None]:
    """This rank's group of each kind (None for a dimension of size 1), created the `mode` way."""
    layout = mesh_group_kinds(dp, pp, tp)
    mine = create_groups(list(layout.values()), rank, mode)
    return {kind: None for kind in GROUP_KINDS} | dict(zip(layout, mine, strict=True))


def create_pp_bwd_group(dp: int, pp: int, tp: int, rank: int, mode: str = "local"
                        ) -> dist.ProcessGroup | None:
    """A second group of this rank's pipeline ranks (None when pp = 1), created the `mode` way.

    A call of its own: `create_groups` makes one group per rank list and hands it to every kind
    that lists those ranks (the tied-embedding group is the pp group at pp = 2), and this one must
    be another communicator."""
    if pp == 1:
        return None
    return create_groups([group_ranks(dp, pp, tp, "pp")], rank, mode)[0]


def mesh_group_kinds(dp: int, pp: int, tp: int) -> dict[str, list[list[int]]]:
    """The groups the mesh creates, kind by kind in creation order (none for a dimension of size 1)."""
    layout = {kind: group_ranks(dp, pp, tp, kind) for kind in GROUP_KINDS}
    return {kind: groups for kind, groups in layout.items() if len(groups[0]) > 1}
