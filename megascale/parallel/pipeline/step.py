"""Pipeline parallelism: run one training step's forwards and backwards through the stages.

One step on every rank of the mesh (dp and tp ranks too), after zero_grad:

    stage = PipelineStage(cfg.model, mesh, cfg.parallel.vpp, factory)   # once; factory: TP or None
    parallelize(stage, factory)                                          # under TP, as for the GPT
    load_stage_state_dict(stage, full)                                   # optional: one-process weights
    ...
    result = pipeline_step(stage, microbatches, micro_batch, schedule,   # forwards + backwards
                           dropout=seeds.for_step(step))                 # seeds: parallel/rng.py
    stage.finish_grads()                                                 # TP partial sums, tied copies
    clip_grad_norm_(params, max_norm, norm_reducer=stage.grad_norm_reducer(params))
    optimizer.step()                                                     # result.loss on every rank

`microbatches` is the step's list of (idx, targets), one per micro-batch; only the first
stage reads idx and only the last reads targets, so other ranks may pass None entries.
The schedule ("afab", "1f1b", "interleaved", see pipeline/schedule.py) is a list of ops per rank;
this module is the one loop that runs any of them: an F receives its input (or embeds the
tokens), runs the chunk and sends the output on (or keeps the loss); a B receives the
output's gradient (or starts from the loss), back-propagates and sends the input's gradient
back. The loss is scaled by 1 / num_microbatches before backward, as gradient accumulation
on one process does, so gradients equal one process's.

With overlap (parallel.pp_overlap, the default) the receives are posted ahead as
`schedule.recv_plan` says and sends are completed lazily (pipeline/comm.py); without, each op
receives blocking right before it runs. Either way the same ops compute the same tensors in the
same order: only when the bytes move changes, so the two give bit-identical gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.config import ParallelConfig
from megascale.observe import timers
from megascale.parallel.mesh import Mesh
from megascale.parallel.pipeline.comm import BACKWARD_TAG, FORWARD_TAG, P2P
from megascale.parallel.pipeline.schedule import Prefetch, recv_plan, schedule_ops
from megascale.parallel.pipeline.stage import PipelineStage, check_pipeline, default_schedule


@dataclass
class StepResult:
    loss: float  # mean loss over the step's micro-batches, the same on every pipeline rank
    wait_s: float  # time blocked on p2p receives (overlap: the part not hidden by compute) and final sends
    total_s: float  # wall time of the step's forwards and backwards on this rank

    @property
    def bubble(self) -> float:
        """Fraction of the step this rank idled; compare with theoretical_bubble(pp, m, vpp)."""
        return self.wait_s / self.total_s if self.total_s > 0 else 0.0


def activation_shape(stage: PipelineStage, micro_batch: int, sequence_parallel: bool) -> tuple[int, int, int]:
    """What travels between stages: (micro_batch, seq_len, d_model), seq_len / tp under SP."""
    cfg, tp = stage.cfg, stage.mesh.tp
    seq = cfg.seq_len // tp if sequence_parallel and tp > 1 else cfg.seq_len
    return micro_batch, seq, cfg.d_model


def pipeline_step(
    stage: PipelineStage,
    microbatches: Sequence[tuple[Tensor, Tensor] | None],
    micro_batch: int,
    schedule: str | None = None,
    sequence_parallel: bool = False,
    forward_context: Callable[[], AbstractContextManager] | None = None,
    dropout: Callable[[int], AbstractContextManager] | None = None,
    backward_context: Callable[[int, int], AbstractContextManager] | None = None,
    overlap: bool = True,
    ahead: int = 0,
) -> StepResult:
    """Forwards and backwards of one step on this rank; gradients accumulate in the stage's parameters.

    forward_context (e.g. the Trainer's autocast) is entered around each forward only, as the
    Trainer does on one process: backward runs outside it. dropout(i) (DropoutSeeds.for_step(step),
    megascale/parallel/rng.py) is entered around each forward of micro-batch i: its masks, which
    recomputation in the backward replays by itself. None: dropout draws from the global generator.
    backward_context(microbatch, chunk) is entered around each backward: the distributed optimizer's
    gradient sync, which reduces a chunk's buckets during that chunk's last micro-batch's backward.
    overlap (parallel.pp_overlap): receives posted ahead, sends completed lazily; False: each
    receive blocks right before its op (the baseline). ahead (parallel.pp_warmup_ahead): extra 1F1B
    warm-up forwards on every rank but the last (schedule.py).
    """
    mesh, m = stage.mesh, len(microbatches)
    pp, vpp = mesh.pp, stage.vpp
    layout = ParallelConfig(tp=mesh.tp, pp=pp, dp=mesh.dp, vpp=vpp, sequence_parallel=sequence_parallel,
                            pp_warmup_ahead=ahead)
    schedule = schedule or default_schedule(layout)
    check_pipeline(stage.cfg, layout, m, schedule)
    param = next(stage.parameters())
    comm = P2P(mesh, activation_shape(stage, micro_batch, sequence_parallel), param.dtype, param.device)
    ops = schedule_ops(schedule, pp, mesh.pp_rank, m, vpp, ahead)
    plan = recv_plan(schedule, pp, mesh.pp_rank, m, vpp, ahead=ahead) if overlap and pp > 1 else None
    streams = _Streams(comm, mesh, plan)
    last_vs = pp * vpp - 1
    inputs: dict[tuple[int, int], Tensor] = {}
    outputs: dict[tuple[int, int], Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=param.device)
    t0 = time.perf_counter()
    for i, op in enumerate(ops):
        key, vs = (op.microbatch, op.chunk), stage.virtual_stage(op.chunk)
        streams.before(i)
        if op.kind == "F":
            idx, targets = microbatches[op.microbatch] or (None, None)
            x = idx if vs == 0 else streams.receive("F").requires_grad_()
            with forward_context() if forward_context else nullcontext(), \
                    dropout(op.microbatch) if dropout else nullcontext(), \
                    timers.span("forward", micro=op.microbatch, chunk=op.chunk):
                out = stage.forward_chunk(op.chunk, x, targets if vs == last_vs else None)
            if vs == last_vs:
                loss_sum += out.detach()
                out = out / m
            else:
                streams.send(i, "F", out)
            inputs[key], outputs[key] = x, out
        else:
            x, out = inputs.pop(key), outputs.pop(key)
            grad = None if vs == last_vs else streams.receive("B")
            with backward_context(op.microbatch, op.chunk) if backward_context else nullcontext(), \
                    timers.span("backward", micro=op.microbatch, chunk=op.chunk):
                if grad is None:
                    out.backward()
                else:
                    torch.autograd.backward(out, grad.to(out.dtype))
            if vs > 0:
                streams.send(i, "B", x.grad)
    comm.flush()
    total_s = time.perf_counter() - t0
    if pp > 1:  # every rank reports the step's loss (logging happens on rank 0, the first stage)
        with timers.comm("broadcast", "pp", "pp"):
            dist.broadcast(loss_sum, src=mesh.rank_at(mesh.dp_rank, pp - 1, mesh.tp_rank),
                           group=mesh.pp_group)
    return StepResult((loss_sum / m).item(), comm.wait_s, total_s)


class _Streams:
    """The step's two p2p streams, "F" (activations, from the previous rank, to the next) and "B"
    (gradients, the other way): blocking receives, or (with a plan) receives posted ahead."""

    def __init__(self, comm: P2P, mesh: Mesh, plan: tuple[Prefetch, ...] | None):
        self.comm, self.plan = comm, plan
        self.tag = {"F": FORWARD_TAG, "B": BACKWARD_TAG}
        self.src = {"F": mesh.pp_prev_rank, "B": mesh.pp_next_rank}
        self.dst = {"F": mesh.pp_next_rank, "B": mesh.pp_prev_rank}

    def _post(self, streams: tuple[str, ...]) -> None:
        for s in streams:
            self.comm.post(self.src[s], self.tag[s])

    def before(self, i: int) -> None:
        """Ahead of op i's wait and compute: post the receives the plan puts there."""
        if self.plan is not None:
            self._post(self.plan[i].before)

    def receive(self, s: str) -> Tensor:
        if self.plan is None:
            return self.comm.recv(self.src[s], self.tag[s])
        return self.comm.take(self.tag[s])

    def send(self, i: int, s: str, tensor: Tensor) -> None:
        if self.plan is None:
            self.comm.send(tensor, self.dst[s], self.tag[s])
            return
        self._post(self.plan[i].before_send)  # receives that come first on this channel
        self.comm.send_lazily(tensor, self.dst[s], self.tag[s])
