"""Bytes per rank of a layout as megascale actually allocates them: params, grads, optimizer, activations.

The runtime twin of the planner's `megascale.perf.memory.estimate` (same field names), exact
where the planner is a model: parameter counts come from the real GPT built on the meta
device with the tp layer factory (vocab padding, which tensors are split), and the flat
buffers of the distributed optimizer are laid out with its own `plan_buckets` (padding
to dp included). tests/test_memory.py checks every figure against a run's real storage.

* params, grads: the flat per-dtype buffers (padded), param dtype wide each.
* optimizer: this rank's shard of two moments (AdamW and LAMB alike) plus one float32
  `step` scalar per tensor. Parameters are fp32 (or fp64), so the parameter shard is the
  master copy: no separate master bytes (see data/optimizer.py).
* comm_buffers: on gloo with parallel.direct_collectives, the receive buffers each bucket's
  reduce-scatter keeps from step to step (distributed/direct.py): dp - 1 shards of it, so
  (dp - 1) / dp of the gradient buffer. NCCL's own reduce-scatter needs none.
* activations: what autograd keeps from the forward for the backward of one micro-batch
  (counted per token, as the tensors our eager GPT saves; Korthikanti et al. 2022's terms
  plus norm statistics, the attention's log-sum-exp and the loss's log-probabilities),
  i.e. what is held when backward starts. With recompute, only each block's input is kept;
  the backward then rebuilds one block's activations at a time (`activations_recompute_peak`).
  Pipeline schedules hold several micro-batches at once: multiply by their in-flight count.

Pipeline stages split the blocks evenly here (stage 0 has the embedding, the last the norm
and head); tensor-parallel activations divide the head-split terms by tp. Verified
figures (tests/test_memory.py): states exactly at dp = 1, 2 and tp = 2; activations at tp = 1
(both styles and blocks, with and without recompute) within 0.5%. Activations under tp > 1
(sequence parallelism saves the gathered input of column layers) and pp > 1 are not checked yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megascale.config import ModelConfig, ParallelConfig
from megascale.parallel.data.buffers import DEFAULT_BUCKET_SIZE, plan_buckets


@dataclass(frozen=True)
class RankMemory:
    params: int  # bytes
    grads: int
    optimizer: int
    comm_buffers: int  # the direct reduce-scatter's receive buffers (gloo)
    activations: int  # held when backward starts (recompute: block inputs only)
    activations_recompute_peak: int  # recompute: plus one block rebuilt in full during backward

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.comm_buffers + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def stage_blocks(n_layers: int, pp: int, stage: int) -> range:
    """The blocks of pipeline stage `stage` of `pp`: an even split, the first stages take the rest."""
    per, extra = divmod(n_layers, pp)
    lo = stage * per + min(stage, extra)
    return range(lo, lo + per + (stage < extra))


def stage_modules(model, pp: int, stage: int) -> list:
    """The modules a stage holds: its blocks, the embedding on the first, norm and head on the last."""
    mods = [model.blocks[i] for i in stage_blocks(len(model.blocks), pp, stage)]
    if stage == 0:
        mods.insert(0, model.embed)
    if stage == pp - 1:
        mods += [model.norm, model.head]
    return mods


def stage_numels(cfg: ModelConfig, parallel: ParallelConfig, stage: int = 0) -> tuple[list[int], int | None]:
    """Element counts of the trainable tensors on one rank of `stage` (tp-local shapes), in the
    buffers' order (backward order, the deferred copy of a tied matrix last), and where the
    deferred tensors start (None: none)."""
    from megascale.model import GPT  # the model imports perf, perf must not import the runtime
    from megascale.parallel.mesh import Mesh
    from megascale.parallel.tensor.apply import TPLayerFactory

    with torch.device("meta"):
        tp = parallel.tp
        model = GPT(cfg, TPLayerFactory(Mesh(1, 1, tp, 0), parallel.sequence_parallel) if tp > 1 else None)
    seen, params = set(), []
    for m in stage_modules(model, parallel.pp, stage):
        for p in m.parameters():
            if id(p) not in seen:  # a tied weight once
                seen.add(id(p))
                params.append(p)
    # a pipeline's copy of a tied matrix waits for the cross-stage sum: the buffer's end (data/buffers.py)
    tied = model.embed.tok.weight if cfg.tie_embeddings and parallel.pp > 1 else None
    order = [p for p in reversed(params) if p is not tied] + [p for p in reversed(params) if p is tied]
    first_deferred = len(params) - 1 if any(p is tied for p in params) else None
    return [p.numel() for p in order], first_deferred


def activation_bytes_per_token(cfg: ModelConfig, tp: int, dtype_bytes: int) -> tuple[float, float, float]:
    """(per block, embedding + head + loss, block input) bytes one token of a micro-batch keeps."""
    h, f, heads = cfg.d_model, cfg.ffn_dim, cfg.n_heads
    if cfg.style == "gpt":
        norm = 2 * h + 2  # LayerNorm: input, output, mean and rstd
        mlp = 2 * f  # fc_in output (GeLU input) and GeLU output (fc_out input)
        rotary = 0
    else:
        norm = 3 * h + 1  # RMSNorm: input, normalised input, output, rstd
        mlp = 4 * f  # gate|up (2f), silu(gate) and the product (fc_out input)
        # Rotated q and k, and one more copy of the attention output: measured, the rotary path
        # leaves SDPA's output in a layout whose re-shape for the output projection copies it.
        rotary = 3 * h
    attn = 3 * h + heads + h + rotary  # qkv output, log-sum-exp, attention output
    shared_input = h if cfg.block == "parallel" else 0  # both norms read the same x
    block = 2 * norm - shared_input + (attn + mlp) / tp
    vocab = -(-cfg.vocab_size // tp)
    edge = (norm + vocab) * dtype_bytes + 8 + 8  # final norm, log-probs; token ids and targets (int64)
    return block * dtype_bytes, edge, h * dtype_bytes


def memory_per_rank(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    micro_batch: int,
    dtype: torch.dtype = torch.float32,
    recompute: bool | None = None,
    stage: int = 0,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    backend: str = "gloo",
) -> RankMemory:
    """Bytes one rank of pipeline stage `stage` holds under the distributed optimizer, on the
    process-group `backend` (gloo: the direct reduce-scatter's buffers, see Mesh.build)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"memory_per_rank: parameters are float32 or float64, got {dtype}")
    recompute = cfg.recompute if recompute is None else recompute
    wb = torch.finfo(dtype).bits // 8
    numels, first_deferred = stage_numels(cfg, parallel, stage)
    buffer = plan_buckets(numels, bucket_size, parallel.dp, first_deferred, parallel.dp_tail_buckets)[-1][1]
    shard = buffer // parallel.dp
    direct = parallel.direct_collectives and backend == "gloo"
    tokens = micro_batch * cfg.seq_len
    block, edge, block_input = activation_bytes_per_token(cfg, parallel.tp, wb)
    n_blocks = len(stage_blocks(cfg.n_layers, parallel.pp, stage))
    first, last = stage == 0, stage == parallel.pp - 1
    edge_tokens = edge if last else 0.0
    if first and not last:
        edge_tokens = 8  # token ids for the embedding's backward
    kept = block_input if recompute else block
    act = tokens * (n_blocks * kept + edge_tokens)
    peak = act + (tokens * block if recompute else 0)
    return RankMemory(
        params=buffer * wb,
        grads=buffer * wb,
        optimizer=2 * shard * wb + 4 * len(numels),
        comm_buffers=(parallel.dp - 1) * shard * wb if direct else 0,
        activations=round(act),
        activations_recompute_peak=round(peak),
    )

