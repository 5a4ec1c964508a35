"""A host that will not join a multi-host job says why to the hosts that wait for it.

`megascale launch` checks its command line and config before its agent starts: a config file missing on
one node (its shared file system not mounted), an override that does not fit its --nproc-per-node. Such a
host ended with its line in its own log, and every other host waited out `fault.rendezvous_timeout_s`
(120 s by default, 600 s and more at scale) for it, to end with "fewer than N hosts joined", leaving
the operator to find the one log that says why. Here the refusing host writes its line under a key of
the job's rendezvous store (`post`), and the agents waiting in a round read it between their polls of
the round's state (`Watch`): each ends at once, exit 2, naming the host and its line.

The key is named by the command line's --rdzv-id (every host's is the same), not by the run id the
agents derive from the config, which a host that cannot read its config cannot know; without one (a
job that may share its store with others) nothing is posted or read. When the endpoint
is the refusing host's own address, no agent serves the store: the refusing host serves one itself,
only for this, until the other hosts have read it or the rendezvous timeout has passed.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable

ENV = "MEGASCALE_RDZV_ID"  # the agent's --rdzv-id as given ("" when none), for `Watch`


class HostRefused(Exception):
    """Another host of the job will not join it (its own check failed): this host's agent ends too."""

    def __init__(self, host: str, message: str):
        super().__init__(f"host {host} will not join this job: {message}")
        self.host, self.message = host, message


def key(rdzv_id: str) -> str:
    return f"megascale/refused/{rdzv_id}"


def post(endpoint: str, rdzv_id: str, host: str, message: str, others: int, timeout_s: float) -> bool:
    """Put this host's refusal where the `others` waiting hosts' agents read it: in the store at
    `endpoint`, waited for up to `timeout_s` (the others may start later), or, where the endpoint is this
    host, in a store served here. Returns once the last of them has read it (it takes the key away), or
    after `timeout_s` (the key is then taken away here: a store that outlives the job, megascale
    rdzv-store, must not refuse the next launch). Whether it was read."""
    import torch.distributed as dist

    from megascale.fault import rendezvous  # it imports this module

    deadline = time.monotonic() + timeout_s
    try:
        addr, port = rendezvous.split_endpoint(endpoint)
        serve = rendezvous.is_this_host(addr)
        if not serve and not rendezvous.store_reachable(endpoint, timeout_s):
            return False
        store = dist.TCPStore(addr, port, is_master=serve, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=5))
        store.set(key(rdzv_id), json.dumps({"host": host, "message": message, "others": others}))
        while time.monotonic() < deadline:
            if not store.check([key(rdzv_id)]):
                # read by all: the agent that serves the store ends once it sees this, the last call here
                store.set(key(rdzv_id) + "/ack", "1")
                return True
            time.sleep(0.1)
        store.delete_key(key(rdzv_id))
        return False
    except (RuntimeError, ValueError, OSError):  # no port, no store: the others find out the slow way
        return False


class Watch:
    """Called between a waiting agent's polls of the round's state: raises HostRefused once a host has
    posted its refusal. `call(fn)` runs fn(store) on the rendezvous store's connection, bounded. The last
    of the hosts the refusal is for takes it away; the agent that serves the store then waits (at most
    ACK_WAIT_S) for the refusing host's last call before it ends and takes the store with it."""

    ACK_WAIT_S = 5.0

    def __init__(self, rdzv_id: str, call: Callable, serves: Callable[[], bool], every_s: float = 1.0):
        self.key, self.call, self.serves, self.every_s, self._last = key(rdzv_id), call, serves, every_s, 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:  # at most this often
            return
        self._last = now
        try:
            found = self.call(self._read)
        except Exception:  # noqa: BLE001 - the store out of reach: the round's own wait says so
            return
        if found is None:
            return
        if self.serves():
            deadline = time.monotonic() + self.ACK_WAIT_S
            while time.monotonic() < deadline:
                try:
                    if self.call(lambda store: store.check([self.key + "/ack"])):
                        self.call(lambda store: store.delete_key(self.key + "/ack"))
                        break
                except Exception:  # noqa: BLE001
                    break
                time.sleep(0.05)
        raise HostRefused(found.get("host", "?"), found.get("message", ""))

    def _read(self, store) -> dict | None:
        if not store.check([self.key]):
            return None
        found = json.loads(store.get(self.key))
        if store.add(self.key + "/read", 1) >= int(found.get("others", 1)):
            store.delete_key(self.key)  # read by every host it was for: gone for a later launch
            store.delete_key(self.key + "/read")
        return found
