"""The distributed optimizer (ZeRO-2 style): each DP rank updates only its shard of every bucket.

How it stays the same optimizer as on one process: the unchanged optimizer classes (torch's
AdamW, our Lamb) run on *pieces*, one per parameter: the 1-D view of the part of that
parameter that lies in this rank's shard (possibly empty), with its gradient the matching
view of the reduce-scattered gradient shard. AdamW is element-wise, so pieces update exactly
as whole tensors would. What is not element-wise goes through the optimizers' hooks:

* LAMB's trust ratio needs ||p|| and ||u|| of whole tensors. Lamb hands its (2, n) local
  squared norms, one column per adapted piece, to `norm_reducer`; every rank lists the same
  tensors in the same order (empty pieces included), so the reducer sums the matrix over
  dp (disjoint pieces of each tensor) and then, for tp-split tensors only, over tp (their
  tp pieces are disjoint too; tp-replicated ones are already whole on each tp rank).
* Global grad-norm clipping sums squared piece norms: over dp (disjoint shards), counting
  tp-replicated tensors on tp rank 0 only, then over the model-parallel (tp x pp) group.

The parameter shard is itself the master copy: params are fp32 (or fp64 in the strict
tests; autocast keeps no low-precision weights), as Megatron-Core does for fp32 params,
so there is no separate master tensor. Low-precision params are refused, not silently
rounded (a seam: a fp32 master shard and fp32 main-grad shard would go here).

Weight decay and LAMB's `adapt` follow the single-process groups of `optim.param_groups`
piece by piece: a piece belongs to its parameter's group. Per-step order, as a Trainer calls it:

    opt.zero_grad()                               # zero the flat grad buffers
    for each micro-batch: with opt.no_sync() except on the last: loss.backward()
    norm = opt.clip_grad_norm_(max_norm)           # waits for the reduce-scatters, clips the shard
    opt.step()                                     # update own shard, all-gather the params
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.config import OptimConfig
from megascale.observe import timers
from megascale.optim import Lamb, clip_grad_norm_
from megascale.optim.build import param_groups
from megascale.parallel.data.buffers import DEFAULT_BUCKET_SIZE, DPBuffers, Piece
from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor.grads import is_split


class DistributedOptimizer:
    """AdamW or Lamb over this rank's shard of the model's flat buffers (see the module docstring)."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, mesh: Mesh, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 overlap_grad_reduce: bool = True, norm_exclude: Iterable[Tensor] = (),
                 overlap_param_gather: bool = False, deferred: Iterable[Tensor] = (), tail_buckets: int = 1):
        """norm_exclude: parameters the global grad norm must not count (a pipeline's second copy of a
        tied matrix, PipelineStage.norm_duplicates()); they are still updated.
        overlap_param_gather: the step launches the parameter all-gathers and returns; each module
        waits for its buckets in a forward pre-hook (call `wait_params` before reading the weights
        any other way). deferred: parameters whose gradients another collective completes after
        backward (DPBuffers). tail_buckets: the buffer's last bucket_size elements in this many
        buckets (plan_buckets)."""
        groups = param_groups(model, cfg.weight_decay)  # the single-process groups: one source of truth
        if not groups:
            raise ValueError("DistributedOptimizer: the model has no trainable parameters")
        self.params = [p for g in groups for p in g["params"]]
        for p in self.params:
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"DistributedOptimizer: parameters must be float32 or float64, got {p.dtype} "
                                "(train in bf16 with autocast, which keeps fp32 weights)")
        self.mesh, self.cfg = mesh, cfg
        self._norm_exclude = {id(p) for p in norm_exclude}
        # The buffers take the model's order, not the groups' (weights, then biases and norms): backward
        # completes gradients layer by layer from the end, so in model order a bucket is complete as
        # soon as its layers are done; in group order bucket 0 held layer 0's biases and nothing
        # could be reduce-scattered before backward ended.
        in_model_order = [p for p in model.parameters() if p.requires_grad]
        self.buffers = DPBuffers(in_model_order, mesh, bucket_size, overlap_grad_reduce, list(deferred),
                                 tail_buckets)
        self.overlap_param_gather = overlap_param_gather
        self._prefetch_hooks = []
        if overlap_param_gather:
            self._prefetch_hooks = _wait_before_use(model, self.buffers, self.wait_params)
        by_id = self.buffers.pieces()
        self.pieces: list[Piece] = [by_id[id(p)] for p in self.params]  # single-optimizer order
        self.views = [self._view(pc) for pc in self.pieces]
        index = {id(p): i for i, p in enumerate(self.params)}
        for g in groups:  # same groups, same order, each parameter replaced by its piece
            g["params"] = [self.views[index[id(p)]] for p in g["params"]]
        self.optimizer = _inner_optimizer(groups, cfg, on_cuda=self.params[0].is_cuda)
        if isinstance(self.optimizer, Lamb):
            adapted = [i for g in self.optimizer.param_groups if g["adapt"] for i in self._indices(g)]
            self.optimizer.norm_reducer = self._lamb_reducer([is_split(self.params[i]) for i in adapted])

    def _view(self, pc: Piece) -> Tensor:
        bucket = self.buffers.buckets[pc.bucket]
        view = bucket.param_shard[pc.shard_offset:pc.shard_offset + pc.numel]
        view.grad = bucket.grad_shard[pc.shard_offset:pc.shard_offset + pc.numel]
        return view

    def _indices(self, group: dict) -> list[int]:
        index = {id(v): i for i, v in enumerate(self.views)}
        return [index[id(v)] for v in group["params"]]

    # ---- the hooks that make pieces behave as whole tensors

    def _lamb_reducer(self, split: list[bool]):
        mesh = self.mesh

        def reduce(sq: Tensor) -> Tensor:
            if mesh.dp > 1:
                with timers.comm("all_reduce", "dp", "dp"):
                    mesh.all_reduce(sq, mesh.dp_group)
            if mesh.tp > 1:
                mask = torch.tensor(split, device=sq.device)
                pieces = sq * mask
                with timers.comm("all_reduce", "tp", "tp"):
                    mesh.all_reduce(pieces, mesh.tp_group)
                sq = torch.where(mask, pieces, sq)
            return sq

        return reduce

    def _grad_norm_reducer(self):
        mesh = self.mesh
        counted = torch.tensor([(is_split(p) or mesh.tp_rank == 0) and id(p) not in self._norm_exclude
                                for p in self.params])

        def reduce(sq: Tensor) -> Tensor:
            total = (sq * counted.to(sq.device)).sum()
            if mesh.dp > 1:  # the global grad norm: over the shards, then over the model-parallel ranks
                with timers.comm("all_reduce", "dp", "dp"):
                    mesh.all_reduce(total, mesh.dp_group)
            if mesh.mp_group is not None:
                with timers.comm("all_reduce", "tp", "mp"):
                    mesh.all_reduce(total, mesh.mp_group)
            return total

        return reduce

    # ---- the step

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (lr is set here, e.g. by optim.set_lr)."""
        return self.optimizer.param_groups

    def no_sync(self):
        """Context for the backward of every micro-batch but the last: accumulate, do not reduce."""
        return self.buffers.no_sync()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffers (gradients stay views into them; set_to_none is ignored)."""
        self.buffers.zero_grad()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduce-scatter, then sum partial (SP) gradients over tp, on the shard.

        Summing over tp commutes with summing over dp, and the tp ranks of one dp rank have the same
        buckets, so the partial-gradient all-reduce of tensor.grads.sync_partial_grads is done here on
        1/dp of the elements. Do not call sync_partial_grads with this optimizer.
        """
        if self.buffers._synced:
            return
        self.buffers.finish_grad_sync()
        if self.mesh.tp > 1:
            grads = [v.grad for p, v in zip(self.params, self.views, strict=True)
                     if getattr(p, "tp_partial_grad", False)]
            if grads:
                flat = torch.cat(grads)
                with timers.comm("all_reduce", "tp", "tp", nbytes=flat.numel() * flat.element_size()):
                    self.mesh.all_reduce(flat, self.mesh.tp_group)
                torch._foreach_copy_(grads, list(flat.split([g.numel() for g in grads])))

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global grad norm over the whole mesh (pre-clip), clipping the shard when max_norm > 0."""
        self.finish_grad_sync()
        return clip_grad_norm_(self.views, max_norm, norm_reducer=self._grad_norm_reducer())

    @torch.no_grad()
    def step(self) -> None:
        self.finish_grad_sync()
        self.wait_params()  # a bucket no forward used: its gather must end before its shard changes
        with timers.span("optimizer"):
            self.optimizer.step()
        # The trainer launched the step's own small collective (its loss all-reduce) before the
        # update, so these megabytes do not hold it on the wire
        self.buffers.start_param_gather()
        if not self.overlap_param_gather:  # else waited for in the next forward, module by module
            self.buffers.wait_param_gather()

    def wait_params(self, buckets: set[int] | None = None) -> None:
        """Block until the parameters (of the given buckets; None: all) hold their gathered values."""
        self.buffers.wait_param_gather(buckets)

    # ---- state

    def state_dict(self) -> dict:
        """This rank's sharded state (the inner optimizer over its pieces) and the layout it fits."""
        return {"inner": self.optimizer.state_dict(), "layout": self._layout()}

    def load_state_dict(self, state: dict) -> None:
        if state["layout"] != self._layout():
            raise ValueError("DistributedOptimizer.load_state_dict: the state was saved with another "
                             "bucket layout or dp rank; load the full state dict instead")
        self.optimizer.load_state_dict(state["inner"])

    def _layout(self) -> list:
        return [self.mesh.dp, self.mesh.dp_rank, [(pc.bucket, pc.start, pc.numel) for pc in self.pieces]]

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The single-process optimizer's state_dict (params indexed as in optim.param_groups),
        gathered over dp on every rank: one all-gather per bucket and state tensor (exp_avg, ...).
        Under tp it is the state of this tp rank's tensors (tensor.state gathers those further)."""
        inner = self.optimizer.state_dict()
        pieces = inner["state"]
        state = {i: {"step": s["step"].clone()} for i, s in pieces.items()}
        keys = [k for k in next(iter(pieces.values()), {}) if k != "step"]
        index = {id(p): i for i, p in enumerate(self.params)}
        for key in keys:
            for bucket in self.buffers.buckets:
                shard = torch.zeros_like(bucket.param_shard)
                for pc in bucket.pieces:
                    shard[pc.shard_offset:pc.shard_offset + pc.numel] = pieces[index[id(pc.param)]][key]
                full = shard
                if self.mesh.dp > 1:
                    full = torch.empty_like(bucket.param_data)
                    dist.all_gather_single(full, shard, group=self.mesh.dp_group)
                for p, off in zip(bucket.params, bucket.offsets, strict=True):
                    state[index[id(p)]][key] = full[off:off + p.numel()].view_as(p).clone()
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_full_state_dict(self, full: dict) -> None:
        """Load a single-process optimizer state dict (as `full_state_dict` returns): keep own pieces."""
        state = {}
        for i, s in full["state"].items():
            pc = self.pieces[int(i)]
            state[int(i)] = {k: (v.flatten()[pc.start:pc.start + pc.numel].clone() if k != "step" else v)
                             for k, v in s.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def _wait_before_use(model: nn.Module, buffers: DPBuffers, wait) -> list:
    """Forward pre-hooks that wait for the all-gathers of the buckets a module is about to read.

    Megatron-Core's overlap_param_gather hooks: each module waits for the parameters it owns itself
    (not its children's), so a layer's first GEMM starts as soon as its own weight is in while the
    gathers of the rest of the layer, and of later layers, run on under it. Waiting for a whole
    block at its entry instead held the first layer's forward until all of that layer's gathers
    were in: 16 ms a step in `benchmarks/overlap.py --dims dp`, against 2-3 ms per module.
    A module whose forward reads a child's weight without calling the child names that child in
    `reads_child_weights` (the fused ops: the MLP's bias + GeLU reads fc_in's, the block's add + norm
    norm2's), and waits for it too. The final norm also waits for the head: the chunked loss of
    model.fused_ops reads head.weight without calling the head.
    """
    def buckets(module: nn.Module | None, recurse: bool = False) -> set[int]:
        if module is None:
            return set()
        return {buffers.bucket_index(p) for p in module.parameters(recurse=recurse) if p.requires_grad}

    hooks = []
    for name, module in model.named_modules():
        if module is model:
            continue
        owned = buckets(module)
        for child in getattr(module, "reads_child_weights", ()):
            owned |= buckets(module.get_submodule(child), recurse=True)
        if name == "norm":
            owned |= buckets(getattr(model, "head", None), recurse=True)
        if owned:
            hooks.append(module.register_forward_pre_hook(lambda _m, _args, owned=owned: wait(owned)))
    return hooks


def _inner_optimizer(groups: list[dict], cfg: OptimConfig, on_cuda: bool) -> torch.optim.Optimizer:
    """build_optimizer's choice, over piece groups (it takes a model, ours are views)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        speed = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **speed)
    if cfg.name == "lamb":
        for g in groups:
            g["adapt"] = g["name"] == "decay"
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r} (known: adamw, lamb)")
