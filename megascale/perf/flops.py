"""Exact FLOPs per token of the GPT in `megascale.model`, from its `ModelConfig` alone.

Pure Python: imports neither torch nor the megascale runtime, so a laptop can plan a
10,000-GPU job with it. Only matrix multiplications are counted (2 FLOPs per multiply-add),
as in Megatron-LM and the PaLM/MegaScale MFU definition; norms, softmax, activations,
residual adds and the embedding lookup are memory-bound and left out.

Per layer, per token, with d = d_model, f = ffn_dim and K = mean number of keys a query
actually attends to (see `attended_keys`):

    qkv            2 * d * 3d        fused query/key/value projection
    attn_scores    2 * d * K         Q K^T (all heads together: heads * head_dim = d)
    attn_values    2 * d * K         softmax(.) V
    attn_out_proj  2 * d * d         attention output projection
    mlp            2 * 2 * d * f     GeLU MLP (fc-in, fc-out); 3 * 2 * d * f for SwiGLU (gate, up, down)

and once per token for the LM head: 2 * d * vocab_size.

Training counts forward + backward = 3x forward (the backward computes gradients for both
inputs and weights). Two figures matter and must not be mixed up:

* model FLOPs (`model_flops_per_token`): the work the model needs, independent of how it is
  run. MFU is achieved model FLOPs / peak; recomputation does not raise it.
* hardware FLOPs (`hardware_flops_per_token`): what the chips really execute; activation
  recomputation adds one more forward pass of the transformer blocks (not of the head).

Published MFU figures (PaLM, Megatron-LM, MegaScale, torchtitan) use a coarser convention,
`published_flops_per_token`: 6N + 12*L*d*s, which counts every query against all s keys (no
causal halving) and counts biases and norms as if they were matmul weights. At s = 2048 it is
1.4% above the exact count for GPT-3 175B; compare a run with a paper only in the paper's
convention (`mfu_conventions` gives both).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megascale.config import ConfigError, ModelConfig


def attended_keys(seq_len: int, window: int | None = None) -> float:
    """Mean number of keys a query attends to in a causal sequence of `seq_len` tokens.

    Query i (0-based) sees min(i + 1, window) keys: itself and up to window - 1 earlier ones.
    With no window (or window >= seq_len) this is full causal attention, (seq_len + 1) / 2.
    Exact for any seq_len, including window not dividing it.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    if window is None or window <= 0 or window >= seq_len:
        return (seq_len + 1) / 2
    # The first `window` queries see 1, 2, ..., window keys; the remaining ones see `window`.
    total = window * (window + 1) // 2 + (seq_len - window) * window
    return total / seq_len


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token, summed over all layers, split by where they are spent."""

    qkv: float
    attn_scores: float
    attn_values: float
    attn_out_proj: float
    mlp: float
    head: float

    @property
    def blocks(self) -> float:
        """Everything inside the transformer blocks (what activation recomputation repeats)."""
        return self.qkv + self.attn_scores + self.attn_values + self.attn_out_proj + self.mlp

    @property
    def total(self) -> float:
        return self.blocks + self.head

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "blocks": self.blocks, "total": self.total}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> FlopsBreakdown:
    """Forward FLOPs per token of the model `cfg` at sequence length `seq_len` (default cfg.seq_len).

    The sequence length only enters through the attention terms; pass a shorter one to cost
    evaluation or generation at a shorter context.
    """
    if cfg.vocab_size <= 0:
        raise ConfigError("model.vocab_size: must be known (> 0) to count the LM head's FLOPs")
    d, f, n = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    s = cfg.seq_len if seq_len is None else seq_len
    window = cfg.window if cfg.attention == "sliding" else None
    keys = attended_keys(s, window)
    mlp_matmuls = 3 if cfg.style == "llama" else 2  # SwiGLU: gate, up, down; GeLU: fc-in, fc-out
    return FlopsBreakdown(
        qkv=n * 2 * d * 3 * d,
        attn_scores=n * 2 * d * keys,
        attn_values=n * 2 * d * keys,
        attn_out_proj=n * 2 * d * d,
        mlp=n * mlp_matmuls * 2 * d * f,
        head=2 * d * cfg.vocab_size,
    )


def flops_per_token(
    cfg: ModelConfig, training: bool = True, recompute: bool = False, seq_len: int | None = None
) -> float:
    """FLOPs per token: forward only, or a training step (3x forward).

    `recompute=True` adds one more forward of the blocks, giving hardware FLOPs for a run with
    activation recomputation; leave it False for model FLOPs (MFU). Inference ignores it.
    """
    fwd = forward_flops_per_token(cfg, seq_len)
    if not training:
        return fwd.total
    return 3 * fwd.total + (fwd.blocks if recompute else 0.0)


def model_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training model FLOPs per token: the numerator of MFU (recomputation never counts)."""
    return flops_per_token(cfg, training=True, recompute=False, seq_len=seq_len)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token the hardware executes, including recomputation if cfg.recompute."""
    return flops_per_token(cfg, training=True, recompute=cfg.recompute, seq_len=seq_len)


# ----------------------------------------------------------------------------- published convention

EXACT = "exact (causal (s+1)/2 keys)"
PUBLISHED = "PaLM/Megatron 6N+12Lds"


def published_param_count(cfg: ModelConfig) -> int:
    """N of the published 6N + 12Lds convention for the GPT in `megascale.model`.

    Every parameter that a token's forward pass multiplies by, counted once: all block weights,
    biases and norms, the final norm, and the LM head's V x d weight, tied or not (tied, it is the
    token embedding, and the head matmul still runs). Left out: the token embedding's own table
    when untied and the learned position table (GPT style), which are lookups, not matmuls.
    Equals GPT.num_params(exclude_embeddings=True) + vocab_size * d_model (tests check it).
    """
    d, f = cfg.d_model, cfg.ffn_dim
    norm = d * (2 if cfg.style == "gpt" and cfg.bias else 1)  # RMSNorm (llama) has no bias
    attn = 4 * d * d + (4 * d if cfg.bias else 0)  # qkv + out projection; biases per cfg.bias
    if cfg.style == "llama":
        mlp = 3 * d * f  # SwiGLU: fused gate/up (d -> 2f) and down (f -> d), never biased
    else:
        mlp = 2 * d * f + ((f + d) if cfg.bias else 0)
    # The parallel block has the same weights as the sequential one (two norms, both branches).
    return cfg.n_layers * (attn + mlp + 2 * norm) + norm + cfg.vocab_size * d


def published_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token as published MFU figures count them: 6N + 12 * L * d * s.

    PaLM (Chowdhery et al. 2022, appendix B): "6N + 12LHQT", with N the parameter count, 6N the
    forward + backward matmul FLOPs of the weights (2N + 4N) and 12LHQT those of dense self-attention
    (H * Q = d_model heads times head size, T = s, full length: no causal halving). Megatron-LM
    (Narayanan et al. 2021) counts 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per batch with activation
    recomputation; without it, per token, 72 l h^2 + 12 l h s + 6 V h: the blocks' 12 l h^2 weights,
    attention over all s keys, and the LM head's V h weight. torchtitan's get_num_flop_per_token is
    6 * num_params + 12 * l * h * q * t, num_params with exclude_embedding=True: the nn.Embedding
    table subtracted, the (untied) output head kept. nanoGPT's estimate_mfu subtracts the position
    table but keeps the tied token table, because it is the final layer's weight.

    So N is the parameters that take part in a matmul, the LM head included (counted once, tied or
    not) and the lookup tables left out: `published_param_count`. For GPT-3 175B that is 174.6e9,
    and 6N + 12Lds = 1.076e12 FLOPs per token at s = 2048. Sliding windows are ignored too: the
    convention knows only s. `seq_len` defaults to cfg.seq_len.
    """
    if cfg.vocab_size <= 0:
        raise ConfigError("model.vocab_size: must be known (> 0) to count the LM head's FLOPs")
    s = cfg.seq_len if seq_len is None else seq_len
    if s <= 0:
        raise ValueError(f"seq_len must be > 0, got {s}")
    return 6 * published_param_count(cfg) + 12 * cfg.n_layers * cfg.d_model * s


def mfu_conventions(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token in both conventions, by name: {EXACT: ..., PUBLISHED: ...}.

    MFU = tokens/s * FLOPs per token / (devices * peak). Report EXACT as this trainer's MFU and
    PUBLISHED beside it when comparing with a paper; never compare across the two.
    """
    return {
        EXACT: model_flops_per_token(cfg, seq_len=seq_len),
        PUBLISHED: published_flops_per_token(cfg, seq_len=seq_len),
    }
