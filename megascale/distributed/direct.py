"""Reduce-scatter and all-gather as direct point-to-point messages, for gloo.

Two faults of gloo's own collectives on a slow link, measured by `benchmarks/gloo_duplex.py` (two
simulated hosts, 1 Gbit/s tbf links, 12 MiB per rank):

- its reduce_scatter is an all-reduce underneath: it sends twice the bytes any optimal algorithm
  does (2.3x the link's floor, direct sends 1.1x);
- its all_gather between two hosts ran at 1.4-1.6x the floor, direct sends at 1.02-1.11x.

So on gloo each rank sends its part straight to every peer (reduce-scatter: chunk j of its input to
rank j; all-gather: its input to all), (n - 1) / n of the whole each way, the bandwidth-optimal
volume, every message posted at once so the exchange runs in the background like an async
collective. The receives are posted before the sends: gloo's pair sends a message only once the
peer has said it is ready to receive, and a rank that posts its send first can have its own "ready"
queued behind its whole payload, so that the two directions run one after the other (the same
benchmark: a 12 MiB swap posted send-first took 2x the floor, receive-first 1.05x). The reduce-
scatter's wait adds the received chunks to the rank's own, peers in rank order (deterministic).
NCCL's collectives are already optimal and are used as they are (`Mesh.direct_collectives` is on
for gloo only).

Several exchanges may be in flight on one group: every rank posts them in the same order, and gloo
matches messages of one (peer, tag) in posting order.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed import p2p

# group -> (its members' global ranks in group order, this rank's place): fixed for a group's life, and
# asking torch each time (get_rank(group) looks the rank up in Python) cost ~5 us of an exchange's ~40.
# Weak keys: a destroyed group's entry goes with it; None (the default group) is asked every time, as a
# new world may replace it.
_MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _members(group) -> tuple[list[int], int]:
    got = _MEMBERS.get(group) if group is not None else None
    if got is None:
        got = (dist.get_process_group_ranks(group), dist.get_rank(group))
        if group is not None:
            _MEMBERS[group] = got
    return got


def start_reduce_scatter(out: Tensor, inp: Tensor, group, tag: int = 0,
                         inbox: list[Tensor] | None = None) -> Exchange:
    """Begin the sum over `group` of chunk r of every rank's flat `inp` into rank r's `out`.

    `out` may be this rank's own chunk of `inp` (a DP bucket's shard: summed in place) or a tensor
    of its own. `inbox`: n - 1 buffers shaped like `out` for the peers' chunks, kept by a caller that
    reduces the same buffer every step (made here when None); they must not be in another exchange.
    """
    ranks, me = _members(group)  # global ranks, group order
    n = len(ranks)
    if inp.numel() != n * out.numel():
        raise ValueError(f"reduce-scatter: input of {inp.numel()} elements for {n} outputs of {out.numel()}")
    flat = inp.reshape(-1)  # a view where inp is contiguous (a DP bucket always is)
    chunks = flat.chunk(n)
    own = chunks[me]
    if own.data_ptr() != out.data_ptr():
        out.copy_(own.view(out.shape))  # own is never sent, so it can be read now
    if inbox is None:
        inbox = [torch.empty(out.shape, dtype=out.dtype, device=out.device) for _ in range(n - 1)]
    peers = [r for r in range(n) if r != me]
    works = [p2p.irecv(buf, src=ranks[r], group=group, tag=tag) for r, buf in zip(peers, inbox, strict=True)]
    works += [p2p.isend(chunks[r], dst=ranks[r], group=group, tag=tag) for r in peers]
    return Exchange(out, inbox, works, (inp, flat), p2p.p2p_timeout(group))


def start_all_gather(out: Tensor, inp: Tensor, group, tag: int = 0) -> Exchange:
    """Begin gathering every rank's `inp` into `out` (n * inp.numel() elements, rank r's at the r-th
    n-th of its flat view). `inp` may be this rank's own part of `out` (a DP bucket's shard)."""
    ranks, me = _members(group)
    n = len(ranks)
    if out.numel() != n * inp.numel():
        raise ValueError(f"all-gather: output of {out.numel()} elements for {n} inputs of {inp.numel()}")
    if not out.is_contiguous():
        raise ValueError("all-gather: the output must be contiguous (it is received into in place)")
    parts, flat_in = out.view(-1).chunk(n), inp.reshape(-1)
    if parts[me].data_ptr() != flat_in.data_ptr():
        parts[me].copy_(flat_in)
    peers = [r for r in range(n) if r != me]
    works = [p2p.irecv(parts[r], src=ranks[r], group=group, tag=tag) for r in peers]
    works += [p2p.isend(parts[me], dst=ranks[r], group=group, tag=tag) for r in peers]
    return Exchange(out, [], works, (inp, out), p2p.p2p_timeout(group))


def gather_rows(t: Tensor, group, tag: int = 0) -> Tensor:
    """Every rank's `t` over `group`, stacked in group rank order: (n, *t.shape), one exchange."""
    rows = t.new_empty((len(_members(group)[0]), *t.shape))
    start_all_gather(rows, t.contiguous(), group, tag).wait()
    return rows


# Up to this size a sum over more than 2 ranks goes in one exchange (every rank's whole tensor to every
# peer) instead of a reduce-scatter and an all-gather: half the round trips, for a few more bytes.
ONE_EXCHANGE_BYTES = 64 * 1024


def all_reduce(t: Tensor, group, tag: int = 0, op: str = "sum") -> None:
    """Sum (or, op="max", take the maximum of) `t` over `group` in place, by direct messages.

    Small tensors and pairs go in ONE exchange, an all-gather of every rank's whole tensor, which
    each rank then reduces itself, in rank order: one round trip where a reduce-scatter and an
    all-gather take two. The sums a step waits for are small and latency-bound (the vocab-parallel
    loss's per-token sums, the grad norm: ~1 ms a round trip on the simulated 1 Gbit/s links), and
    between two ranks it moves the same bytes as the pair of collectives. Larger tensors over more
    ranks go as a direct reduce-scatter and all-gather of the sums, 2 (n - 1) / n of it each way (a
    ring's volume) in 2 (n - 1) messages per rank. Either way every rank gets the same bits: in
    the first each rank reduces the same rows in the same order; in the second each chunk is summed
    once, by the rank that owns it (own chunk, then the peers' in rank order), and copied to the others.

    For the groups our transport carries (p2p.routed): there these messages cost a fraction of
    gloo's own all-reduce, whose small messages take ~28 futex calls and 0.5 ms of CPU each
    (benchmarks/transport.py)."""
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
    ranks, me = _members(group)
    n = len(ranks)
    if n == 1:
        return
    flat = t.reshape(-1)  # a view of t where t is contiguous, a copy otherwise
    if op == "max" or n == 2 or flat.numel() * flat.element_size() <= ONE_EXCHANGE_BYTES:
        rows = gather_rows(flat, group, tag)
        reduce = torch.maximum if op == "max" else torch.add
        out = rows[0]
        for r in range(1, n):  # rank order, on every rank: the same bits everywhere
            out = reduce(out, rows[r], out=out)
        t.copy_(out.view(t.shape))
        return
    pad = -flat.numel() % n
    buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    chunk = buf.numel() // n
    own = buf.narrow(0, me * chunk, chunk)
    start_reduce_scatter(own, buf, group, tag).wait()
    start_all_gather(buf, own, group, tag).wait()
    if pad or not t.is_contiguous():  # the sums are in a copy: back into t
        t.copy_(buf.narrow(0, 0, t.numel()).view(t.shape))


class Exchange:
    """The messages of one exchange in flight; `wait` completes them (a reduce-scatter then sums its
    inbox into `out`). It keeps the input referenced until then, so nothing being sent is freed."""

    def __init__(self, out: Tensor, inbox: list[Tensor], works: list, keep: tuple, timeout=None):
        self.out, self.inbox, self.works, self._keep, self.timeout = out, inbox, works, keep, timeout

    def wait(self, *_args, **_kwargs) -> bool:
        if self.works is not None:
            for w in self.works:
                w.wait(self.timeout) if self.timeout is not None else w.wait()
            self.works = self._keep = None
            for buf in self.inbox:  # peers in rank order: the same sum on every run
                self.out.add_(buf)
        return True

    def is_completed(self) -> bool:
        return self.works is None
