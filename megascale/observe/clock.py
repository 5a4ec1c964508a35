"""Each rank's clock offset to rank 0's, so that one timeline can hold every rank's spans.

NTP's method over the job's own network: rank r sends its time t1, rank 0 answers with its
time t0, r notes t2 on arrival; if the two legs take equally long, rank 0's clock read t0 at r's
(t1 + t2) / 2, so offset = t0 - (t1 + t2) / 2, with an error of at most (t2 - t1) / 2. Of
`rounds` exchanges the one with the shortest round trip wins (queueing only ever lengthens one
leg, which is what biases an estimate). Rank 0 serves ranks one after another: O(world) round
trips, some milliseconds for a host's worth of ranks; at tens of thousands of ranks this wants
a tree (host leaders first), which is left for the cluster driver.

Collective over `group` (a gloo group: the timestamps travel as CPU tensors); every rank gets
its own (offset_ns, err_ns); rank 0's is (0, 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def measure_offsets(now: Callable[[], int], group=None, rounds: int = 8) -> tuple[int, int]:
    rank = dist.get_rank()
    world = dist.get_world_size(group)
    buf = torch.zeros(1, dtype=torch.int64)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    root = ranks[0]
    if rank == root:
        for peer in ranks[1:]:
            for _ in range(rounds):
                dist.recv(buf, src=peer, group=group)
                buf[0] = now()
                dist.send(buf, dst=peer, group=group)
        return 0, 0
    best = None
    for _ in range(rounds):
        t1 = now()
        buf[0] = t1
        dist.send(buf, dst=root, group=group)
        dist.recv(buf, src=root, group=group)
        t2 = now()
        rtt = t2 - t1
        if best is None or rtt < best[0]:
            best = (rtt, int(buf[0]) - (t1 + t2) // 2)
    rtt, offset = best
    return offset, rtt // 2
