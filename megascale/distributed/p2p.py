"""Where a group's point-to-point messages go: gloo's isend/irecv, or our socket transport.

`isend` and `irecv` take the arguments of torch's (a global peer rank, the group, a tag) and
return something to `wait(timeout)` on. A group registered by `use_sockets` (Mesh.build, with
`parallel.transport = "sockets"` on gloo) sends over `sockets.SocketTransport`, every other
group through torch.distributed. The callers (the direct reduce-scatter and all-gather, the
pipeline's p2p) do not know which: both keep gloo's matching rule, messages of one (peer, tag)
in posting order.

A group's messages travel on a channel of their own: the group's place in its mesh and the
mesh's number in this process (each Mesh.build that asks for sockets makes the next), both
the same on every rank because every rank builds its meshes in the same order.
"""

from __future__ import annotations

import datetime
import secrets
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed.sockets import SocketTransport, local_address

_ROUTES: dict[dist.ProcessGroup, tuple[SocketTransport, int]] = {}
_TRANSPORT: SocketTransport | None = None
_MESHES = 0  # meshes routed over sockets so far in this process: the channels' high part
_TAG_BITS = 32


def _key(group: dist.ProcessGroup | None, tag: int) -> tuple[SocketTransport, int] | None:
    """(transport, message key) for a routed group, None for one torch.distributed carries."""
    route = _ROUTES.get(group) if group is not None else None
    return None if route is None else (route[0], (route[1] << _TAG_BITS) | tag)


def isend(tensor: Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    if (ours := _key(group, tag)) is None:
        return dist.isend(tensor, dst=dst, group=group, tag=tag)
    return ours[0].isend(tensor, dst, ours[1])


def irecv(tensor: Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    if (ours := _key(group, tag)) is None:
        return dist.irecv(tensor, src=src, group=group, tag=tag)
    return ours[0].irecv(tensor, src, ours[1])


def routed(group: dist.ProcessGroup | None) -> bool:
    """Whether this group's messages go over the socket transport."""
    return group is not None and group in _ROUTES


def use_sockets(groups: tuple[dist.ProcessGroup | None, ...]) -> None:
    """Send these groups' point-to-point messages over the socket transport from now on.

    Collective over the world: every rank calls it, in the same order (the first call starts this
    process's transport, with one broadcast of rank 0's nonce). A group already routed keeps its
    channel (the mesh hands one group to two kinds where their ranks coincide)."""
    global _TRANSPORT, _MESHES
    if _TRANSPORT is None:
        # not torch's generator: drawing from it here would change the model's initialisation
        nonce = torch.tensor([secrets.randbits(62) + 1], dtype=torch.int64)
        dist.broadcast(nonce, src=0)
        store = dist.distributed_c10d._get_default_store()
        _TRANSPORT = SocketTransport(store, dist.get_rank(), dist.get_world_size(), int(nonce),
                                     local_address())
    _MESHES += 1
    for place, group in enumerate(groups):
        if group is not None and group not in _ROUTES:
            _ROUTES[group] = (_TRANSPORT, (_MESHES << 8) | place)


# Linux's TC_PRIO_INTERACTIVE and TC_PRIO_BULK: pfifo_fast's first and last band
INTERACTIVE, BULK = 6, 2


Groups = tuple[dist.ProcessGroup | None, ...]


def prioritise(interactive: Groups, bulk: Groups) -> None:
    """Mark this rank's connections to the members of routed groups: `interactive` ones (the pipeline's
    activations, tensor parallelism's exchanges: a step waits for each) ahead of `bulk` ones (dp's
    buckets, megabytes that the overlaps run behind the compute) in the host's send queue. On one
    FIFO queue, which a Linux socket's packets share, an activation sent while a bucket is on the
    wire waits behind the bucket's backlog; a NIC serves its queues side by side. A rank's peers
    in different dimensions are different ranks, so one mark per connection says which it carries."""
    me = dist.get_rank()
    for groups, priority in ((bulk, BULK), (interactive, INTERACTIVE)):
        for group in groups:
            if routed(group):
                transport = _ROUTES[group][0]
                for peer in dist.get_process_group_ranks(group):
                    if peer != me:
                        transport.set_priority(peer, priority)


def p2p_timeout(group) -> datetime.timedelta | None:
    """The group's collective timeout (distributed.collective_timeout_s once training runs), for
    waits on its isend/irecv: gloo's p2p wait has none of its own, so a peer that stopped would hang
    the wait instead of failing it (the pipeline's receives use it too). None: the backend's own."""
    if group is None and not dist.is_initialized():  # one pipeline stage, one process: no waits
        return None
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return _TIMEOUTS[group]  # asking the backend took ~7 us, and every direct exchange asks
    except KeyError:
        pass
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # not gloo: its own waits keep the backend's timeout
        timeout = None
    _TIMEOUTS[group] = timeout
    return timeout


# group -> its timeout as p2p_timeout found it (weak keys: a destroyed group's entry goes with it);
# distributed.init.set_collective_timeout, which changes them, empties it
_TIMEOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget_timeouts() -> None:
    """The groups' timeouts changed: ask the backends again."""
    _TIMEOUTS.clear()


def close() -> None:
    """Close this process's transport (at shutdown: the peers' pending receives fail at once)."""
    global _TRANSPORT, _MESHES
    if _TRANSPORT is not None:
        _TRANSPORT.close()
    _TRANSPORT, _MESHES = None, 0
    _ROUTES.clear()
