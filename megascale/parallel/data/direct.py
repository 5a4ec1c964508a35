"""The dp reduce-scatter as direct point-to-point messages, for gloo.

gloo's reduce_scatter is an all-reduce underneath: on 2 ranks over a 1 Gbit/s link, a 24 MB
reduce-scatter sent 24 MB per rank where 12 MB is the least any algorithm can send, and took
2.3x as long as direct sends on an unshaped link (an ad-hoc probe; `benchmarks/overlap.py`'s dp
rows show the effect on a whole step). So on gloo each rank sends chunk j of its bucket straight to
rank j and receives its own chunk from every other rank, (dp - 1) / dp of the bucket each way, the
bandwidth-optimal volume, all messages posted at once so the whole exchange runs in the background
like the native collective; the wait adds the received chunks to the rank's own, the peers in rank
order (deterministic). NCCL's reduce-scatter is already optimal and is used as it is.

The received chunks need buffers of their own, dp - 1 shards per bucket, made on first use and kept:
(dp - 1) / dp of the gradient buffer more host memory on gloo, none on NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class DirectReduceScatter:
    """One bucket's reduce-scatter over the dp group by direct sends (see the module docstring)."""

    def __init__(self, group, tag: int):
        self.group, self.tag = group, tag
        self.ranks = dist.get_process_group_ranks(group)  # global ranks, dp rank order
        self.me = dist.get_rank(group)
        self._inbox: list[Tensor] | None = None

    def start(self, shard: Tensor, full: Tensor) -> _Exchange:
        """Begin reducing `full` (dp equal chunks, this rank's own chunk viewed by `shard`) into `shard`."""
        n, me = len(self.ranks), self.me
        chunks = full.chunk(n)
        if chunks[me].data_ptr() != shard.data_ptr() or chunks[me].numel() != shard.numel():
            raise ValueError("DirectReduceScatter: shard must be this rank's chunk of the bucket")
        if self._inbox is None:
            self._inbox = [torch.empty_like(shard) for _ in range(n - 1)]
        peers = [r for r in range(n) if r != me]
        works = [dist.isend(chunks[r], dst=self.ranks[r], group=self.group, tag=self.tag) for r in peers]
        works += [dist.irecv(buf, src=self.ranks[r], group=self.group, tag=self.tag)
                  for r, buf in zip(peers, self._inbox, strict=True)]
        return _Exchange(shard, self._inbox, works)


class _Exchange:
    """The messages of one reduce-scatter in flight: `wait` completes them and sums into the shard."""

    def __init__(self, shard: Tensor, inbox: list[Tensor], works: list):
        self.shard, self.inbox, self.works = shard, inbox, works

    def wait(self, *_args, **_kwargs) -> bool:
        if self.works is not None:
            for w in self.works:
                w.wait()
            self.works = None
            for buf in self.inbox:  # peers in rank order: the same sum on every run
                self.shard.add_(buf)
        return True

    def is_completed(self) -> bool:
        return self.works is None
