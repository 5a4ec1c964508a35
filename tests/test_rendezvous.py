"""The agents' rendezvous state (megascale/fault/rendezvous.py): a call that fails throws its connection
away, so a link that comes back (or a store that restarts) is used at once, not after TCP's backoff or a
reply meant for an earlier call."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from megascale.fault import rendezvous


class Link:
    """A TCP relay on 127.0.0.1 to `port` that can be cut (bytes dropped both ways, connections kept
    open): a link down, as its two ends see it."""

    def __init__(self, port: int):
        self.up = True
        self._to = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._listener.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self._to))
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                if self.up:
                    dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    yield store
    del store


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setattr(rendezvous, "STATE_TIMEOUT_S", 0.5)


def test_state_round_trips_in_elastics_format(server):
    backend = rendezvous.make_backend(lambda: rendezvous._client("127.0.0.1", server.port), "job")
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"round 1")
    assert (state, ok) == (b"round 1", True)
    assert backend.get_state() == (b"round 1", token)
    # a stale token does not overwrite: the current state comes back, not ours
    assert backend.set_state(b"round 2", token)[2] is True
    state, _, ok = backend.set_state(b"round 3", token)  # the token of round 1: stale now
    assert (state, ok) == (b"round 2", False)
    assert backend.connections == 1


def test_after_a_link_outage_the_next_call_gets_through_on_a_new_connection(server):
    link = Link(server.port)
    backend = rendezvous.make_backend(lambda: rendezvous._client("127.0.0.1", link.port), "job")
    try:
        backend.set_state(b"before")
        link.up = False  # the request goes out and nothing comes back
        with pytest.raises(RendezvousConnectionError):
            backend.get_state()
        link.up = True
        t = time.monotonic()
        # on the old connection the request above is lost for good: this call would wait out its timeout
        assert backend.get_state()[0] == b"before"
        assert time.monotonic() - t < rendezvous.STATE_TIMEOUT_S
        assert backend.connections == 2
    finally:
        link.close()


def test_a_store_out_of_reach_is_a_connection_error_and_its_return_is_used():
    with socket.socket() as s:  # a port with nothing behind it, for now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = rendezvous.make_backend(lambda: rendezvous._client("127.0.0.1", port), "job")
    with pytest.raises(RendezvousConnectionError, match="cannot reach the rendezvous store"):
        backend.get_state()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the store restarted
    try:
        assert backend.set_state(b"again")[2] is True
    finally:
        del store


def test_the_registered_handler_completes_a_one_host_round():
    rendezvous.register()
    rendezvous.register()  # a second launch in the same process
    params = RendezvousParameters(backend=rendezvous.BACKEND, endpoint="127.0.0.1:0", run_id="one-host",
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1")
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    handler = rendezvous_handler_registry.create_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.num_nodes_waiting() == 0
    finally:
        handler.shutdown()


def test_waiting_agents_read_the_state_every_poll_interval(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

    polls = [rendezvous.poll_interval_s(n) for n in (1, 2, 20, 100, 200, 5000)]
    assert polls == [0.1, 0.1, 0.1, 0.5, 1.0, 1.0]
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)  # undone after the test
    params = RendezvousParameters(backend=rendezvous.BACKEND, endpoint="127.0.0.1:0", run_id="poll",
                                  min_nodes=1, max_nodes=2, local_addr="127.0.0.1")
    handler = rendezvous.create_handler(params)
    try:
        # elastic reuses a read of the state for 1 s and sleeps 1 s between reads: both are the poll here
        assert handler._state_holder._cache_duration == 0.1
        slept = []
        monkeypatch.setattr(utils.time, "sleep", slept.append)
        dynamic_rendezvous._delay(seconds=1)  # the executor's poll
        dynamic_rendezvous._delay(seconds=0.25)  # any other delay is elastic's
        assert slept == [0.1, 0.25]
        second = rendezvous.create_handler(RendezvousParameters(  # wraps elastic's delay, not ours
            backend=rendezvous.BACKEND, endpoint="127.0.0.1:0", run_id="poll2", min_nodes=1, max_nodes=2,
            local_addr="127.0.0.1", poll_interval=0.3))
        second.shutdown()
        dynamic_rendezvous._delay(seconds=1)
        assert slept == [0.1, 0.25, 0.3]
    finally:
        monkeypatch.undo()
        handler.shutdown()


def test_a_min_max_round_waits_the_configured_last_call_for_more_hosts():
    """`fault.rendezvous_last_call_s` is the handler's last call in a MIN:MAX job (the wait for more hosts
    once MIN are in; after an eviction with no spare, the survivors' wait); MIN = MAX never waits."""
    from megascale.config import FaultConfig
    from megascale.fault.driver import rendezvous_configs

    three = FaultConfig(rendezvous_last_call_s=3)
    for fault, nodes, want in [(FaultConfig(), (1, 2), 10.0), (three, (1, 2), 3.0), (three, (2, 2), 2.0)]:
        configs = rendezvous_configs(*nodes, fault)
        handler = rendezvous.create_handler(RendezvousParameters(
            backend=rendezvous.BACKEND, endpoint="127.0.0.1:0", run_id=f"last-call-{want}",
            min_nodes=nodes[0], max_nodes=nodes[1], local_addr="127.0.0.1", **configs))
        try:
            assert handler._settings.timeout.last_call == datetime.timedelta(seconds=want)
        finally:
            handler.shutdown()


def test_a_refusal_is_read_by_the_hosts_it_is_for_and_gone_for_the_next_launch(monkeypatch):
    """fault/refusal.py on a store that outlives the job (megascale rdzv-store): the refusal reaches each
    waiting host once, and the last of them takes it away, so a later launch with the same --rdzv-id is
    not refused; one that nobody read is taken away by the refusing host after its wait."""
    from megascale.fault import refusal

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    endpoint = f"127.0.0.1:{server.port}"
    monkeypatch.setattr(rendezvous, "is_this_host", lambda addr: False)  # the refusing host is another one
    posted = []
    poster = threading.Thread(target=lambda: posted.append(
        refusal.post(endpoint, "job", "10.0.0.7", "config file x.toml: does not exist", 2, 30)))
    poster.start()
    watches = [refusal.Watch("job", lambda fn: fn(server), lambda: False) for _ in range(2)]
    deadline = time.monotonic() + 10
    while not server.check([refusal.key("job")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for watch in watches:
        with pytest.raises(refusal.HostRefused, match=r"^host 10\.0\.0\.7 will not join this job: config "
                                                      r"file x\.toml: does not exist$"):
            watch()
    poster.join(10)
    assert posted == [True]
    assert not server.check([refusal.key("job")]), "the next launch would be refused"
    later = refusal.Watch("job", lambda fn: fn(server), lambda: False)
    later()  # nothing to read: no exception
    # nobody reads it: the refusing host takes it away when its wait ends
    assert refusal.post(endpoint, "job", "10.0.0.7", "unread", 2, 0.5) is False
    assert not server.check([refusal.key("job")])
