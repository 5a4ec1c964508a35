"""A store that forwards every call to another and records it: the ground truth of store traffic.

Process-group start-up is store traffic (barriers, bootstrap address exchange), and the
scale benchmark replays it for thousands of simulated ranks. This wrapper is how that
traffic is counted from the real code path instead of guessed: pass it to
`init_process_group(store=...)` and every operation torch and its backend perform on the
store is appended to `ops` as (operation, key), keys as the client sent them.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist


class RecordingStore(dist.Store):
    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner
        self.ops: list[tuple[str, str]] = []
        self._lock = threading.Lock()  # the backend may call from its own threads

    def _record(self, op: str, *keys: str) -> None:
        with self._lock:
            self.ops.extend((op, k) for k in keys)

    def set(self, key: str, value) -> None:
        self._record("set", key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._record("get", key)
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._record("add", key)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        self._record("compare_set", key)
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self._record("delete_key", key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._record("num_keys", "")
        return self.inner.num_keys()

    def check(self, keys: list[str]) -> bool:
        self._record("check", *keys)
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._record("wait", *keys)
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._record("get", *keys)
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._record("set", *keys)
        self.inner.multi_set(keys, values)

    def append(self, key: str, value) -> None:
        self._record("append", key)
        self.inner.append(key, value)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op, _ in self.ops:
            out[op] = out.get(op, 0) + 1
        return out
