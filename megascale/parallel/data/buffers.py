"""Flat parameter and gradient buffers in buckets, and their data-parallel collectives.

Megatron-Core's `param_and_grad_buffer.py`, picotron-short. Every trainable parameter of one
dtype lives in one flat contiguous tensor (its `.data` is a view into it) and its gradient
in a second one (its `.grad` is a view, so autograd accumulates micro-batches into the
buffer in place). Each buffer is cut into buckets of about `bucket_size` elements at
parameter boundaries, padded so that it splits into dp equal shards:

    bucket  = [ p7 | p6 | p5 ... | pad ]          one reduce-scatter + one all-gather each
    shards  = [ rank 0 | rank 1 | ... ]           contiguous: a shard may cut through a tensor

Why flat buckets: one collective per bucket instead of one per tensor (hundreds of small
messages are latency-bound), and a shard of a bucket is a plain slice, so the sharded
optimizer works on views with no copies. Parameters go into the buffer in reverse order,
the order backward produces their gradients, so the first bucket is complete first.

Why the reduce-scatter may start during backward (`overlap=True`, MegaScale's DP overlap):
a post-accumulate-grad hook counts the gradients of each bucket on the last micro-batch
and launches the bucket's asynchronous reduce-scatter when the bucket is complete, while
backward goes on computing earlier layers. Buckets are launched strictly in index order
(a complete bucket waits for earlier ones), so every rank of the dp group issues the
collectives in the same order whatever order autograd finished them in. A bucket some of
whose parameters got no gradient on this rank (a tp row bias used on tp rank 0 only) is
launched by `finish_grad_sync`. `overlap=False` launches everything there, after backward.
Under a pipeline the schedule interleaves micro-batches, so the caller opens the sync for the
last micro-batch's backward of each chunk (pipeline_step's backward_context). Parameters whose
gradient needs another collective first (`deferred`: a pipeline's two copies of a tied matrix,
summed across stages) sit at the end of the buffer, are never launched by the hook, and go in
`finish_grad_sync` after that collective, so they do not hold back the buckets before them.

Why the buffer's last bucket's worth is cut finer (`tail_buckets`, parallel.dp_tail_buckets): those
elements hold the gradients backward completes last, whose reduce-scatter nothing is left to hide,
and the parameters the next forward needs first, whose gather it waits for; smaller buckets there
shrink both exposed pieces. On gloo both collectives go as direct sends (distributed/direct.py,
Mesh.direct_collectives): gloo's reduce-scatter is an all-reduce (twice the bytes), and each bucket
keeps the receive buffers of its first exchange, dp - 1 shards, from step to step.

Why the all-gather of the updated parameters may run into the next step
(`start_param_gather`, MegaScale's parameter prefetch): every bucket's all-gather is launched
right after the optimizer step, in the order the forward consumes the buckets (the reverse of
their index), and `wait_param_gather` waits for a bucket only when a module that uses it is
about to run (the optimizer's forward pre-hooks), so the gathers overlap fetching the next
batch and the first layers' forward.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.distributed.direct import start_all_gather, start_reduce_scatter
from megascale.observe import timers
from megascale.parallel.mesh import Mesh

DEFAULT_BUCKET_SIZE = 40_000_000  # elements; Megatron-Core's default (its min bucket at dp <= 40)


@dataclass(frozen=True)
class Piece:
    """The part of parameter `param` inside this rank's shard: elements [start, start + numel) of
    its flattened view, at offset `shard_offset` of the bucket's shard (numel may be 0)."""

    param: nn.Parameter
    bucket: int
    start: int
    numel: int
    shard_offset: int


def plan_buckets(numels: list[int], bucket_size: int, dp: int, break_before: int | None = None,
                 tail_buckets: int = 1) -> list[tuple[int, int, list[int]]]:
    """(start, end, parameter indices) of each bucket over parameters laid out in the given order.

    A bucket closes once it holds >= bucket_size elements, and before parameter `break_before`
    (the deferred ones start their own bucket); its end is padded to a multiple of dp so it
    splits into equal shards. With tail_buckets = k > 1, the last bucket_size elements before the
    deferred ones go in k buckets of about a k-th of that: in backward order they are the gradients
    completed last, whose reduce-scatter nothing is left to hide, and the parameters the next
    forward needs first, whose all-gather it waits for. Pure arithmetic, so it is tested without
    processes.
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be > 0, got {bucket_size}")
    if tail_buckets <= 0:
        raise ValueError(f"tail_buckets must be > 0, got {tail_buckets}")
    n_main = len(numels) if break_before is None else break_before
    main = sum(numels[:n_main])
    tail_from = max(0, main - bucket_size) if tail_buckets > 1 else main  # element offset, no padding
    tail_cap = -(-(main - tail_from) // tail_buckets)
    ends = list(itertools.accumulate(numels))
    # the tail: the parameters that end past tail_from (none if tail_buckets is 1)
    in_tail = [i < n_main and ends[i] > tail_from for i in range(len(numels))]
    buckets, start, offset, members = [], 0, 0, []
    for i, n in enumerate(numels):
        members.append(i)
        offset += n
        last = i == len(numels) - 1
        if (offset - start >= (tail_cap if in_tail[i] else bucket_size) or last or i + 1 == break_before
                or in_tail[i + 1] != in_tail[i]):  # a full-size bucket stops where the tail begins
            end = start + -(-(offset - start) // dp) * dp
            buckets.append((start, end, members))
            start = offset = end
            members = []
    return buckets


class Bucket:
    """A contiguous range of one dtype's buffers that is reduce-scattered and all-gathered as one."""

    def __init__(self, index: int, params: list[nn.Parameter], offsets: list[int], start: int, end: int,
                 param_data: Tensor, grad_data: Tensor, mesh: Mesh):
        self.index, self.params, self.offsets, self.mesh = index, params, offsets, mesh
        self.param_data, self.grad_data = param_data[start:end], grad_data[start:end]
        self.shard_size = (end - start) // mesh.dp
        lo = mesh.dp_rank * self.shard_size
        self.param_shard = self.param_data[lo:lo + self.shard_size]
        self.grad_shard = self.grad_data[lo:lo + self.shard_size]
        self.pieces = []
        for p, off in zip(params, offsets, strict=True):  # off: position of p inside the bucket
            a, b = max(off, lo), min(off + p.numel(), lo + self.shard_size)
            # Outside the shard: a zero-length piece, so that every rank lists every tensor.
            self.pieces.append(Piece(p, index, a - off, b - a, a - lo) if b > a else Piece(p, index, 0, 0, 0))
        self.ready: set[int] = set()
        self.work = self.pending = None
        # gloo: the reduce-scatter as direct sends (distributed/direct.py), into buffers kept from
        # step to step: dp - 1 shards, made by the first exchange
        self._inbox: list[Tensor] | None = None

    def start_grad_reduce(self) -> None:
        """Average over dp: scale by 1/dp, then reduce-scatter into this rank's shard (async)."""
        if self.mesh.dp > 1:
            self.grad_data.mul_(1.0 / self.mesh.dp)
            self.pending = timers.launch("reduce_scatter", "dp", "dp",
                                         nbytes=self.grad_data.numel() * self.grad_data.element_size())
            if self.mesh.direct_collectives:
                self.work = start_reduce_scatter(self.grad_shard, self.grad_data, self.mesh.dp_group,
                                                 tag=self.index, inbox=self._inbox)
                self._inbox = self.work.inbox
            else:
                self.work = dist.reduce_scatter_single(self.grad_shard, self.grad_data,
                                                       group=self.mesh.dp_group, async_op=True)
            self.pending.issued()

    def start_param_gather(self):
        """All-gather every rank's updated shard into the full bucket (async; returns the work or None)."""
        if self.mesh.dp == 1:
            return None
        pending = timers.launch("all_gather", "dp", "dp",
                                nbytes=self.param_data.numel() * self.param_data.element_size())
        if self.mesh.direct_collectives:
            work = start_all_gather(self.param_data, self.param_shard, self.mesh.dp_group, tag=self.index)
        else:
            work = dist.all_gather_single(self.param_data, self.param_shard, group=self.mesh.dp_group,
                                          async_op=True)
        pending.issued()
        return pending, work


class DPBuffers:
    """The flat buffers of a model's trainable parameters, their buckets, and the gradient sync.

    After construction every parameter's `.data` and `.grad` are views into the buffers; the
    model must not replace them (no zero_grad(set_to_none=True): use `zero_grad` here).
    """

    def __init__(self, params: list[nn.Parameter], mesh: Mesh, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 overlap: bool = True, deferred: list[nn.Parameter] = (), tail_buckets: int = 1):
        self.mesh, self.overlap, self.tail_buckets = mesh, overlap, tail_buckets
        self._deferred = {id(p) for p in deferred}
        self.param_buffers: dict[torch.dtype, Tensor] = {}
        self.grad_buffers: dict[torch.dtype, Tensor] = {}
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        order = [p for p in reversed(params) if id(p) not in self._deferred]  # backward order: the last
        order += [p for p in reversed(params) if id(p) in self._deferred]  # layers' gradients come first
        for p in order:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, group in by_dtype.items():
            self._build(dtype, group, bucket_size)
        self._sync_enabled = True
        self._next = 0  # index of the next bucket to launch
        self._synced = False
        self._gathering: list[tuple[Bucket, object]] = []  # param all-gathers in flight, in issue order
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params
                       if id(p) not in self._deferred] if overlap else []

    @torch.no_grad()
    def _build(self, dtype: torch.dtype, params: list[nn.Parameter], bucket_size: int) -> None:
        first_deferred = next((i for i, p in enumerate(params) if id(p) in self._deferred), None)
        plan = plan_buckets([p.numel() for p in params], bucket_size, self.mesh.dp, first_deferred,
                            self.tail_buckets)
        total = plan[-1][1]
        device = params[0].device
        data = torch.zeros(total, dtype=dtype, device=device)
        grad = torch.zeros(total, dtype=dtype, device=device)
        for start, end, members in plan:
            ps, offsets, offset = [params[i] for i in members], [], start
            for p in ps:
                n = p.numel()
                data[offset:offset + n].copy_(p.data.flatten())
                p.data = data[offset:offset + n].view_as(p)
                p.grad = grad[offset:offset + n].view_as(p)
                offsets.append(offset - start)
                offset += n
            bucket = Bucket(len(self.buckets), ps, offsets, start, end, data, grad, self.mesh)
            self.buckets.append(bucket)
            self._bucket_of.update({id(p): bucket for p in ps})
        self.param_buffers[dtype], self.grad_buffers[dtype] = data, grad

    def pieces(self) -> dict[int, Piece]:
        """This rank's piece of every parameter, by id(param)."""
        return {id(pc.param): pc for b in self.buckets for pc in b.pieces}

    # ---- gradient synchronisation

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate (every micro-batch but the last)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[id(p)]
        if bucket.index < self._next:
            raise RuntimeError(
                "a gradient arrived after its bucket was reduce-scattered: run the backward of every "
                "micro-batch but the last inside no_sync(), and zero_grad() after each step"
            )
        bucket.ready.add(id(p))
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                break
            b.start_grad_reduce()
            self._next += 1

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet and wait for all: each rank's grad shards hold dp means.

        Idempotent until the next zero_grad, so the optimizer can call it for a trainer that did not.
        """
        if self._synced:
            return
        for b in self.buckets[self._next:]:
            b.start_grad_reduce()
        self._next = len(self.buckets)
        for b in self.buckets:
            if b.work is not None:
                b.pending.wait(b.work)
                b.work = b.pending = None
        self._synced = True

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the updated shards into every rank's full parameters (all buckets in flight at once)."""
        self.start_param_gather()
        self.wait_param_gather()

    @torch.no_grad()
    def start_param_gather(self) -> None:
        """Launch every bucket's all-gather, the forward's first bucket (the highest index) first."""
        self.wait_param_gather()  # a gather still in flight would race the new one on the same buffer
        for b in reversed(self.buckets):
            w = b.start_param_gather()
            if w is not None:
                self._gathering.append((b, w))

    def wait_param_gather(self, buckets: set[int] | None = None) -> None:
        """Wait until the given buckets (indices; None: all) hold the gathered parameters.

        Gathers complete in issue order, so it waits for everything issued before them as well:
        the wait never skips a bucket a caller may read next.
        """
        while self._gathering:
            if buckets is not None and not buckets.intersection(b.index for b, _ in self._gathering):
                return
            _, (pending, work) = self._gathering.pop(0)
            pending.wait(work)

    def bucket_index(self, p: nn.Parameter) -> int:
        return self._bucket_of[id(p)].index

    def zero_grad(self) -> None:
        for g in self.grad_buffers.values():
            g.zero_()
        for b in self.buckets:
            b.ready.clear()
        self._next, self._synced = 0, False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
