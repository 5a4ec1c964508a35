"""The GPT: embeddings, a list of blocks, a final norm, the LM head and its loss.

Read top to bottom, nanoGPT style. Its structure is what the parallelisms cut along:
`embed`, `blocks` (an nn.ModuleList a pipeline splits into stages), `norm`, `head`, and the
loss; tensor parallelism comes in through the `LayerFactory`. Nothing here knows its rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megascale.config import ConfigError, ModelConfig
from megascale.model.block import Block, make_norm, run_block
from megascale.model.factory import LayerFactory, dropout, name_dropout_sites
from megascale.model.rotary import Rotary
from megascale.perf import flops

IGNORE_INDEX = -1  # targets equal to this are left out of the loss (padding)


class Embedding(nn.Module):
    """Token embedding, plus learned absolute positions in the GPT style, then dropout."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory):
        super().__init__()
        self.tok = factory.embedding(cfg.vocab_size, cfg.d_model, style="vocab")
        self.pos = (
            factory.embedding(cfg.seq_len, cfg.d_model, style="position") if cfg.style == "gpt" else None
        )
        self.drop = dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.drop(x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, factory: LayerFactory | None = None):
        super().__init__()
        check_model_config(cfg)
        self.cfg = cfg
        factory = factory or LayerFactory()
        self.loss_fn = factory.cross_entropy(cfg.vocab_size, IGNORE_INDEX)
        # model.fused_ops: head + loss chunked over tokens (never the full logits); see forward
        self.fused_loss_fn = (factory.fused_cross_entropy(cfg.vocab_size, IGNORE_INDEX) if cfg.fused_ops
                              else None)
        self.embed = Embedding(cfg, factory)
        rotary = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta) if cfg.style == "llama" else None
        self.blocks = nn.ModuleList(Block(cfg, factory, rotary) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.head = factory.linear(cfg.d_model, cfg.vocab_size, bias=False, style="head")
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight
        name_dropout_sites(self)
        self.init_weights()

    # -----------------------------------------------------------------------------------
    # Initialisation

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 / Megatron-LM init: N(0, init_std) weights, zero biases, norms at one.

        The two projections that write into the residual stream in each block (attention out,
        MLP out) get std init_std / sqrt(2 * n_layers), so the residual's variance does not grow
        with depth (GPT-2 paper, section 2.3). Parameters are named by role, not by class, so
        parallel layers from another factory are initialised the same way.
        """
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        norm_params = {
            id(p) for m in self.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for p in m.parameters()
        }
        for name, p in self.named_parameters():  # a tied weight is listed (and drawn) once
            if id(p) in norm_params and name.endswith("weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(("attn.proj.weight", "mlp.fc_out.weight")):
                nn.init.normal_(p, 0.0, residual_std)
            else:
                nn.init.normal_(p, 0.0, std)
        for m in self.modules():
            if isinstance(m, Rotary):
                m.reset_parameters()

    # -----------------------------------------------------------------------------------
    # Forward

    def body(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (b, s) -> final normalised hidden states (b, s, d_model)."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {idx.shape[1]} tokens is longer than model.seq_len={self.cfg.seq_len}"
            )
        x = self.embed(idx)
        recompute = self.cfg.recompute and torch.is_grad_enabled()
        for block in self.blocks:
            # Recomputation keeps only each block's input; the dropout masks are replayed, so
            # loss and gradients are identical to a plain run.
            x = run_block(block, x, recompute)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, s, vocab) when targets is None, else the mean cross-entropy (a scalar).

        Targets equal to IGNORE_INDEX (-1) do not count. The logits of the loss path are not
        kept: autograd saves only cross_entropy's log-probabilities, and the head's backward
        needs the hidden states, not its output. With model.fused_ops the head and the loss run
        together in chunks of tokens and not even the full logits exist (ops/cross_entropy.py).
        """
        hidden = self.body(idx)
        if targets is not None and self.fused_loss_fn is not None:
            return self.fused_loss_fn(hidden, self.head, targets)
        logits = self.head(hidden)
        if targets is None:
            return logits
        return self.loss_fn(logits.flatten(0, 1), targets.flatten())

    # -----------------------------------------------------------------------------------
    # Accounting

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied weight counts once).

        exclude_embeddings=True gives Kaplan et al.'s N: without the token and position tables
        and the LM head (its "de-embedding"), i.e. the parameters of the blocks and final norm.
        """
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for module in (self.embed.tok, self.embed.pos, self.head):
                for p in module.parameters() if module is not None else ():
                    params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, training: bool = True) -> float:
        """Model FLOPs per token (forward, or forward + backward); see megascale.perf.flops."""
        return flops.flops_per_token(self.cfg, training=training)

    # -----------------------------------------------------------------------------------
    # Sampling

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (b, t); returns (b, t + max_new_tokens).

        The context is cropped to the last seq_len tokens. temperature 0 is greedy decoding;
        top_k (>= 1, or None for no top-k) keeps the k most likely tokens. vocab_limit (the
        tokenizer's vocabulary when model.vocab_size is padded past it) masks ids >= vocab_limit
        to -inf first, so they are never chosen. Runs in eval mode (no dropout) and restores the
        previous mode. No KV cache: each step re-reads the cropped context, which is fine for
        the sample texts of a training run.

        With sliding-window attention a context longer than the window is right-padded to a length
        from a short fixed list (`context_bucket`): the flex-attention kernel is compiled for static
        shapes, and one compile per context length would pass torch.compile's recompile limit
        within a few tokens and fall back to an s x s eager path. Attention is causal, so padding
        after the last real token changes nothing before it; its logits are read at that token.
        """
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if vocab_limit is not None and not 1 <= vocab_limit <= self.cfg.vocab_size:
            raise ValueError(f"vocab_limit must be in [1, {self.cfg.vocab_size}], got {vocab_limit}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.cfg.seq_len :]
                t = ctx.shape[1]
                if self.cfg.attention == "sliding" and t > self.cfg.window:
                    ctx = nn.functional.pad(ctx, (0, context_bucket(t, self.cfg.seq_len) - t))
                hidden = self.body(ctx)
                logits = self.head(hidden[:, t - 1]).float()  # the head only for the last real position
                if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                    logits[:, vocab_limit:] = float("-inf")
                if temperature <= 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
                idx = torch.cat((idx, nxt), dim=1)
        finally:
            self.train(was_training)
        return idx


def context_bucket(t: int, seq_len: int) -> int:
    """The padded length of a t-token context: the next power of two, at most seq_len. A generation
    then meets about log2(seq_len / window) + 1 shapes past the window, not one per token."""
    return min(seq_len, 1 << (t - 1).bit_length())


def check_model_config(cfg: ModelConfig) -> None:
    """The model-level checks the GPT relies on, as ConfigErrors naming the field."""
    if cfg.vocab_size <= 0:
        raise ConfigError(
            f"model.vocab_size: must be > 0 to build the model (set it from the tokenizer), "
            f"got {cfg.vocab_size}"
        )
    for name, allowed in (
        ("style", ("gpt", "llama")),
        ("block", ("sequential", "parallel")),
        ("attention", ("full", "sliding")),
    ):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"model.{name}: must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"model.n_heads: {cfg.n_heads} heads do not divide model.d_model={cfg.d_model}")
    if cfg.style == "llama" and cfg.head_dim % 2:
        raise ConfigError(f"model.n_heads: rotary positions need an even head size, got {cfg.head_dim}")
    if cfg.attention == "sliding" and cfg.window <= 0:
        raise ConfigError("model.window: sliding-window attention needs a window > 0")
