"""Reduce-scatter and all-gather as direct point-to-point messages in chunks, for gloo.

Two faults of gloo's own collectives on a slow link, each measured with an ad-hoc probe on the
simulated cluster (two hosts, 1 Gbit/s tbf links, `benchmarks/overlap.py`'s set-up):

- its reduce_scatter is an all-reduce underneath: a 24 MB reduce-scatter sent 24 MB per rank where
  12 MB is the least any algorithm can send;
- one large message each way between a pair runs at about half duplex: swapping 12 MiB took 0.21 s
  where the link needs 0.105 s, and raw TCP on the same link 0.105 s. Cut into 256 KiB messages
  the same swap took 0.109 s (the 48 messages of a direction stream back to back). gloo's
  all_gather of 6 MiB per rank took 62-70 ms against 56 ms as chunked direct messages.

So on gloo each rank sends its part straight to every peer (reduce-scatter: chunk j of its input to
rank j; all-gather: its input to all), (n - 1) / n of the whole each way, the bandwidth-optimal
volume, every message posted at once so the exchange runs in the background like an async
collective, and every message is cut into pieces of at most `chunk_bytes`. The reduce-scatter's wait
adds the received chunks to the rank's own, peers in rank order (deterministic). NCCL's collectives
are already optimal and are used as they are (`Mesh.direct_collectives` is on for gloo only).
`isend` / `irecv` cut one point-to-point message the same way: the pipeline's activations and
gradients, which 1F1B's steady phase sends both ways between two stages at once.

Several exchanges may be in flight on one group: every rank posts them in the same order, and gloo
matches messages of one (peer, tag) in posting order, so the pieces of a message (one tag) meet
their counterparts piece for piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK_BYTES = 256 * 1024  # the knee of the probe's sweep: 1 MiB pieces still lost 10%


def start_reduce_scatter(out: Tensor, inp: Tensor, group, tag: int = 0, inbox: list[Tensor] | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Exchange:
    """Begin the sum over `group` of chunk r of every rank's flat `inp` into rank r's `out`.

    `out` may be this rank's own chunk of `inp` (a DP bucket's shard: summed in place) or a tensor
    of its own. `inbox`: n - 1 buffers shaped like `out` for the peers' chunks, kept by a caller that
    reduces the same buffer every step (made here when None); they must not be in another exchange.
    """
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)  # global ranks, group order
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
    works = []
    for r, buf in zip(peers, inbox, strict=True):  # receives first: each is posted before its data comes
        works += _post(False, buf.view(-1), ranks[r], group, tag, chunk_bytes)
    for r in peers:
        works += _post(True, chunks[r], ranks[r], group, tag, chunk_bytes)
    return Exchange(out, inbox, works, (inp, flat))


def start_all_gather(out: Tensor, inp: Tensor, group, tag: int = 0,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Exchange:
    """Begin gathering every rank's `inp` into `out` (n * inp.numel() elements, rank r's at the r-th
    n-th of its flat view). `inp` may be this rank's own part of `out` (a DP bucket's shard)."""
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)
    n = len(ranks)
    if out.numel() != n * inp.numel():
        raise ValueError(f"all-gather: output of {out.numel()} elements for {n} inputs of {inp.numel()}")
    if not out.is_contiguous():
        raise ValueError("all-gather: the output must be contiguous (it is received into in place)")
    parts, flat_in = out.view(-1).chunk(n), inp.reshape(-1)
    if parts[me].data_ptr() != flat_in.data_ptr():
        parts[me].copy_(flat_in)
    peers = [r for r in range(n) if r != me]
    works = []
    for r in peers:
        works += _post(False, parts[r], ranks[r], group, tag, chunk_bytes)
    for r in peers:
        works += _post(True, parts[me], ranks[r], group, tag, chunk_bytes)
    return Exchange(out, [], works, (inp, out))


def isend(tensor: Tensor, dst: int, group, tag: int, chunk_bytes: int) -> Pieces:
    """dist.isend of a contiguous tensor in pieces of at most chunk_bytes (0: whole); the receiver
    must `irecv` it with the same chunk_bytes (the pipeline's p2p under gloo)."""
    return Pieces(_post(True, tensor.view(-1), dst, group, tag, chunk_bytes))


def irecv(tensor: Tensor, src: int, group, tag: int, chunk_bytes: int) -> Pieces:
    """The receive that matches `isend`: into a contiguous tensor, piece for piece."""
    return Pieces(_post(False, tensor.view(-1), src, group, tag, chunk_bytes))


class Pieces:
    """The works of one message's pieces, as one work."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, *_args, **_kwargs) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def pieces(flat: Tensor, chunk_bytes: int) -> tuple[Tensor, ...]:
    """`flat` cut into consecutive views of at most chunk_bytes (0: whole); the same cut on every rank
    for tensors of one size, so a sender's pieces and its receiver's match one for one."""
    per = max(1, chunk_bytes // flat.element_size()) if chunk_bytes > 0 else max(1, flat.numel())
    return flat.split(per)


def _post(send: bool, flat: Tensor, peer: int, group, tag: int, chunk_bytes: int) -> list:
    # looked up per call and the peer by keyword: benchmarks/overlap.py wraps and records these
    op, side = (dist.isend, {"dst": peer}) if send else (dist.irecv, {"src": peer})
    return [op(piece, group=group, tag=tag, **side) for piece in pieces(flat, chunk_bytes)]


class Exchange:
    """The messages of one exchange in flight; `wait` completes them (a reduce-scatter then sums its
    inbox into `out`). It keeps the input referenced until then, so nothing being sent is freed."""

    def __init__(self, out: Tensor, inbox: list[Tensor], works: list, keep: tuple):
        self.out, self.inbox, self.works, self._keep = out, inbox, works, keep

    def wait(self, *_args, **_kwargs) -> bool:
        if self.works is not None:
            for w in self.works:
                w.wait()
            self.works = self._keep = None
            for buf in self.inbox:  # peers in rank order: the same sum on every run
                self.out.add_(buf)
        return True

    def is_completed(self) -> bool:
        return self.works is None
