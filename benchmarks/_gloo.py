"""Run one benchmark function on every rank of a local gloo job (shared by the parallel benchmarks)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _worker(rank: int, world: int, port: int, fn: Callable, args: Any, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        results.put((rank, fn(world, args)))
    finally:
        dist.destroy_process_group()


def run_on_gloo(world: int, fn: Callable[[int, Any], Any], args: Any) -> dict[int, Any]:
    """{rank: fn(world, args)} with one thread per rank; world 1 runs here, without a process group."""
    if world == 1:
        torch.set_num_threads(1)
        return {0: fn(1, args)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return out
