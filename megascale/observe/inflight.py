"""What a rank is doing right now, in a memory-mapped file that outlives a stopped process.

Every collective and point-to-point op that the timers see goes through `begin`/`end` (or
`issue` + `begin_wait` for an async one), which write a few int64s into
`RUN_DIR/trace/inflight/rank_NNNNN.bin`: the op in flight (group, op, sequence number, peer,
since when), the last one completed, and per group the count of collectives this rank has
issued. Because the words live in a shared file mapping, a rank that was SIGSTOP'd, or is stuck
in C++ with the GIL held, still shows its last state to anyone who reads the file: the kernel
owns those pages, not the process. A heartbeat word (written by the watchdog thread, wall clock)
tells a live rank from a stopped one.

Sequence numbers make the wait-for graph (`observe.diagnose`): every member of a group issues
the group's collectives in the same order, so "rank A is in its 57th tp collective while rank B
has issued only 56" means A waits for B. Point-to-point messages are counted per channel (peer,
tag): A's 12th receive from B on a tag waits for B's 12th send to A on it.

The static part (host, pid, mesh coordinates, the members of each group, the op names) is a JSON
file beside it, written once: `rank_NNNNN.json`.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import numpy as np

from megascale.observe.linefile import say

MAGIC = 0x4D454741494E464C  # "MEGAINFL"
VERSION = 1
# word offsets of the record
MAGIC_W, VERSION_W, PID_W, RANK_W, HEARTBEAT_W, STEP_W, STATE_W = range(7)
CUR_GROUP, CUR_OP, CUR_SEQ, CUR_PEER, CUR_TAG, CUR_T0 = range(8, 14)
LAST_GROUP, LAST_OP, LAST_SEQ, LAST_T1 = range(16, 20)
UPDATED_W = 20  # wall clock of the last begin/end: how long ago this rank last made progress
NCHAN_W = 21  # p2p channels in use
ISSUED0 = 24  # per group: collectives issued
MAX_GROUPS = 16
CHAN0 = ISSUED0 + MAX_GROUPS  # per p2p channel: peer, tag, sent, received
MAX_CHANNELS = 8
WORDS = CHAN0 + 4 * MAX_CHANNELS

IDLE, IN_OP, WAITING = 0, 1, 2  # STATE_W: computing / in a blocking op / waiting for an async op
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "barrier",
       "all_gather_object", "gather", "other")
P2P_GROUP = "pp"


def record_path(dir_: Path, rank: int) -> Path:
    return Path(dir_) / f"rank_{rank:05d}.bin"


def _map_file(path: Path) -> mmap.mmap:
    """The record's file, zeroed and mapped. A restart's file of the right size is zeroed in place: its
    blocks are there already, so a disk that filled up since the first start does not refuse them."""
    size = 8 * WORDS
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, 0)
        os.pwrite(fd, b"\0" * size, 0)  # real blocks, not a sparse file: a store to a hole can SIGBUS
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class InFlight:
    """The writer side: one per rank, used by the timers on the training thread only."""

    def __init__(self, dir_: str | Path, rank: int, groups: dict[str, list[int]], *, host: str,
                 coords: dict[str, int]):
        self.dir = Path(dir_)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.groups = list(groups)  # index = position in the record
        if len(self.groups) > MAX_GROUPS:
            raise ValueError(f"at most {MAX_GROUPS} groups can be tracked, got {len(self.groups)}")
        self._gid = {g: i for i, g in enumerate(self.groups)}
        self._op = {o: i for i, o in enumerate(OPS)}
        self._chan: dict[tuple[int, int], int] = {}
        self.shared = True  # False: the record lives in this process only (its file could not be written)
        try:
            self._map = _map_file(record_path(self.dir, rank))
        except OSError as e:  # a full disk: the rank trains on; only a hang's diagnosis misses its record
            self.shared = False
            self._map = mmap.mmap(-1, 8 * WORDS)
            say(f"in-flight record of rank {rank}: cannot write {record_path(self.dir, rank)} "
                f"({e.strerror or e}); a hang's diagnosis will not see this rank's ops; training goes on")
        # a memoryview of int64 words: a store is a few tens of ns (a numpy scalar store is ~5x that)
        self.words = memoryview(self._map).cast("q")
        w = self.words
        w[VERSION_W], w[PID_W], w[RANK_W] = VERSION, os.getpid(), rank
        w[CUR_GROUP] = w[LAST_GROUP] = -1
        w[MAGIC_W] = MAGIC  # last: a reader takes a record without it as not yet written
        info = {"rank": rank, "pid": os.getpid(), "host": host, "coords": coords, "groups": groups,
                "ops": OPS, "version": VERSION}
        if self.shared:
            tmp = self.dir / f"rank_{rank:05d}.json.tmp"
            try:
                tmp.write_text(json.dumps(info))
                os.replace(tmp, self.dir / f"rank_{rank:05d}.json")
            except OSError as e:  # the words are there, but no reader finds a record without this file
                tmp.unlink(missing_ok=True)
                # nor with an earlier start's, whose groups may be another layout's (a shrink since)
                (self.dir / f"rank_{rank:05d}.json").unlink(missing_ok=True)
                say(f"in-flight record of rank {rank}: cannot write {tmp.with_suffix('')} "
                    f"({e.strerror or e}); a hang's diagnosis will not see this rank's ops; training goes on")
        self._seq = [0] * len(self.groups)
        self.heartbeat()

    def _channel(self, peer: int, tag: int) -> int:
        c = self._chan.get((peer, tag))
        if c is None:
            c = len(self._chan)
            if c >= MAX_CHANNELS:
                return -1
            self._chan[(peer, tag)] = c
            base = CHAN0 + 4 * c
            self.words[base], self.words[base + 1] = peer, tag
            self.words[NCHAN_W] = c + 1
        return c

    def issue(self, group: str, peer: int = -1, tag: int = -1, recv: bool = False) -> int:
        """Count one op of `group` (a p2p op on its channel instead); returns its sequence number."""
        w = self.words
        if peer >= 0:
            c = self._channel(peer, tag)
            if c < 0:
                return -1
            slot = CHAN0 + 4 * c + (3 if recv else 2)
            seq = int(w[slot]) + 1
            w[slot] = seq
            return seq
        g = self._gid[group]
        seq = self._seq[g] = self._seq[g] + 1
        w[ISSUED0 + g] = seq
        return seq

    def begin(self, group: str, op: str, peer: int = -1, tag: int = -1) -> int:
        """A blocking op starts: issue it and mark it in flight."""
        seq = self.issue(group, peer, tag, recv=op == "recv")
        self._mark(group, op, seq, peer, tag, IN_OP)
        return seq

    def begin_wait(self, group: str, op: str, seq: int, peer: int = -1, tag: int = -1) -> None:
        """The wait for an op issued earlier (`issue`) starts."""
        self._mark(group, op, seq, peer, tag, WAITING)

    def _mark(self, group, op, seq, peer, tag, state) -> None:
        w = self.words
        w[CUR_GROUP] = self._gid[group]
        w[CUR_OP] = self._op.get(op, len(OPS) - 1)
        w[CUR_SEQ], w[CUR_PEER], w[CUR_TAG] = seq, peer, tag
        w[CUR_T0] = w[UPDATED_W] = time.time_ns()
        w[STATE_W] = state

    def end(self) -> None:
        """The op in flight completed."""
        w = self.words
        w[STATE_W] = IDLE
        w[LAST_GROUP], w[LAST_OP], w[LAST_SEQ] = w[CUR_GROUP], w[CUR_OP], w[CUR_SEQ]
        w[LAST_T1] = w[UPDATED_W] = time.time_ns()

    def set_step(self, step: int) -> None:
        self.words[STEP_W] = step

    def heartbeat(self) -> None:
        self.words[HEARTBEAT_W] = time.time_ns()

    def close(self) -> None:
        self.words.release()
        self._map.close()


def read_record(dir_: str | Path, rank: int) -> dict | None:
    """One rank's record as a dict (None if it has not written one), with names resolved."""
    dir_ = Path(dir_)
    try:
        info = json.loads((dir_ / f"rank_{rank:05d}.json").read_text())
        raw = np.fromfile(record_path(dir_, rank), dtype=np.int64, count=WORDS)
    except (OSError, ValueError):
        return None
    if len(raw) < WORDS or raw[MAGIC_W] != MAGIC:
        return None
    w = [int(v) for v in raw]
    groups, ops = list(info["groups"]), info["ops"]

    def op_at(g, o, seq, peer=-1, tag=-1):
        if g < 0:
            return None
        out = {"group": groups[g], "op": ops[o], "seq": seq}
        if peer >= 0:
            out.update(peer=peer, tag=tag)
        return out

    state = w[STATE_W]
    current = op_at(w[CUR_GROUP], w[CUR_OP], w[CUR_SEQ], w[CUR_PEER], w[CUR_TAG]) if state != IDLE else None
    if current is not None:
        current["since_ns"] = w[CUR_T0]
        current["waiting_async"] = state == WAITING
    channels = []  # this rank's p2p counts per (peer, tag)
    for c in range(min(w[NCHAN_W], MAX_CHANNELS)):
        base = CHAN0 + 4 * c
        channels.append({"peer": w[base], "tag": w[base + 1], "sent": w[base + 2], "received": w[base + 3]})
    return {
        **info,
        "pid": w[PID_W],
        "heartbeat_ns": w[HEARTBEAT_W],
        "updated_ns": w[UPDATED_W],
        "step": w[STEP_W],
        "current": current,
        "last": op_at(w[LAST_GROUP], w[LAST_OP], w[LAST_SEQ]),
        "last_t1_ns": w[LAST_T1],
        "issued": {g: w[ISSUED0 + i] for i, g in enumerate(groups)},
        "channels": channels,
    }


def read_all(dir_: str | Path) -> dict[int, dict]:
    """Every rank's record under `dir_` (trace/inflight), by rank."""
    out = {}
    for p in sorted(Path(dir_).glob("rank_*.json")):
        rank = int(p.stem.split("_")[1])
        rec = read_record(dir_, rank)
        if rec is not None:
            out[rank] = rec
    return out
