"""One transformer layer: sequential (GPT-2) or parallel (GPT-J, PaLM, MegaScale) block.

sequential:  h = x + Attn(LN1 x);  y = h + MLP(LN2 h)
parallel:    y = x + Attn(LN1 x) + MLP(LN2 x)

The parallel block removes the dependency of the MLP on the attention output, so the two
branches (and, under tensor parallelism, their communication) can overlap; MegaScale
reports it as one of its efficiency changes at no loss of quality at scale.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megascale.config import ModelConfig
from megascale.model.attention import Attention
from megascale.model.factory import DropoutStream, LayerFactory, current_stream, dropout, use_stream
from megascale.model.mlp import GeluMLP, SwiGLU
from megascale.model.rotary import Rotary
from megascale.ops.norms import add_norm


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (bias per cfg.bias) for the GPT style, RMSNorm for the Llama style."""
    if cfg.style == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, factory: LayerFactory, rotary: Rotary | None = None):
        super().__init__()
        self.parallel = cfg.block == "parallel"
        self.fused = cfg.fused_ops
        # add_norm reads norm2's weights without calling it: DP's parameter gather waits for them here
        self.reads_child_weights = ("norm2",) if cfg.fused_ops else ()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg, factory, rotary)
        self.norm2 = make_norm(cfg)
        self.mlp = SwiGLU(cfg, factory) if cfg.style == "llama" else GeluMLP(cfg, factory)
        # Residual dropout on each branch's output, as nanoGPT; Identity when off (no cost).
        # One site per branch: each draws its own mask (see factory.py for where they come from).
        self.drop_attn = dropout(cfg.dropout)
        self.drop_mlp = dropout(cfg.dropout)
        # The parallel block's two branches share one input and one summed output. Tensor
        # parallelism with sequence parallelism replaces these identities with ONE all-gather
        # of the shared input and ONE reduce-scatter of the summed output (MegaScale's point:
        # half the collectives of the sequential block on the critical path).
        self.branch_in = nn.Identity()
        self.branch_out = nn.Identity()
        # Or the whole of the two branches, (block, x) -> y, run as another schedule of the same
        # sums: tensor parallelism's overlap of those two collectives (parallel/tensor/branches.py)
        self.branch_schedule = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            if self.branch_schedule is not None:
                return self.branch_schedule(self, x)
            h = self.branch_in(x)
            branches = self.drop_attn(self.attn(self.norm1(h))) + self.drop_mlp(self.mlp(self.norm2(h)))
            return x + self.branch_out(branches)
        if self.fused:  # the residual add and norm2 in one op (megascale/ops/norms.py): same h, same norm
            h, y = add_norm(x, self.drop_attn(self.attn(self.norm1(x))), self.norm2)
            return h + self.drop_mlp(self.mlp(y))
        h = x + self.drop_attn(self.attn(self.norm1(x)))
        return h + self.drop_mlp(self.mlp(self.norm2(h)))


def _replay(block: nn.Module, x: torch.Tensor, stream: DropoutStream) -> torch.Tensor:
    with use_stream(stream):
        return block(x)


def run_block(block: nn.Module, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """block(x), under activation recomputation if asked, drawing the forward's dropout masks.

    The recomputation runs in backward, after the micro-batch's dropout stream is out of use:
    the stream goes to the checkpointed function as an argument and is put back there, so the
    replay draws the same masks. With no stream, torch.utils.checkpoint replays the global
    generator itself (its preserve_rng_state).

    The replay stops once the tensors backward needs are back (torch.utils.checkpoint's early stop:
    the block's last GEMM is not redone: 7-9% of a recomputed step of the CPU default model), except
    in a block whose forward issues a collective in one autograd function and waits for it in a later
    one (the fused block's schedule, parallel/tensor/branches.py): cut between the two, the exchange
    stayed posted and never waited, and gloo matched a later exchange with the same peer and tag
    against it (a tp2 recompute run hung in step 0). There the replay runs to the block's end. (The
    chunked layers of overlap.py issue and wait inside one function: a stop never falls between.)
    """
    if not recompute:
        return block(x)
    stream = current_stream()
    whole = getattr(block, "branch_schedule", None) is not None
    with set_checkpoint_early_stop(not whole):  # (read when the forward runs; it holds for the replay)
        if stream is None:
            return checkpoint(block, x, use_reentrant=False)
        return checkpoint(_replay, block, x, stream, use_reentrant=False)
