"""Stage 1 on a second host: each rank's host-memory snapshot copied into a peer host's memory.

A snapshot in /dev/shm outlives its process, not its machine. When a host dies whole (power, kernel,
a NIC that takes the node down) its ranks' snapshots die with it, and without a copy elsewhere the job
restores from storage, redoing every step since the last persisted checkpoint. Gemini (SOSP '23)
keeps a copy of every snapshot in another machine's memory; so do we (`checkpoint.memory_replicas`).

Pairing: the hosts form a ring in the order of their first rank; the i-th rank of host h sends its
snapshot to the i-th rank of host h+1 (modulo that host's rank count) and keeps what the i-th ranks
of host h-1 send. A job on one host has nobody to send to and replicates nothing.

Each replication is one point-to-point exchange on a gloo group of its own, from a background
thread after the snapshot's copy is complete: a JSON header (step, the source's identity, its box
table, its small state), then the slot's bytes. The holder writes them into one of two replica slots
per source (files `replica-rank<src>-on-rank<holder>.slot<k>.{bin,json}` under its own memory
directory), the header last and atomically, into the slot that does not hold the newest complete
replica: as with the rank's own slots, a header always describes a whole copy, and the previous one
survives a transfer cut short.

On restore (manager.py) a rank without its own copy of the chosen step receives it from a holder and
installs it as its own snapshot (`HostSnapshot.install`), so the usual checks then apply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megascale.checkpoint.snapshot import shared_buffer


def ring_peers(hosts: list[str], rank: int) -> tuple[int | None, list[int]]:
    """(the rank `rank` sends its snapshot to, the ranks that send theirs to it), given each rank's host
    key. With fewer than two hosts nothing is sent: a copy on the same machine dies with the original."""
    order: list[str] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    if len(order) < 2:
        return None, []
    ranks = {h: [r for r, k in enumerate(hosts) if k == h] for h in order}

    def dest(r: int) -> int:
        h = order.index(hosts[r])
        nxt = ranks[order[(h + 1) % len(order)]]
        return nxt[ranks[hosts[r]].index(r) % len(nxt)]

    return dest(rank), [r for r in range(len(hosts)) if dest(r) == rank]


def _json_tensors(obj: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(its length, its bytes): a JSON object as the two messages `_recv_json` reads."""
    blob = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    return torch.tensor([blob.numel()], dtype=torch.int64), blob


def _send_json(obj: dict, dst: int, group) -> None:
    for t in _json_tensors(obj):
        dist.send(t, dst, group=group)


def _recv_json(src: int, group) -> dict:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    blob = torch.zeros(int(n.item()), dtype=torch.uint8)
    dist.recv(blob, src, group=group)
    out = json.loads(bytes(blob.numpy()).decode())
    if not isinstance(out, dict):
        raise ValueError(f"rank {src} sent a replica header that is not an object")
    return out


class PeerReplicas:
    def __init__(self, directory: Path, rank: int, identity: dict[str, Any], hosts: list[str], group,
                 log: Callable[[str], None] = print):
        """directory: this host's memory directory; identity: this rank's snapshot identity (a source's
        is the same with its own rank); hosts: each rank's host key; group: a gloo group of all ranks."""
        self.dir, self.rank, self.identity, self.group, self.log = Path(directory), rank, identity, group, log
        self.dest, self.sources = ring_peers(hosts, rank)
        self._buffers: dict[tuple[int, int], np.ndarray] = {}

    @property
    def active(self) -> bool:
        return self.dest is not None

    def _file(self, src: int, slot: int, ext: str) -> Path:
        return self.dir / f"replica-rank{src:05d}-on-rank{self.rank:05d}.slot{slot}.{ext}"

    # ---- replicating a snapshot (a background thread; every rank at the same steps)

    def exchange(self, header: dict[str, Any], data: np.ndarray) -> None:
        """Send this rank's snapshot (its header and bytes) to `dest`; keep what `sources` send."""
        # the sends asynchronous, the receives in turn: no pair waits on another (a ring of blocking
        # sends would deadlock once the messages outgrow gloo's buffers)
        sends = [dist.isend(t, self.dest, group=self.group)
                 for t in (*_json_tensors({**header, "nbytes": int(data.size)}), torch.from_numpy(data))]
        try:
            for src in self.sources:
                self._receive(src)
        finally:
            for w in sends:
                w.wait()

    def _receive(self, src: int) -> None:
        header = _recv_json(src, self.group)
        nbytes = int(header["nbytes"])
        slot = self._free_slot(src)
        self._file(src, slot, "json").unlink(missing_ok=True)
        buf = self._buffer(src, slot, nbytes)
        dist.recv(torch.from_numpy(buf[:nbytes]), src, group=self.group)
        if isinstance(buf, np.memmap):
            buf.flush()
        tmp = self._file(src, slot, "json.tmp")
        tmp.write_text(json.dumps(header))
        os.replace(tmp, self._file(src, slot, "json"))

    def _free_slot(self, src: int) -> int:
        """The slot that does not hold the newest complete replica of `src`."""
        steps = [(h or {}).get("step", -1) for h in (self._header(src, 0), self._header(src, 1))]
        return 1 if steps[0] > steps[1] else 0

    def _buffer(self, src: int, slot: int, nbytes: int) -> np.ndarray:
        buf = self._buffers.get((src, slot))
        if buf is not None and buf.size >= nbytes and self._file(src, slot, "bin").exists():
            return buf
        buf = shared_buffer(self._file(src, slot, "bin"), nbytes)
        self._buffers[(src, slot)] = buf
        return buf

    # ---- after a restart

    def _header(self, src: int, slot: int) -> dict | None:
        try:
            h = json.loads(self._file(src, slot, "json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(h, dict) or h.get("identity") != {**self.identity, "rank": src}:
            return None  # another run, layout or world size
        if not self._file(src, slot, "bin").exists():
            return None
        return h

    def held(self) -> dict[int, list[int]]:
        """{source rank: steps of the complete replicas this rank holds for it}, for this job's layout.
        Every replica file in the directory counts, not only those of this attempt's sources: the ring
        may have been another one before the restart."""
        out: dict[int, list[int]] = {}
        for f in self.dir.glob(f"replica-rank*-on-rank{self.rank:05d}.slot*.json"):
            try:
                src, slot = int(f.name[12:17]), int(f.name.split(".slot")[1][0])
            except (ValueError, IndexError):
                continue
            h = self._header(src, slot)
            if h is not None:
                out.setdefault(src, []).append(int(h["step"]))
        return {s: sorted(v, reverse=True) for s, v in out.items()}

    def serve(self, src: int, step: int, to: int, group) -> None:
        """Send the replica of `src` at `step` to rank `to` (which calls `fetch`). A replica gone meanwhile
        is sent as an error, never as silence: the receiver would wait for ever."""
        problem = f"rank {self.rank} holds no replica of rank {src} at step {step}"
        for slot in (0, 1):
            h = self._header(src, slot)
            if h is not None and h["step"] == step:
                try:
                    data = np.fromfile(self._file(src, slot, "bin"), dtype=np.uint8, count=int(h["nbytes"]))
                except (OSError, ValueError) as e:
                    problem = f"rank {self.rank}: {self._file(src, slot, 'bin')}: {e}"
                    break
                if data.size == int(h["nbytes"]):
                    _send_json(h, to, group)
                    dist.send(torch.from_numpy(data), to, group=group)
                    return
                problem = f"rank {self.rank}: {self._file(src, slot, 'bin')} is shorter than its header says"
                break
        _send_json({"error": problem}, to, group)
        raise FileNotFoundError(problem)

    def clear(self) -> None:
        self._buffers.clear()
        for f in self.dir.glob(f"replica-rank*-on-rank{self.rank:05d}.slot*"):
            f.unlink(missing_ok=True)


def fetch(holder: int, group) -> tuple[dict[str, Any], np.ndarray]:
    """Receive a replica that `holder` serves: (its header, its bytes)."""
    header = _recv_json(holder, group)
    if "error" in header:
        raise FileNotFoundError(str(header["error"]))
    data = np.empty(int(header["nbytes"]), dtype=np.uint8)
    dist.recv(torch.from_numpy(data), holder, group=group)
    return header, data
