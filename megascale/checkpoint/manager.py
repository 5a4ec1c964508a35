"""The checkpoint flow of a run: snapshot, persist in the background, restore the newest state.

    mgr = CheckpointManager(cfg, run_dir, mesh, rank, world, log)     # collective (a gloo group)
    info = mgr.restore(state)        # collective: the newest complete state, or None (fresh start)
    ...
    mgr.before_update()              # every step, before the optimizer changes the weights
    mgr.save(step, state, persist)   # after a step: stage 1 now, stage 2 queued in the background
    mgr.finish()                     # wait for stage 2; clear host memory once storage has the state

`state` is the Trainer's `TrainState`: it gives the rank's boxes (shards.py) of the weights and
optimizer state, and its small JSON state (RNG, loader position).

Flow of one checkpoint (docs/architecture.md draws it):

1. Stage 1 (`snapshot.py`): copy the boxes into a host-memory slot under /dev/shm, in the
   background while the next step's forwards and backwards run; the update waits for it.
2. Stage 2 (`storage.py`, `writer.py`): a background thread on every rank hands the slot to the
   rank's writer process, which writes the rank's boxes in DCP format from /dev/shm; one
   all-gather brings the outcomes to rank 0, which merges the metadata and writes the commit
   marker with every file's checksum.
   A failure is one logged line; training goes on and the previous checkpoint stays newest.
3. Restore: the newest complete state wins: the host-memory snapshot every rank still has
   (a restarted process on the same host, same layout), else the newest committed checkpoint
   whose checksums verify (else the one before it). From storage any layout reads any other
   layout's checkpoint: each rank reads the boxes it needs; with dp > 1 one replica reads the
   weights and broadcasts them to the others (`checkpoint.broadcast_restore`).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from megascale.checkpoint.replica import PeerReplicas, fetch
from megascale.checkpoint.shards import Chunk, ensure_optimizer_state
from megascale.checkpoint.snapshot import HostSnapshot
from megascale.checkpoint.storage import CheckpointError, Storage
from megascale.checkpoint.writer import WriterProcess
from megascale.config import Config
from megascale.errors import UserError
from megascale.fault.inject import host_id, inject
from megascale.observe import timers

if TYPE_CHECKING:
    from megascale.checkpoint.dcp_io import PersistResult


class TrainState(Protocol):
    """What the manager needs of the Trainer's state (parallel/engine.py's ParallelEngine has it)."""

    def model_chunks(self) -> list[Chunk]: ...

    def optimizer_chunks(self) -> list[Chunk]: ...

    @property
    def optimizer(self): ...

    def broadcast_weights(self) -> None: ...  # dp replica 0's weights to the other replicas


def storage_root(cfg: Config, run_dir: Path) -> str | Path:
    """Where the run's checkpoints live: checkpoint.path, else RUN_DIR/checkpoints."""
    return cfg.checkpoint.path or run_dir.resolve() / "checkpoints"


@dataclass
class RestoreInfo:
    step: int
    source: str  # "memory" or "storage"
    where: str  # the checkpoint's path (storage) or the memory directory
    extra: dict[str, Any]  # this rank's JSON state: loader, rng (rng only when the layout is the same)
    seconds: float
    bytes_read: int = 0  # this rank's reads from storage (checksum verification apart)
    bytes_verified: int = 0
    same_layout: bool = True
    from_peers: int = 0  # ranks whose snapshot came from a peer host's replica (their own host lost it)
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that could not be used, why


def default_memory_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "megascale"
    return Path(tempfile.gettempdir()) / "megascale-snapshots"


def state_mb(state: TrainState) -> float:
    """The rank's weights and optimizer state, in MB (what a checkpoint of it writes)."""
    return sum(c.tensor.numel() * c.tensor.element_size()
               for c in state.model_chunks() + state.optimizer_chunks()) / 1e6


def _rank_extra_fqn(rank: int) -> str:
    return f"rank/{rank:05d}/extra"


class CheckpointManager:
    def __init__(self, cfg: Config, run_dir: Path, mesh, rank: int, world: int, layout: dict,
                 log: Callable[[str], None]):
        c = cfg.checkpoint
        self.cfg, self.mesh, self.rank, self.world = cfg, mesh, rank, world
        self.layout, self.log = layout, log
        self.default_storage = not c.path
        self.storage = Storage(storage_root(cfg, run_dir))
        # stage 2's collectives run in a background thread: a gloo group of their own keeps them
        # apart from training's (NCCL or gloo) collectives, whatever order the two threads go in
        self.group = dist.new_group(backend="gloo") if world > 1 else None
        run_key = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.memory_dir = Path(c.memory_dir or default_memory_dir()) / run_key
        identity = {"run": str(run_dir.resolve()), "layout": layout, "world": world, "rank": rank}
        self.snapshots = HostSnapshot(self.memory_dir if c.memory else None, rank, identity,
                                      shared=c.memory, background=c.async_snapshot, log=log)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="persist") if c.async_persist else None
        # the writing itself in a process of its own (writer.py), reading the slot file; a thread when
        # there is no slot file to read or the storage lives in this process (memory://)
        self.writer = WriterProcess(rank) if c.writer_process and WriterProcess.possible() else None
        self._pending: list[Future] = []
        self._events: list[dict[str, Any]] = []
        self._events_lock = threading.Lock()
        self.committed: set[int] = set()
        self.persist_error = ""  # why the last failed persist failed
        self._snapshot_step = -1
        self.last_blocked_s = 0.0
        self.skipped = 0  # memory snapshots skipped for want of a free slot (see save)
        # a copy of every snapshot in a peer host's memory (replica.py), in a daemon thread: a transfer
        # stuck on a dead peer must not keep this process from exiting
        self.replicas: PeerReplicas | None = None
        self._replicating: list[Future] = []
        self._owners: dict[int, set[int]] = {}
        self._holders: dict[tuple[int, int], int] = {}
        if c.memory and c.memory_replicas and world > 1:
            hosts: list[str | None] = [None] * world
            dist.all_gather_object(hosts, host_id(), group=self.group)
            replicas = PeerReplicas(self.memory_dir, rank, identity, hosts, None, log)
            if replicas.active:  # the same on every rank (one host list): all create the group, or none
                replicas.group = dist.new_group(backend="gloo")
                self.replicas = replicas
                self._replicate_queue: queue.Queue = queue.Queue()
                threading.Thread(target=self._replicate_loop, name="replicate", daemon=True).start()

    # ------------------------------------------------------------------ saving

    def before_update(self) -> None:
        """Stage 1's copy must be complete before the optimizer changes the weights. The wait adds to
        `last_blocked_s`: what the last checkpoint cost training, save() call included."""
        t0 = time.perf_counter()
        self.snapshots.wait()
        self.last_blocked_s += time.perf_counter() - t0

    def save(self, step: int, state: TrainState, extra: dict[str, Any], persist_it: bool,
             last: bool = False) -> float:
        """Snapshot `step` (stage 1) and, if `persist_it`, queue stage 2. Returns the seconds training
        was blocked here (the copy itself overlaps the next step unless async_snapshot is off).
        `last`: the caller waits for storage next (the run's end, a stop by signal): nothing trains
        meanwhile."""
        t0 = time.perf_counter()
        if persist_it and step in self.committed:  # re-saving a committed step: it is the same state
            persist_it = False
        took = False
        if step != self._snapshot_step:
            chunks = state.model_chunks() + state.optimizer_chunks()
            # a snapshot for memory only is skipped, not waited for, while both slots are taken: a
            # persist of the older one holds it for seconds on a busy host, and training would stall
            took = self.snapshots.take(step, chunks, extra, pin=persist_it, wait=persist_it)
            self.skipped += not took
        if took:
            self._snapshot_step = step
            if self.replicas is not None:
                self.snapshots.pin(step)  # until the peer host has its copy
                done: Future = Future()
                self._replicating = [f for f in self._replicating if not f.done()] + [done]
                self._replicate_queue.put((step, done))
        elif persist_it:
            self.snapshots.pin(step)
        if persist_it:
            self._pending = [f for f in self._pending if not f.done()]
            # The writer process keeps stage 2's GIL-bound serialisation away from training. When
            # nothing trains meanwhile it protects nothing, and starting one (a new interpreter
            # importing torch, every rank of a host at once) costs more than the write: 6 s of a
            # 2 x 2 test job's 18 s.
            here = last and not (self.writer is not None and self.writer.running())
            if (self.writer is not None and not self.writer.started
                    and state_mb(state) < self.cfg.checkpoint.writer_process_min_mb):
                # a small state: the thread's GIL costs training milliseconds per checkpoint, less than
                # a new interpreter (seconds of CPU at the first persist, every rank of the host at once)
                self.writer = None
            if self._pool is None:
                self._persist(step, here)
            else:
                self._pending.append(self._pool.submit(self._persist, step, here))
        blocked = time.perf_counter() - t0
        self.last_blocked_s = blocked
        return blocked

    def _persist(self, step: int, in_process: bool = False) -> PersistResult:
        from megascale.checkpoint.dcp_io import persist, write_rank_files

        _lower_priority()
        t0 = timers.now_ns()
        views, extra = self.snapshots.acquire(step)
        try:
            blob = json.dumps(extra.get("rng", {})).encode()
            by_process = (self.writer is not None and not in_process and self.snapshots.shared
                          and self.storage.protocol != "memory")
            if by_process:
                slot_file, table = self.snapshots.slot_file(step)

                def write(path: str):
                    root = self.storage.display if self.storage.is_url else self.storage.root  # absolute
                    return self.writer.write(root, path, slot_file, table, blob)
            else:
                extra_box = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                own = Chunk(_rank_extra_fqn(self.rank), tuple(extra_box.shape), (0,), extra_box, True)

                def write(path: str):
                    return write_rank_files(self.storage, path, self.rank, [*views, own])
            meta = None
            if self.rank == 0:
                meta = {"world": self.world, "layout": self.layout, "loader": extra.get("loader"),
                        "config": self.cfg.to_dict()}
            result = persist(self.storage, step, write, meta, self.group, self.rank, self.world, inject)
        finally:
            self.snapshots.release(step)
        if result.ok:
            self.committed.add(step)
            if self.rank == 0:
                self._trim()
        else:
            self.persist_error = result.error or "unknown error"
            newest = max(self.committed) if self.committed else None
            self.log(f"checkpoint: persisting step {step} to {self.storage.url(result.path)} failed "
                     f"({result.error}); training goes on"
                     + (f", step {newest} stays the newest checkpoint" if newest is not None else ""))
        # stage 2 on the trace's checkpoint track (from this thread: nothing blocked on it)
        timers.record("persist", "checkpoint", t0, timers.now_ns(), nbytes=result.bytes_written or 0)
        with self._events_lock:
            self._events.append({"step": step, "ok": result.ok, "persist_s": result.seconds,
                                 "bytes": result.bytes_written, "error": result.error,
                                 "writer": "process" if by_process else "training process"})
        return result

    def _replicate_loop(self) -> None:
        _lower_priority()
        while True:
            step, done = self._replicate_queue.get()
            t0 = timers.now_ns()
            nbytes = 0
            try:
                data, header = self.snapshots.raw(step)
                nbytes = int(data.size)
                self.replicas.exchange(header, data)
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 - a peer gone: the restart that follows deals with it
                self.log(f"checkpoint: replicating the snapshot of step {step} to rank {self.replicas.dest} "
                         f"failed ({type(e).__name__}: {e}); the previous replica stays")
                done.set_result(None)
            finally:
                self.snapshots.release(step)
            timers.record("replicate", "checkpoint", t0, timers.now_ns(), nbytes=nbytes)

    def wait_replicas(self) -> None:
        """Until the snapshots taken so far are on their peer hosts."""
        for f in self._replicating:
            f.result()
        self._replicating = []

    def _trim(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop leftovers of failed persists."""
        done = self.storage.committed()
        for _, path in done[:-self.cfg.checkpoint.keep]:
            self.storage.remove(path)
        newest = done[-1][0] if done else -1
        for s, path in self.storage.partial():
            if s < newest:
                self.storage.remove(path)

    def events(self) -> list[dict[str, Any]]:
        """Stage 2 results since the last call (for the metrics log)."""
        with self._events_lock:
            out, self._events = self._events, []
        return out

    def wait(self) -> None:
        """Until every queued persist is done."""
        for f in self._pending:
            f.result()
        self._pending = []

    def finish(self, step: int) -> bool:
        """Wait for stage 2. Once storage holds `step`, the host-memory copy is freed. True if it does."""
        self.wait()
        self.wait_replicas()
        safe = step in self.committed
        if safe:
            self.snapshots.clear()
            if self.replicas is not None:
                self.replicas.clear()
        return safe

    def close(self) -> None:
        self.wait()
        self.snapshots.close()
        if self.writer is not None:
            self.writer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ restoring

    def fresh_start(self) -> None:
        """Forget host-memory snapshots (and peers' replicas) of an earlier run of this directory."""
        self.snapshots.clear()
        if self.replicas is not None:
            self.replicas.clear()

    def restore(self, state: TrainState) -> RestoreInfo | None:
        """Collective: load the newest complete state into `state`; None when there is none."""
        t0 = time.perf_counter()
        self.wait_replicas()  # a rollback: no transfer of a snapshot still reading a slot
        listing = [self.storage.committed() if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(listing, src=0, group=self.group)
        stored = listing[0]
        mem = self._common_memory_steps()
        newest_stored = stored[-1][0] if stored else -1
        skipped: list[str] = []
        if mem and mem[0] >= newest_stored:
            info = self._restore_memory(mem[0], state)
            if info is not None:
                info.seconds = time.perf_counter() - t0
                self.committed = {s for s, _ in stored}
                return info
            skipped.append(f"host memory step {mem[0]}: unusable")
        for step, path in reversed(stored):
            problem, record, verified = self._check_stored(path)
            if problem is not None:
                self.log(f"checkpoint: {problem}; falling back to an earlier checkpoint")
                skipped.append(problem)
                continue
            info = self._restore_storage(step, path, record, state)
            info.bytes_verified = verified
            info.seconds, info.skipped = time.perf_counter() - t0, skipped
            self.committed = {s for s, _ in stored}
            return info
        if skipped:
            raise UserError(f"checkpoint {self.storage.display}: no usable checkpoint ({skipped[-1]}); "
                            "start fresh "
                            "with checkpoint.resume=false (the old checkpoints are archived)")
        return None

    def _common_memory_steps(self) -> list[int]:
        """Steps every rank can restore from host memory: its own snapshot, or a peer host's replica of
        it (a rank whose host died whole)."""
        mine = self.snapshots.find()
        if self.world == 1:
            return mine
        held = self.replicas.held() if self.replicas is not None else {}
        every: list[tuple | None] = [None] * self.world
        dist.all_gather_object(every, (mine, held), group=self.group)
        self._owners = {r: set(own) for r, (own, _) in enumerate(every)}
        self._holders = {}  # (rank, step) -> the first rank holding a replica of it
        for holder, (_, h) in enumerate(every):
            for src, steps in h.items():
                for s in steps:
                    self._holders.setdefault((int(src), s), holder)
        common: set[int] | None = None
        for r in range(self.world):
            avail = self._owners[r] | {s for (src, s) in self._holders if src == r}
            common = avail if common is None else common & avail
        return sorted(common or (), reverse=True)

    def _fetch_from_peers(self, step: int) -> int:
        """Every rank without its own snapshot of `step` receives a peer host's replica of it and installs
        it as its own. The same order of transfers on every rank; each involves two. Returns how many."""
        lost = [r for r in range(self.world) if step not in self._owners.get(r, {step})]
        for r in lost:
            holder = self._holders[(r, step)]
            if self.rank == holder:
                self.replicas.serve(r, step, r, self.group)
            elif self.rank == r:
                header, data = fetch(holder, self.group)
                self.snapshots.install(header, data)
        if lost and self.rank == 0:
            self.log(f"checkpoint: rank(s) {', '.join(map(str, lost))} lost their host-memory snapshot "
                     f"(their host's memory is gone); step {step} comes from the replicas on peer hosts")
        return len(lost)

    def _restore_memory(self, step: int, state: TrainState) -> RestoreInfo | None:
        error = ""
        extra: dict[str, Any] = {}
        fetched = 0
        try:
            fetched = self._fetch_from_peers(step)
            table = self.snapshots.table(step)
            ensure_optimizer_state(state.optimizer, _optimizer_keys(
                (fqn, tuple(shape), dtype) for fqn, _, _, dtype, _, _, shape in table))
            extra = self.snapshots.restore(step, state.model_chunks() + state.optimizer_chunks())
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # a damaged or foreign snapshot
            error = f"{type(e).__name__}: {e}"
        if self._agree(error):
            self.log(f"checkpoint: the host-memory snapshot of step {step} cannot be used "
                     f"({error or 'another rank'})"
                     "; restoring from storage")
            return None
        self._snapshot_step = step
        return RestoreInfo(step, "memory", str(self.memory_dir), extra, 0.0, from_peers=fetched)

    def _check_stored(self, path: str) -> tuple[str | None, dict | None, int]:
        """Verify every file's checksum, the files split over the ranks: (the first problem or None,
        the commit record, the bytes this rank checksummed)."""
        record, problem = None, None
        try:
            record = self.storage.read_commit(path)
        except CheckpointError as e:
            problem = str(e)
        box = [record, problem]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        record, problem = box
        if problem:
            return problem, None, 0
        from megascale.checkpoint.dcp_io import verify

        mine = sorted(record["files"])[self.rank::self.world]
        problem = self._agree(verify(self.storage, path, record, mine) or "") or None
        return problem, record, sum(record["files"][n]["bytes"] for n in mine)

    def _restore_storage(self, step: int, path: str, record: dict, state: TrainState) -> RestoreInfo:
        from megascale.checkpoint.dcp_io import load_chunks, stored_tensors

        same = record.get("layout") == self.layout and record.get("world") == self.world
        broadcast = self.cfg.checkpoint.broadcast_restore and self.mesh.dp > 1
        error, nbytes, extra = "", 0, {}
        try:
            tensors = stored_tensors(self.storage, path)
            ensure_optimizer_state(state.optimizer, _optimizer_keys(
                (k, tuple(md.size), str(md.properties.dtype)) for k, md in tensors.items()))
            chunks = state.optimizer_chunks()
            if not broadcast or self.mesh.dp_rank == 0:
                chunks = state.model_chunks() + chunks
            if same:
                md = tensors.get(_rank_extra_fqn(self.rank))
                if md is None:
                    raise CheckpointError(f"checkpoint {self.storage.url(path)}: no state of rank "
                                          f"{self.rank}")
                blob = torch.zeros(int(md.size[0]), dtype=torch.uint8)
                chunks.append(Chunk(_rank_extra_fqn(self.rank), tuple(blob.shape), (0,), blob, True))
            nbytes = load_chunks(self.storage, path, chunks)
            if same:
                extra["rng"] = json.loads(bytes(blob.tolist()).decode())
        except UserError as e:
            error = str(e)
        error = self._agree(error)
        if error:
            raise UserError(error)
        if broadcast:
            state.broadcast_weights()
        extra["loader"] = record.get("loader")
        return RestoreInfo(step, "storage", self.storage.url(path), extra, 0.0, nbytes, same_layout=same)

    def _agree(self, error: str) -> str:
        if self.world == 1:
            return error
        out: list[str | None] = [None] * self.world
        dist.all_gather_object(out, error, group=self.group)
        return next((e for e in out if e), "")


def _lower_priority() -> None:
    """Stage 2 runs niced: on a busy host its copies and checksums yield to training's threads (Linux
    applies nice per thread, and the threads a thread starts inherit it)."""
    if threading.current_thread() is threading.main_thread() or \
            getattr(threading.current_thread(), "_megascale_niced", False):  # synchronous mode: never nice
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass
    threading.current_thread()._megascale_niced = True


def _optimizer_keys(entries) -> dict[str, tuple[bool, torch.dtype]]:
    """optim/<key>/<param> entries (fqn, shape, dtype name) -> {key: (is_scalar, dtype)}."""
    keys = {}
    for fqn, shape, dtype in entries:
        if fqn.startswith("optim/"):
            key = fqn.split("/", 2)[1]
            keys[key] = (len(shape) == 0, getattr(torch, str(dtype).removeprefix("torch.")))
    return keys
