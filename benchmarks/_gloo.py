"""Run one benchmark function on every rank of a local gloo job (shared by the parallel benchmarks)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 600


def _worker(rank: int, world: int, port: int, fn: Callable, args: Any, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        results.put((rank, fn(world, args)))
    finally:
        dist.destroy_process_group()


def run_on_gloo(world: int, fn: Callable[[int, Any], Any], args: Any) -> dict[int, Any]:
    """{rank: fn(world, args)} with one thread per rank; world 1 runs here, without a process group."""
    if world == 1:
        torch.set_num_threads(1)
        return {0: fn(1, args)}
    # The store lives here, on a port the OS picks and that stays bound until every rank is done: a
    # port chosen, released and bound later by rank 0 can be taken in between by another job.
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = server.port
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(out) < world:
            try:
                rank, value = results.get(timeout=1)
            except queue.Empty:
                # a rank that died (an exception, a kill) would leave the others waiting in a collective
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if dead:
                    raise RuntimeError(f"{fn.__name__}: ranks died (rank: exit code) {dead}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__}: no answer in {TIMEOUT_S} s from ranks "
                                       f"{sorted(set(range(world)) - set(out))}") from None
                continue
            out[rank] = value
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return out
