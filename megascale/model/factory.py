"""Layer factories: the one seam through which parallelism changes the model's layers.

The GPT never constructs an nn.Linear or nn.Embedding itself; it asks a `LayerFactory`,
naming the role each layer plays. The serial factory below returns the plain PyTorch
layers. Tensor parallelism (megascale/parallel/tensor.py) subclasses it and returns
column-/row-parallel linears and a vocab-parallel embedding, without the model changing or
ever learning its rank. The factory is only called at construction: it costs nothing per step.

Roles for `linear(..., style=...)`:

* "column": the output features may be split across ranks (qkv, MLP fc-in, SwiGLU gate+up).
  The model reshapes outputs with -1 for the head/feature count, so a shard just works.
  Fused layouts are ordered so that a contiguous split of the output features gives each
  rank whole units:
    - qkv: features ordered (head, [q, k, v], head_dim): head h owns rows
      [3*hd*h, 3*hd*(h+1)), as Megatron-LM does. Any tp dividing n_heads splits by heads.
    - SwiGLU gate+up: features ordered (ffn, [gate, up]): row 2*i is gate unit i, row 2*i+1
      its up partner. Any tp dividing ffn_dim keeps pairs together.
* "row": the input features are split across ranks and partial outputs are summed (attention
  out-projection, MLP fc-out). These are the residual-branch outputs and get the scaled init.
* "head": the LM head (vocab-parallel in TP; its weight may be tied to the token embedding).

Roles for `embedding(..., style=...)`: "vocab" (token embedding: vocab-parallel in TP) and
"position" (learned positions: replicated in TP).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

LINEAR_STYLES = ("column", "row", "head")
EMBEDDING_STYLES = ("vocab", "position")


class LayerFactory:
    """Serial layers. Subclass and override to parallelise; keep the signatures."""

    def linear(self, in_features: int, out_features: int, bias: bool, style: str) -> nn.Module:
        if style not in LINEAR_STYLES:
            raise ValueError(f"linear style must be one of {LINEAR_STYLES}, got {style!r}")
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(self, num_embeddings: int, dim: int, style: str = "vocab") -> nn.Module:
        if style not in EMBEDDING_STYLES:
            raise ValueError(f"embedding style must be one of {EMBEDDING_STYLES}, got {style!r}")
        return nn.Embedding(num_embeddings, dim)

    def cross_entropy(self, vocab_size: int, ignore_index: int = -1):
        """The loss over the head's logits: (tokens, V), (tokens,) -> mean cross-entropy.

        Tensor parallelism returns a vocab-parallel loss instead, which never gathers the
        full logits."""

        def loss(logits, targets):
            return F.cross_entropy(logits, targets, ignore_index=ignore_index)

        return loss
