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

Dropout's random numbers come through here too (the second half of this file): each dropout
site of the model (a `Dropout` module, the attention-probability dropout of an `Attention`)
has a stable id from its module name, and, while a `DropoutStream` is in use (`use_stream`,
set from outside by megascale.parallel.rng.DropoutSeeds), draws its mask from the default
generator forked to the seed `stream.seed(site, split)`: a pure function of the micro-batch's
coordinates, the site and, for split regions, the tp rank. With no stream in use, dropout
draws from the global generator as plain PyTorch does. At dropout 0 the sites are
nn.Identity or skipped: nothing here runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from megascale.ops.cross_entropy import chunked_cross_entropy

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

    def fused_cross_entropy(self, vocab_size: int, ignore_index: int = -1):
        """model.fused_ops: the head's matmul and the loss in one op, chunked over tokens, that never
        holds the full logits (megascale/ops/cross_entropy.py): (hidden (b, s, d), head, targets
        (b, s)) -> mean cross-entropy, equal to cross_entropy(head(hidden), targets).

        Tensor parallelism returns the vocab-parallel chunked loss instead."""

        def loss(hidden, head, targets):
            return chunked_cross_entropy(hidden.flatten(0, 1), head.weight, targets.flatten(), ignore_index)

        return loss


# ---------------------------------------------------------------------------------------
# Dropout: sites, streams, forked generators


class DropoutStream:
    """The dropout seeds of one micro-batch's forward; the model only asks, parallel/rng.py answers.

    seed(site, split) must be a pure function: recomputation and a resumed run ask again and
    must get the same answer. split: the site's activation differs per tp rank (this rank's
    heads, or its 1/tp of the sequence), so its mask must too; otherwise it is replicated over
    tp and its mask must be the same on every tp rank.
    """

    def seed(self, site: int, split: bool) -> int:
        raise NotImplementedError


_STREAM: ContextVar[DropoutStream | None] = ContextVar("megascale_dropout_stream", default=None)


def current_stream() -> DropoutStream | None:
    return _STREAM.get()


@contextmanager
def use_stream(stream: DropoutStream | None) -> Iterator[None]:
    """Dropout inside draws its masks from `stream` (None: from the global generator)."""
    token = _STREAM.set(stream)
    try:
        yield
    finally:
        _STREAM.reset(token)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)  # torch.cuda (and xpu, mps, ... with the same API)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


@contextmanager
def forked_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block on `device`'s default generator seeded with `seed`, then restore its state.

    The default generator because SDPA's dropout reads no other; its state is put back, so the
    global stream (and torch.utils.checkpoint's replay of it) never sees these draws.
    """
    gen = _default_generator(device)
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


def site_id(name: str) -> int:
    """A dropout site's id: 64 bits of a hash of its module name (stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def name_dropout_sites(model: nn.Module) -> None:
    """Give every dropout site of `model` the id of its qualified name ("blocks.3.drop_attn").

    A pipeline stage registers its blocks under their global index, so its sites get the
    one-process GPT's ids: the masks do not depend on how the layers are cut."""
    for name, m in model.named_modules():
        if hasattr(m, "dropout_site"):
            m.dropout_site = site_id(name)


class Dropout(nn.Module):
    """nn.Dropout whose mask comes from the stream in use (see the top of this file).

    dropout_split is False (replicated over tp) unless tensor parallelism marks the region as
    holding 1/tp of the sequence (tensor.apply.parallelize).
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.dropout_site = 0
        self.dropout_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        stream = _STREAM.get()
        if stream is None:
            return F.dropout(x, self.p, True)
        with forked_rng(x.device, stream.seed(self.dropout_site, self.dropout_split)):
            return F.dropout(x, self.p, True)

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.dropout_split}"


def dropout(p: float) -> nn.Module:
    """A dropout site, or nn.Identity when p is 0 (no cost)."""
    return Dropout(p) if p > 0 else nn.Identity()

