"""Reduce-scatter as direct point-to-point messages, for gloo.

gloo's reduce_scatter is an all-reduce underneath: on 2 ranks over a 1 Gbit/s link, a 24 MB
reduce-scatter sent 24 MB per rank where 12 MB is the least any algorithm can send, and took
2.3x as long as direct sends on an unshaped link (an ad-hoc probe; `benchmarks/overlap.py`'s T_comm
shows the effect on a whole step's collectives). So on gloo each rank sends chunk j of its input
straight to rank j and receives its own chunk from every other rank: (n - 1) / n of the input each
way, the bandwidth-optimal volume, with every message posted at once, so the exchange runs in the
background like an async collective. The wait adds the received chunks to the rank's own, the
peers in rank order (deterministic). NCCL's reduce-scatter is already optimal and is used as it is
(`Mesh.direct_reduce_scatter` is on for gloo only).

Several exchanges may be in flight on one group: every rank posts them in the same order, and gloo
matches messages of one (peer, tag) in posting order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def start_reduce_scatter(out: Tensor, inp: Tensor, group, tag: int = 0,
                         inbox: list[Tensor] | None = None) -> Exchange:
    """Begin the sum over `group` of chunk r of every rank's flat `inp` into rank r's `out`.

    `out` may be this rank's own chunk of `inp` (a DP bucket's shard: summed in place) or a tensor
    of its own. `inbox`: n - 1 buffers shaped like `out` for the peers' chunks, kept by a caller that
    reduces the same buffer every step (made here when None); they must not be in another exchange.
    """
    ranks = dist.get_process_group_ranks(group)  # global ranks, in group rank order
    n, me = len(ranks), dist.get_rank(group)
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
    works = [dist.isend(chunks[r], dst=ranks[r], group=group, tag=tag) for r in peers]
    works += [dist.irecv(buf, src=ranks[r], group=group, tag=tag)
              for r, buf in zip(peers, inbox, strict=True)]
    return Exchange(out, inbox, works, (inp, flat))


class Exchange:
    """The messages of one reduce-scatter in flight; `wait` completes them and sums into `out`.

    It keeps the input referenced until then, so nothing being sent is freed."""

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
