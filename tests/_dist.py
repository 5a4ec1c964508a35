"""Run functions on N gloo processes that are started once and reused (one pool per test module).

A fresh interpreter importing torch and megascale costs ~2.5 CPU-seconds on a shared 2-core machine,
so workers are forked from one server process that imported them once (`mp_context()`, multiprocessing's
forkserver with those modules preloaded: a clean process, no threads, no process group, as the launch's
own prefork does), and a test module starts its pool once (a module-scoped fixture) and every test sends
it work:
`pool.run(fn, *args)` calls fn(rank, *args) on every rank and returns the results in rank
order. fn must be a module-level (picklable) function. If a rank raises, the pool is
closed (the others may be stuck in a collective), the traceback is raised here, and the
next `run` starts a fresh pool. A worker process that dies is named, with its exit code, within
seconds; a run with no answer after the workers' own timeouts dumps every live worker's stacks
(faulthandler, into the test's captured stderr) before the pool is killed. The pool's store is
hosted here, on a port the OS picks and that stays bound for the pool's life: a port chosen,
released and bound later by rank 0 can be taken in between by another test's job (EADDRINUSE,
seen in CI).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from multiprocessing import reduction

import pytest
import torch

# what every worker needs, imported once in the fork server (torch._dynamo: every torch optimizer's step
# imports it); the test modules' own imports then cost a worker little
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megascale.train"]
_SERVED = "MEGASCALE_TEST_FORKSERVER"  # set in the server's environment, so its children start none


def mp_context():
    """The multiprocessing context for test workers, forked from a server with PRELOAD imported. A worker
    gets the server's environment, the one this process had when the server started (tests hand workers
    what they need as arguments)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    if _SERVED not in os.environ:
        from multiprocessing import forkserver

        os.environ[_SERVED] = "1"
        try:
            forkserver.ensure_running()
        finally:
            del os.environ[_SERVED]  # only the server (and its children) keep it
    return ctx


if _SERVED not in os.environ:  # at collection: no test has changed the environment yet, and the server
    mp_context()  # loads while the first tests run

TIMEOUT_S = 300
GRACE_S = 60  # a run waits this much past a worker's own timeouts, whose errors say more than ours


def _worker(rank: int, world: int, port: int, tasks: mp.Queue, results: mp.Queue, out=None) -> None:
    import torch.distributed as dist

    if out is not None:  # the pool's starter's stdout and stderr, not the fork server's
        for fd, dup in zip((1, 2), out, strict=True):
            os.dup2(dup.detach(), fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung pool's stacks (WorkerPool.close)
    torch.set_num_threads(1)  # the machine has 2 cores for everyone
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, fn(rank, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world: int):
        self.world = world
        self._start()

    def _start(self) -> None:
        import torch.distributed as dist

        ctx, world = mp_context(), self.world
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        port = self._store.port
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            # (a forked worker's output goes where the test's does, as a spawned one's did: its
            # captured output, where a hung pool's stacks are read)
            ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results,
                                              (reduction.DupFd(1), reduction.DupFd(2))), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        if self.procs is None:
            self._start()
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        deadline = time.monotonic() + TIMEOUT_S + GRACE_S
        while len(out) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=5)
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(out))
                dead = {r: self.procs[r].exitcode for r in missing if not self.procs[r].is_alive()}
                if dead:  # a worker killed by a signal, or one whose process group never started
                    self.close(force=True, dump=True)
                    raise RuntimeError(f"{fn.__name__}: workers died (rank: exit code) {dead}") from None
                if time.monotonic() < deadline:
                    continue
                self.close(force=True, dump=True)
                raise TimeoutError(f"{fn.__name__}: no answer from ranks {missing} in {TIMEOUT_S + GRACE_S}s "
                                   "(their stacks are in the captured stderr)") from None
            if not ok:
                self.close(force=True)
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world)]

    def close(self, force: bool = False, dump: bool = False) -> None:
        if self.procs is None:
            return
        if dump:  # every thread's stack of every live worker, on stderr, before they are killed
            for p in self.procs:  # one at a time: dumps written at once interleave on the shared stderr
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(1)
        if not force:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.terminate()
                p.join()
        self.procs = None
        self._store = None


# ---- fixtures shared by the multi-process test modules (import them by these names)


@pytest.fixture(name="one_thread", scope="module", autouse=True)
def one_thread_fixture():
    """The serial runs take one core, as each worker does: 2 threads on a busy 2-core machine spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(name="pools", scope="module")
def pools_fixture():
    """pools(world) -> a WorkerPool of that many ranks; one pool alive at a time (2 cores for everyone)."""
    made: dict[int, WorkerPool] = {}

    def get(world: int) -> WorkerPool:
        for w in [w for w in made if w != world]:
            made.pop(w).close()
        if world not in made:
            made[world] = WorkerPool(world)
        return made[world]

    yield get
    for p in made.values():
        p.close()
