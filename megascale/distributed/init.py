"""Process-group start-up for a job launched by torchrun (or `megascale train --nproc N`).

The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a single
process (none of them set) needs no torch.distributed at all. Each phase of start-up is
timed so the breakdown can be logged: at scale, this is where minutes go (MegaScale measured
over 1,000 s on 2,048 GPUs before its fixes).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megascale.errors import UserError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> DistInfo:
    """Join the job's default process group if the launcher started several processes."""
    world = env_world_size()
    if world == 1 or dist.is_initialized():
        if dist.is_initialized():
            return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                            dist.get_backend())
        return DistInfo()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    t0 = time.perf_counter()
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, backend, {"init_process_group": time.perf_counter() - t0})


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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
