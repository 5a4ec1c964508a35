"""Creating a job's process groups: in what order, by whom, with which synchronisation.

MegaScale measured Megatron-LM spending over 1,000 s on 2,048 GPUs creating process groups.
Most of it was synchronisation, not work: every rank called `new_group` for every group of
the job, and each call ended with a store-based barrier over the whole world. A mesh has
G = N/tp + N/pp + N/dp + ... groups, so that is G x N store operations: O(N^2).

Modes (`distributed.group_init`):

- "global", the naive way (Megatron-LM on torch < 2.1, kept as the baseline to measure
  against): every rank creates every group, then a barrier over all ranks.
- "local", ours: each rank creates only the groups it is a member of, with
  `new_group(use_local_synchronization=True)`: non-members take no part, and the group's
  name is a hash of its ranks, so no global counter has to agree across ranks. There is no
  barrier at all: the backend's own bootstrap already synchronises the members (gloo connects
  a full mesh through the store; NCCL exchanges its unique id on first use). Store traffic is
  then the bootstrap alone, proportional to the sum of group sizes: O(N). Every rank creates
  its groups in the same order of kinds, and belongs to exactly one group of each kind, so
  the members of a group are always creating the same group: no deadlock. (A rank in no group
of a kind creates a group of itself alone: see `create_groups`.)
- On NCCL with a bound device (`distributed.eager_init`, the default on GPU), torch derives
  subgroup communicators from the world's with ncclCommSplit, which involves no store at
  all but is collective over the parent: every rank must take part in every split. "local"
  then becomes "every rank calls `new_group` for every group, with no barrier".

A list of rank lists that occurs twice (the model-parallel group equals the tensor-parallel
one when pp = 1) is created once and shared: two groups with the same hashed name would
share store keys.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch.distributed as dist

GROUP_INIT_MODES = ("local", "global")


@contextlib.contextmanager
def init_barrier(enabled: bool) -> Iterator[None]:
    """torch >= 2.1 reads TORCH_DIST_INIT_BARRIER at each new_group: "1" ends it with a store barrier."""
    old = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCH_DIST_INIT_BARRIER"]
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = old


def splits_communicators() -> bool:
    """True when torch will create subgroups by splitting the world's communicator (NCCL, eager)."""
    default = dist.distributed_c10d._get_default_group()
    return default.bound_device_id is not None and dist.get_backend() == "nccl"


def create_groups(kinds: Sequence[Sequence[Sequence[int]]], rank: int, mode: str = "local"
                  ) -> list[dist.ProcessGroup | None]:
    """For each kind (a list of disjoint rank lists covering the world), create its groups and
    return the one this rank belongs to (None if it belongs to none). Every rank calls this with
    the same `kinds`, in the same order."""
    if mode not in GROUP_INIT_MODES:
        raise ValueError(f"group_init must be one of {GROUP_INIT_MODES}, got {mode!r}")
    every_rank_creates_every_group = mode == "global" or splits_communicators()
    local_sync = mode == "local" and not every_rank_creates_every_group
    created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # every group this rank took part in
    mine: list[dist.ProcessGroup | None] = []
    with init_barrier(mode == "global"):
        for groups in kinds:
            own = None
            for ranks in groups:
                key = tuple(sorted(ranks))
                member = rank in key
                if key not in created and (member or every_rank_creates_every_group):
                    created[key] = dist.new_group(list(key), use_local_synchronization=local_sync)
                if member:
                    own = created[key]
            if local_sync and not any(rank in ranks for ranks in groups):
                # torch names a locally synchronised group by a hash of its ranks *and of how many
                # groups the process knows*, so all processes must know equally many: a rank in
                # none of this kind's groups (a middle pipeline stage for "emb") makes one of itself.
                created[(rank,)] = dist.new_group([rank], use_local_synchronization=True)
            mine.append(own)
    return mine
