"""RedisStore against real redis-servers, and against TCPStore as the reference.

The behaviour tests run the same assertions on TCPStore (libuv and legacy servers) and on
RedisStore, so any way in which RedisStore differs from the store c10d was written for
shows up as a failure of the Redis case alone.
"""

from __future__ import annotations

import datetime
import gc
import signal
import threading
import time
import uuid

import pytest
import redis
import torch
import torch.distributed as dist
from _dist import mp_context
from _redis import (  # noqa: F401 - the fixtures are found by their names
    PASSWORD,
    free_port,
    redis_auth_server_fixture,
    redis_server_fixture,
    redis_server_to_stop_fixture,
)

from megascale.distributed import redis_store
from megascale.distributed.redis_store import PASSWORD_ENV, RedisStore, open_redis_store
from megascale.errors import UserError

TIMEOUT = datetime.timedelta(seconds=10)
SHORT = datetime.timedelta(milliseconds=500)


def _seconds(td: datetime.timedelta) -> float:
    return td.total_seconds()


def _later(delay_s: float, fn, *args) -> threading.Thread:
    def run():
        time.sleep(delay_s)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _job() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(params=["tcp-libuv", "tcp-legacy", "redis"])
def store(request, redis_server):
    if request.param == "redis":
        s = RedisStore(redis_server.url, f"test/{_job()}/", timeout=TIMEOUT)
    else:
        s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, use_libuv=request.param == "tcp-libuv")
    yield s
    if isinstance(s, RedisStore):
        s.close()


@pytest.fixture
def peer(store):
    """A second client of the same store: what another rank would hold."""
    p = store.clone()
    yield p
    if isinstance(p, RedisStore):
        p.close()


# -- the same behaviour as TCPStore ---------------------------------------------------------------


def test_set_get_str_and_bytes(store, peer):
    store.set("s", "text")
    store.set("b", b"\x00\xffbin")
    store.set("e", b"")
    assert store.get("s") == b"text"
    assert peer.get("b") == b"\x00\xffbin"
    assert peer.get("e") == b""
    peer.set("s", b"other")
    assert store.get("s") == b"other"


def test_add_is_a_decimal_counter(store, peer):
    assert store.add("c", 3) == 3
    assert peer.add("c", -5) == -2
    assert store.get("c") == b"-2"
    assert store.add("c", 0) == -2
    store.set("n", "10")
    assert store.get("n") == b"10"  # set has no reply: a round trip on its connection applies it first
    assert peer.add("n", 5) == 15


def test_compare_set_matches_tcpstore(store):
    assert store.compare_set("new", "", "d") == b"d"  # missing, expected empty: set
    assert store.get("new") == b"d"
    assert store.compare_set("absent", "x", "d") == b"x"  # missing, expected given: nothing set
    assert not store.check(["absent"])
    assert store.compare_set("new", "d", b"e") == b"e"  # present and equal: set
    assert store.get("new") == b"e"
    assert store.compare_set("new", "d", "f") == b"e"  # present and different: current value
    assert store.get("new") == b"e"


def test_wait_times_out_on_a_missing_key(store):
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout") as info:
        store.wait(["missing"], SHORT)
    elapsed = time.monotonic() - t0
    assert "missing" in str(info.value)
    assert _seconds(SHORT) * 0.9 <= elapsed < _seconds(SHORT) + 3


def test_wait_returns_once_a_peer_sets(store, peer):
    store.set("first", "1")
    setter = _later(0.3, peer.set, "second", "2")
    t0 = time.monotonic()
    store.wait(["first", "second"], TIMEOUT)
    assert time.monotonic() - t0 < _seconds(TIMEOUT) / 2
    setter.join()
    store.wait(["first", "second"])  # the store's own timeout; both exist: returns at once


def test_get_blocks_until_a_peer_sets(store, peer):
    setter = _later(0.3, peer.set, "late", b"value")
    t0 = time.monotonic()
    assert store.get("late") == b"value"
    assert time.monotonic() - t0 < _seconds(TIMEOUT) / 2
    setter.join()


def test_get_times_out_after_the_store_timeout(store):
    store.set_timeout(SHORT)
    assert store.timeout == SHORT
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.get("never")
    assert time.monotonic() - t0 < _seconds(SHORT) + 3


def test_delete_key(store, peer):
    store.set("k", "v")
    assert store.check(["k"])  # set has no reply (libuv TCPStore): without a round trip the peer's
    assert peer.delete_key("k") is True  # delete can reach the server first (CI, once: False)
    assert store.delete_key("k") is False
    assert not store.check(["k"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["k"], SHORT)  # a deleted key is missing again
    peer.set("k", "again")
    store.wait(["k"], TIMEOUT)
    assert store.get("k") == b"again"


def test_num_keys_counts_new_keys(store):
    n0 = store.num_keys()
    for k in ("a", "b", "c"):
        store.set(k, "1")
    assert store.num_keys() == n0 + 3
    store.set("a", "2")
    store.add("counter", 1)
    assert store.num_keys() == n0 + 4
    store.delete_key("b")
    assert store.num_keys() == n0 + 3


def test_check(store):
    assert store.check([])
    assert not store.check(["x"])
    store.set("x", "1")
    assert store.check(["x"])
    assert not store.check(["x", "y"])
    store.add("y", 1)
    assert store.check(["x", "y"])


def test_extended_api(store, peer):
    assert store.has_extended_api()
    store.append("log", "a")
    assert store.get("log") == b"a"  # append has no reply either: a round trip applies it before the peer's
    peer.append("log", b"bc")
    store.multi_set(["m1", "m2"], ["one", b"two"])
    assert peer.multi_get(["m2", "log", "m1"]) == [b"two", b"abc", b"one"]


def test_through_a_cpp_prefix_store(store, peer):
    """c10d reaches a store through C++ (PrefixStore, gloo): every call crosses the pybind trampoline."""
    a, b = dist.PrefixStore("job/", store), dist.PrefixStore("job/", peer)
    n0 = a.num_keys()
    setter = _later(0.2, b.set, "k", "v")
    assert a.get("k") == b"v"
    setter.join()
    a.wait(["k"])
    a.wait(["k"], SHORT)
    assert b.add("n", 2) == 2
    assert a.compare_set("n", "2", "7") == b"7"
    assert a.check(["k", "n"]) and not a.check(["zz"])
    assert a.num_keys() == n0 + 2
    assert b.delete_key("k") and not a.delete_key("k")
    assert a.multi_get(["n"]) == [b"7"]
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        a.wait(["k"], SHORT)


# -- Redis only -----------------------------------------------------------------------------------


def test_jobs_and_attempts_never_see_each_others_keys(redis_server):
    job, other = _job(), _job()
    stores = [open_redis_store(redis_server.url, job_id=j, attempt=a, timeout=TIMEOUT)
              for j, a in [(job, 0), (job, 1), (other, 0)]]
    try:
        for i, s in enumerate(stores):
            s.set("k", str(i))
        assert [s.get("k") for s in stores] == [b"0", b"1", b"2"]
        stores[0].set("only-in-0", "x")
        assert [s.num_keys() for s in stores] == [2, 1, 1]
        assert not stores[1].check(["only-in-0"]) and not stores[2].check(["only-in-0"])
        with pytest.raises(dist.DistStoreError):
            stores[1].wait(["only-in-0"], SHORT)
        assert stores[1].delete_key("k")
        assert stores[0].get("k") == b"0" and stores[2].get("k") == b"2"
        assert stores[0].prefix == f"megascale/{job}/0/"
    finally:
        for s in stores:
            s.close()


def test_many_waiters_on_one_key_of_one_store_all_wake(redis_server):
    """Threads share the client (one pool); one write must wake every waiter at once, not just the first.

    Waking them all is the rotation's job (BLMOVE puts the element back). Were it consumed, the waiters
    would still return, but only through the hash check at the end of a blocking slice.
    """
    prefix = f"test/{_job()}/"
    s = RedisStore(redis_server.url, prefix, timeout=TIMEOUT)
    done: list[float] = []
    waiters = [threading.Thread(target=lambda: (s.wait(["go"]), done.append(time.monotonic())))
               for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s.set("go", "1")
    for t in waiters:
        t.join(timeout=_seconds(TIMEOUT))
    assert len(done) == 4 and max(done) - t0 < redis_store._SLICE_S
    assert redis_server.client().llen(f"{prefix}wake/go") == 1
    s.close()


def test_keys_expire_and_lost_wake_lists_are_survived(redis_server):
    prefix = f"test/{_job()}/"
    s = RedisStore(redis_server.url, prefix, ttl=datetime.timedelta(hours=1))
    s.set("k", "v")
    raw = redis_server.client()
    assert 0 < raw.ttl(f"{prefix}kv") <= 3600
    assert 0 < raw.ttl(f"{prefix}wake/k") <= 3600
    raw.delete(f"{prefix}wake/k")  # as if its TTL ran out before the hash's
    s.wait(["k"], SHORT)  # falls back to the hash once the blocking slice ends
    s.close()


def test_password_from_the_environment(redis_auth_server, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    s = open_redis_store(redis_auth_server.url, job_id=_job(), attempt=0, timeout=TIMEOUT)
    s.set("k", "v")
    assert s.get("k") == b"v"
    assert PASSWORD not in repr(s)
    s.close()
    in_url = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{redis_auth_server.port}/0", "test/url/")
    assert in_url.check([]) and PASSWORD not in repr(in_url)
    in_url.close()


@pytest.mark.parametrize("password", ["wrong-password", None])
def test_bad_or_missing_password_is_a_user_error(redis_auth_server, monkeypatch, password):
    if password is None:
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
    else:
        monkeypatch.setenv(PASSWORD_ENV, password)
    with pytest.raises(UserError, match="distributed.store.*authentication failed") as info:
        open_redis_store(redis_auth_server.url, job_id=_job(), attempt=0)
    assert "wrong-password" not in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://", "redis://h:port/0",
                                 "redis://user:hunter2@h:1/db", "127.0.0.1:6379"])
def test_bad_url_is_a_user_error(url):
    with pytest.raises(UserError, match="distributed.store: not a redis:// URL") as info:
        RedisStore(url, "p/")
    assert "hunter2" not in str(info.value)


def test_bad_job_id_is_a_user_error(redis_server):
    for job_id, attempt in [("", 0), ("a/b", 0), ("a", -1)]:
        with pytest.raises(UserError, match="distributed.store"):
            open_redis_store(redis_server.url, job_id=job_id, attempt=attempt)


def test_nothing_listening_is_a_quick_user_error():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(UserError, match=f"cannot reach Redis at 127.0.0.1:{port}/0"):
        RedisStore(f"redis://127.0.0.1:{port}", "p/", connect_timeout=1.0)
    assert time.monotonic() - t0 < 2.0


def test_a_server_that_dies_fails_waits_and_gets_promptly(redis_server_to_stop):
    timeout = datetime.timedelta(seconds=3)
    s = RedisStore(redis_server_to_stop.url, "test/dies/", timeout=timeout)
    s.set("k", "v")
    errors: list[BaseException] = []

    def blocked_wait():
        try:
            s.wait(["never"], datetime.timedelta(seconds=60))
        except BaseException as e:  # noqa: B036 - handed to the test thread
            errors.append(e)

    waiter = threading.Thread(target=blocked_wait, daemon=True)
    waiter.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    redis_server_to_stop.stop()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and time.monotonic() - t0 < _seconds(timeout)
    address = f"127.0.0.1:{redis_server_to_stop.port}/0"
    assert isinstance(errors[0], dist.DistStoreError) and address in str(errors[0])
    for call in (lambda: s.get("missing"), lambda: s.wait(["k"]), lambda: s.set("k", "w")):
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=f"lost the Redis store at {address}"):
            call()
        assert time.monotonic() - t0 < _seconds(timeout) + 3
    s.close()


def test_a_frozen_server_fails_a_long_wait_within_seconds(redis_server_to_stop, monkeypatch):
    """A Redis that stops answering (frozen, or cut off by the network) closes no socket: only the
    socket timeout, a little longer than one blocking slice, can notice it. Shorter slices keep this quick."""
    monkeypatch.setattr(redis_store, "_SLICE_S", 0.5)
    monkeypatch.setattr(redis_store, "_SOCKET_SLACK_S", 0.5)
    s = RedisStore(redis_server_to_stop.url, "test/frozen/", timeout=TIMEOUT)
    redis_server_to_stop.proc.send_signal(signal.SIGSTOP)
    lost = f"lost the Redis store at 127.0.0.1:{redis_server_to_stop.port}/0 during wait"
    try:
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=lost):
            s.wait(["never"], datetime.timedelta(seconds=60))
        assert time.monotonic() - t0 < 1.0 + 2  # the socket timeout, and some scheduling slack
    finally:
        redis_server_to_stop.proc.send_signal(signal.SIGCONT)
    s.close()


# -- a real gloo job on the store -----------------------------------------------------------------


def _gloo_rank(rank: int, world: int, url: str, job: str, results) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    # No reference kept: c10d holds only the C++ half, and the store must survive that.
    dist.init_process_group("gloo", store=open_redis_store(url, job_id=job, attempt=0, timeout=timeout),
                            rank=rank, world_size=world, timeout=timeout)
    gc.collect()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    group = dist.new_group(list(range(world)))  # new groups rendezvous through the store again
    ranks = torch.tensor([float(rank)])
    dist.all_reduce(ranks, group=group)
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, total.item(), ranks.item()))


def test_a_gloo_job_runs_on_the_redis_store(redis_server):
    world, job = 2, _job()
    ctx = mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, redis_server.url, job, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * world
    got = sorted(results.get(timeout=5) for _ in range(world))
    assert got == [(r, 3.0, 1.0) for r in range(world)]
    with redis.Redis(port=redis_server.port) as raw:
        assert raw.hlen(f"megascale/{job}/0/kv") > 0  # the rendezvous really went through Redis
