"""Apply tensor (+ sequence) parallelism to the one GPT, from outside it.

Two steps, torchtitan style:

1. `TPLayerFactory` is handed to `GPT(cfg, factory)`: every layer the model asks for by role
   comes back parallel ("column" -> ColumnParallelLinear, "row" -> RowParallelLinear,
   "head" -> vocab-padded ColumnParallelLinear, "vocab" -> VocabParallelEmbedding,
   "position" -> replicated, sliced per rank under SP).
2. `parallelize(model, factory)` finishes what construction cannot: it zeroes the vocab
   padding (the model's init draws every row), marks replicated parameters whose gradient
   each rank holds only in part, and, for parallel blocks that expose the `branch_in` /
   `branch_out` regions, moves the collectives of attention and MLP into ONE all-gather
   (or copy) of their common input and ONE reduce-scatter (or all-reduce) of their summed
   output, as MegaScale does to take collectives off the critical path.

Sequence parallelism (Korthikanti et al. 2022): between blocks each rank holds 1/tp of the
sequence, so norms, dropout and the residual stream cost 1/tp of the memory. Column layers
all-gather the sequence on entry and row layers reduce-scatter it on exit: the same bytes as
plain TP's all-reduce (all-reduce = reduce-scatter + all-gather), in a different place.

`overlap_chunks` > 0 (parallel.tp_overlap): the column and row layers pipeline those
collectives with their GEMMs in chunks (overlap.py); the fused parallel block keeps its one
all-gather and one reduce-scatter in place, or with `overlap_branches` (parallel.
tp_overlap_branches) runs them under its MLP's own rows (branches.py: gloo's direct sends and no
residual dropout only).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from megascale.config import ConfigError, ModelConfig
from megascale.model.factory import EMBEDDING_STYLES, LINEAR_STYLES, Dropout, LayerFactory
from megascale.ops.cross_entropy import vocab_parallel_chunked_cross_entropy
from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor import branches, comm
from megascale.parallel.tensor.flight import overlap_settings
from megascale.parallel.tensor.layers import (
    INPUT_MODES,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelPositions,
    VocabParallelEmbedding,
    mark,
    zero_padding,
)
from megascale.parallel.tensor.loss import vocab_parallel_cross_entropy


def check_tp(cfg: ModelConfig, mesh: Mesh, sequence_parallel: bool) -> None:
    """The model shapes tensor parallelism needs, as ConfigErrors naming the fields."""
    tp = mesh.tp
    if cfg.n_heads % tp:
        raise ConfigError(
            f"parallel.tp: {tp} ranks do not split model.n_heads={cfg.n_heads} into whole heads"
        )
    if cfg.ffn_dim % tp:
        raise ConfigError(f"parallel.tp: {tp} ranks do not split the MLP width {cfg.ffn_dim} (model.d_ff)")
    if sequence_parallel and cfg.seq_len % tp:
        raise ConfigError(
            f"parallel.sequence_parallel: model.seq_len={cfg.seq_len} does not split over parallel.tp={tp}"
        )


class TPLayerFactory(LayerFactory):
    """Builds the tensor-parallel layers for one mesh; the model never learns its rank.

    overlap_chunks: chunks per overlapped GEMM (0: off); overlap_impl: parallel.tp_overlap_impl for a
    model on `device` (symm_mem.py); overlap_branches: parallel.tp_overlap_branches (branches.py). When
    on, construction creates the overlap's process group, so every rank must build its factory, in the
    same order.
    """

    def __init__(self, mesh: Mesh, sequence_parallel: bool = False, overlap_chunks: int = 0,
                 overlap_impl: str = "chunked", device: torch.device | str = "cpu",
                 overlap_branches: bool = False):
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel and mesh.tp > 1
        self.overlap = overlap_settings(mesh, overlap_chunks, overlap_impl, device)
        self.overlap_branches = overlap_branches

    def linear(self, in_features: int, out_features: int, bias: bool, style: str) -> nn.Module:
        if style not in LINEAR_STYLES:
            raise ValueError(f"linear style must be one of {LINEAR_STYLES}, got {style!r}")
        if style == "row":
            mode = "reduce_scatter_seq" if self.sequence_parallel else "reduce"
            return RowParallelLinear(in_features, out_features, bias, self.mesh, output_mode=mode,
                                     overlap=self.overlap)
        mode = "gather_seq" if self.sequence_parallel else "copy"
        return ColumnParallelLinear(in_features, out_features, bias, self.mesh, input_mode=mode,
                                    pad=style == "head", overlap=self.overlap)

    def embedding(self, num_embeddings: int, dim: int, style: str = "vocab") -> nn.Module:
        if style not in EMBEDDING_STYLES:
            raise ValueError(f"embedding style must be one of {EMBEDDING_STYLES}, got {style!r}")
        if style == "vocab":
            sp = self.sequence_parallel
            return VocabParallelEmbedding(num_embeddings, dim, self.mesh, sequence_parallel=sp)
        if self.sequence_parallel:
            return SequenceParallelPositions(num_embeddings, dim, self.mesh)
        return nn.Embedding(num_embeddings, dim)

    def cross_entropy(self, vocab_size: int, ignore_index: int = -1):
        """The loss over the head's vocab-parallel logits: (tokens, V/tp), (tokens,) -> mean."""

        def loss(logits: Tensor, targets: Tensor) -> Tensor:
            return vocab_parallel_cross_entropy(logits, targets, self.mesh, vocab_size, ignore_index)

        return loss

    def fused_cross_entropy(self, vocab_size: int, ignore_index: int = -1):
        """model.fused_ops: the vocab-parallel head and loss chunked over tokens (ops/cross_entropy.py).

        The head's input stage (copy, or the sequence all-gather under SP) runs here as the head
        would run it; its backward sums the loss's partial input gradient over tp."""

        def loss(hidden: Tensor, head: nn.Module, targets: Tensor) -> Tensor:
            x = INPUT_MODES[head.input_mode](hidden, self.mesh)
            return vocab_parallel_chunked_cross_entropy(x.flatten(0, 1), head.weight, targets.flatten(),
                                                        self.mesh, vocab_size, ignore_index)

        return loss


class BranchIn(nn.Module):
    """Entry of a region shared by several column layers: one all-gather (SP) or one copy."""

    def __init__(self, mesh: Mesh, sequence_parallel: bool):
        super().__init__()
        self.mesh, self.sequence_parallel = mesh, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return comm.gather_seq(x, self.mesh) if self.sequence_parallel else comm.copy_to_tp(x, self.mesh)


class BranchOut(nn.Module):
    """Exit of a region whose row layers' partial sums were added: one reduce-scatter or all-reduce."""

    def __init__(self, mesh: Mesh, sequence_parallel: bool):
        super().__init__()
        self.mesh, self.sequence_parallel = mesh, sequence_parallel

    def forward(self, y: Tensor) -> Tensor:
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(y, self.mesh)
        return comm.reduce_from_tp(y, self.mesh)


def parallelize(model: nn.Module, factory: TPLayerFactory, fuse_parallel_block: bool = True) -> nn.Module:
    """Finish a GPT built with `factory` (see the module docstring); returns the model."""
    mesh, sp = factory.mesh, factory.sequence_parallel
    check_tp(model.cfg, mesh, sp)
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            zero_padding(m.weight, 0, m.weight.tp_full_size, mesh)
    for p in model.parameters():
        if not hasattr(p, "tp_split_dim"):  # replicated: partial gradients only on SP's sequence slices
            mark(p, None, p.shape[0] if p.ndim else 1, partial_grad=sp)
    for block in getattr(model, "blocks", ()) if mesh.tp > 1 else ():
        if fuse_parallel_block and getattr(block, "parallel", False) and hasattr(block, "branch_in"):
            fuse_branches(block, mesh, sp)  # its dropout acts on full-sequence partial sums: replicated
            if factory.overlap_branches and branches.applies(block, factory.overlap, sp):  # under its MLP
                block.branch_schedule = functools.partial(branches.overlapped_branches, ov=factory.overlap,
                                                          tp=mesh.tp)
        elif sp:
            if factory.overlap is None:  # with overlap qkv gathers itself, under its own GEMM
                gather_before_attention(block.attn, mesh)
            mark_dropout_split(block)  # the branch outputs are reduce-scattered: 1/tp of the sequence
    for block in getattr(model, "blocks", ()) if mesh.tp > 1 else ():
        if getattr(block.mlp, "fused_bias_gelu", False):
            gather_before_mlp(block.mlp, mesh)
    if sp and getattr(model, "embed", None) is not None:
        mark_dropout_split(model.embed)  # the embedding is reduce-scattered too
    return model


def mark_dropout_split(module: nn.Module) -> None:
    """The residual-stream dropout of `module` holds this rank's 1/tp of the sequence (SP): its masks
    must differ per tp rank (Megatron's rule; see megascale/parallel/rng.py). Attention-probability
    dropout is split already (this rank's heads)."""
    for m in module.modules():
        if isinstance(m, Dropout):
            m.dropout_split = True


def gather_before_attention(attn: nn.Module, mesh: Mesh) -> None:
    """Under SP, all-gather the sequence at the attention module's entry, not inside qkv.

    Attention.forward reads (batch, seq) from its input to shape q, k, v; with the gather
    inside the qkv layer it would see the 1/tp slice and mis-shape the heads. Gathering on
    entry is the same collective at the same point (qkv takes its input as is).
    """
    attn.qkv.input_mode = "none"
    attn.register_forward_pre_hook(lambda module, args: (comm.gather_seq(args[0], mesh), *args[1:]))


def gather_before_mlp(mlp: nn.Module, mesh: Mesh) -> None:
    """model.fused_ops: fc_in's input stage (copy or sequence all-gather) at the MLP's entry.

    The fused GeLU MLP runs fc_in's matmul itself, without the bias, and adds the bias inside the
    fused GeLU (model/mlp.py); the collective fc_in would run on entry runs here instead, the
    same one at the same point. Nothing to do where a shared region brings the input in already.
    """
    mode = mlp.fc_in.input_mode
    if mode != "none":
        mlp.fc_in.input_mode = "none"
        mlp.register_forward_pre_hook(lambda module, args: (INPUT_MODES[mode](args[0], mesh), *args[1:]))


def fuse_branches(block: nn.Module, mesh: Mesh, sequence_parallel: bool) -> None:
    """One collective in, one out, for the parallel block  y = x + out(Attn(N1 h) + MLP(N2 h)), h = in(x).

    The column layers then take their input as is and the row layers return partial sums.
    The norms run on the gathered (or copied) input and only see the gradient of this rank's
    heads / MLP slice, so their gradients are partial and summed over tp.
    """
    block.branch_in = BranchIn(mesh, sequence_parallel)
    block.branch_out = BranchOut(mesh, sequence_parallel)
    for m in block.modules():
        if isinstance(m, ColumnParallelLinear):
            m.input_mode = "none"
        elif isinstance(m, RowParallelLinear):
            m.output_mode = "none"
    for norm in (block.norm1, block.norm2):
        for p in norm.parameters():
            p.tp_partial_grad = True


def tp_loss(model: nn.Module, factory: TPLayerFactory, idx: Tensor, targets: Tensor) -> Tensor:
    """The GPT's training loss under TP: body, vocab-parallel head, vocab-parallel cross-entropy.

    What GPT.forward(idx, targets) does, with the loss taken from the factory; it becomes
    GPT.forward itself once the model asks its factory for the loss (see the report).
    """
    logits = model.head(model.body(idx))
    return factory.cross_entropy(model.cfg.vocab_size)(logits.flatten(0, 1), targets.flatten())
