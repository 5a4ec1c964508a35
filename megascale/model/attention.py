"""Causal self-attention with a fused qkv projection; full or sliding-window.

The qkv projection's output features are ordered (head, [q, k, v], head_dim) (see
factory.py), so a column-parallel shard holds whole heads. Shapes use -1 for the head count:
under tensor parallelism this module runs unchanged on its local heads.

The attention-probability dropout is a dropout site of its own (see factory.py): a split
region, since each tp rank holds different heads, so its mask differs per tp rank.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from megascale.config import ModelConfig
from megascale.model.factory import LayerFactory, current_stream, forked_rng
from megascale.model.rotary import Rotary
from megascale.ops.attention import causal_attention, sliding_window_attention
from megascale.ops.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, factory: LayerFactory, rotary: Rotary | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.window = cfg.window if cfg.attention == "sliding" else 0
        self.dropout = cfg.dropout
        self.dropout_site = 0  # named by name_dropout_sites
        self.dropout_split = True  # this rank's heads
        self.qkv = factory.linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias, style="column")
        self.proj = factory.linear(cfg.d_model, cfg.d_model, bias=cfg.bias, style="row")
        # One Rotary shared by all layers (named_modules/named_buffers list it once); a
        # pipeline stage holding only some blocks still carries it along.
        self.rotary = rotary
        self.fused_rotary = cfg.fused_ops  # Rotary's arithmetic as one op (megascale/ops/rotary.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        # The shape comes from qkv's output, not from x: under sequence parallelism x holds
        # 1/tp of the sequence and the column-parallel qkv gathers the rest.
        b, s = qkv.shape[:2]
        # (b, s, heads, 3*hd) split into three (b, heads, s, hd) views: no copy before the kernel,
        # and the backward of split is one cat straight into the qkv gradient's layout.
        qkv = qkv.view(b, s, -1, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))
        if self.rotary is not None and self.fused_rotary:
            cos, sin = self.rotary.cos[:s], self.rotary.sin[:s]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        dropout = self.dropout if self.training else 0.0
        stream = current_stream() if dropout else None
        # SDPA draws its mask from the default generator: fork it to this site's seed.
        seed = stream.seed(self.dropout_site, self.dropout_split) if stream else None
        with forked_rng(q.device, seed) if stream else nullcontext():
            if self.window:
                y = sliding_window_attention(q, k, v, self.window, dropout)
            else:
                y = causal_attention(q, k, v, dropout)
        # SDPA returns (b, heads, s, hd) laid out as (b, s, heads, hd): this reshape is a view.
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))
