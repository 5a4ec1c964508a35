"""Point-to-point activations and gradients between pipeline stages, timed.

Shapes are static, (micro_batch, seq_len, d_model) with seq_len / tp under sequence
parallelism, so nothing but the payload travels (no shape handshake). Sends are
asynchronous (isend): a rank never waits for its neighbour to take a message, only for the
messages it needs, which is what makes any deadlock-free op order (see
pipeline.schedule.simulate) run as written. Receives block, and the time spent blocked is the
rank's bubble: what `wait_s` accumulates.

Each direction has its own tag. With pp = 2 both neighbours are the same rank, and under
the interleaved schedule the last rank sends it both activations (to the next chunk) and
gradients; the tag keeps the two streams apart, and within a stream messages match in
order, which the schedules guarantee. (NCCL ignores tags: on GPUs two-stage interleaving
would need Megatron's paired send/recv batches.)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.observe import timers
from megascale.parallel.mesh import Mesh

FORWARD_TAG, BACKWARD_TAG = 0, 1


class P2P:
    """Sends and receives of one pipeline rank for one step, with the time blocked in receives."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.mesh, self.shape, self.dtype, self.device = mesh, shape, dtype, device
        self.pending: list[tuple[dist.Work, Tensor, object]] = []  # the tensors stay alive until sent
        self.wait_s = 0.0

    def send(self, tensor: Tensor, dst: int, tag: int) -> None:
        buf = tensor.detach().to(self.dtype).contiguous()
        timed = timers.launch("send", "pp", "pp", peer=dst, tag=tag, nbytes=buf.numel() * buf.element_size())
        self.pending.append((dist.isend(buf, dst=dst, group=self.mesh.pp_group, tag=tag), buf, timed))

    def recv(self, src: int, tag: int) -> Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        t0 = time.perf_counter()
        with timers.comm("recv", "pp", "pp", peer=src, tag=tag, nbytes=buf.numel() * buf.element_size()):
            dist.irecv(buf, src=src, group=self.mesh.pp_group, tag=tag).wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def flush(self) -> None:
        """Wait for every send of the step (their buffers may then be freed)."""
        t0 = time.perf_counter()
        for work, _, timed in self.pending:
            timed.wait(work)
        self.pending.clear()
        self.wait_s += time.perf_counter() - t0
