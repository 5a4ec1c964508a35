"""One rank's model, optimizer and training step for any (dp, pp, tp, vpp, sequence_parallel) layout.

The Trainer's engine for every world size, so that train.py stays one readable loop: a single
process is a mesh of one (`Mesh(1, 1, 1, 0)`), for which nothing below calls torch.distributed
and nothing costs time that the plain loop would not spend. Built once per rank, after
torch.distributed and the mesh:

    engine = ParallelEngine(cfg, mesh, device, dtype, full_state)   # one-process weights (None: the seed's)
    loss = engine.forward_backward(x, y, autocast)                  # this dp rank's rows of the batch
    norm = engine.clip_grads(max_norm)                              # global norm over the mesh
    agreement = engine.start_agree(loss, signal)                    # one all-reduce: dp mean, any stop
    engine.step(); engine.zero_grad()                               # (its param all-gathers behind it)
    loss, stop_signal = engine.finish_agree(agreement)              # (engine.agree: both at once)

What is built:

* the model: the GPT (pp = 1) or this rank's PipelineStage (pp > 1), with tensor-parallel
  layers from a TPLayerFactory when tp > 1, loaded from the single-process initial weights
  (the serial GPT built with the same seed): that is what makes every layout train the
  same model as one process;
* the optimizer: the ZeRO-2 DistributedOptimizer when dp > 1, else the one-process optimizer
  with the tensor/pipeline norm reducers (LAMB's whole-tensor norms, the global grad norm).

Composition rules (each has a test through the Trainer, tests/test_trainer_parallel.py):

* The distributed optimizer sums TP sequence-parallel partial gradients in finish_grad_sync,
  so with it the pipeline runs only its tied-embedding all-reduce (PipelineStage.
  finish_tied_grads), and before the optimizer's reduce-scatter: the embedding and head
  copies sit at different places of their stages' buckets, only whole gradients line up.
* The global grad norm counts the tied matrix once: the head's copy is excluded from the
  distributed optimizer's norm as from PipelineStage.grad_norm_reducer.
* With pp > 1 the distributed optimizer reduces a chunk's buckets during that chunk's last
  micro-batch's backward (the pipeline interleaves micro-batches, so the schedule, through
  pipeline_step's backward_context, decides when a gradient is final). The tied matrix's two
  copies wait for finish_tied_grads: they sit in buckets of their own at the buffer's end.
* With parallel.dp_overlap_param_gather the step returns with the parameter all-gathers in
  flight; the model's forward pre-hooks wait for each bucket before its first use, and every
  other reader of the weights here (checkpoint chunks, evaluation, the full state dict, loading)
  calls `_weights_ready` first. Not under train.compile (a hook's wait inside a compiled graph):
  there the step gathers before it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.checkpoint.rng import rng_state, set_rng_state
from megascale.checkpoint.shards import Chunk, model_chunks, optimizer_chunks
from megascale.config import Config
from megascale.fault.inject import skips
from megascale.model import GPT
from megascale.observe import timers
from megascale.optim import Lamb, build_optimizer, clip_grad_norm_
from megascale.parallel.data.optimizer import DistributedOptimizer
from megascale.parallel.mesh import Mesh
from megascale.parallel.pipeline import (
    PipelineStage,
    activation_shape,
    gather_stage_state_dict,
    load_stage_state_dict,
    num_microbatches,
    pipeline_step,
)
from megascale.parallel.pipeline.comm import FORWARD_TAG, P2P
from megascale.parallel.rng import DropoutSeeds
from megascale.parallel.tensor.apply import TPLayerFactory, parallelize
from megascale.parallel.tensor.grads import grad_norm_reducer, lamb_norm_reducer, sync_partial_grads
from megascale.parallel.tensor.state import full_state_dict, load_full_state_dict

Autocast = Callable[[], AbstractContextManager]


def layout_of(cfg: Config) -> dict:
    """What a checkpoint's sharded state depends on: resuming needs the same values."""
    p = cfg.parallel
    out = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "vpp": p.vpp, "sequence_parallel": p.sequence_parallel}
    if p.dp > 1:
        out["dp_bucket_size"] = p.dp_bucket_size
        out["dp_tail_buckets"] = p.dp_tail_buckets
    return out


@dataclasses.dataclass
class _Agreement:
    """A started `ParallelEngine.agree`: its all-reduce in flight (work None: nothing to wait for)."""

    loss: Tensor
    stop_signal: int | None
    buf: Tensor | None = None
    pending: object = None
    work: object = None


class ParallelEngine:
    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, dtype: torch.dtype,
                 full_state: dict[str, Tensor] | None = None):
        p, t = cfg.parallel, cfg.train
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.sequence_parallel = p.sequence_parallel and mesh.tp > 1
        self.pipelined = mesh.pp > 1
        self.schedule = p.resolved_schedule
        self.micro_batch = t.micro_batch
        self.n_micro = num_microbatches(t.global_batch, t.micro_batch, mesh.dp)
        self.factory = (TPLayerFactory(mesh, self.sequence_parallel,
                                       p.tp_overlap_chunks if p.tp_overlap else 0, p.tp_overlap_impl, device,
                                       overlap_branches=p.tp_overlap_branches)
                        if mesh.tp > 1 else None)
        self.bubble = float("nan")  # this rank's idle fraction in the last step's pipeline

        self.single = mesh.world_size == 1
        if self.single:  # one process: the seed's GPT is the model, built where it runs
            model = self.model = GPT(cfg.model).to(device=device, dtype=dtype)
            if full_state is not None:
                model.load_state_dict(full_state)
        else:
            if full_state is None:  # the serial GPT of this seed, on CPU: every layout starts from it
                full_state = GPT(cfg.model).to(dtype).state_dict()
            # Initialisation draws random numbers a single process does not: keep the RNG stream
            # (dropout) where one process has it; the weights come from full_state anyway.
            rng = rng_state()
            with torch.device(device):  # under NCCL the stage's tied-weight broadcast needs device tensors
                if self.pipelined:
                    model = PipelineStage(cfg.model, mesh, p.vpp, self.factory)
                else:
                    model = GPT(cfg.model, self.factory)
            if self.factory is not None:
                parallelize(model, self.factory)
            set_rng_state(rng)
            self.model = model = model.to(dtype=dtype)
            self.load_model_state(full_state)
        if t.compile:  # each block one graph (under tp its collectives are custom ops: tensor/comm.py)
            for block in model.blocks:
                block.compile()
        self.forward = model
        # dropout masks from (seed, step, micro-batch, site, tp coordinate): resumable, layout-aware
        self.dropout = (DropoutSeeds(t.seed, mesh, micro_batches=self.n_micro) if cfg.model.dropout > 0
                        else None)
        self.tied = cfg.model.tie_embeddings

        self.params = list(self.model.parameters())
        duplicates = self.model.norm_duplicates() if self.pipelined else []
        self.distributed = mesh.dp > 1
        self.norm_reducer = None
        if self.distributed:
            tied = [self.model.tied_weight()] if self.pipelined and self.model.tied else []
            self.optimizer = DistributedOptimizer(
                self.model, cfg.optim, mesh, bucket_size=p.dp_bucket_size,
                overlap_grad_reduce=p.dp_overlap_grad_reduce, norm_exclude=duplicates,
                overlap_param_gather=p.dp_overlap_param_gather and not t.compile, deferred=tied,
                tail_buckets=p.dp_tail_buckets)
        else:
            self.optimizer = build_optimizer(self.model, cfg.optim)
            if isinstance(self.optimizer, Lamb) and mesh.tp > 1:
                self.optimizer.norm_reducer = lamb_norm_reducer(self.optimizer, mesh)
            if self.pipelined:
                self.norm_reducer = self.model.grad_norm_reducer(self.params)
            elif not self.single:
                self.norm_reducer = grad_norm_reducer(self.params, mesh)

    # ------------------------------------------------------------------ checkpoint state (shards.py)

    def model_chunks(self) -> list[Chunk]:
        """This rank's boxes of the global weights (views, not copies)."""
        self._weights_ready()
        return model_chunks(self.model, self.mesh, self.tied)

    def optimizer_chunks(self) -> list[Chunk]:
        """This rank's boxes of the global optimizer state (views, not copies)."""
        self._weights_ready()
        return optimizer_chunks(self.optimizer, self.model, self.mesh, self.tied)

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """Data-parallel replica 0's weights to the other replicas (a restore read them once)."""
        if self.mesh.dp == 1:
            return
        self._weights_ready()
        src = self.mesh.rank_at(0, self.mesh.pp_rank, self.mesh.tp_rank)
        flat = torch.cat([p.data.reshape(-1) for p in self.params])
        dist.broadcast(flat, src=src, group=self.mesh.dp_group)
        torch._foreach_copy_([p.data for p in self.params],
                             [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in self.params]),
                                                            self.params, strict=True)])

    # ------------------------------------------------------------------ weights

    def _weights_ready(self) -> None:
        """Wait for parameter all-gathers still in flight from the last step (dp_overlap_param_gather)."""
        if isinstance(getattr(self, "optimizer", None), DistributedOptimizer):  # (not built yet in __init__)
            self.optimizer.wait_params()

    def load_model_state(self, full: dict[str, Tensor]) -> None:
        """Load a one-process state dict (this rank's part of it). KeyError/ValueError/RuntimeError
        when it does not fit the model config."""
        self._weights_ready()  # a gather in flight would overwrite what is loaded
        if self.pipelined:
            load_stage_state_dict(self.model, full)
        elif self.factory is not None:
            load_full_state_dict(self.model, full, self.mesh)
        else:
            self.model.load_state_dict(full)

    def full_model_state(self) -> dict[str, Tensor] | None:
        """The one-process state dict, on CPU, on the ranks of data-parallel replica 0 (None elsewhere).

        Collective over the model-parallel ranks of replica 0: every rank must call it.
        """
        self._weights_ready()
        if self.mesh.dp_rank != 0:
            return None
        if self.single:
            return self.model.state_dict()
        if self.pipelined:
            full = gather_stage_state_dict(self.model)
        elif self.factory is not None:
            full = full_state_dict(self.model, self.mesh)
        else:
            full = self.model.state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in full.items()}

    # ------------------------------------------------------------------ the step

    def forward_backward(self, x: Tensor, y: Tensor, autocast: Autocast, step: int = 0) -> Tensor:
        """Forwards and backwards of this dp rank's rows at optimizer step `step` (0-based; it seeds
        dropout); the mean loss over them (float64, 0-dim).

        Under pp every stage gets the (last stage's) loss; under tp every tp rank computes it.
        """
        mb, n = self.micro_batch, self.n_micro
        mbs = [(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for i in range(n)]
        if self.pipelined:
            result = pipeline_step(self.model, mbs, mb, self.schedule, self.sequence_parallel,
                                   forward_context=autocast,
                                   dropout=self.dropout.for_step(step) if self.dropout else None,
                                   backward_context=self._grad_sync if self.distributed else None,
                                   overlap=self.cfg.parallel.pp_overlap,
                                   ahead=self.cfg.parallel.pp_warmup_ahead)
            self.bubble = result.bubble
            return torch.tensor(result.loss, dtype=torch.float64, device=self.device)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, (xs, ys) in enumerate(mbs):
            # the distributed optimizer reduces the gradients once, on the last micro-batch
            accumulate = self.distributed and i < n - 1
            with self.optimizer.no_sync() if accumulate else contextlib.nullcontext():
                with autocast(), self.dropout.step(step, i) if self.dropout else contextlib.nullcontext(), \
                        timers.span("forward", micro=i):
                    loss = self.forward(xs, ys)
                with timers.span("backward", micro=i):
                    (loss / n).backward()
            loss_sum += loss.detach()
        return loss_sum / n

    def _grad_sync(self, microbatch: int, chunk: int) -> AbstractContextManager:
        """Under pp: a chunk's gradients are final in its last micro-batch's backward; reduce then."""
        return contextlib.nullcontext() if microbatch == self.n_micro - 1 else self.optimizer.no_sync()

    def clip_grads(self, max_norm: float) -> Tensor:
        """Finish the gradients (TP partial sums, tied copies, dp reduce-scatter) and clip by the global
        norm; returns the pre-clip norm, the same on every rank."""
        if self.distributed:
            if self.pipelined:
                self.model.finish_tied_grads()
            return self.optimizer.clip_grad_norm_(max_norm)
        if self.pipelined:
            self.model.finish_grads()
        elif not self.single:
            sync_partial_grads(self.model, self.mesh)
        return clip_grad_norm_(self.params, max_norm, self.norm_reducer)

    def step(self) -> None:
        if self.distributed:  # it times its own update, between the reduce-scatter and the all-gather
            self.optimizer.step()
            return
        with timers.span("optimizer"):
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.distributed:
            self.optimizer.zero_grad()  # the flat buffers stay; gradients are views into them
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def agree(self, loss: Tensor, stop_signal: int | None, step: int = -1) -> tuple[float, int | None]:
        """One all-reduce per step: the job's mean loss (over dp) and whether any rank was signalled.

        Every rank then stops after the same step. The loss counts once per dp replica (from its
        last stage's tp rank 0).
        """
        return self.finish_agree(self.start_agree(loss, stop_signal, step))

    def start_agree(self, loss: Tensor, stop_signal: int | None, step: int = -1) -> _Agreement:
        """`agree`'s all-reduce, launched; `finish_agree` waits for it. The trainer launches it before
        the update, so its few bytes go on the wire ahead of the parameter all-gathers the update
        launches (dp_overlap_param_gather), not behind megabytes of them."""
        if self.single:
            return _Agreement(loss, stop_signal)
        counted = self.mesh.tp_rank == 0 and self.mesh.is_last_stage
        sig = float(stop_signal or 0)
        buf = torch.stack([loss.to(torch.float64) / self.mesh.dp if counted else loss.new_zeros(()),
                           loss.new_tensor(float(stop_signal is not None)), loss.new_tensor(sig)])
        if skips("agree", step):  # an injected bug: this rank leaves the others waiting here
            return _Agreement(loss, stop_signal)
        pending = timers.launch("all_reduce", "dp", "world")
        work = dist.all_reduce(buf, async_op=True)
        pending.issued()
        return _Agreement(loss, stop_signal, buf, pending, work)

    @staticmethod
    def finish_agree(agreement: _Agreement) -> tuple[float, int | None]:
        """(the job's mean loss, the signal every rank stops for, or None) of a started `agree`."""
        if agreement.work is None:  # one process, or an injected skip
            return agreement.loss.item(), agreement.stop_signal
        agreement.pending.wait(agreement.work)
        mean, stopped, sigs = agreement.buf.tolist()
        if stopped == 0:
            return mean, None
        return mean, agreement.stop_signal or int(round(sigs / stopped))

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, samples, batches: int, autocast: Autocast) -> float:
        """Mean loss over validation micro-batches 0 .. batches-1 (the one-process set), split over dp."""
        self.model.eval()
        self._weights_ready()
        mb, mesh = self.micro_batch, self.mesh
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in range(mesh.dp_rank, batches, mesh.dp):
            seqs = samples.batch(range(b * mb, (b + 1) * mb))
            x, y = seqs[:, :-1].to(self.device), seqs[:, 1:].to(self.device)
            with autocast():
                loss = self._pipeline_loss(x, y) if self.pipelined else self.model(x, y)
            if loss is not None:
                total += loss.double()
        self.model.train()
        counted = mesh.tp_rank == 0 and mesh.is_last_stage
        if not counted:
            total.zero_()
        if not self.single:
            with timers.comm("all_reduce", "dp", "world"):
                dist.all_reduce(total)
        return total.item() / batches

    def _pipeline_loss(self, x: Tensor, y: Tensor) -> Tensor | None:
        """Forward only, through the virtual stages in order; the loss on the last stage, else None."""
        stage, mesh = self.model, self.mesh
        param = next(stage.parameters())
        shape = activation_shape(stage, x.shape[0], self.sequence_parallel)
        comm = P2P(mesh, shape, param.dtype, param.device)
        last, out = mesh.pp * stage.vpp - 1, None
        for vs in range(mesh.pp_rank, last + 1, mesh.pp):
            h = x if vs == 0 else comm.recv(mesh.pp_prev_rank, FORWARD_TAG)
            out = stage.forward_chunk(vs // mesh.pp, h, y if vs == last else None)
            if vs < last:
                comm.send(out, mesh.pp_next_rank, FORWARD_TAG)
                out = None
        comm.flush()
        return out
