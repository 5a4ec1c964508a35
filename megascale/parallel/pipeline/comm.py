"""Point-to-point activations and gradients between pipeline stages, timed.

Shapes are static, (micro_batch, seq_len, d_model) with seq_len / tp under sequence
parallelism, so nothing but the payload travels (no shape handshake). Sends are
asynchronous (isend): a rank never waits for its neighbour to take a message, only for the
messages it needs, which is what makes any deadlock-free op order (see
pipeline.schedule.simulate) run as written. The time a rank spends blocked on a receive is
its bubble: what `wait_s` accumulates.

Two ways to receive. `recv` posts the receive when the op needs it and blocks on it
(parallel.pp_overlap = false, the baseline). With pp_overlap the step posts each receive ahead
(`post`, an irecv: MegaScale's and Megatron's overlap_p2p_comm), in the order of
`schedule.recv_plan`, so the message lands while the rank computes, and `take` waits only for
what is still missing: the exposed part of the transfer. Sends are then completed lazily:
`send_lazily` lets go of those the backend reports done (NCCL; gloo's report so only once
waited for) and `flush` waits for the rest at the end of the step, so neither direction waits
on the other through warm-up and cool-down (MegaScale's decoupled send/recv).

Streams and communicators. Activations flow forward (FORWARD_TAG), gradients backward
(BACKWARD_TAG); within a stream messages match in order, which the schedules guarantee. With
pp = 2 both neighbours are the same rank, and under the interleaved schedule each sends the
other both streams. Gloo keeps them apart by tag. NCCL ignores tags, and runs a communicator's
sends and receives to one peer one after another, so under NCCL each direction has its own
group (`Mesh.pp_bwd_group` carries the gradients): the streams can neither swap messages nor
queue behind each other's pending receives. Within one direction a pp = 2 interleaved channel
still carries messages both ways, which is why `recv_plan` posts receives and issues sends in
one order both ends share (a receive posted ahead of a send the peer waits for would hang).
The blocking baseline keeps op order, unpaired: under NCCL, pp = 2 interleaved wants pp_overlap
(or the same plan with depth 0, which posts nothing early but what the order needs). Gloo needs
neither group nor order, so it gets the second group only when asked (Mesh.build's p2p_groups:
the tests), and its start-up stays the one distributed/traffic.py models.

Every wait is bounded by the group's collective timeout (distributed.collective_timeout_s):
gloo's p2p waits have none, and a stage whose neighbour stopped would otherwise hang in a
receive until the hang watchdog, instead of failing the step at once, as a collective does.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed import p2p
from megascale.distributed.p2p import p2p_timeout
from megascale.observe import timers
from megascale.parallel.mesh import Mesh

FORWARD_TAG, BACKWARD_TAG = 0, 1


class P2P:
    """Sends and receives of one pipeline rank for one step, with the time blocked in receives."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.mesh, self.shape, self.dtype, self.device = mesh, shape, dtype, device
        self.pending: list[tuple[_Bounded, Tensor, object]] = []  # the tensors stay alive until sent
        # per stream (tag), the receives posted ahead, oldest first: (work, buffer, source)
        self.posted: dict[int, deque[tuple[_Bounded, Tensor, int]]] = {FORWARD_TAG: deque(),
                                                                        BACKWARD_TAG: deque()}
        self.wait_s = 0.0
        self.timeout = {tag: p2p_timeout(self.group(tag)) for tag in (FORWARD_TAG, BACKWARD_TAG)}

    def group(self, tag: int) -> dist.ProcessGroup | None:
        """The communicator of a direction: the backward one where the mesh has it (NCCL)."""
        if tag == BACKWARD_TAG and self.mesh.pp_bwd_group is not None:
            return self.mesh.pp_bwd_group
        return self.mesh.pp_group

    def send(self, tensor: Tensor, dst: int, tag: int) -> None:
        buf = tensor.detach().to(self.dtype).contiguous()
        timed = timers.launch("send", "pp", "pp", peer=dst, tag=tag, nbytes=buf.numel() * buf.element_size())
        work = _Bounded(p2p.isend(buf, dst=dst, group=self.group(tag), tag=tag), self.timeout[tag])
        timed.issued()
        self.pending.append((work, buf, timed))

    def send_lazily(self, tensor: Tensor, dst: int, tag: int) -> None:
        """`send`, after letting go of the sends already done (their buffers may be freed)."""
        self.pending = [p for p in self.pending if not _reaped(p)]
        self.send(tensor, dst, tag)

    def recv(self, src: int, tag: int) -> Tensor:
        """Receive now, blocking (the baseline, and evaluation)."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        t0 = time.perf_counter()
        with timers.comm("recv", "pp", "pp", peer=src, tag=tag, nbytes=buf.numel() * buf.element_size()):
            _Bounded(p2p.irecv(buf, src=src, group=self.group(tag), tag=tag), self.timeout[tag]).wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def post(self, src: int, tag: int) -> None:
        """Post the next receive of a stream ahead of the op that takes it."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = _Bounded(p2p.irecv(buf, src=src, group=self.group(tag), tag=tag), self.timeout[tag])
        self.posted[tag].append((work, buf, src))

    def take(self, tag: int) -> Tensor:
        """The oldest posted receive of a stream, once it has arrived; the wait is the exposed time.

        Timed as a blocking receive (timers.comm, entered at the wait), not as a launched op: the
        in-flight record counts a receive's sequence number on the channel's received side, and the
        trace's "recv" span is then exactly the blocked part."""
        work, buf, src = self.posted[tag].popleft()
        t0 = time.perf_counter()
        with timers.comm("recv", "pp", "pp", peer=src, tag=tag, nbytes=buf.numel() * buf.element_size()):
            work.wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def flush(self) -> None:
        """Wait for every send of the step (their buffers may then be freed)."""
        if any(self.posted.values()):
            raise RuntimeError("pipeline p2p: receives posted but never taken (plan and ops disagree)")
        t0 = time.perf_counter()
        for work, _, timed in self.pending:
            timed.wait(work)
        self.pending.clear()
        self.wait_s += time.perf_counter() - t0


class _Bounded:
    """A p2p Work whose wait fails at `timeout` (a timedelta; None: the backend's own) instead of
    blocking for ever on a peer that stopped."""

    __slots__ = ("work", "timeout")

    def __init__(self, work: dist.Work, timeout):
        self.work, self.timeout = work, timeout

    def wait(self, *_args, **_kwargs) -> bool:
        return self.work.wait(self.timeout) if self.timeout is not None else self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _reaped(pending: tuple[_Bounded, Tensor, object]) -> bool:
    """Close a send's span if the backend says it completed (which never blocks)."""
    work, _, timed = pending
    if not work.is_completed():
        return False
    timed.wait(work)
    return True
