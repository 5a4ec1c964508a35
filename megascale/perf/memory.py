"""Memory per device: parameters, gradients, optimizer state and activations.

Parameter counts follow the GPT in `megascale.model` (GPT style: LayerNorm with bias, fused
QKV, GeLU MLP, learned positions; Llama style: RMSNorm, SwiGLU, rotary). The bytes per
parameter depend on the precision policy:

* "fp32" (our CPU runs): weights, gradients 4 bytes each, AdamW/LAMB moments 8 bytes.
* "mixed" (our bf16 runs: autocast, fp32 master weights): the same 4 + 4 + 8, since autocast
  keeps no separate bf16 copy of the weights.
* "megatron" (bf16 weights, fp32 main gradients, fp32 master copy + two moments): 2 + 4 + 12,
  the accounting of Megatron-LM and the MegaScale paper's baseline.

With a distributed optimizer (ZeRO-1/2 style, `shard_optimizer`) the optimizer state is split
across the data-parallel group, and with ZeRO-2 the gradients too.

Activations per layer and micro-batch follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), counted in elements so that any dtype works:
the tensors autograd keeps for a sequential GPT layer are, per token, LN inputs (2h), the
LN outputs feeding QKV and MLP (2h), Q, K, V (3h), the attention output (h), the MLP input
to the activation and its output (2f; SwiGLU 3f). Without a fused (flash) attention kernel
the softmax output (heads x attended keys per token) is kept as well. Sequence parallelism
splits the h-wide tensors by tp. Full recomputation keeps only each layer's input (h), plus
one layer's full activations while it is being recomputed.

How many micro-batches' activations a stage holds at once comes from the pipeline schedule
itself (`pipeline.max_inflight`), not from a formula.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megascale.config import ModelConfig
from megascale.perf.flops import attended_keys

POLICIES: dict[str, tuple[int, int, int]] = {  # bytes per parameter: weights, gradients, optimizer state
    "fp32": (4, 4, 8),
    "mixed": (4, 4, 8),
    "megatron": (2, 4, 12),
}


def layer_params(cfg: ModelConfig) -> int:
    h, f = cfg.d_model, cfg.ffn_dim
    attn = 4 * h * h + (4 * h if cfg.bias else 0)
    if cfg.style == "llama":
        mlp = 3 * h * f  # SwiGLU has no biases in megascale.model, whatever cfg.bias says
    else:
        mlp = 2 * h * f + ((f + h) if cfg.bias else 0)
    return attn + mlp + 2 * norm_params(cfg)


def norm_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.style == "gpt" and cfg.bias else 1)


def embedding_params(cfg: ModelConfig) -> int:
    """Token embedding, plus learned positions for GPT style."""
    return cfg.vocab_size * cfg.d_model + (cfg.seq_len * cfg.d_model if cfg.style == "gpt" else 0)


def head_params(cfg: ModelConfig) -> int:
    """Final norm plus the LM head unless it shares the embedding's weight."""
    return norm_params(cfg) + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)


def total_params(cfg: ModelConfig) -> int:
    return embedding_params(cfg) + cfg.n_layers * layer_params(cfg) + head_params(cfg)


def stage_params(cfg: ModelConfig, tp: int, pp: int, stage: int) -> float:
    """Parameters held by one rank of pipeline stage `stage` (tensor-parallel shard).

    With pp > 1 and tied embeddings the last stage keeps its own copy of the embedding for the
    head (Megatron-LM's arrangement, kept in sync by an all-reduce of its gradient).
    """
    p = cfg.n_layers / pp * layer_params(cfg)
    if stage == 0:
        p += embedding_params(cfg)
    if stage == pp - 1:
        p += head_params(cfg)
        if cfg.tie_embeddings and pp > 1:
            p += cfg.vocab_size * cfg.d_model
    return p / tp


def activation_elements_per_token(cfg: ModelConfig, tp: int, sp: bool, flash: bool, recompute: bool) -> float:
    """Elements one layer keeps per token of a micro-batch for its backward, on one TP rank."""
    h, f = cfg.d_model, cfg.ffn_dim
    if recompute:
        return h / tp if sp else h
    h_split = 4 * h / tp  # Q, K, V and the attention output: always split by TP (heads)
    h_rep = 4 * h / tp if sp else 4 * h  # LN inputs and outputs (replicated across TP without SP)
    act = (3 * f if cfg.style == "llama" else 2 * f) / tp
    scores = 0.0
    if not flash:
        window = cfg.window if cfg.attention == "sliding" else None
        scores = cfg.n_heads / tp * attended_keys(cfg.seq_len, window)
    return h_split + h_rep + act + scores


@dataclass(frozen=True)
class MemoryEstimate:
    params: float  # bytes
    grads: float
    optimizer: float
    activations: float
    activations_recompute: float  # what activations would be with full recomputation
    recompute: bool

    @property
    def total(self) -> float:
        act = self.activations_recompute if self.recompute else self.activations
        return self.params + self.grads + self.optimizer + act

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def estimate(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    inflight_chunks: int,
    vpp: int = 1,
    policy: str = "mixed",
    act_bytes: int = 2,
    sp: bool = True,
    flash: bool = True,
    shard_optimizer: bool = True,
    shard_grads: bool = False,
    recompute: bool = False,
) -> MemoryEstimate:
    """Peak bytes on the most loaded rank (the first stage: it holds the most activations)."""
    wb, gb, ob = POLICIES[policy]
    n = max(stage_params(cfg, tp, pp, s) for s in {0, pp - 1})
    layers_per_chunk = cfg.n_layers / (pp * vpp)
    tokens = micro_batch * cfg.seq_len

    def act(rc: bool) -> float:
        per_layer = activation_elements_per_token(cfg, tp, sp, flash, rc) * tokens * act_bytes
        held = inflight_chunks * layers_per_chunk * per_layer
        if rc:  # one layer is materialised in full while its backward runs
            held += activation_elements_per_token(cfg, tp, sp, flash, False) * tokens * act_bytes
        return held

    return MemoryEstimate(
        params=n * wb,
        grads=n * gb / (dp if shard_grads else 1),
        optimizer=n * ob / (dp if shard_optimizer else 1),
        activations=act(False),
        activations_recompute=act(True),
        recompute=recompute,
    )
