"""Stage 1: a copy of a rank's state in host memory that outlives the process.

Each rank owns two *slots*, each one file under `checkpoint.memory_dir` (tmpfs: /dev/shm)
mapped into the process (a shared `numpy.memmap`), sized once for the rank's boxes (shards.py),
its pages reserved up front (`posix_fallocate`: a full tmpfs is an error at allocation, not a
SIGBUS in the middle of a copy) and reused, so a snapshot allocates nothing: it is one `copy_`
per box. Each box's tensor has a storage of its own exact size (`torch.from_numpy` of its
slice), which lets stage 2 hand it to DCP without the copy DCP makes of views into a larger
storage. A directory without room for the slots is one logged line, and the snapshots stay in
process memory (they then do not survive the process). A
slot's JSON header is written (atomically) only after its copy is complete and deleted
before the slot is overwritten, so a header always describes a whole snapshot; with two
slots the previous complete snapshot survives while the next is being taken, and while
stage 2 persists one slot the other takes the next snapshot.

The copy may run in a background thread while the next step's forwards and backwards run:
the weights and optimizer state do not change until that step's update, which calls
`wait()` first (the Trainer does). A restarted process on the same host (same run
directory, same rank and layout) finds the newest header and restores from memory.

With `shared=False` (checkpoint.memory = false) the slots are private memory: stage 2 still
persists in the background, but nothing survives the process.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megascale.checkpoint.shards import Chunk

_ALIGN = 64
DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                torch.int32, torch.uint8, torch.bool)}


def _nbytes(c: Chunk) -> int:
    return math.prod(c.sizes) * c.tensor.element_size()


def table_nbytes(table: list) -> int:
    """The bytes a slot's box table spans (its last box's end)."""
    return max((t[4] + math.prod(t[2]) * DTYPES[t[3]].itemsize for t in table), default=1)


def shared_buffer(path: Path, nbytes: int) -> np.memmap:
    """A file of `nbytes` (tmpfs), its pages reserved now, mapped: a full tmpfs is ENOSPC here, not a
    SIGBUS in the middle of a copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    finally:
        os.close(fd)
    return np.memmap(path, dtype=np.uint8, mode="r+", shape=(max(nbytes, 1),))


@dataclass
class _Slot:
    index: int
    buffer: np.ndarray | None = None  # uint8, the whole slot (a shared memmap, or private memory)
    table: list | None = None  # [(fqn, offsets, sizes, dtype, byte offset, write)]
    step: int = -1  # of the complete snapshot it holds; -1: none
    target: int = -1  # the step being (or last) copied into it
    extra: dict | None = None
    busy: int = 0  # persists queued on it or reading it: never overwritten meanwhile
    copy: Future | None = None  # the copy into it
    views: tuple | None = None  # (buffer, table, boxes): the boxes made for that buffer and table (_views)


class HostSnapshot:
    def __init__(self, directory: str | Path | None, rank: int, identity: dict[str, Any], shared: bool = True,
                 background: bool = True, log: Callable[[str], None] = print):
        """directory: where the slot files live (shared); identity: what a restored snapshot must match
        (layout, world size, rank), compared field by field."""
        self.dir = Path(directory) if directory is not None else None
        self.rank, self.identity, self.shared = rank, identity, shared and directory is not None
        self.slots = [_Slot(0), _Slot(1)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot") if background else None
        self._copy: Future | None = None
        self._lock = threading.Condition()
        self.latest: _Slot | None = None
        self.log = log

    # ---- files

    def _file(self, slot: int, ext: str) -> Path:
        assert self.dir is not None
        return self.dir / f"rank{self.rank:05d}.slot{slot}.{ext}"

    def _allocate(self, slot: _Slot, table: list, nbytes: int) -> None:
        if slot.buffer is not None and slot.table is not None and [t[:4] for t in slot.table] == \
                [t[:4] for t in table] and slot.buffer.size >= nbytes:
            slot.table = table
            return
        slot.buffer = None
        if self.shared:
            f = self._file(slot.index, "bin")
            try:
                slot.buffer = shared_buffer(f, nbytes)
            except OSError as e:
                f.unlink(missing_ok=True)
                self.log(f"checkpoint.memory_dir {self.dir}: no room for a {nbytes / 1e6:.0f} MB snapshot "
                         f"({e.strerror or e}); snapshots stay in process memory and will not survive a "
                         "restart")
                self.shared = False
        if slot.buffer is None:
            slot.buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        slot.table = table

    @staticmethod
    def _views(slot: _Slot) -> list[Chunk]:
        """The boxes of the slot's table over its buffer. Made once per layout and kept: a rank's state is
        hundreds of tensors (~800 for the CPU default model), and making their views again each
        snapshot cost the training thread ~20 ms while two of four ranks' threads shared a core."""
        if slot.views is not None and slot.views[0] is slot.buffer and slot.views[1] == slot.table:
            return list(slot.views[2])
        out = []
        for fqn, offsets, sizes, dtype, off, write, shape in slot.table:
            d = DTYPES[dtype]
            n = math.prod(sizes) * torch.empty((), dtype=d).element_size()
            box = torch.from_numpy(slot.buffer[off:off + n]).view(d).view(sizes)  # a storage of its own
            out.append(Chunk(fqn, tuple(shape), tuple(offsets), box, write))
        slot.views = (slot.buffer, list(slot.table), out)
        return list(out)

    # ---- taking a snapshot

    def take(self, step: int, chunks: list[Chunk], extra: dict[str, Any], pin: bool = False,
             wait: bool = True) -> bool:
        """Start copying `chunks` into a free slot (in the background if enabled); `pin`: keep the slot
        for stage 2 (as `pin` does) from now on, before the copy is even done. With both slots taken (the
        newest snapshot, and an older one stage 2 still persists or a peer still receives), wait for one,
        or with `wait=False` take nothing and return False: a snapshot skipped costs a few steps of
        redo after a crash, a wait stalls training for the rest of a persist (seconds)."""
        self.wait()
        table, off = [], 0
        for c in chunks:
            table.append((c.fqn, list(c.offsets), list(c.sizes), str(c.tensor.dtype), off, c.write,
                          list(c.global_shape)))
            off += -(-_nbytes(c) // _ALIGN) * _ALIGN
        with self._lock:  # a slot that is neither the newest snapshot nor being persisted
            while True:
                free = [s for s in self.slots if s is not self.latest and not s.busy]
                if free:
                    slot = free[0]
                    break
                if not wait:
                    return False
                self._lock.wait()
            if self.shared:
                self._file(slot.index, "json").unlink(missing_ok=True)
            slot.step, slot.target = -1, step
            slot.busy += int(pin)
        self._allocate(slot, table, off)
        views = self._views(slot)

        def copy() -> None:
            with torch.no_grad():
                for v, c in zip(views, chunks, strict=True):
                    _copy_box(v.tensor, c.tensor)
            slot.extra = extra
            if self.shared:
                header = {"step": step, "identity": self.identity, "table": slot.table, "extra": extra}
                tmp = self._file(slot.index, "json.tmp")
                tmp.write_text(json.dumps(header))
                os.replace(tmp, self._file(slot.index, "json"))
            with self._lock:
                slot.step = step
                self.latest = slot
                self._lock.notify_all()

        slot.copy = self._pool.submit(copy) if self._pool is not None else _done(copy)
        self._copy = slot.copy
        return True

    def wait(self) -> None:
        """Until the copy in flight is complete (before the weights change)."""
        if self._copy is not None:
            self._copy.result()
            self._copy = None

    # ---- handing a slot to stage 2

    def slot_file(self, step: int) -> tuple[str, list]:
        """(the slot file, its table) of the pinned snapshot of `step`: the writer process reads it."""
        with self._lock:
            slot = next(s for s in self.slots if s.target == step and s.busy)
        return str(self._file(slot.index, "bin")), [list(t) for t in slot.table]

    def pin(self, step: int) -> None:
        """Keep the slot of `step` (taken or being taken) from being overwritten until `release`."""
        with self._lock:
            slot = next(s for s in self.slots if s.target == step or s.step == step)
            slot.busy += 1

    def acquire(self, step: int) -> tuple[list[Chunk], dict[str, Any]]:
        """The boxes of the pinned snapshot of `step`, once its copy is complete (stage 2 reads them)."""
        with self._lock:
            slot = next(s for s in self.slots if s.target == step and s.busy)
        if slot.copy is not None:
            slot.copy.result()  # this slot's copy only (the main thread owns the latest one's future)
        return self._views(slot), dict(slot.extra or {})

    def raw(self, step: int) -> tuple[np.ndarray, dict[str, Any]]:
        """(the bytes, the header) of the pinned snapshot of `step`, once its copy is complete: what a
        peer host keeps a replica of (replica.py)."""
        with self._lock:
            slot = next(s for s in self.slots if s.target == step and s.busy)
        if slot.copy is not None:
            slot.copy.result()
        nbytes = table_nbytes(slot.table)
        header = {"step": step, "identity": self.identity, "table": slot.table, "extra": slot.extra}
        return slot.buffer[:nbytes], header

    def release(self, step: int) -> None:
        with self._lock:
            for s in self.slots:
                if s.step == step and s.busy:
                    s.busy -= 1
                    break
            self._lock.notify_all()

    # ---- after a restart

    def find(self) -> list[int]:
        """Steps of the complete snapshots this rank left in memory for this identity, newest first."""
        if not self.shared:
            return []
        steps = []
        for i in (0, 1):
            h = self._header(i)
            if h is not None:
                steps.append(h["step"])
        return sorted(steps, reverse=True)

    def table(self, step: int) -> list:
        """The box table of the snapshot of `step` this rank left in memory (KeyError: none)."""
        for i in (0, 1):
            h = self._header(i)
            if h is not None and h["step"] == step:
                return h["table"]
        raise KeyError(f"snapshot of step {step}")

    def _header(self, i: int) -> dict | None:
        f = self._file(i, "json")
        try:
            h = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(h, dict) or h.get("identity") != self.identity or not self._file(i, "bin").exists():
            return None
        return h

    def install(self, header: dict[str, Any], data: np.ndarray) -> None:
        """Make a snapshot received from a peer host (replica.py) this rank's own, as if it had taken it:
        into the slot without a snapshot or with the older one, the header last. `restore` then reads
        it like any other."""
        if not self.shared:
            raise OSError("no shared memory directory to install a snapshot into")
        if header.get("identity") != self.identity:
            raise ValueError("the replica is of another rank, layout or run")
        steps = [(self._header(i) or {}).get("step", -1) for i in (0, 1)]
        i = 1 if steps[0] > steps[1] else 0
        self._file(i, "json").unlink(missing_ok=True)
        buf = shared_buffer(self._file(i, "bin"), data.size)
        buf[:data.size] = data
        buf.flush()
        keep = {k: header[k] for k in ("step", "identity", "table", "extra")}
        tmp = self._file(i, "json.tmp")
        tmp.write_text(json.dumps(keep))
        os.replace(tmp, self._file(i, "json"))

    def restore(self, step: int, chunks: list[Chunk]) -> dict[str, Any]:
        """Copy the snapshot of `step` into `chunks` (the same boxes it was taken of); its extra state."""
        for i in (0, 1):
            h = self._header(i)
            if h is None or h["step"] != step:
                continue
            table = [tuple(t) for t in h["table"]]
            mine = [(c.fqn, list(c.offsets), list(c.sizes), str(c.tensor.dtype)) for c in chunks]
            if [t[:4] for t in table] != mine:
                raise ValueError("the snapshot holds other tensors than this rank's state")
            slot = self.slots[i]
            nbytes = table_nbytes(table)
            size = self._file(i, "bin").stat().st_size
            if size < nbytes:
                raise ValueError(f"{self._file(i, 'bin')}: {size} bytes, the snapshot needs {nbytes}")
            slot.buffer = np.memmap(self._file(i, "bin"), dtype=np.uint8, mode="r+", shape=(size,))
            slot.table, slot.step, slot.target, slot.extra = [list(t) for t in table], step, step, h["extra"]
            with torch.no_grad():
                for v, c in zip(self._views(slot), chunks, strict=True):
                    c.tensor.copy_(v.tensor)
            self.latest = slot
            return h["extra"]
        raise FileNotFoundError(f"no snapshot of step {step}")

    def clear(self) -> None:
        """Delete this rank's slot files (a fresh start, or the state is safe in storage)."""
        self.wait()
        if self.dir is None:
            return
        for i in (0, 1):
            for ext in ("json", "bin", "json.tmp"):
                self._file(i, ext).unlink(missing_ok=True)
        try:
            self.dir.rmdir()  # the run's folder, once no rank has a slot in it
        except OSError:
            pass
        self.slots = [_Slot(0), _Slot(1)]
        self.latest = None

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _copy_box(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. A CPU box is copied by NumPy: a torch op in this thread would start a second OpenMP
    team that fights training's for the cores (the data loader's prefetch thread learned the same)."""
    if src.device.type == "cpu" and src.dtype != torch.bfloat16:
        np.copyto(dst.numpy(), src.detach().numpy())
    else:
        dst.copy_(src)


def _done(fn) -> Future:
    f: Future = Future()
    try:
        fn()
        f.set_result(None)
    except BaseException as e:  # noqa: BLE001 - re-raised by wait()
        f.set_exception(e)
    return f
