"""`data.shared_loader`: one reader per host; the host's ranks take their rows from shared memory.

Without it every rank runs its own `BatchLoader`: the tensor-parallel ranks of a data-parallel
replica all read, pack and shuffle the same rows, and the pipeline stages that never look at a
token (all but the first and the last) read them too. MegaScale gives each host one loader
instead: here the host's lowest global rank (its *leader*) runs a producer thread that reads the
rows of every data-parallel replica on the host once and writes them into a ring of slots in a
/dev/shm file; each rank that consumes tokens copies its replica's rows out of the slot on a reader
thread of its own. Both work ahead (the producer up to `slots - 1` batches) while the step computes,
so next_batch only takes a finished copy, as with BatchLoader's prefetch thread.

Nothing about the data changes: the order, blends (`self_ordered`), the data-parallel slices and
the loader state are `BatchLoader`'s (this is a subclass; the leader calls its `stream_indices` and
`local_slice`), so a run with the flag is bit-for-bit the run without it, a checkpoint taken with
one resumes with the other, and a process of one loads exactly as `BatchLoader` does.

Who consumes: pipeline stage 0 (inputs) and the last stage (targets), every tensor-parallel rank of
them. The other stages get a zero placeholder of the right shape and read nothing. A ring is made
only where it saves reads: on a host where no two consumers share a replica (pure data parallelism,
or one consumer) each consumer reads its own rows as `BatchLoader` does ("local"), rather than piling
every replica's reads on the leader.

The ring (one file per host, named per job, restart attempt, a nonce from global rank 0, the
leader's rank and pid):

    header page   magic, version, nonce, leader pid, layout (batch, rows per replica, seq_len,
                  replicas, slots, consumers), the dataset's size and seed, the producer's error
                  (position + 1, message), and per consumer its *ack*: the next position it needs + 1
    message page  the producer's error message, UTF-8
    slot k        a page of words (stamp, position, a checksum of each replica's part), then the batch,
                  split once by the producer: int64 [replicas, 2 (inputs, targets), global_batch // dp,
                  seq_len], so a reader's copies are two contiguous ones

Batch at stream position p lives in slot (p // global_batch) % slots. The producer writes it only
when every consumer's next position n satisfies n <= p < n + slots * global_batch (so it never
overwrites a batch someone still needs, and waits for ranks that have not repositioned after a
`load_state_dict`), and in this order: stamp 0, rows, checksums, position, stamp p + 1. A reader takes a
slot only if its stamp is p + 1 before and after its copies and the checksum of what it copied
matches (the stamps suffice where stores are seen in order, as on x86; the checksum, the sum of the
int64 words mod 2^63 at ~45 GB/s where zlib's CRC-32 does ~4, guards weaker orderings): a
half-written slot, a slot of another position, and (the nonce, checked with the layout when a rank
attaches) a file of another job or attempt are never read. A slot that still holds p is not
written again (after a rollback or resume to a batch still in the ring, nothing is read twice), nor
waited for: the consumers may have taken it and moved on before the producer gets to it.

Restarts: the leader creates the file under a temporary name and renames it complete; once every
consumer of the host has mapped it (two gathers, start-up only) the leader unlinks it, so the memory
lives exactly as long as the processes and a crash leaves nothing behind. Files of a dead leader
(its pid is in the name) from a crash during that window are removed by the next leader on the host.
A consumer whose leader is gone, or whose producer failed, raises instead of waiting for ever.

Coordination is `all_gather_object` on the default group (gloo on CPU) at start-up only; the
steps themselves touch no process group. GPU: with `pin_device` each rank's reader copies its rows into
pinned host memory (its thread bound to the rank's device, as torch's DataLoader pin thread is), from
which the Trainer's `.to(device, non_blocking=True)` is a DMA; no GPU has run it yet.
"""

from __future__ import annotations

import mmap
import os
import queue
import re
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale.data.loader import BatchLoader, _stop_thread, put_unless_stopped, take
from megascale.errors import UserError

MAGIC = int.from_bytes(b"MSDRING1", "little")
VERSION = 1
PREFIX = "megascale-data-"
PAGE = 4096
HEADER_BYTES = 2 * PAGE  # the words, then the producer's error message
(W_MAGIC, W_VERSION, W_NONCE, W_PID, W_BATCH, W_PER, W_SEQ, W_REPLICAS, W_SLOTS, W_CONSUMERS,
 W_SAMPLES, W_SEED, W_ERROR, W_ERROR_LEN, W_ERROR_USER) = range(15)
ACK0 = 16  # ack of consumer i: the next stream position it needs + 1 (0: not attached yet)
MAX_CONSUMERS = PAGE // 8 - ACK0
S_STAMP, S_POSITION, S_SUM0 = 0, 1, 2  # slot words: position + 1 when complete (0: empty/being written)
MAX_REPLICAS = PAGE // 8 - S_SUM0
_NAME = re.compile(re.escape(PREFIX) + r".*-p(\d+)(\.part)?$")


def default_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


def remove_stale(dir_: Path) -> list[Path]:
    """Delete ring files (complete or half-made) whose leader process no longer runs; returns them."""
    gone = []
    for p in Path(dir_).glob(PREFIX + "*"):
        m = _NAME.match(p.name)
        if m and not _alive(int(m.group(1))):
            try:
                p.unlink()
                gone.append(p)
            except OSError:  # another leader got there first, or not ours to delete
                pass
    return gone


def checksum(*arrays: np.ndarray) -> int:
    """The sum of the int64 words of `arrays`, mod 2^63 (what a torn or half-written copy fails)."""
    total = sum(int(a.view(np.uint64).sum(dtype=np.uint64)) for a in arrays)
    return total & (2**63 - 1)


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


class Ring:
    """The host's ring of batch slots: a shared file mapping, viewed as int64 words and rows."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path, self._mm = path, mm
        buf = np.frombuffer(mm, dtype=np.uint8)
        self.words = buf[:PAGE].view(np.int64)
        self.acks = self.words[ACK0:ACK0 + int(self.words[W_CONSUMERS])]
        self.message = buf[PAGE:HEADER_BYTES]
        w = self.words
        self.batch, self.per, self.seq = int(w[W_BATCH]), int(w[W_PER]), int(w[W_SEQ])
        self.replicas, self.slots = int(w[W_REPLICAS]), int(w[W_SLOTS])
        data = self.replicas * 2 * self.per * self.seq * 8
        self.slot_bytes = PAGE + _align(data)
        self.slot_words, self.slot_rows = [], []
        for s in range(self.slots):
            base = HEADER_BYTES + s * self.slot_bytes
            self.slot_words.append(buf[base:base + PAGE].view(np.int64))
            self.slot_rows.append(buf[base + PAGE:base + PAGE + data].view(np.int64)
                                  .reshape(self.replicas, 2, self.per, self.seq))

    @staticmethod
    def nbytes(per: int, seq: int, replicas: int, slots: int) -> int:
        return HEADER_BYTES + slots * (PAGE + _align(replicas * 2 * per * seq * 8))

    @classmethod
    def create(cls, path: Path, *, nonce: int, batch: int, per: int, seq: int, replicas: int, slots: int,
               consumers: int, num_samples: int, seed: int) -> Ring:
        """Make the file complete under a temporary name, then rename it into place (readers never see a
        file without its header). Space is reserved up front: tmpfs that runs out later is a SIGBUS."""
        if consumers > MAX_CONSUMERS or replicas > MAX_REPLICAS:
            raise OSError(f"{consumers} consumers / {replicas} replicas on one host: at most "
                          f"{MAX_CONSUMERS} / {MAX_REPLICAS}")
        size = cls.nbytes(per, seq, replicas, slots)
        part = path.with_name(path.name + ".part")
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            part.unlink(missing_ok=True)
            raise
        os.close(fd)
        w = np.frombuffer(mm, dtype=np.int64, count=ACK0)
        w[W_VERSION], w[W_NONCE], w[W_PID] = VERSION, nonce, os.getpid()
        w[W_BATCH], w[W_PER], w[W_SEQ], w[W_REPLICAS], w[W_SLOTS] = batch, per, seq, replicas, slots
        w[W_CONSUMERS], w[W_SAMPLES], w[W_SEED] = consumers, num_samples, seed & (2**63 - 1)
        w[W_MAGIC] = MAGIC
        del w
        os.rename(part, path)
        return cls(path, mm)

    @classmethod
    def attach(cls, path: Path, expect: dict[str, int]) -> Ring:
        """Map the host's ring; its header must be this job's (nonce) with this layout, else UserError."""
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        w = np.frombuffer(mm, dtype=np.int64, count=ACK0)
        got = {"magic": int(w[W_MAGIC]), "version": int(w[W_VERSION]), "nonce": int(w[W_NONCE]),
               "batch": int(w[W_BATCH]), "per": int(w[W_PER]), "seq": int(w[W_SEQ]),
               "replicas": int(w[W_REPLICAS]), "slots": int(w[W_SLOTS]), "consumers": int(w[W_CONSUMERS]),
               "num_samples": int(w[W_SAMPLES]), "seed": int(w[W_SEED])}
        del w
        want = {"magic": MAGIC, "version": VERSION, **expect, "seed": expect["seed"] & (2**63 - 1)}
        wrong = [f"{k} {got[k]} (expected {v})" for k, v in want.items() if got.get(k) != v]
        if wrong:
            raise UserError(f"data.shared_loader: {path} is not this job's batch ring: {', '.join(wrong)}")
        return cls(path, mm)

    # ---- slots

    def slot_of(self, position: int) -> int:
        return (position // self.batch) % self.slots

    def holds(self, position: int) -> bool:
        return int(self.slot_words[self.slot_of(position)][S_STAMP]) == position + 1

    def window_open(self, position: int) -> bool:
        """May the batch at `position` be written now: every consumer attached, none still needing the
        batch its slot holds, none positioned elsewhere (ahead of it, or a ring's length behind)."""
        nxt = self.acks.copy() - 1
        return bool((nxt >= 0).all() and (nxt <= position).all()
                    and (position < nxt + self.slots * self.batch).all())

    def put(self, position: int, tokens: np.ndarray) -> None:
        """Write the batch at `position`: every replica's rows, [replicas * per, seq + 1] int64 tokens."""
        s = self.slot_of(position)
        w, rows = self.slot_words[s], self.slot_rows[s]
        w[S_STAMP] = 0
        tokens = tokens.reshape(self.replicas, self.per, self.seq + 1)
        rows[:, 0], rows[:, 1] = tokens[:, :, :-1], tokens[:, :, 1:]
        for r in range(self.replicas):
            w[S_SUM0 + r] = checksum(rows[r])
        w[S_POSITION] = position
        w[S_STAMP] = position + 1

    def try_take(self, position: int, replica: int, out: tuple[np.ndarray, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray] | None:
        """One replica's (inputs, targets) of the batch at `position`, copied (into `out` if given), or
        None if the slot does not hold it complete (not written yet, being written, another position,
        or torn)."""
        s = self.slot_of(position)
        w = self.slot_words[s]
        if int(w[S_STAMP]) != position + 1:
            return None
        part = self.slot_rows[s][replica]
        if out is None:
            x, y = part[0].copy(), part[1].copy()
        else:
            x, y = out
            np.copyto(x, part[0])
            np.copyto(y, part[1])
        if (checksum(x, y) != int(w[S_SUM0 + replica]) or int(w[S_POSITION]) != position
                or int(w[S_STAMP]) != position + 1):
            return None
        return x, y

    def ack(self, consumer: int, next_position: int) -> None:
        self.acks[consumer] = next_position + 1

    # ---- the producer's error

    def set_error(self, position: int, error: BaseException) -> None:
        msg = (str(error) or type(error).__name__).encode()[:PAGE]
        self.message[:len(msg)] = np.frombuffer(msg, dtype=np.uint8)
        self.words[W_ERROR_LEN], self.words[W_ERROR_USER] = len(msg), isinstance(error, UserError)
        self.words[W_ERROR] = position + 1

    def error_for(self, position: int) -> BaseException | None:
        """The producer's error, if it failed at or before `position`."""
        at = int(self.words[W_ERROR])
        if not at or at - 1 > position:
            return None
        msg = self.message[:int(self.words[W_ERROR_LEN])].tobytes().decode(errors="replace")
        if self.words[W_ERROR_USER]:
            return UserError(msg)
        return RuntimeError(f"data.shared_loader: the host's loader failed at sample {at - 1}: {msg}")

    @property
    def leader_pid(self) -> int:
        return int(self.words[W_PID])


class SharedBatchLoader(BatchLoader):
    """`BatchLoader` with one reader per host (see the module doc). Collective at construction:
    every rank of the job builds one, in the same order."""

    def __init__(self, samples: Any, global_batch: int, seed: int, *, shuffle: bool = True, dp_rank: int = 0,
                 dp_size: int = 1, prefetch: int = 2, consumer: bool = True, host: str | None = None,
                 job_key: str = "", shm_dir: str | Path | None = None, timeout_s: float = 1800.0,
                 pin_device: int | None = None) -> None:
        super().__init__(samples, global_batch, seed, shuffle=shuffle, dp_rank=dp_rank, dp_size=dp_size,
                         prefetch=prefetch)
        self.consumer, self.timeout_s = bool(consumer), timeout_s
        self.stats["copy_cpu_s"] = 0.0  # the reader thread's (the producer's reads are in load_cpu_s)
        # GPU: the CUDA device whose pinned host memory the rank's copies land in (None: pageable memory)
        self.pin_device = pin_device if pin_device is not None and torch.cuda.is_available() else None
        self.slots = max(2, prefetch + 2)
        self.mode = "local"  # "local": BatchLoader's reads; "ring": from the host's ring; "idle": no tokens
        self.ring: Ring | None = None
        self.is_leader = True
        self.host_ranks: list[int] = [0]
        self._producer: threading.Thread | None = None
        self._producer_stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._rows: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._blank: torch.Tensor | None = None
        self.ring_path: Path | None = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._connect(host, job_key, Path(shm_dir) if shm_dir else default_dir())

    # ---- start-up: who is on this host, the leader's ring, everyone attached

    def _connect(self, host: str | None, job_key: str, shm_dir: Path) -> None:
        from megascale.fault.inject import host_id

        rank, world = dist.get_rank(), dist.get_world_size()
        host = host or host_id()
        every: list[Any] = [None] * world
        dist.all_gather_object(every, ((host, self.dp_rank, self.consumer, os.getpid()),
                                       uuid.uuid4().hex[:12] if rank == 0 else None))
        nonce = int(every[0][1], 16)
        me = [r for r in range(world) if every[r][0][0] == host]
        consumers = [r for r in me if every[r][0][2]]
        leader = me[0]
        self.host_ranks, self.leader, self.is_leader = me, leader, rank == leader
        self.replicas = sorted({every[r][0][1] for r in consumers})
        # a ring only where it saves reads: some replica on this host has several consumers (its tp ranks,
        # its first and last stage); where each consumer is a replica of its own (pure dp) each reads its own
        shared = len(consumers) > len(self.replicas)
        self.mode = "idle" if not self.consumer else "ring" if shared else "local"
        name = f"{PREFIX}{_safe(job_key) or 'job'}-{nonce:012x}-r{leader}-p{every[leader][0][3]}"
        path = self.ring_path = shm_dir / name
        per = self.global_batch // self.dp_size
        layout = {"nonce": nonce, "batch": self.global_batch, "per": per, "seq": self.samples.seq_len,
                  "replicas": len(self.replicas), "slots": self.slots, "consumers": len(consumers)}
        error = None
        if shared and self.is_leader:
            try:
                remove_stale(shm_dir)
                self.ring = Ring.create(path, **layout, num_samples=self.num_samples, seed=self.seed)
            except OSError as e:
                error = (f"data.shared_loader: cannot make the host's batch ring in {shm_dir} ({e}); "
                         "free space there or set data.shared_loader=false")
        _agree(error)  # the file exists on every host (or every rank raises the same error)
        if shared and self.consumer and not self.is_leader:
            try:
                self.ring = Ring.attach(path, {**layout, "num_samples": self.num_samples, "seed": self.seed})
            except UserError as e:
                error = str(e)
            except OSError as e:
                error = f"data.shared_loader: cannot open {path} ({e})"
        try:
            _agree(error)  # every consumer has it mapped: the name is no longer needed
        finally:
            if shared and self.is_leader:
                path.unlink(missing_ok=True)
        if self.ring is not None and self.consumer:
            self._me = consumers.index(rank)
            self._replica = self.replicas.index(self.dp_rank)
            self.ring.ack(self._me, self.consumed_samples)

    # ---- loading

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "local":
            return super().next_batch()
        c0 = time.thread_time()
        if self.ring is not None and self.is_leader and self._producer is None:
            self._start_producer()
        if self.mode == "idle":  # a middle pipeline stage: its inputs come from the previous stage
            if self._blank is None:
                self._blank = torch.zeros(self.global_batch // self.dp_size, self.samples.seq_len,
                                          dtype=torch.int64)
            x = y = self._blank
        else:
            if self._reader is None:
                self._start_reader()
            position, item = take(self._rows, self._reader, "ring reader")
            if isinstance(item, BaseException):
                self._halt()
                raise item
            assert position == self.consumed_samples, "ring reader out of step"
            x, y = (torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in item)
        self.consumed_samples += self.global_batch
        if self.mode == "ring":  # the slot of the batch just taken may be written again
            self.ring.ack(self._me, self.consumed_samples)
        self.stats["next_cpu_s"] += time.thread_time() - c0
        return x, y

    def _fill(self, position: int) -> None:
        """Producer: read the rows of every replica on this host of the batch at `position` into its slot."""
        ring = self.ring  # never one the ring holds: _produce passes those without calling this
        c0 = time.thread_time()
        indices = self.stream_indices(position, self.global_batch)
        rows = np.concatenate([indices[self.local_slice(r)] for r in self.replicas])
        # NumPy only on this thread, as BatchLoader's prefetch thread (no second OpenMP team)
        ring.put(position, np.asarray(self.samples.batch(rows)).astype(np.int64, copy=False))
        self._count_read(len(rows), time.thread_time() - c0)

    def _start_producer(self) -> None:
        self._error = None
        self.ring.words[W_ERROR] = 0  # a failure before a reposition is not this run's
        self._producer_stop = threading.Event()
        self._producer = threading.Thread(
            target=_produce, args=(weakref.ref(self), self.ring, self.consumed_samples, self._producer_stop),
            name="megascale-data-host", daemon=True,
        )
        self._producer.start()
        self._producer_finalizer = weakref.finalize(self, _stop_thread, self._producer_stop, self._producer)

    def _start_reader(self) -> None:
        """This rank's copies out of the ring, on a thread of their own: off the step's critical path."""
        stop = threading.Event()
        self._rows = queue.Queue(maxsize=max(1, self.prefetch))
        self._reader = threading.Thread(
            target=_read, args=(weakref.ref(self), self.ring, self.consumed_samples, self._rows, stop,
                                self.pin_device),
            name="megascale-data-reader", daemon=True,
        )
        self._reader.start()
        self._reader_finalizer = weakref.finalize(self, _stop_thread, stop, self._reader)

    def _halt(self) -> None:
        """Stop the reader (dropping its copies: the ring still holds them) and the producer."""
        super()._halt()
        if self._reader is not None:
            self._reader_finalizer()
            self._reader = None
        if self._producer is not None:
            self._producer_finalizer()
            self._producer = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # halts both threads; the next next_batch starts them here
        if self.mode == "ring":
            self.ring.ack(self._me, self.consumed_samples)

    def _copy(self, position: int, stop: threading.Event) -> tuple | None:
        """Reader thread: this replica's (inputs, targets) at `position` once the slot holds them; None if
        stopped; raises the producer's error, or if the leader is gone or the batch never comes."""
        ring, pause, start = self.ring, 2e-5, time.monotonic()
        check, out, into = start + 1.0, None, None
        if self.pin_device is not None:  # the rank's copy lands in pinned memory: the device copy is a DMA
            try:
                shape = (self.global_batch // self.dp_size, self.samples.seq_len)
                out = tuple(torch.empty(shape, dtype=torch.int64, pin_memory=True) for _ in range(2))
                into = (out[0].numpy(), out[1].numpy())
            except RuntimeError:  # no pinned memory to be had: pageable copies, as BatchLoader's
                self.pin_device, out = None, None
        while not stop.is_set():
            got = ring.try_take(position, self._replica, into)
            if got is not None:
                return got if out is None else out
            if (err := ring.error_for(position)) is not None:
                raise self._error if self.is_leader and self._error is not None else err
            now = time.monotonic()
            if now >= check:
                check = now + 1.0
                if not self.is_leader and not _alive(ring.leader_pid):
                    raise RuntimeError(f"data.shared_loader: the host's loader (rank {self.leader}, pid "
                                       f"{ring.leader_pid}) is gone; sample {position} never came")
                if self.is_leader and (self._producer is None or not self._producer.is_alive()):
                    raise RuntimeError(f"data.shared_loader: the producer thread stopped before sample "
                                       f"{position}")
                if now - start > self.timeout_s:
                    raise RuntimeError(f"data.shared_loader: sample {position} not in the host's ring after "
                                       f"{self.timeout_s:.0f} s (leader rank {self.leader})")
            stop.wait(pause)
            pause = min(2 * pause, 1e-3)
        return None


# How often the producer looks at a full ring. Its window opens when the host's consumers take a batch,
# once a step, and it works slots - 1 batches ahead, so a few looks a step are enough: it looks every
# 1/POLLS_PER_STEP of the last interval between openings, within these bounds. A fixed 2 ms (as before)
# cost the leader ~2% of a core at all times, idle included (0.10 CPU-s/s with six jobs' producers).
POLLS_PER_STEP = 8
MIN_POLL_S, MAX_POLL_S = 2e-3, 50e-3


def _produce(ref: weakref.ref, ring: Ring, position: int, stop: threading.Event) -> None:
    """The leader's producer thread: fill the batches at `position`, `position` + B, ... as slots free."""
    cap, opened = MIN_POLL_S, None
    while not stop.is_set():
        if ring.holds(position):
            # Written before a reposition (a rollback, a resume): nothing to write, and nothing to wait
            # for either. The consumers read such a batch without the producer and may be past it
            # already; the window, which wants no consumer past the position it writes, would then never
            # open for it, and the next batch they need would never come (seen in CI: both tp ranks of a
            # host stuck in next_batch after a NaN rollback). A later write to its slot waits for the
            # window as any write does, so the batch stays while a consumer still needs it.
            position += ring.batch
            continue
        pause, waited = 1e-4, False
        while not ring.window_open(position):
            waited = True
            if stop.wait(pause):
                return
            pause = min(2 * pause, cap)
        if waited:  # the window just opened: a step's length since it last had to be waited for
            now = time.monotonic()
            if opened is not None:
                cap = min(MAX_POLL_S, max(MIN_POLL_S, (now - opened) / POLLS_PER_STEP))
            opened = now
        loader = ref()
        if loader is None:
            return
        try:
            loader._fill(position)
        except BaseException as e:  # every consumer of the host raises it
            loader._error = e
            ring.set_error(position, e)
            return
        del loader
        position += ring.batch


def _read(ref: weakref.ref, ring: Ring, position: int, out: queue.Queue, stop: threading.Event,
          device: int | None = None) -> None:
    """A consumer's reader thread: copy this rank's rows at `position`, `position` + B, ... into `out`.
    It acknowledges nothing (next_batch does, as the caller takes each batch), so the ring keeps every
    batch it copied until then and a reposition can drop the copies."""
    if device is not None:  # a new thread's current device is 0: pinning from it would open a context there
        try:
            torch.cuda.set_device(device)
        except BaseException as e:  # handed to the caller, as a failed copy is
            put_unless_stopped(out, (position, e), stop)
            return
    while not stop.is_set():
        loader = ref()
        if loader is None:
            return
        c0 = time.thread_time()
        try:
            rows = loader._copy(position, stop)
            if rows is None:
                return
            item: Any = (position, rows)
        except BaseException as e:  # handed to the caller, which re-raises it
            item = (position, e)
        loader.stats["copy_cpu_s"] += time.thread_time() - c0  # the copy (and any polling) is loading too
        del loader
        put_unless_stopped(out, item, stop)
        if isinstance(item[1], BaseException):
            return
        position += ring.batch


def _agree(error: str | None) -> None:
    """Every rank raises the first rank's error, or none does (a collective)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:48]


def job_key(cfg: Any) -> str:
    """The run and restart attempt a ring belongs to (its file name): distributed.job_id or the
    launcher's run id, and torch elastic's restart count."""
    run = cfg.distributed.job_id or os.environ.get("TORCHELASTIC_RUN_ID", "") or "local"
    return f"{run}-a{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def build_loader(cfg: Any, samples: Any, mesh: Any, device: torch.device | None = None) -> BatchLoader:
    """The Trainer's loader for this rank: a `SharedBatchLoader` when data.shared_loader is on and the
    job has more than one process (collective then), else a `BatchLoader`."""
    kw = {"seed": cfg.data.seed, "dp_rank": mesh.dp_rank, "dp_size": mesh.dp, "prefetch": 2}
    if not cfg.data.shared_loader or mesh.world_size == 1:
        return BatchLoader(samples, cfg.train.global_batch, **kw)
    consumer = mesh.is_first_stage or mesh.is_last_stage  # stage 0 embeds the inputs, the last takes targets
    pin = device.index if device is not None and device.type == "cuda" else None
    return SharedBatchLoader(samples, cfg.train.global_batch, consumer=consumer, job_key=job_key(cfg),
                             timeout_s=cfg.distributed.collective_timeout_s, pin_device=pin, **kw)
