"""Per-micro-batch compute time of one transformer layer (and of the embedding and the head).

The layer is written out as the kernels it runs: GEMMs with their shapes on one tensor-
parallel rank, and memory-bound kernels (norms, activation, residual adds) with the bytes
they move. Times come from `DeviceModel` (perf/gemm.py). Tensor-parallel collectives are
costed here too because they sit between those GEMMs:

* sequence parallel: all-gather before each column-parallel GEMM, reduce-scatter after each
  row-parallel one (forward; the mirror image in backward); without it, an all-reduce.
* the parallel block (y = x + Attn(LN x) + MLP(LN x)) shares one LayerNorm, one all-gather
  and one reduce-scatter between attention and MLP: half the TP traffic of the sequential one.
* `tp_overlap` (MegaScale sec. 3.2), as the runtime runs it by default (parallel/tensor/overlap.py,
  one chunk split by rank): the GEMM rows of this rank's own shard run under the all-gather that
  feeds the rest, or under the reduce-scatter of the rest, and a column layer's backward
  reduce-scatter also under the weight gradient; a collective costs max(0, comm - that window).
  The fused parallel block's two collectives each run under half of the own rows' MLP, forward and
  backward (parallel/tensor/branches.py; the runtime does so on gloo's direct sends, not yet on NCCL).

The GEMM FLOPs written here equal `perf.flops.forward_flops_per_token` (tests check it);
attention GEMMs are scaled by the causal / sliding-window fraction of keys attended.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import ModelConfig
from megascale.perf import collectives
from megascale.perf.flops import attended_keys
from megascale.perf.gemm import DeviceModel
from megascale.perf.presets import Link
from megascale.perf.sliding_path import sliding_window_path

# Backward costs two GEMMs (input-gradient, weight-gradient) per forward GEMM, and about twice
# the forward's memory traffic in elementwise kernels (read the saved input and the incoming
# gradient, write the outgoing gradient).
BACKWARD_ELEMENTWISE_FACTOR = 2.0


@dataclass(frozen=True)
class Gemm:
    m: float
    n: float
    k: float
    batch: float = 1.0
    flop_scale: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch * self.flop_scale


@dataclass(frozen=True)
class LayerCost:
    """Seconds for one layer and one micro-batch on one TP rank."""

    fwd: float  # compute + exposed TP communication
    bwd: float
    fwd_tp_exposed: float
    bwd_tp_exposed: float
    tp_comm: float  # all TP communication (fwd + bwd), overlapped or not
    fwd_flops: float  # GEMM FLOPs of the forward on this rank
    # the kernels the in-place factor scales (all but the projections' GEMMs), fwd + bwd, as timed alone
    in_place_base: float = 0.0


def layer_gemms(
    cfg: ModelConfig, tokens: int, batch: int, tp: int, parallel_block: bool, sliding_kernel: str = "flex"
) -> list[list[Gemm]]:
    """The forward GEMMs of one layer on one TP rank, grouped by the TP collective they sit next to.

    Groups: [column-parallel GEMMs after an all-gather], [attention core], [row-parallel GEMMs before
    a reduce-scatter] (one set for attention and one for the MLP in the sequential block; fused in
    the parallel block).

    The attention core is costed as the kernel runs it: a flash/flex kernel skips masked blocks
    (FLOPs scaled by the fraction of keys attended), while the "banded" sliding-window kernel
    multiplies each block of `window` queries with 2 x window keys, masked (the first block only
    its own, not told apart here), so it executes more FLOPs than the model needs (MFU still counts
    only the model's).
    """
    h, f, s = cfg.d_model, cfg.ffn_dim, cfg.seq_len
    window = cfg.window if cfg.attention == "sliding" else None
    frac = attended_keys(s, window) / s
    heads = batch * cfg.n_heads / tp
    qkv = Gemm(tokens, 3 * h / tp, h)
    core = [Gemm(s, s, cfg.head_dim, heads, frac), Gemm(s, cfg.head_dim, s, heads, frac)]
    path = _sliding_path(cfg, sliding_kernel)
    if path == "dense":  # every score of the square, the band a mask
        core = [Gemm(s, s, cfg.head_dim, heads), Gemm(s, cfg.head_dim, s, heads)]
    elif path == "banded":
        blocks = heads * -(-s // window)
        core = [
            Gemm(window, 2 * window, cfg.head_dim, blocks),
            Gemm(window, cfg.head_dim, 2 * window, blocks),
        ]
    proj = Gemm(tokens, h, h / tp)
    n_in = 2 if cfg.style == "llama" else 1  # SwiGLU: gate and up
    mlp_in = [Gemm(tokens, f / tp, h)] * n_in
    mlp_out = Gemm(tokens, h, f / tp)
    if parallel_block:
        return [[qkv, *mlp_in], core, [proj, mlp_out]]
    return [[qkv], core, [proj], mlp_in, [mlp_out]]


def elementwise_bytes(
    cfg: ModelConfig,
    tokens: int,
    tp: int,
    sp: bool,
    parallel_block: bool,
    bpe: int,
    sliding_kernel: str = "flex",
) -> tuple[float, int]:
    """Forward bytes moved and kernel count of the memory-bound ops of one layer on one TP rank.

    Per token, in elements: a norm reads and writes h; a residual add reads 2h, writes h; GeLU
    reads and writes the ffn width f; SwiGLU's silu(gate) * up reads/writes 5f (silu r+w 2f, mul
    r 2f w f). Rotary (Llama) rotates q and k in eager ops (4 muls, an add, a sub and a cat over
    half-widths): ~9 elements per element of q and of k. The banded sliding-window kernel runs on
    SDPA's fused kernel (scores stay on chip) but lays out its blocks with copies: q, k and v padded
    (read and write each), k and v with each block's predecessor (read 2, write 2 each: twice as
    wide), the output's blocks joined (read and write): ~16 elements per element of q, 8 kernels.
    h-wide ops are split by TP only with sequence parallelism.
    """
    h, f = cfg.d_model, cfg.ffn_dim
    hs = h / tp if sp else h
    if parallel_block:
        elems, kernels = 2 * hs + 4 * hs, 2  # one norm, one three-way residual add
    else:
        elems, kernels = 2 * (2 * hs) + 2 * (3 * hs), 4  # two norms, two residual adds
    if cfg.style == "llama":
        elems += 5 * f / tp + 9 * 2 * h / tp
        kernels += 2 + 2 * 7
    else:
        elems += 2 * f / tp
        kernels += 1
    if _sliding_path(cfg, sliding_kernel) == "banded":
        elems += 16 * h / tp
        kernels += 8
    return elems * tokens * bpe, kernels


def _sliding_path(cfg: ModelConfig, sliding_kernel: str) -> str | None:
    """The kernel a sliding-window layer runs: the model's own choice by size (perf/sliding_path.py)
    where it runs banded kernels (CPU), else "flex"; None for full attention."""
    if cfg.attention != "sliding":
        return None
    if sliding_kernel == "banded":
        return sliding_window_path(cfg.seq_len, cfg.window)
    return sliding_kernel


def tp_calls_per_layer(tp: int, parallel_block: bool) -> int:
    """TP collective calls of one layer in each direction on one rank: one next to each GEMM group but
    the attention core's (layer_gemms), with or without SP; the TP overlap's one chunk (split by rank)
    keeps one each."""
    if tp == 1:
        return 0
    return 2 if parallel_block else 4


def _overlap(comm: float, window: float) -> float:
    """Exposed part of a collective with `window` seconds of GEMM running under it."""
    return max(0.0, comm - window)


def layer_cost(
    cfg: ModelConfig,
    dev: DeviceModel,
    micro_batch: int,
    tp: int,
    sp: bool,
    tp_link: Link | None,
    parallel_block: bool,
    tp_overlap: bool,
    recompute: bool,
    sliding_kernel: str = "flex",
) -> LayerCost:
    tokens = micro_batch * cfg.seq_len
    groups = layer_gemms(cfg, tokens, micro_batch, tp, parallel_block, sliding_kernel)
    bpe = dev.bytes_per_element

    attn_eff = dev.curve.attention_efficiency

    def fwd_t(g: Gemm, core: bool) -> float:
        e = attn_eff if core else 1.0
        return dev.gemm(g.m, g.n, g.k, g.batch, g.flop_scale, e, core)

    def bwd_t(g: Gemm, core: bool) -> float:  # dX = dY W^T and dW = X^T dY
        e = attn_eff if core else 1.0
        return dev.gemm(g.m, g.k, g.n, g.batch, g.flop_scale, e, core) + dev.gemm(
            g.k, g.n, g.m, g.batch, g.flop_scale, e, core
        )

    ew_bytes, ew_kernels = elementwise_bytes(cfg, tokens, tp, sp, parallel_block, bpe, sliding_kernel)
    fwd = dev.elementwise(ew_bytes, ew_kernels)
    bwd = dev.elementwise(BACKWARD_ELEMENTWISE_FACTOR * ew_bytes, 2 * ew_kernels)
    act_elems = tokens * cfg.ffn_dim / tp  # the activation function's inputs on this rank
    c = dev.curve
    fwd += act_elems * (c.silu_fwd_s if cfg.style == "llama" else c.gelu_fwd_s) / dev.share
    bwd += act_elems * (c.silu_bwd_s if cfg.style == "llama" else c.gelu_bwd_s) / dev.share
    fwd_exp = bwd_exp = fwd_comm = bwd_comm = gemm_fwd = gemm_bwd = 0.0
    act_bytes = tokens * cfg.d_model * bpe  # one full activation of the layer
    if parallel_block:  # the fused block's overlap: half of the own rows' MLP under each collective
        mlp = [*groups[0][1:], *groups[2][1:]]
        mlp_window = tuple(sum(t(g, False) for g in mlp) / (2 * tp) for t in (fwd_t, bwd_t))
    for i, group in enumerate(groups):
        core = i == 1  # the attention core runs as one fused kernel
        gf = sum(fwd_t(g, core) for g in group)
        gb = sum(bwd_t(g, core) for g in group)
        fwd += gf
        bwd += gb
        if not core:  # the projections: what the in-place factor leaves as calibrated
            gemm_fwd, gemm_bwd = gemm_fwd + gf, gemm_bwd + gb
        if tp == 1 or tp_link is None or core:  # the attention core needs no TP collective
            continue
        if sp:
            c = collectives.all_gather(act_bytes, tp, tp_link)  # = reduce-scatter's cost
            cf = cb = c
        else:  # all-reduce after the row-parallel GEMM forward, after the column-parallel one backward
            ar = collectives.all_reduce(act_bytes, tp, tp_link)
            column = i == 0 or (not parallel_block and i == 3)
            cf, cb = (0.0, ar) if column else (ar, 0.0)
        fwd_comm += cf
        bwd_comm += cb
        if tp_overlap and sp and parallel_block:
            fwd_exp += _overlap(cf, mlp_window[0])
            bwd_exp += _overlap(cb, mlp_window[1])
        elif tp_overlap and sp:
            # forward: the own rows' GEMMs. Backward (gb: input and weight gradients, about half each):
            # a column layer's reduce-scatter of its input gradient has the own rows' and the weight
            # gradient under it; a row layer's all-gather of the output gradient only the own rows'
            fwd_exp += _overlap(cf, gf / tp)
            column = i == 0 or (not parallel_block and i == 3)
            bwd_exp += _overlap(cb, gb / (2 * tp) + (gb / 2 if column else 0.0))
        else:
            fwd_exp += cf
            bwd_exp += cb
    fwd_flops = sum(g.flops for group in groups for g in group)
    # The layer's kernels as they run in place, not alone (perf/host.py): the projections' GEMMs as
    # calibrated (within 3% inside a layer); the rest (attention, whose CPU backward is ~2.7x its
    # forward, not 2x; the memory-bound kernels among others' data, in autograd's fresh buffers) by
    # the measured factor. Then the framework's own work per layer and micro-batch, before the exposed
    # collectives: the modules' and autograd's, the tensor-parallel functions' around each call.
    base = fwd + bwd - gemm_fwd - gemm_bwd
    extra = (dev.curve.in_place_factor if tp == 1 else dev.curve.in_place_factor_tp) - 1.0
    tp_host = tp_calls_per_layer(tp, parallel_block) * dev.curve.host_tp_call_s
    fwd = dev.with_host(fwd + extra * (fwd - gemm_fwd), dev.curve.host_layer_fwd_s + tp_host)
    bwd = dev.with_host(bwd + extra * (bwd - gemm_bwd), dev.curve.host_layer_bwd_s + tp_host)
    if recompute:  # the backward first reruns the forward, collectives included
        bwd += fwd
        bwd_exp += fwd_exp
        bwd_comm += fwd_comm
    return LayerCost(fwd + fwd_exp, bwd + bwd_exp, fwd_exp, bwd_exp, fwd_comm + bwd_comm, fwd_flops, base)


def head_cost(cfg: ModelConfig, dev: DeviceModel, micro_batch: int, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of final norm + vocab-parallel LM head + cross-entropy on one rank."""
    tokens = micro_batch * cfg.seq_len
    g = Gemm(tokens, cfg.vocab_size / tp, cfg.d_model)
    bpe = dev.bytes_per_element
    logits = tokens * cfg.vocab_size / tp * bpe
    norm = 2 * tokens * cfg.d_model * bpe
    fwd = dev.gemm(g.m, g.n, g.k) + dev.elementwise(3 * logits + norm, 4)  # max, exp-sum, log-prob
    bwd = dev.gemm(g.m, g.k, g.n) + dev.gemm(g.k, g.n, g.m) + dev.elementwise(2 * logits + 2 * norm, 3)
    # the framework's work around the layers per micro-batch (perf/host.py; the vocab-parallel loss's
    # under tp), charged to the backward
    host = dev.curve.host_microbatch_s + (dev.curve.host_tp_microbatch_s if tp > 1 else 0.0)
    return fwd, dev.with_host(bwd, host)


def embedding_cost(cfg: ModelConfig, dev: DeviceModel, micro_batch: int) -> tuple[float, float]:
    """(forward, backward) seconds of the token (+ position) embedding: a gather and a scatter-add."""
    n_bytes = micro_batch * cfg.seq_len * cfg.d_model * dev.bytes_per_element
    pos = 2 if cfg.style == "gpt" else 1
    return dev.elementwise(pos * 2 * n_bytes, pos), dev.elementwise(pos * 3 * n_bytes, pos)
