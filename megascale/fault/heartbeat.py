"""Heartbeats: every rank tells the job's store, every few seconds, how it is doing.

    hb = HeartbeatWriter(rank, interval_s=2.0)    # under a launcher's agent store; else a no-op
    hb.update(step=12, loss=2.31, tokens_per_s=9100.0, status="training")
    hb.log("step 12: val loss 2.40")                # the last line said, for the driver's status
    hb.stop(status="done")

The record is one JSON value at key `megascale/<generation>/hb/<rank>` of the beat store that this
host's `megascale launch` agent serves on 127.0.0.1 (so beats never cross hosts, and do not depend
on the job's store, which may be Redis or a round's TCPStore that dies with the workers): step,
loss, tokens/s, status, the last log line, the bytes its collectives moved, the wall time of the
beat, host and pid. A thread writes it, on a store client of its own (the training thread's client
is not shared across threads), so a rank that is computing, restoring or blocked in a collective
keeps beating; a rank whose beats stop is dead, stopped or hung with the GIL held, and one whose
beats go on with the same step is stuck in the job (`megascale.fault.driver` tells them apart).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from megascale.fault.inject import host_id


def heartbeat_key(attempt: int, rank: int) -> str:
    return f"megascale/{attempt}/hb/{rank}"


def agent_store_address() -> tuple[str, int] | None:
    """Where to beat: under `megascale launch` its agent's own beat store on this host
    (MEGASCALE_BEAT_STORE, host:port), whatever the job's store is (a round's TCPStore, Redis); under
    plain torchrun its agent store (nobody reads the beats there; they cost nothing)."""
    env = os.environ
    if env.get("MEGASCALE_BEAT_STORE"):
        host, _, port = env["MEGASCALE_BEAT_STORE"].rpartition(":")
        return host, int(port)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return env["MASTER_ADDR"], int(env["MASTER_PORT"])


def beat_generation() -> int:
    """The key's first part: `megascale launch`'s count of worker starts on this host (a membership restart
    starts new workers with the same restart count, and they must not inherit the old ones' beats)."""
    return int(os.environ.get("MEGASCALE_BEAT_GEN") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class HeartbeatWriter:
    def __init__(self, rank: int, interval_s: float = 2.0, bytes_moved=None):
        self.rank, self.interval_s = rank, interval_s
        self.state: dict[str, Any] = {"rank": rank, "host": host_id(), "pid": os.getpid(),
                                      "step": 0, "status": "starting", "loss": None, "tokens_per_s": None,
                                      "last_log": ""}
        self._bytes = bytes_moved or (lambda: 0)
        self._attempt = beat_generation()
        self._stop = threading.Event()
        self._store = None
        self._thread = None
        where = agent_store_address()
        if where is None:
            return
        try:
            self._store = dist.TCPStore(where[0], where[1], is_master=False,
                                        timeout=datetime.timedelta(seconds=30))
        except (RuntimeError, ValueError):
            return  # no store to beat to: the driver will see no beats and say so
        self._beat()
        self._thread = threading.Thread(target=self._run, name="megascale-heartbeat", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def update(self, **fields: Any) -> None:
        self.state.update(fields)

    def log(self, line: str) -> None:
        self.state["last_log"] = line[-300:]

    def _beat(self) -> None:
        rec = {**self.state, "bytes": self._bytes(), "t": time.time(), "attempt": self._attempt}
        try:
            self._store.set(heartbeat_key(self._attempt, self.rank), json.dumps(rec, default=str))
        except Exception:  # noqa: BLE001 - the store restarting must not take training down
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def stop(self, status: str | None = None) -> None:
        if self._thread is None:
            return
        if status:
            self.state["status"] = status
        self._stop.set()
        self._thread.join(timeout=5)
        self._beat()
        self._thread = None


def read_heartbeats(store, attempt: int, ranks: list[int]) -> dict[int, dict] | None:
    """The newest beat of each of `ranks` that has one (non-blocking); None when the store failed."""
    keys = [heartbeat_key(attempt, r) for r in ranks]
    out = {}
    try:
        present = [k for k in keys if store.check([k])]
        if not present:
            return out
        for v in store.multi_get(present):
            rec = json.loads(v)
            out[int(rec["rank"])] = rec
    except Exception:  # noqa: BLE001 - a store hiccup: the caller reconnects
        return None
    return out
