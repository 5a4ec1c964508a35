"""Pipeline stages: the layer list cut into pp x vpp chunks, and the part of the GPT one rank holds.

Partitioning: the n_layers blocks are cut into S = pp * vpp contiguous virtual stages whose
sizes differ by at most one (the first n_layers % S get the extra layer, np.array_split's
rule: the last stage also carries the final norm, the LM head and the loss, so it should
not get more). Virtual stage s lives on rank s % pp as its chunk s // pp (Megatron's
interleaving: chunk c of rank r is virtual stage c * pp + r). The embedding belongs to
virtual stage 0 (rank 0, chunk 0), the final norm, head and loss to stage S - 1 (the last
rank, its last chunk).

`PipelineStage` is built from the GPT config and instantiates only what its rank owns: the
blocks are registered under their *global* layer index, so the stage's state-dict keys are
exactly the one-process GPT's keys for those parts. Loading a full state dict is picking
keys; gathering one back is merging the stages' dicts.

Tied embeddings with pp > 1: the token embedding (first stage) and the LM head (last
stage) are two copies of one matrix, kept equal as Megatron does with its embedding
group: the copies start equal (broadcast at construction) and their gradients are summed
over the pair after every backward, so both get the one-process gradient and the same
update. The grad-norm reducer counts the head's copy zero times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.config import ConfigError, ModelConfig, ParallelConfig
from megascale.model.block import Block, make_norm, run_block
from megascale.model.factory import LayerFactory, name_dropout_sites
from megascale.model.gpt import GPT, IGNORE_INDEX, Embedding, check_model_config
from megascale.model.rotary import Rotary
from megascale.observe import timers
from megascale.parallel.mesh import Mesh
from megascale.parallel.pipeline.schedule import SCHEDULES
from megascale.parallel.tensor.grads import grad_norm_reducer, sync_partial_grads
from megascale.parallel.tensor.state import full_state_dict, load_full_state_dict


def partition(n_layers: int, pp: int, vpp: int = 1) -> list[range]:
    """The global layer indices of each virtual stage 0 .. pp * vpp - 1 (balanced, contiguous)."""
    stages = pp * vpp
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (s < extra)
        out.append(range(start, start + size))
        start += size
    return out


def rank_chunks(n_layers: int, pp: int, vpp: int, rank: int) -> list[range]:
    """The layers of each chunk of one pipeline rank: chunk c is virtual stage c * pp + rank."""
    stages = partition(n_layers, pp, vpp)
    return [stages[c * pp + rank] for c in range(vpp)]


def num_microbatches(global_batch: int, micro_batch: int, dp: int) -> int:
    return global_batch // (micro_batch * dp)


def default_schedule(parallel: ParallelConfig) -> str:
    return "interleaved" if parallel.vpp > 1 else "1f1b"


def check_pipeline(model: ModelConfig, parallel: ParallelConfig, microbatches: int, schedule: str) -> None:
    """The layouts the pipeline can run, as ConfigErrors naming the field and the reason."""
    pp, vpp = parallel.pp, parallel.vpp
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule: must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"parallel.vpp: {vpp} virtual stages need parallel.pp > 1 (interleaving is "
                          "across pipeline ranks)")
    if vpp > 1 and schedule == "1f1b":
        raise ConfigError(f"parallel.vpp: {vpp} chunks per rank need the interleaved schedule, not 1f1b")
    if vpp == 1 and schedule == "interleaved":
        raise ConfigError("parallel.vpp: the interleaved schedule needs parallel.vpp > 1")
    if parallel.pp_warmup_ahead and pp > 1 and schedule != "1f1b":
        raise ConfigError(f"parallel.pp_warmup_ahead: {parallel.pp_warmup_ahead} is for the 1f1b schedule, "
                          f"not {schedule} (afab runs every forward first; the interleaved warm-up already "
                          "runs ahead, as Megatron's does)")
    if model.n_layers < pp * vpp:
        raise ConfigError(f"model.n_layers: {model.n_layers} layers do not fill parallel.pp * parallel.vpp = "
                          f"{pp * vpp} virtual stages (each needs at least one layer)")
    what = (f"{microbatches} micro-batches per step (train.global_batch / (train.micro_batch x "
            f"parallel.dp))")
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(f"train.global_batch: {what} are fewer than parallel.pp={pp} stages; 1F1B needs "
                          "at least one micro-batch per stage")
    if schedule == "interleaved" and (microbatches < pp or microbatches % pp):
        raise ConfigError(f"train.global_batch: {what} are not a multiple of parallel.pp={pp}, as the "
                          "interleaved schedule requires (micro-batches run in groups of pp)")


class Layers(nn.Module):
    """The blocks a rank holds, registered under their global layer index.

    An nn.ModuleList would name them 0, 1, ...; the global index makes the stage's state-dict
    keys the one-process GPT's ("blocks.5.attn.qkv.weight"), so no key mapping is needed.
    """

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i, block in blocks.items():
            self.add_module(str(i), block)

    def __getitem__(self, i: int) -> nn.Module:
        return self._modules[str(i)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class PipelineStage(nn.Module):
    """One pipeline rank's chunks of the GPT: forward_chunk(c, x) runs virtual stage c * pp + rank.

    Only the owned parts are built. Initialised with the GPT's rule (same distributions,
    not the same draws as one process: load a full state dict for that). Every rank of the
    mesh must construct its stage together: with tied embeddings and pp > 1 the
    constructor creates the embedding groups and broadcasts the first stage's matrix.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, vpp: int = 1, factory: LayerFactory | None = None):
        super().__init__()
        check_model_config(cfg)
        factory = factory or LayerFactory()
        self.cfg, self.mesh, self.vpp = cfg, mesh, vpp
        pp, rank = mesh.pp, mesh.pp_rank
        self.chunk_layers = rank_chunks(cfg.n_layers, pp, vpp, rank)
        self.first_chunk = 0 if mesh.is_first_stage else None  # the chunk holding the embedding
        self.last_chunk = vpp - 1 if mesh.is_last_stage else None  # the chunk holding norm, head, loss
        self.loss_fn = factory.cross_entropy(cfg.vocab_size, IGNORE_INDEX)
        self.fused_loss_fn = (factory.fused_cross_entropy(cfg.vocab_size, IGNORE_INDEX) if cfg.fused_ops
                              else None)  # model.fused_ops: as GPT.forward
        self.embed = Embedding(cfg, factory) if mesh.is_first_stage else None
        rotary = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta) if cfg.style == "llama" else None
        self.blocks = Layers({i: Block(cfg, factory, rotary) for layers in self.chunk_layers for i in layers})
        self.norm = make_norm(cfg) if mesh.is_last_stage else None
        self.head = factory.linear(cfg.d_model, cfg.vocab_size, bias=False, style="head") \
            if mesh.is_last_stage else None
        # tied: this rank holds one of two copies of the tied matrix (first or last stage, pp > 1)
        self.tied = cfg.tie_embeddings and pp > 1 and (mesh.is_first_stage or mesh.is_last_stage)
        if cfg.tie_embeddings and pp == 1:
            self.head.weight = self.embed.tok.weight
        name_dropout_sites(self)  # the GPT's names ("blocks.<global index>..."), so the GPT's masks
        GPT.init_weights(self)  # the GPT's rule reads only cfg, modules() and named_parameters()
        self.embedding_group = mesh.emb_group if cfg.tie_embeddings and pp > 1 else None
        if self.tied:
            with torch.no_grad():
                dist.broadcast(self.tied_weight(), src=mesh.rank_at(mesh.dp_rank, 0, mesh.tp_rank),
                               group=self.embedding_group)

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.mesh.pp + self.mesh.pp_rank

    def forward_chunk(self, chunk: int, x: Tensor, targets: Tensor | None = None) -> Tensor:
        """Token ids (first chunk) or hidden states -> hidden states, or the mean loss (last chunk)."""
        if chunk == self.first_chunk:
            x = self.embed(x)
        recompute = self.cfg.recompute and torch.is_grad_enabled()
        for i in self.chunk_layers[chunk]:
            x = run_block(self.blocks[i], x, recompute)
        if chunk != self.last_chunk:
            return x
        if self.fused_loss_fn is not None:
            return self.fused_loss_fn(self.norm(x), self.head, targets)
        logits = self.head(self.norm(x))
        return self.loss_fn(logits.flatten(0, 1), targets.flatten())

    # -----------------------------------------------------------------------------------
    # Gradients

    def tied_weight(self) -> Tensor:
        """This rank's copy of the tied matrix: the embedding on the first stage, the head on the last."""
        return self.embed.tok.weight if self.embed is not None else self.head.weight

    @torch.no_grad()
    def finish_grads(self) -> None:
        """After the schedule's backwards: sum TP partial gradients, then the tied copies' gradients.

        With the distributed optimizer call only `finish_tied_grads`: its finish_grad_sync sums the
        TP partial gradients itself (on its shard).
        """
        sync_partial_grads(self, self.mesh)
        self.finish_tied_grads()

    @torch.no_grad()
    def finish_tied_grads(self) -> None:
        """Sum the gradients of the two copies of a tied matrix (first and last stage); else nothing.

        Under the distributed optimizer this must run before its reduce-scatter over dp: the two
        copies lie at different places of their stages' buckets, so only whole gradients line up.
        """
        if self.tied:
            w = self.tied_weight()
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            with timers.comm("all_reduce", "pp", "emb", nbytes=w.grad.numel() * w.grad.element_size()):
                self.mesh.all_reduce(w.grad, self.embedding_group)

    def norm_duplicates(self) -> list[Tensor]:
        """Parameters a global grad norm must not count: the head's copy of a tied matrix."""
        return [self.head.weight] if self.tied and self.head is not None else []

    def grad_norm_reducer(self, params: Iterable[Tensor]) -> Callable[[Tensor], Tensor]:
        """For clip_grad_norm_(params, ..., norm_reducer=...): each parameter of the model counted once.

        Stages hold disjoint parameters (summed over the mp group by the TP reducer, which also
        counts tp-replicated ones once); the head's copy of a tied matrix is left out.
        """
        params = list(params)
        inner = grad_norm_reducer(params, self.mesh)
        duplicates = {id(p) for p in self.norm_duplicates()}

        def reduce(sq: Tensor) -> Tensor:  # the entries follow the parameters that have a gradient now
            keep = [id(p) not in duplicates for p in params if p.grad is not None]
            return inner(sq * torch.tensor(keep, dtype=sq.dtype, device=sq.device))

        return reduce


# ---------------------------------------------------------------------------------------
# Full (one-process) state dict <-> stages


def load_stage_state_dict(stage: PipelineStage, full: dict[str, Tensor]) -> None:
    """Copy the one-process GPT's state dict into the stage (its keys only; TP shards cut on the way)."""
    own = stage.state_dict().keys()
    missing = own - full.keys()
    if missing:
        raise KeyError(f"full state dict lacks the stage's {sorted(missing)}")
    load_full_state_dict(stage, {k: full[k] for k in own}, stage.mesh)


def gather_stage_state_dict(stage: PipelineStage) -> dict[str, Tensor]:
    """The one-process GPT's state dict, gathered over tp then pp; every rank of the mp group gets it.

    Objects travel through all_gather_object: meant for parity checks and small exports;
    large checkpoints are written per rank (torch.distributed.checkpoint).
    """
    local = full_state_dict(stage, stage.mesh)
    if stage.mesh.pp == 1:
        return local
    parts: list[dict[str, Tensor] | None] = [None] * stage.mesh.pp
    dist.all_gather_object(parts, local, group=stage.mesh.pp_group)
    out: dict[str, Tensor] = {}
    for part in parts:
        out.update(part)
    return out
