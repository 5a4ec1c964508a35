"""The store operations a job's start-up performs, per rank, without running the job.

`benchmarks/init_scale.py` replays this traffic for 2,048 or 12,288 simulated ranks against
real stores: processes cannot reach that scale on one machine, store traffic can. The
operations are the real code path's, not guesses: `tests/test_group_init.py` runs real gloo
processes through `megascale.distributed.groups` over a `RecordingStore` and checks that
every rank's recorded operations equal the ones generated here, key for key.

What is generated (keys as torch 2.13 names them):

- torch's store-based barrier (the "global" mode's, after init and after every group):
  add(key, 1), add(key, 0), set(key:last_worker) by whichever rank counts the last arrival,
  wait(key:last_worker).
- gloo's bootstrap of a group of k ranks: each member sets its address and then waits for
  and reads all k (recorded).
- NCCL's bootstrap, from ProcessGroupNCCL's broadcastUniqueNCCLID (no GPU here to record
  it): the group's rank 0 sets the unique id, the others get it. Lazily, at the group's first
  collective ("nccl"); or, with a bound device ("nccl-split"), once for the world at init,
  every subgroup then split from it by NCCL without the store.

A step is what happens between two points where the simulated ranks must wait for each
other; within a step each rank's operations come in rounds, a round ending at the rank's
next blocking operation (a wait or get on a key another rank writes). Replaying round by
round over all ranks never deadlocks, even with fewer client threads than ranks, and
performs exactly the operations the real ranks perform.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

BACKENDS = ("gloo", "nccl", "nccl-split")
MODES = ("local", "global")


@dataclass(frozen=True)
class StoreOp:
    op: str  # "set", "get", "add", "wait", or "set_if_last" (set key if the previous add returned count)
    key: str
    amount: int = 0  # add
    count: int = 0  # set_if_last


def _merge(a: list[list[StoreOp]], b: list[list[StoreOp]]) -> list[list[StoreOp]]:
    """Two ranks' worth of rounds as one: round i of the result is a's round i, then b's."""
    n = max(len(a), len(b))
    return [[*(a[i] if i < len(a) else ()), *(b[i] if i < len(b) else ())] for i in range(n)]


class RankRounds(Mapping):
    """rank -> that rank's rounds in a step: its own operations plus, if set, rounds that every
    rank of the world performs (a world barrier). Held apart, a naive step at 12,288 ranks costs
    one list instead of 12,288; a rank's merged list is built when it is read."""

    def __init__(self, world: int):
        self.world = world
        self.own: dict[int, list[list[StoreOp]]] = {}
        self.everyone: list[list[StoreOp]] = []

    def __getitem__(self, rank: int) -> list[list[StoreOp]]:
        if not self.everyone:
            return self.own[rank]
        if not 0 <= rank < self.world:
            raise KeyError(rank)
        return _merge(self.own.get(rank, []), self.everyone)

    def __iter__(self):
        return iter(range(self.world)) if self.everyone else iter(self.own)

    def __len__(self) -> int:
        return self.world if self.everyone else len(self.own)

    def num_ops(self) -> tuple[int, set[str]]:
        """(operations other than set_if_last, the keys of the set_if_last ones), without merging."""
        n, last_keys = 0, set()
        for rounds, times in [*((r, 1) for r in self.own.values()), (self.everyone, self.world)]:
            for ops in rounds:
                n += times * len(ops)
                for o in ops:
                    if o.op == "set_if_last":
                        n -= times
                        last_keys.add(o.key)
        return n, last_keys


@dataclass
class Step:
    name: str
    world: int
    rounds: RankRounds = field(init=False)  # rank -> ops, round by round

    def __post_init__(self):
        self.rounds = RankRounds(self.world)

    def add(self, rank: int, rounds: list[list[StoreOp]]) -> None:
        """Add a rank's rounds. The lists are kept, not copied (a merge makes new ones), so the
        members of a group can share one: gloo's world bootstrap at 12,288 ranks is 151M reads."""
        own = self.rounds.own
        own[rank] = _merge(own[rank], rounds) if rank in own else rounds

    def add_everyone(self, rounds: list[list[StoreOp]]) -> None:
        """Rounds every rank of the world performs (after its own in each round)."""
        self.rounds.everyone = _merge(self.rounds.everyone, rounds)

    @property
    def num_ops(self) -> int:
        """Store operations in the step, a set_if_last counted once per key (one rank sets it)."""
        n, last_keys = self.rounds.num_ops()
        return n + len(last_keys)


def barrier(key: str, world: int) -> list[list[StoreOp]]:
    """torch's _store_based_barrier, for one rank."""
    return [[StoreOp("add", key, 1), StoreOp("add", key, 0), StoreOp("set_if_last", f"{key}:last_worker",
                                                                        count=world)],
            [StoreOp("wait", f"{key}:last_worker")]]


def gloo_bootstrap(prefix: str, group_rank: int, size: int) -> list[list[StoreOp]]:
    """Each member publishes its address, then waits for and reads every member's (its own too)."""
    return [[StoreOp("set", f"{prefix}/cpu//0/{group_rank}")], _gloo_reads(prefix, size)]


@functools.lru_cache(maxsize=4)
def _gloo_reads(prefix: str, size: int) -> list[StoreOp]:  # one list shared by all members of a group
    return [op for r in range(size) for op in (StoreOp("wait", f"{prefix}/cpu//0/{r}"),
                                               StoreOp("get", f"{prefix}/cpu//0/{r}"))]


def nccl_bootstrap(prefix: str, group_rank: int, size: int) -> list[list[StoreOp]]:
    key = f"{prefix}/0"  # ProcessGroupNCCL names its n-th communicator's id key str(n)
    return [[StoreOp("set", key)], []] if group_rank == 0 else [[], [StoreOp("get", key)]]


def hashed_group_name(ranks: Sequence[int], groups_known: int) -> str:
    """torch's name for a group created with use_local_synchronization=True (see _hash_ranks_to_str)."""
    text = "_".join(map(str, ranks)) + f"_{groups_known}"
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def unique_groups(world: int, kinds: Sequence[Sequence[Sequence[int]]], mode: str
                  ) -> list[list[tuple[int, ...]]]:
    """The groups `groups.create_groups` creates, kind by kind: each rank list sorted, a list seen
    in an earlier kind dropped (created once), and in "local" mode a group of one for each rank
    that is in none of a kind's groups (it keeps every process's count of groups equal)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for groups in kinds:
        fresh = [g for g in (tuple(sorted(r)) for r in groups) if g not in seen]
        if mode == "local":
            covered = {r for g in groups for r in g}
            fresh += [(r,) for r in range(world) if r not in covered]
        seen.update(fresh)
        out.append(fresh)
    return out


def group_names(world: int, kinds: list[list[tuple[int, ...]]], mode: str) -> dict[tuple[int, ...], str]:
    """The name torch gives each group: a global counter ("global": every rank creates every group)
    or a hash of its ranks and of how many groups the member's process already knows ("local")."""
    names: dict[tuple[int, ...], str] = {}
    known = [1] * world  # the world group
    for groups in kinds:
        for ranks in groups:
            if mode == "global":
                names[ranks] = str(len(names) + 1)
            else:
                names[ranks] = hashed_group_name(ranks, known[ranks[0]])
                for r in ranks:
                    known[r] += 1
    return names


def startup_traffic(world: int, kinds: Sequence[Sequence[Sequence[int]]], mode: str = "local",
                    backend: str = "gloo") -> Iterator[Step]:
    """The steps of start-up: init_process_group, then every group of `kinds` (as given to
    `groups.create_groups`), then, for lazily initialised NCCL, each group's first collective."""
    if mode not in MODES or backend not in BACKENDS:
        raise ValueError(f"mode must be one of {MODES} and backend one of {BACKENDS}")
    bootstrap = gloo_bootstrap if backend == "gloo" else nccl_bootstrap
    kinds = unique_groups(world, kinds, mode)
    names = group_names(world, kinds, mode)
    # creating a group bootstraps its backend at once only for gloo; NCCL is lazy or split
    boots_at_creation = backend == "gloo"

    init = Step("init_process_group", world)
    if backend != "nccl":  # lazy NCCL bootstraps the world at its first collective, below
        for r in range(world):
            init.add(r, bootstrap("0/", r, world))
    if mode == "global":
        init.add_everyone([[], [], *barrier("store_based_barrier_key:0", world)])
    yield init

    if mode == "global":  # every group is a step of its own: all ranks take part in its barrier
        for groups in kinds:
            for ranks in groups:
                step = Step(f"group {names[ranks]}", world)
                pad = [[], []] if boots_at_creation else []  # the barrier follows the bootstrap
                if boots_at_creation:
                    for gr, r in enumerate(ranks):
                        step.add(r, bootstrap(f"0//{names[ranks]}/", gr, len(ranks)))
                step.add_everyone([*pad, *barrier(f"0//store_based_barrier_key:{names[ranks]}", world)])
                yield step
    elif boots_at_creation:  # "local": the groups of one kind are disjoint and form together
        for kind, groups in enumerate(kinds):
            step = Step(f"kind {kind}", world)
            for ranks in groups:
                for gr, r in enumerate(ranks):
                    step.add(r, bootstrap(f"0//{names[ranks]}/", gr, len(ranks)))
            yield step

    if backend == "nccl":  # lazy: the unique ids are exchanged at each group's first collective
        first = Step("first collective: world", world)
        for r in range(world):
            first.add(r, nccl_bootstrap("0/", r, world))
        yield first
        for kind, groups in enumerate(kinds):
            step = Step(f"first collective: kind {kind}", world)
            for ranks in (g for g in groups if len(g) > 1):  # a group of one never communicates
                for gr, r in enumerate(ranks):
                    step.add(r, nccl_bootstrap(f"0//{names[ranks]}/", gr, len(ranks)))
            yield step


def count_ops(steps: Iterator[Step]) -> tuple[int, int]:
    """(steps, store operations), counting set_if_last once per barrier (one rank sets it)."""
    n_steps = n_ops = 0
    for step in steps:
        n_steps += 1
        n_ops += step.num_ops
    return n_steps, n_ops
