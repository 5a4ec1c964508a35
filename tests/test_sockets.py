"""The socket transport (distributed/sockets.py): matching, early messages, dtypes, failures, and
random traffic on every path."""

from __future__ import annotations

import contextlib
import random
import secrets
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megascale.distributed import direct
from megascale.distributed.sockets import _HEADER, _HELLO, SocketTransport, TransportError
from tests._dist import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(3)
    yield p
    p.close()


def _transport(rank: int) -> SocketTransport:
    """A transport of its own for one test (rank 0's nonce, so no test reads another's messages)."""
    nonce = torch.tensor([secrets.randbits(62) + 1], dtype=torch.int64)
    dist.broadcast(nonce, src=0)
    store = dist.distributed_c10d._get_default_store()
    return SocketTransport(store, rank, dist.get_world_size(), int(nonce), "127.0.0.1")


def _payload(src: int, dst: int, key: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 1000 * src + 100 * dst + key).to(dtype)


CASES = [(1, torch.float64, 5), (2, torch.bfloat16, 7), (3, torch.int64, 3), (4, torch.float32, 0),
         (5, torch.float32, 1 << 20)]  # the last: 4 MiB, many reads per message


def _exchange(rank: int):
    t = _transport(rank)
    world = dist.get_world_size()
    peers = [r for r in range(world) if r != rank]
    got: dict[tuple[int, int, int], torch.Tensor] = {}
    handles = []
    # half the receives posted before anything is sent, the other half after the peers' sends have
    # landed (the early-message path), and keys posted in another order than they were sent
    for src in peers:
        for key, dtype, n in CASES[:2]:
            for i in range(2):  # two messages of one key: matched in order
                buf = torch.empty(n, dtype=dtype)
                got[(src, key, i)] = buf
                handles.append(t.irecv(buf, src, key))
    dist.barrier()
    sends = [t.isend(_payload(rank, dst, key, dtype, n) + i, dst, key)
             for dst in peers for key, dtype, n in CASES for i in range(2)]
    for h in sends:
        h.wait(60)
    dist.barrier()  # every message sent: those not yet posted for are early ones
    for src in peers:
        for key, dtype, n in reversed(CASES[2:]):
            for i in range(2):
                buf = torch.empty(n, dtype=dtype)
                got[(src, key, i)] = buf
                handles.append(t.irecv(buf, src, key))
    for h in handles:
        h.wait(60)
    ok = all(torch.equal(buf, _payload(src, rank, key, buf.dtype, buf.numel()) + i)
             for (src, key, i), buf in got.items())
    # a receive of the wrong size fails on its own, naming the peer, and the stream stays in step
    nxt = (rank + 1) % world
    prv = (rank - 1) % world
    t.isend(torch.ones(4), nxt, 9).wait(60)
    t.isend(torch.full((2,), 7.0), nxt, 9).wait(60)
    wrong, right = torch.empty(3), torch.empty(2)
    h_wrong, h_right = t.irecv(wrong, prv, 9), t.irecv(right, prv, 9)
    try:
        h_wrong.wait(60)
        mismatch = None
    except TransportError as e:
        mismatch = str(e)
    h_right.wait(60)
    dist.barrier()
    t.close()
    return ok, mismatch, right.tolist()


def test_messages_match_by_peer_and_key_in_order(pool):
    for rank, (ok, mismatch, right) in enumerate(pool.run(_exchange)):
        assert ok
        assert mismatch is not None and f"rank {(rank - 1) % 3}" in mismatch
        assert "a message of 16 bytes for a receive of 12" in mismatch
        assert right == [7.0, 7.0]


def _failures(rank: int):
    t = _transport(rank)
    out = {}
    if rank == 0:  # nobody sends: the wait fails at its timeout, as a hang
        h = t.irecv(torch.empty(1), 1, 3)
        t0 = time.monotonic()
        try:
            h.wait(0.3)
        except TransportError as e:
            out["timeout"] = (str(e), time.monotonic() - t0)
        t.isend(torch.ones(1), 2, 1).wait(60)  # rank 2 now has a connection from rank 0 ...
        h = t.irecv(torch.empty(1), 2, 5)  # ... and rank 0 one from rank 2, whose process "dies"
        dist.barrier()
        t0 = time.monotonic()
        try:
            h.wait(60)
        except TransportError as e:
            out["gone"] = (str(e), time.monotonic() - t0)
        try:  # a receive posted after the peer left fails at once
            t.irecv(torch.empty(1), 2, 6).wait(60)
        except TransportError as e:
            out["after"] = str(e)
    elif rank == 2:
        t.irecv(torch.empty(1), 0, 1).wait(60)
        t.isend(torch.ones(1), 0, 4).wait(60)  # connected to rank 0, on another key
        dist.barrier()
        time.sleep(0.2)
        t.close()
    else:
        dist.barrier()
    dist.barrier()
    t.close()
    return out


def test_a_wait_fails_at_its_timeout_and_at_once_when_the_peer_leaves(pool):
    out = pool.run(_failures)[0]
    msg, waited = out["timeout"]
    assert "receive with rank 1 timed out after 0.3 s" in msg and waited < 5
    msg, waited = out["gone"]
    assert "receive with rank 2 failed" in msg and "connection from rank 2 lost" in msg
    assert waited < 10  # not the 60 s timeout
    assert "connection from rank 2 lost" in out["after"]


def _stranger(rank: int):
    t = _transport(rank)
    if rank == 0:
        buf = torch.zeros(1)
        h = t.irecv(buf, 1, 2)
        host, port = t._listener.getsockname()[:2]
        with socket.create_connection((host, port)) as s:  # another attempt's rank 1, say
            s.sendall(_HELLO.pack(t.nonce + 1, 1) + _HEADER.pack(2, 4) + b"\0" * 4)
            time.sleep(0.3)
        stranger_delivered = h.is_completed()
        dist.barrier()
        h.wait(60)
        result = (stranger_delivered, buf.item())
    else:
        dist.barrier()
        if rank == 1:
            t.isend(torch.full((1,), 3.0), 0, 2).wait(60)
        result = None
    dist.barrier()
    t.close()
    return result


def test_a_connection_from_another_attempt_is_dropped(pool):
    stranger_delivered, value = pool.run(_stranger)[0]
    assert not stranger_delivered and value == 3.0


@contextlib.contextmanager
def _no_idle_reader():
    """The idle reader never looks (what is not waited for stays in the socket): what reads shows."""
    from megascale.distributed import sockets

    before = sockets._IDLE_CHECK_S, sockets._IDLE_CHECK_MAX_S
    sockets._IDLE_CHECK_S = sockets._IDLE_CHECK_MAX_S = 3600.0
    try:
        yield
    finally:
        sockets._IDLE_CHECK_S, sockets._IDLE_CHECK_MAX_S = before


def _who_reads(rank: int):
    """Rank 1 sends rank 0 a large and then a small message, both posted for: the reader reads the
    large one ahead (and stops: nothing large is left to read ahead for), the small one its wait."""
    from megascale.distributed import sockets

    with _no_idle_reader():
        return _who_reads_here(rank, sockets._PULL_BYTES // 4 + 1)


def _who_reads_here(rank: int, large: int):
    t = _transport(rank)
    small = 1024  # elements: float32
    out = None
    if rank == 0:
        got_small, got_large = torch.empty(small), torch.empty(large)
        h_small, h_large = t.irecv(got_small, 1, 1), t.irecv(got_large, 1, 2)
        dist.barrier()
        dist.barrier()  # both messages sent
        deadline = time.monotonic() + 30
        while not h_large.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)  # no wait: the reader reads it ahead
        out = {"large_read_ahead": h_large.is_completed(), "small_read_ahead": h_small.is_completed()}
        h_small.wait(60)  # the wait reads it (the idle reader never looks)
        h_large.wait(60)
        out["right"] = (torch.equal(got_small, torch.arange(small, dtype=torch.float32)),
                        torch.equal(got_large, -torch.arange(large, dtype=torch.float32)))
    elif rank == 1:
        dist.barrier()
        t.isend(-torch.arange(large, dtype=torch.float32), 0, 2).wait(60)
        t.isend(torch.arange(small, dtype=torch.float32), 0, 1).wait(60)
        dist.barrier()
    else:
        dist.barrier()
        dist.barrier()
    dist.barrier()
    t.close()
    return out


def test_a_small_receive_is_read_by_its_wait_a_large_one_by_the_reader_ahead(pool):
    out = pool.run(_who_reads)[0]
    assert out["large_read_ahead"] and not out["small_read_ahead"]
    assert out["right"] == (True, True)


def _mid_message(rank: int):
    """A peer that stops in the middle of a message its receiver's wait is reading: the wait fails at
    its timeout, and so does every later receive from it (the stream is out of step), naming the peer."""
    with _no_idle_reader():  # else the idle reader takes the message, and holds the connection
        return _mid_message_here(rank)


def _mid_message_here(rank: int):
    t = _transport(rank)
    out = None
    if rank == 0:
        h = t.irecv(torch.empty(4), 1, 2)
        host, port = t._listener.getsockname()[:2]
        with socket.create_connection((host, port)) as s:  # rank 1's connection, as far as the hello goes
            s.sendall(_HELLO.pack(t.nonce, 1) + _HEADER.pack(2, 16) + b"\0" * 8)
            t0 = time.monotonic()
            try:
                h.wait(0.3)
            except TransportError as e:
                out = [str(e), time.monotonic() - t0]
            try:
                t.irecv(torch.empty(4), 1, 3).wait(0.3)
            except TransportError as e:
                out.append(str(e))
    dist.barrier()
    t.close()
    return out


def test_a_wait_that_times_out_inside_a_message_fails_the_connection(pool):
    first, waited, later = pool.run(_mid_message)[0]
    assert "receive with rank 1 failed" in first and "timed out in the middle of a message" in first
    assert waited < 5
    assert "connection from rank 1 lost" in later


def _broken_early(rank: int):
    """A peer whose connection ends inside a message nobody has posted for yet (the idle reader was
    reading it): the receive posted for it later fails at once, naming the peer."""
    t = _transport(rank)
    out = None
    if rank == 0:
        host, port = t._listener.getsockname()[:2]
        with socket.create_connection((host, port)) as s:
            s.sendall(_HELLO.pack(t.nonce, 1) + _HEADER.pack(2, 16) + b"\0" * 8)
            time.sleep(0.2)  # the idle reader takes the first half
        time.sleep(0.2)  # ... and meets the end
        t0 = time.monotonic()
        try:
            t.irecv(torch.empty(4), 1, 2).wait(30)
        except TransportError as e:
            out = (str(e), time.monotonic() - t0)
    dist.barrier()
    t.close()
    return out


def test_a_receive_of_a_message_cut_off_by_a_lost_connection_fails_at_once(pool):
    msg, waited = pool.run(_broken_early)[0]
    assert "receive with rank 1 failed" in msg and "connection from rank 1 lost" in msg
    assert waited < 10  # not the 30 s timeout


def _mesh_routes(rank: int):
    from megascale.config import ParallelConfig
    from megascale.distributed import p2p
    from megascale.parallel.mesh import Mesh

    ours = Mesh.build(ParallelConfig(dp=3))  # the default transport
    theirs = Mesh.build(ParallelConfig(dp=3, transport="gloo"))
    routed = (p2p.routed(ours.dp_group), p2p.routed(theirs.dp_group))
    # a direct all-gather on each: the same numbers either way
    from megascale.distributed.direct import start_all_gather

    outs = []
    for mesh in (ours, theirs):
        out = torch.empty(6, dtype=torch.float64)
        start_all_gather(out, torch.full((2,), float(rank)), mesh.dp_group).wait()
        outs.append(out.tolist())
    return routed, outs


def test_the_mesh_routes_its_groups_by_parallel_transport(pool):
    for routed, (ours, theirs) in pool.run(_mesh_routes):
        assert routed == (True, False)
        assert ours == theirs == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def _timeouts(rank: int):
    """A direct all-gather's wait on a routed group before and after set_collective_timeout: rank 1 never
    sends, so rank 0's wait ends at the group's timeout, the new one (not the one asked first)."""
    from megascale.config import ParallelConfig
    from megascale.distributed import p2p
    from megascale.distributed.direct import start_all_gather
    from megascale.distributed.init import set_collective_timeout
    from megascale.parallel.mesh import Mesh

    mesh = Mesh.build(ParallelConfig(dp=3))
    start_all_gather(torch.empty(3), torch.ones(1), mesh.dp_group).wait()  # asks the timeout: cached
    before = p2p.p2p_timeout(mesh.dp_group)
    waited = None
    if rank == 0:  # (a process's own timeouts: the others' barrier below keeps the long one)
        set_collective_timeout(mesh, 0.5)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timed out after 0.5 s"):
            start_all_gather(torch.empty(3), torch.ones(1), mesh.dp_group, tag=9).wait()
        waited = time.monotonic() - t0
        set_collective_timeout(mesh, before.total_seconds())  # the pool's next test: as it was
    dist.barrier()
    return rank, before.total_seconds(), waited


def test_an_exchange_waits_for_the_timeout_set_last(pool):
    for rank, before, waited in pool.run(_timeouts):
        assert before > 0.5
        if rank == 0:
            assert waited < 5


def _marks(rank: int):
    from megascale.config import ParallelConfig
    from megascale.distributed import p2p
    from megascale.distributed.direct import start_all_gather
    from megascale.parallel.mesh import Mesh

    def marks(mesh) -> dict[int, int]:
        """The SO_PRIORITY of this rank's connections to its peers (opened by an all-gather)."""
        group = mesh.dp_group or mesh.pp_group or mesh.tp_group
        start_all_gather(torch.empty(3), torch.ones(1), group).wait()
        out = p2p._ROUTES[group][0]._out
        return {p: out[p].sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) for p in sorted(out)}

    dp = marks(Mesh.build(ParallelConfig(dp=3)))
    pp = marks(Mesh.build(ParallelConfig(pp=3)))  # the same peers, now the pipeline's: marked again
    off = marks(Mesh.build(ParallelConfig(dp=3, transport_priority=False)))  # left as they were
    return rank, dp, pp, off


def test_the_mesh_marks_its_connections_dp_bulk_pipeline_and_tp_interactive(pool):
    """parallel.transport_priority: a host's send queue (one FIFO in a Linux socket's default
    discipline; bands where it has them, as the simulated cluster's links do) puts the pipeline's
    and tp's packets ahead of dp's."""
    from megascale.distributed.p2p import BULK, INTERACTIVE

    for rank, dp, pp, off in pool.run(_marks):
        peers = [r for r in range(3) if r != rank]
        assert dp == dict.fromkeys(peers, BULK)
        assert pp == off == dict.fromkeys(peers, INTERACTIVE)


def _inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    # 7 elements: not a multiple of 3 (padded); a transposed view (not contiguous); past the size of
    # one exchange (a reduce-scatter and an all-gather, padded); int64
    return [torch.randn(7, dtype=torch.float64, generator=gen),
            torch.randn(4, 6, dtype=torch.float64, generator=gen).t(),
            torch.randn(direct.ONE_EXCHANGE_BYTES // 8 + 1, dtype=torch.float64, generator=gen),
            torch.arange(5, dtype=torch.int64) * (rank + 1)]


def _all_reduce(rank: int):
    from megascale.config import ParallelConfig
    from megascale.parallel.mesh import Mesh

    ours = Mesh.build(ParallelConfig(dp=3))
    theirs = Mesh.build(ParallelConfig(dp=3, transport="gloo"))
    calls, scatters = [], []
    real, real_scatter = direct.all_reduce, direct.start_reduce_scatter
    direct.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    direct.start_reduce_scatter = lambda *a, **k: (scatters.append(1), real_scatter(*a, **k))[1]
    try:
        got = []
        for mesh in (ours, theirs):
            tensors = _inputs(rank)
            for t in tensors:
                mesh.all_reduce(t, mesh.dp_group)
            peak = _inputs(rank)[0]
            mesh.all_reduce(peak, mesh.dp_group, op="max")
            got.append([*tensors, peak])
    finally:
        direct.all_reduce, direct.start_reduce_scatter = real, real_scatter
    return len(calls), len(scatters), got


def test_an_all_reduce_over_the_transport_sums_as_gloo_does_and_alike_on_every_rank(pool):
    """Small sums in one exchange, a large one as a reduce-scatter and an all-gather, and a max."""
    results = pool.run(_all_reduce)
    want = [_inputs(rank) for rank in range(3)]
    for calls, scatters, (ours, theirs) in results:
        assert calls == 5  # the routed mesh's five went over the transport, the gloo mesh's not
        assert scatters == 1  # the large one only
        for i in range(3):
            assert ours[i].shape == want[0][i].shape
            torch.testing.assert_close(ours[i], want[0][i] + want[1][i] + want[2][i], rtol=1e-15, atol=1e-15)
            torch.testing.assert_close(ours[i], theirs[i], rtol=1e-15, atol=1e-15)
        assert ours[3].tolist() == [0, 6, 12, 18, 24]
        assert torch.equal(ours[4], torch.stack([w[0] for w in want]).amax(0))
        assert torch.equal(ours[4], theirs[4])
    for i in range(5):  # every rank has the same bits
        assert all(torch.equal(r[2][0][i], results[0][2][0][i]) for r in results)


def _wait_all(handles: list) -> None:
    for h in handles:
        h.wait(60)


def _random_round(t: SocketTransport, rank: int, program, me, r: int) -> list[str]:
    """One round of `_random_traffic`: the mismatches."""
    from megascale.distributed.sockets import _PULL_BYTES

    world = dist.get_world_size()
    msgs = []  # (src, dst, key, numel); a pair's messages of one key arrive in send order
    for src in range(world):
        for dst in range(world):
            for _ in range(program.randint(1, 4) if src != dst else 0):
                large = program.random() < 0.15
                numel = (program.randint(_PULL_BYTES // 4 + 1, _PULL_BYTES // 2) if large
                         else program.choice([0, 1, 7, 1000, 40_000]))
                msgs.append((src, dst, program.randint(1, 3), numel))
    mine = [i for i, m in enumerate(msgs) if m[1] == rank]
    # some receives posted before any send (a prefix of each peer's key, whose receives match in
    # order), the rest after the sends have had time to land (early messages)
    by_key: dict[tuple[int, int], list[int]] = {}
    for i in mine:
        by_key.setdefault((msgs[i][0], msgs[i][2]), []).append(i)
    before = sorted(i for ids in by_key.values() for i in ids[:me.randint(0, len(ids))])
    posted: dict[int, tuple[torch.Tensor, object]] = {}
    for i in before:
        posted[i] = (buf := torch.empty(msgs[i][3]), t.irecv(buf, msgs[i][0], msgs[i][2]))
    dist.barrier()
    sends = [t.isend(torch.arange(numel, dtype=torch.float32) + 7 * i + r, dst, key)
             for i, (src, dst, key, numel) in enumerate(msgs) if src == rank]
    time.sleep(me.random() * 0.02)
    for i in sorted(set(mine) - set(before)):
        posted[i] = (buf := torch.empty(msgs[i][3]), t.irecv(buf, msgs[i][0], msgs[i][2]))
    waits = sorted(posted, key=lambda _: me.random())
    helper = threading.Thread(target=_wait_all, args=([posted[i][1] for i in waits[::2]],))
    helper.start()
    _wait_all([posted[i][1] for i in waits[1::2]])
    helper.join(120)
    _wait_all(sends)
    return [f"round {r}: message {msgs[i]} wrong" for i, (buf, _) in posted.items()
            if not torch.equal(buf, torch.arange(buf.numel(), dtype=torch.float32) + 7 * i + r)]


def _random_traffic(rank: int, seed: int, rounds: int) -> list[str]:
    """Every rank runs the same random program (one seed): per round, each ordered pair of ranks swaps
    1-4 messages on random keys, small (read by their wait) and large (> 512 KiB, read by the reader
    thread as they arrive), a key often twice (matched in order); each receiver posts its receives
    partly before the sends and partly after them (early messages), and waits for them in a random
    order, half from a second thread (two waits on one connection). The mismatches."""
    t = _transport(rank)
    program, me = random.Random(seed), random.Random(seed * 1000 + rank)  # the job's, this rank's
    bad = []
    for r in range(rounds):
        bad += _random_round(t, rank, program, me, r)
        dist.barrier()
    t.close()
    return bad


@pytest.mark.parametrize("seed", [1, 2])
def test_random_traffic_arrives_whole_and_in_order_on_every_path(pool, seed):
    assert pool.run(_random_traffic, seed, 25) == [[]] * 3
