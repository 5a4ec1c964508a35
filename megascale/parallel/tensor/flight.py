"""The asynchronous collectives of the tensor-parallel overlap (overlap.py): its settings, and the
collectives one pass issues, in issue order, each waited for once.

A TPLayerFactory's overlapped layers share one `Overlap`: the chunk count, and a process group of
their own (the ranks of mesh.tp_group), as Megatron's TP-overlap communicators are, so that a chunk
never queues behind another tp collective of the plain path (the vocab-parallel loss, BranchIn /
BranchOut, the partial-gradient sums) and on NCCL runs on a communicator and stream of its own.
Every pass waits for all it issued before it returns, so the group sees the same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed import p2p
from megascale.distributed.direct import start_all_gather, start_reduce_scatter
from megascale.distributed.groups import create_groups
from megascale.observe import timers
from megascale.parallel.mesh import Mesh, group_ranks
from megascale.parallel.tensor import symm_mem


@dataclass(frozen=True, eq=False)
class Overlap:
    """How the layers of one TPLayerFactory overlap: chunks per GEMM, and the group they use."""

    chunks: int
    group: dist.ProcessGroup
    rank: int = 0  # this rank's place in the group (its tp rank): its own rows of every chunk
    direct: bool = False  # collectives as direct sends (gloo, Mesh.direct_collectives)
    symm_mem: bool = False  # the SP layers through PyTorch's fused symmetric-memory ops (symm_mem.py)

    def peers(self, tp: int) -> list[int]:
        return [r for r in range(tp) if r != self.rank]


def overlap_settings(mesh: Mesh, chunks: int, impl: str = "chunked",
                     device: torch.device | str = "cpu") -> Overlap | None:
    """None when off (chunks == 0, or tp == 1). impl: parallel.tp_overlap_impl (symm_mem.py), for a
    model on `device`. Collective: every rank calls it, in the same order."""
    if chunks <= 0 or mesh.tp == 1:
        return None
    fused = symm_mem.resolve(impl, device)  # before the group: a bad setting fails before any collective
    group = create_groups([group_ranks(mesh.dp, mesh.pp, mesh.tp, "tp")], mesh.rank)[0]
    if p2p.routed(mesh.tp_group):  # parallel.transport = "sockets": its messages on a channel of its own
        p2p.use_sockets((group,))
    return Overlap(chunks, group, mesh.tp_rank, mesh.direct_collectives, fused)


def num_chunks(size: int, chunks: int) -> int:
    """The largest divisor of `size` that is <= chunks (at least 1): equal chunks only."""
    return next(c for c in range(max(1, min(chunks, size)), 0, -1) if size % c == 0)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class Flight:
    """The async collectives of one pass, in issue order (the same on every rank), each waited once.

    The tensors stay referenced until their wait, so nothing in flight is freed under gloo."""

    def __init__(self, ov: Overlap):
        self.group, self.direct, self.ops = ov.group, ov.direct, []

    def _issue(self, op: str, nbytes: int, collective, *tensors: Tensor) -> None:
        pending = timers.launch(op, "tp", "tp", nbytes=nbytes)
        self.ops.append((pending, collective(*tensors, group=self.group, async_op=True), tensors))
        pending.issued()

    # out / inp (tp, ...) stacked by rank; gloo wants them concatenated, (tp * n0, ...): views
    def all_gather(self, out: Tensor, inp: Tensor) -> None:
        if self.direct:  # gloo: faster than its own (distributed/direct.py)
            self._direct("all_gather", _nbytes(out), start_all_gather, out, inp)
        else:
            self._issue("all_gather", _nbytes(out), dist.all_gather_single, out.flatten(0, 1), inp)

    def reduce_scatter(self, out: Tensor, inp: Tensor) -> None:
        if self.direct:  # gloo: half the bytes of its own reduce-scatter (distributed/direct.py)
            self._direct("reduce_scatter", _nbytes(inp), start_reduce_scatter, out, inp)
        else:
            self._issue("reduce_scatter", _nbytes(inp), dist.reduce_scatter_single, out, inp.flatten(0, 1))

    def _direct(self, op: str, nbytes: int, start, out: Tensor, inp: Tensor) -> None:
        pending = timers.launch(op, "tp", "tp", nbytes=nbytes)  # the exchange keeps its tensors itself
        self.ops.append((pending, start(out, inp, self.group), ()))
        pending.issued()

    def all_reduce(self, t: Tensor) -> None:
        self._issue("all_reduce", _nbytes(t), dist.all_reduce, t)

    def wait(self, i: int) -> None:
        if self.ops[i] is not None:
            pending, work, _ = self.ops[i]
            self.ops[i] = None
            pending.wait(work)  # only the wait counts as exposed communication

    def wait_all(self) -> None:
        for i in range(len(self.ops)):
            self.wait(i)
