"""A `torch.distributed.Store` kept in Redis, for jobs too large for one TCPStore.

TCPStore is a single server thread inside rank 0: at thousands of ranks its rendezvous and
the store traffic of `new_group` queue behind it, and it dies with rank 0. Redis serves
many clients at once, lives outside the job (so a restarted job finds it), and one
server can hold the stores of many jobs. `RedisStore` subclasses `torch.distributed.Store`
in Python (PyTorch's pybind trampoline forwards the C++ calls of c10d and gloo/NCCL to
these methods), so it is passed as `dist.init_process_group(backend, store=..., ...)`.

Layout (one store = one key prefix):

- `{prefix}kv`: ONE hash, field = store key. One hash makes `num_keys` an HLEN and lets
  the whole store expire as one object.
- `{prefix}wake/{key}`: a list that holds one element once `key` has been written. Every
  write script pushes it (if empty) in the same atomic step as the write, so a waiter
  blocks in `BLMOVE wake wake RIGHT LEFT t` instead of polling: it returns at once if the
  key exists, else when a writer pushes. The move rotates the element back into the same
  list, so every other client blocked on the key is woken too.

Every write (set, add, compare_set, append, multi_set, delete) is one Lua script, one
round trip, atomic. Each write renews a TTL (default 7 days) on the hash and on the
key's wake list, so the keys of abandoned jobs go away while a live job keeps its own.

Blocking calls are issued in slices of at most `_SLICE_S` and the socket timeout is a few
seconds longer, so a Redis that dies or becomes unreachable during a long wait is noticed
within seconds, not at the end of the wait. redis-py is told not to retry: a lost
connection raises `DistStoreError` naming the server (a retried HINCRBY could count twice,
and a Redis restarted without persistence has lost the keys anyway).
"""

from __future__ import annotations

import datetime
import os
import time
import urllib.parse
from collections.abc import Sequence

import redis
import redis.backoff
import redis.exceptions
import redis.retry
import torch.distributed as dist

from megascale.errors import UserError

PASSWORD_ENV = "MEGASCALE_REDIS_PASSWORD"
_SLICE_S = 2.0  # longest single blocking call to Redis
_SOCKET_SLACK_S = 3.0  # socket timeout = slice + slack: a blocked BLMOVE is never cut by the socket
_MIN_BLOCK_S = 0.01  # BLMOVE's timeout 0 means "forever": never send less than this

_Value = str | bytes

# c10d keeps only the C++ half of a Python store: were the Python object collected while a process group
# still uses it (`init_process_group(store=RedisStore(...))` keeps no Python reference), the next call from
# C++ would fail with "INTERNAL ASSERT FAILED ... Not implemented". So an open store keeps itself alive here
# until close().
_OPEN: dict[int, RedisStore] = {}

# Shared by every write script: make sure the key's wake list holds one element and renew the TTLs.
# KEYS[1] is the hash; ARGV[1] the TTL in seconds.
_TOUCH = """
local function touch(wake)
  if redis.call('LLEN', wake) == 0 then redis.call('RPUSH', wake, '1') end
  redis.call('EXPIRE', wake, ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
"""
# KEYS = {hash, wake}; ARGV = {ttl, field, value}
_SET = _TOUCH + """
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
touch(KEYS[2])
return 1
"""
_ADD = _TOUCH + """
local v = redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
touch(KEYS[2])
return v
"""
_APPEND = _TOUCH + """
local cur = redis.call('HGET', KEYS[1], ARGV[2]) or ''
redis.call('HSET', KEYS[1], ARGV[2], cur .. ARGV[3])
touch(KEYS[2])
return 1
"""
# TCPStore's compare_set: a missing key is created only when `expected` is empty; the reply is the value
# the key holds afterwards, or `expected` itself when the key is missing and nothing was set.
# ARGV = {ttl, field, expected, desired}
_COMPARE_SET = _TOUCH + """
local cur = redis.call('HGET', KEYS[1], ARGV[2])
if (cur == false and ARGV[3] == '') or cur == ARGV[3] then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
  touch(KEYS[2])
  return ARGV[4]
end
if cur == false then return ARGV[3] end
return cur
"""
# KEYS = {hash, wake_1..wake_n}; ARGV = {ttl, field_1, value_1, ..., field_n, value_n}
_MULTI_SET = _TOUCH + """
for i = 2, #KEYS do
  redis.call('HSET', KEYS[1], ARGV[2 * i - 2], ARGV[2 * i - 1])
  touch(KEYS[i])
end
return 1
"""
# KEYS = {hash, wake}; ARGV = {field}
_DELETE = """
local n = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return n
"""


def _redact(url: str) -> str:
    """The URL without its user:password part, for messages."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return scheme + sep + netloc + slash + path


def _reason(e: Exception) -> str:
    return " ".join(str(e).split()).rstrip(".") or type(e).__name__


def _parse_url(url: str) -> tuple[str, int, int, str | None, str | None]:
    """(host, port, db, username, password) of redis://[user[:password]@]host[:port][/db]."""
    bad = UserError(f"distributed.store: not a redis:// URL: {_redact(url)} (expected redis://host:port/db)")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or 6379
    except ValueError:
        raise bad from None
    if parts.scheme != "redis" or not parts.hostname or parts.query or parts.fragment:
        raise bad
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise bad
    unquote = lambda s: urllib.parse.unquote(s) if s else None
    return parts.hostname, port, int(path or 0), unquote(parts.username), unquote(parts.password)


class RedisStore(dist.Store):
    """The keys of one job attempt, under `prefix`, in one Redis database.

    Thread-safe (redis-py's connection pool: a thread blocked in `wait` holds one
    connection, the others take theirs). `timeout` is the default for `get` and `wait`
    without a timeout, as for TCPStore; a zero timeout waits for ever. The object stays
    alive until `close()`, even with no reference left (see `_OPEN`).
    """

    def __init__(self, url: str, prefix: str, timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                 password: str | None = None, connect_timeout: float = 5.0,
                 ttl: datetime.timedelta = datetime.timedelta(days=7)):
        super().__init__()
        host, port, db, username, url_password = _parse_url(url)
        self.address = f"{host}:{port}/{db}"
        self.prefix = prefix
        # Kept (privately) only so that clone() can open a second connection pool; never shown.
        self._args = dict(url=url, prefix=prefix, password=password, connect_timeout=connect_timeout, ttl=ttl)
        self._ttl_s = max(1, int(ttl.total_seconds()))
        self._hash = f"{prefix}kv"
        self._r = redis.Redis(
            host=host, port=port, db=db, username=username,
            password=password if password is not None else url_password,
            socket_connect_timeout=connect_timeout, socket_timeout=_SLICE_S + _SOCKET_SLACK_S,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), client_name="megascale-store",
            protocol=2,  # RESP3 (redis-py 8's default) buys nothing here; every server speaks RESP2
        )
        try:
            self._r.ping()
        except redis.exceptions.RedisError as e:
            self._r.close()
            if isinstance(e, redis.exceptions.AuthenticationError):
                what = f"Redis at {self.address}: authentication failed"
                why = f"{_reason(e)}; the password comes from {PASSWORD_ENV} or the URL"
            else:
                what, why = f"cannot reach Redis at {self.address}", _reason(e)
            raise UserError(f"distributed.store: {what} ({why})") from None
        super().set_timeout(timeout)
        scripts = {"set": _SET, "add": _ADD, "append": _APPEND, "compare_set": _COMPARE_SET,
                   "multi_set": _MULTI_SET, "delete": _DELETE}
        self._scripts = {name: self._r.register_script(src) for name, src in scripts.items()}
        _OPEN[id(self)] = self

    def __repr__(self) -> str:
        return f"RedisStore(redis://{self.address}, prefix={self.prefix!r})"

    # -- plumbing ---------------------------------------------------------------------------------

    def _wake(self, key: str) -> str:
        return f"{self.prefix}wake/{key}"

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one redis-py call; any Redis failure becomes a DistStoreError that names the server."""
        try:
            return fn(*args, **kwargs)
        except redis.exceptions.RedisError as e:
            if isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
                message = f"lost the Redis store at {self.address} during {what}"
            else:
                message = f"Redis at {self.address} refused {what}"
            raise dist.DistStoreError(f"distributed.store: {message} ({_reason(e)})") from None

    def _write(self, name: str, keys: Sequence[str], args: Sequence) -> object:
        wakes = [self._wake(k) for k in keys]
        return self._call(name, self._scripts[name], keys=[self._hash, *wakes], args=[self._ttl_s, *args])

    @staticmethod
    def _deadline(timeout: datetime.timedelta) -> float | None:
        return None if timeout == datetime.timedelta(0) else time.monotonic() + timeout.total_seconds()

    def _wait_one(self, key: str, deadline: float | None, keys: Sequence[str],
                  timeout: datetime.timedelta) -> None:
        wake = self._wake(key)
        while True:
            block = _SLICE_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ms = int(timeout.total_seconds() * 1000)
                    raise dist.DistStoreError(
                        f"distributed.store: wait timeout after {ms}ms, keys: {', '.join(keys)} "
                        f"(Redis at {self.address}, prefix {self.prefix!r})")
                block = max(_MIN_BLOCK_S, min(block, remaining))
            if self._call("wait", self._r.blmove, wake, wake, round(block, 3), "RIGHT", "LEFT") is not None:
                return
            # A slice passed without a wake-up. The wake list renews its TTL only when its own key is
            # written, so after a long quiet spell it can expire before the hash: the hash is the truth.
            if self._call("wait", self._r.hexists, self._hash, key):
                return

    # -- the Store interface ----------------------------------------------------------------------

    def set(self, key: str, value: _Value) -> None:
        self._write("set", [key], [key, value])

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store's timeout for it to be set (as TCPStore does)."""
        value = self._call("get", self._r.hget, self._hash, key)
        if value is not None:
            return value
        timeout = self.timeout
        deadline = self._deadline(timeout)
        while True:
            self._wait_one(key, deadline, [key], timeout)
            value = self._call("get", self._r.hget, self._hash, key)
            if value is not None:
                return value
            time.sleep(0.01)  # deleted between the wake-up and the read: wait again

    def add(self, key: str, value: int) -> int:
        return int(self._write("add", [key], [key, int(value)]))

    def compare_set(self, key: str, expected_value: _Value, desired_value: _Value) -> bytes:
        return self._write("compare_set", [key], [key, expected_value, desired_value])

    def append(self, key: str, value: _Value) -> None:
        self._write("append", [key], [key, value])

    def multi_set(self, keys: Sequence[str], values: Sequence[_Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        if keys:
            self._write("multi_set", keys, [x for kv in zip(keys, values, strict=True) for x in kv])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = list(keys)
        if not keys:
            return []
        self.wait(keys)
        values = self._call("multi_get", self._r.hmget, self._hash, keys)
        return [v if v is not None else self.get(k) for k, v in zip(keys, values, strict=True)]

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", self._scripts["delete"], keys=[self._hash, self._wake(key)],
                               args=[key]))

    def num_keys(self) -> int:
        return int(self._call("num_keys", self._r.hlen, self._hash))

    # The trampoline calls these two by their C++ names (PrefixStore and the backends go through it).
    deleteKey = delete_key
    getNumKeys = num_keys

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists; never blocks."""
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hexists(self._hash, key)
        return all(self._call("check", pipe.execute))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists; DistStoreError after `timeout` (default: the store's)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = self._deadline(timeout)
        for key in keys:
            self._wait_one(key, deadline, keys, timeout)

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> RedisStore:
        """Another client of the same store, with its own connections."""
        return RedisStore(timeout=self.timeout, **self._args)

    def close(self) -> None:
        """Drop the connections and let the object go; call it after destroy_process_group().

        The keys stay: they belong to the job, not to this client (they expire with the TTL).
        """
        _OPEN.pop(id(self), None)
        self._r.close()


def open_redis_store(url: str, *, job_id: str, attempt: int,
                     timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> RedisStore:
    """The store of one attempt of one job: prefix `megascale/{job_id}/{attempt}/`.

    A restart is a new attempt, so it never reads the keys (rendezvous counters, group
    addresses) of the attempt it replaces; concurrent jobs on one Redis never meet. The
    password, if any, comes from MEGASCALE_REDIS_PASSWORD (or from the URL).
    """
    if not job_id or "/" in job_id:
        raise UserError(f"distributed.store: the job id must be non-empty and contain no '/': {job_id!r}")
    if attempt < 0:
        raise UserError(f"distributed.store: the attempt number must be >= 0, not {attempt}")
    return RedisStore(url, f"megascale/{job_id}/{attempt}/", timeout=timeout,
                      password=os.environ.get(PASSWORD_ENV) or None)
