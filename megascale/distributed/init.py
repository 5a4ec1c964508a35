"""Process-group start-up for a job launched by torchrun (or `megascale train --nproc N`).

The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a single
process (none of them set) needs no torch.distributed at all. Each phase of start-up is
timed so the breakdown can be logged: at scale, this is where minutes go (MegaScale measured
over 1,000 s on 2,048 GPUs before its fixes). The store is chosen in `store.py`, the groups
are created in `groups.py`; `benchmarks/init_scale.py` and `benchmarks/init_processes.py`
measure both.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megascale.config import DistributedConfig, ParallelConfig
from megascale.distributed import p2p
from megascale.distributed.groups import init_barrier
from megascale.distributed.store import open_store
from megascale.errors import UserError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    store: str = ""  # which store, in words
    timings: dict[str, float] = field(default_factory=dict)  # start-up phase -> seconds, in order

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def startup_line(self) -> str:
        """The start-up breakdown for the log: 'imports 2.10 s, store 0.01 s, ...'."""
        parts = [f"{phase.replace('_', ' ')} {s:.2f} s" for phase, s in self.timings.items()]
        return ", ".join(parts) + (f"; store: {self.store}" if self.store else "")


_STORE: dist.Store | None = None  # ours, closed at shutdown (a Redis store holds connections)


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), i.e. what interpreter start-up and imports took."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def init_distributed(device: torch.device, cfg: DistributedConfig | None = None) -> DistInfo:
    """Join the job's default process group if the launcher started several processes.

    Phases, each timed: the store (`distributed.store`), init_process_group (the backend's
    bootstrap of the world; on GPU with `eager_init` the NCCL communicator is built now, so
    subgroups can be split from it). The mesh's groups and the first collective are timed
    by `create_mesh` / `first_collective` and added to the same breakdown.
    """
    cfg = cfg or DistributedConfig()
    world = env_world_size()
    if world == 1 or dist.is_initialized():
        if dist.is_initialized():
            return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                            dist.get_backend())
        return DistInfo()
    global _STORE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    backend = "nccl" if device.type == "cuda" else "gloo"
    info = DistInfo(rank, world, local_rank, backend)
    age = process_age_s()
    if age is not None:
        info.timings["imports"] = age
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    t0 = time.perf_counter()
    _STORE, info.store = open_store(cfg.store, rank, world, timeout, cfg.job_id)
    t1 = time.perf_counter()
    eager = torch.device("cuda", local_rank) if device.type == "cuda" and cfg.eager_init else None
    with init_barrier(cfg.group_init == "global"):  # the naive way also ended init with a world barrier
        dist.init_process_group(backend, store=_STORE, rank=rank, world_size=world, timeout=timeout,
                                device_id=eager)
    t2 = time.perf_counter()
    info.timings |= {"store": t1 - t0, "init_process_group": t2 - t1}
    return info


def create_mesh(info: DistInfo, parallel: ParallelConfig, cfg: DistributedConfig | None = None):
    """The (dp, pp, tp) mesh with its groups, created the `distributed.group_init` way, timed."""
    from megascale.parallel.mesh import Mesh

    t0 = time.perf_counter()
    mesh = Mesh.build(parallel, (cfg or DistributedConfig()).group_init)
    info.timings["groups"] = time.perf_counter() - t0
    return mesh


def first_collective(info: DistInfo, mesh, device: torch.device) -> None:
    """One tiny all-reduce on the world and on each of this rank's groups, timed.

    Lazily initialised backends (NCCL without a bound device) build a group's communicator at
    its first collective; doing it here, all groups at once in the same order on every rank,
    keeps that cost out of the first training step and puts it in the start-up breakdown.
    """
    t0 = time.perf_counter()
    x = torch.zeros(1, device=device)
    for group in (None, *(g for g in mesh.groups() if g is not None)):
        dist.all_reduce(x, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info.timings["first_collective"] = time.perf_counter() - t0


def set_collective_timeout(mesh, seconds: float) -> None:
    """The timeout of every collective from here on, on the world and each of this rank's mesh groups
    (start-up ran under distributed.timeout_s; see DistributedConfig)."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in (None, *(g for g in mesh.groups() if g is not None)):
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    p2p.forget_timeouts()  # the direct exchanges' waits take the new ones


def shutdown_distributed() -> None:
    global _STORE
    p2p.close()  # the socket transport's connections, before the store they were found through
    if dist.is_initialized():
        dist.destroy_process_group()
    if _STORE is not None and hasattr(_STORE, "close"):
        _STORE.close()
    _STORE = None


class agree_on_user_errors:  # noqa: N801 - used as a context manager, named like one
    """Make a user error raised on some ranks a user error on every rank, with the same message.

        with agree_on_user_errors(info):
            ...  # per-rank checks of the user's input (files, dataset, checkpoint)

    Every rank leaves the block through one all-gather of its error message (or None): if any
    rank failed, every rank raises the first failing rank's message, so all of them stop at
    the same point (none is left waiting in a later collective) and rank 0, which alone
    prints, can say why. Anything but a UserError is a bug and propagates on its own rank
    (the launcher then stops the others). Free on one process.
    """

    def __init__(self, info: DistInfo):
        self.info = info

    def __enter__(self) -> agree_on_user_errors:
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if self.info.world_size == 1 or (kind is not None and not issubclass(kind, UserError)):
            return False
        messages: list[str | None] = [None] * self.info.world_size
        dist.all_gather_object(messages, str(value) if value is not None else None)
        first = next((m for m in messages if m is not None), None)
        if first is not None:
            raise UserError(first) from None
        return False
