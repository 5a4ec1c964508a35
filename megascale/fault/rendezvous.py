"""The agents' rendezvous: elastic's c10d rendezvous, whose state travels on a connection that is
replaced after a failed call.

Every monitor tick each host's agent asks the rendezvous state whether a host waits to join, and every
second its keep-alive thread writes to it. Elastic's c10d backend keeps one TCPStore connection for
the agent's whole life. When a host's link goes down, the requests it sends meanwhile stay unacked,
and TCP backs off its retransmissions on that connection (0.2 s, 0.4 s, ... doubling): after a 20 s
outage the next retransmission came some 5 s after the link was back, and the call waiting on it
returned only at its 10 s read timeout. The agent, whose monitor loop waits on that call, learned of
the new round 8 s late (a link-fault soak: 11 s from link-up to the first step). A reply that arrives
after its call timed out is also read as the answer to the next call on the same connection.

Here the state goes through a connection of its own, which is dropped after any failed call; the next
call opens a new one, whose SYN leaves at once, so the first tick after the link is back gets through.
Calls time out after `STATE_TIMEOUT_S`, so while the store is out of reach the agent's own checks (exits,
beats) still run every few seconds. The store handed to the workers' rounds (elastic's, for the master
address) keeps its own connection, idle between rounds, so no backoff builds up on it.

The handler is elastic's own `DynamicRendezvousHandler` (built by `create_handler`), registered under
`BACKEND`: nothing of the rendezvous protocol is ours, except how often a waiting agent reads the state.
Elastic sleeps 1 s between reads and reuses a read for 1 s (a round waits on that two or three times:
1.1-1.8 s of a 4.5 s restart after a crash, two hosts); here both are `poll_interval_s`, max_nodes / 200 s
within [0.1 s, 1 s], so the store still sees at most ~200 reads a second from the waiting agents, whatever
the job's size.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable

from megascale.errors import UserError
from megascale.fault import refusal

BACKEND = "megascale-c10d"
SERVES_ENV = "MEGASCALE_SERVES_RDZV"  # "1" in the environment of the workers whose agent serves the store
# how long one call to the rendezvous state may take, connecting included: a compare-and-set on the
# store takes milliseconds even on a busy host; a call that takes this long waits on a dead link
STATE_TIMEOUT_S = 3.0


def make_backend(connect: Callable[[], object], run_id: str):
    """A RendezvousBackend that keeps elastic's c10d state format and replaces its connection (a store
    from `connect()`) after a failed call. Built lazily: elastic is heavy to import."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class ReconnectingBackend(RendezvousBackend):
        def __init__(self) -> None:
            self._lock = threading.Lock()  # the agent's loop and its keep-alive thread share it
            self._inner: C10dRendezvousBackend | None = None
            self._store = None  # the connection under _inner
            self.connections = 0  # connections tried, failed ones included (the tests read it)

        @property
        def name(self) -> str:
            return BACKEND

        def _call(self, op: Callable):
            with self._lock:
                if self._inner is None:
                    self.connections += 1
                try:
                    self._inner, result = _bounded(lambda: self._on(op), STATE_TIMEOUT_S)
                    return result
                except (RendezvousConnectionError, RuntimeError, ValueError, TimeoutError, OSError) as e:
                    self._inner = None  # its unacked requests (or a late reply) stay with it
                    if isinstance(e, RendezvousConnectionError):
                        raise
                    raise RendezvousConnectionError(f"cannot reach the rendezvous store: {e}") from e

        def _on(self, op: Callable):
            if self._inner is None:
                self._store = connect()
                return (inner := C10dRendezvousBackend(self._store, run_id)), op(inner)
            return self._inner, op(self._inner)

        def on_store(self, fn: Callable):
            """fn(store) on the state's connection, bounded and replaced after a failure as a state call is
            (fault/refusal.py reads a key of its own there)."""
            return self._call(lambda _inner: fn(self._store))

        def get_state(self):
            return self._call(lambda b: b.get_state())

        def set_state(self, state: bytes, token=None):
            return self._call(lambda b: b.set_state(state, token))

    return ReconnectingBackend()


def _bounded(fn: Callable, timeout: float):
    """fn() on a thread of its own, waited for at most `timeout` s (then TimeoutError). A TCPStore call on a
    connection whose peer went silent returns when TCP gives up, some 15 minutes later, whatever the
    store's timeout says (only waiting for a key is bounded by it). The thread left behind holds only the
    abandoned connection, and ends when the link returns or TCP gives up."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run, name="rendezvous-call", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer in {timeout:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _client(host: str, port: int):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=STATE_TIMEOUT_S))


DEFAULT_PORT = 29400  # elastic's, for an endpoint that names none
# the agent's --nnodes as MIN:MAX, in its workers' environment: the ranks compare it across hosts
# (distributed/same_config.py), as they compare their configs
NNODES_ENV = "MEGASCALE_NNODES"


def parse_nnodes(text: str) -> tuple[int, int]:
    """`--nnodes N` or `MIN:MAX` as (min, max) hosts."""
    lo, colon, hi = text.partition(":")
    if not lo.isdigit() or (colon and not hi.isdigit()):
        raise UserError(f"--nnodes: {text!r} is not N or MIN:MAX")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise UserError(f"--nnodes {text}: needs 1 <= MIN <= MAX")
    return low, high


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of HOST[:PORT] ([v6]:PORT too)."""
    if ":" not in endpoint:
        return endpoint, DEFAULT_PORT
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port) if port else DEFAULT_PORT


def is_this_host(addr: str) -> bool:
    """Whether `addr` is an address of this machine (one a socket binds to)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as probe:
            probe.bind((addr, 0))
        return True
    except OSError:
        return False


def store_reachable(endpoint: str, timeout_s: float, waiting: Callable[[], None] = lambda: None) -> bool:
    """Whether the store at `endpoint` accepts connections within `timeout_s` (hosts start in any order,
    and the store's may come up after this one); `waiting()` once if it has to wait."""
    host, port = split_endpoint(endpoint)
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            if not said:
                waiting()
                said = True
            time.sleep(1.0)


def connect(endpoint: str):
    """A client of the rendezvous store at HOST:PORT (calls bounded by its timeout)."""
    return _client(*split_endpoint(endpoint))


def poll_interval_s(max_nodes: int) -> float:
    """Seconds between a waiting agent's reads of the rendezvous state (`fault.rendezvous_poll_s` = 0)."""
    return min(1.0, max(0.1, max_nodes / 200))


_WATCHERS: list[Callable[[], None]] = []  # called between a waiting agent's polls (may raise to end it)


def _poll_every(every: float) -> None:
    """Elastic's waiting agents read the state every `every` s instead of every 1 s, and run `_WATCHERS`
    before each wait. Private API: the executor's sleep is `dynamic_rendezvous._delay(seconds=1)`; every
    other delay (the first round's random skew) is left as it is. Without that name (another torch),
    elastic's 1 s stays and nothing watches."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = getattr(dr, "_delay", None)
    if original is None:
        return
    original = getattr(original, "elastic_delay", original)  # a second handler: wrap elastic's, not ours

    def delay(seconds) -> None:  # elastic calls it with seconds=
        if seconds == 1:  # waiting in a round for its state to change
            for watch in _WATCHERS:
                watch()
            seconds = every
        original(seconds=seconds)

    delay.elastic_delay = original
    dr._delay = delay


def create_handler(params):
    """Elastic's c10d rendezvous handler for `params`, its state on a reconnecting connection. The store
    elastic makes here is the server on the host that holds the endpoint (else a client), and the
    store of the rounds."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as elastic_handler

    poll = float(params.get("poll_interval", 0) or 0) or poll_interval_s(params.max_nodes)
    _poll_every(poll)
    _, store = create_backend(params)
    host, port = store.host, store.port  # the port the server took (an endpoint may say port 0)
    os.environ[SERVES_ENV] = "1" if _serves(params, host) else ""  # the workers inherit it
    backend = make_backend(lambda: _client(host, port), params.run_id)
    # a host whose own checks failed before its agent started posts why (fault/refusal.py): read it
    watching = bool(os.environ.get(refusal.ENV))  # megascale launch with --rdzv-id (fault/refusal.py)
    every = max(1.0, params.max_nodes / 200)  # ~200 reads a second on the store at most, as the polls
    _WATCHERS[:] = ([refusal.Watch(os.environ[refusal.ENV], backend.on_store, serves_store, every)]
                    if watching else [])
    handler = elastic_handler(store, backend, params)
    holder = getattr(handler, "_state_holder", None)  # private API, as _poll_every
    if poll != 1.0 and isinstance(getattr(holder, "_cache_duration", None), (int, float)):
        holder._cache_duration = poll  # a read is reused this long (elastic: 1 s, which hid faster polls)
    return handler


def _serves(params, host: str) -> bool:
    """Whether this agent serves the rendezvous store: elastic's own choice in `create_backend` (the
    `is_host` parameter, else whether the endpoint names this machine). Private API as _poll_every;
    without it, False (a straggler there is then evicted like any other, and its leaving ends the job).
    Several agents on the machine the endpoint names all read True (elastic falls back to a client
    when the port is taken, and the store tells nobody): none of them is evicted as a straggler."""
    chosen = params.get_as_bool("is_host")
    if chosen is not None:
        return chosen
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:
        return False
    return _matches_machine_hostname(host)


def serves_store() -> bool:
    """In a worker of `megascale launch`: whether its host's agent serves the rendezvous store, so that
    the host cannot leave without ending the job (README: Eviction)."""
    return os.environ.get(SERVES_ENV) == "1"


def register() -> None:
    """Make `BACKEND` a rendezvous backend name for elastic's launcher (again: a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
