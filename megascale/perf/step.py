"""Predict one training step of a model on a layout and a cluster: time, MFU, memory.

This is where the pieces meet: per-layer compute with tensor-parallel collectives
(perf/compute.py), the pipeline timeline with point-to-point and data-parallel streams
(perf/pipeline.py), the optimizer step, and memory (perf/memory.py).

`Settings` holds MegaScale's switches. "megatron" is the Megatron-LM-like baseline
(sequential block, no overlap in any dimension); "megascale" turns on the parallel block
and all three overlaps. Anything in between can be asked for, to see what each buys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megascale.config import ModelConfig
from megascale.errors import UserError
from megascale.perf import collectives, compute, memory, pipeline
from megascale.perf.flops import model_flops_per_token
from megascale.perf.gemm import DeviceModel
from megascale.perf.presets import ClusterPreset, Link

# A fused Adam/LAMB kernel reads weight, gradient and two moments and writes weight and moments
# (7 x 4 bytes), plus the bf16 copy of the weights and the grad-norm read: ~32 bytes per parameter.
OPTIMIZER_BYTES_PER_PARAM = 32
# Keep 10% of device memory for the allocator's fragmentation, workspaces and the framework itself.
USABLE_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class Settings:
    name: str = "megascale"
    parallel_block: bool | None = True  # None: as the model config says
    tp_overlap: bool = True
    tp_overlap_branches: bool = True  # the fused parallel block's too (parallel.tp_overlap_branches)
    pp_overlap: bool = True
    dp_overlap: bool = True
    pp_warmup_ahead: int = 0  # 1F1B: extra warm-up forwards on all ranks but the last (memory for latency)


MEGATRON = Settings("megatron", parallel_block=False, tp_overlap=False, pp_overlap=False, dp_overlap=False)
MEGASCALE = Settings("megascale")
AS_CONFIGURED = Settings("config", parallel_block=None)  # the model's own block, all overlaps on
SETTINGS = {"megatron": MEGATRON, "megascale": MEGASCALE, "config": AS_CONFIGURED}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    recompute: bool = False
    sequence_parallel: bool = True  # only meaningful when tp > 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        rc = " rc" if self.recompute else ""
        return f"tp{self.tp} pp{self.pp} v{self.vpp} dp{self.dp} mb{self.micro_batch}{rc}"


@dataclass
class Breakdown:
    """Seconds of one step on the busiest pipeline rank, adding up to the step time."""

    compute: float = 0.0
    tp_exposed: float = 0.0
    bubble: float = 0.0
    pp_exposed: float = 0.0
    dp_exposed: float = 0.0
    optimizer: float = 0.0
    other_exposed: float = 0.0  # tied-embedding gradient sync, grad-norm all-reduce
    # shared_compute only: how much longer the node's cores take for all its ranks' CPU work
    # (compute and communication) than the timeline, which gives every rank its share of them
    cpu_contention: float = 0.0


@dataclass
class Prediction:
    layout: Layout
    settings: Settings
    global_batch: int
    micro_batches: int
    step_time: float
    tokens_per_s: float
    mfu: float
    memory: memory.MemoryEstimate
    fits: bool
    breakdown: Breakdown | None = None
    comm_total: dict[str, float] = field(
        default_factory=dict
    )  # all traffic time per dimension, hidden or not
    # shared_compute with links that cost CPU only: the busiest rank's CPU-seconds of a step at a
    # whole core, {"compute": ..., "comm": ...}, whose sum over the node's ranks bounds the step
    cpu_seconds: dict[str, float] | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["memory"] = self.memory.as_dict()
        d["label"] = self.layout.label()
        return d


def bytes_per_element(dtype: str) -> int:
    return {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp64": 8}[dtype]


def check_layout(cfg: ModelConfig, lay: Layout, global_batch: int) -> int:
    """Number of micro-batches per data-parallel rank; UserError if the layout cannot run the model."""
    if cfg.n_heads % lay.tp:
        raise UserError(f"tp={lay.tp} does not divide model.n_heads={cfg.n_heads}")
    if cfg.n_layers % (lay.pp * lay.vpp):
        raise UserError(f"pp*vpp={lay.pp * lay.vpp} does not divide model.n_layers={cfg.n_layers}")
    if global_batch % (lay.dp * lay.micro_batch):
        raise UserError(
            f"batch {global_batch} does not split into dp={lay.dp} x micro-batch {lay.micro_batch}"
        )
    m = global_batch // (lay.dp * lay.micro_batch)
    if lay.vpp > 1 and m % lay.pp:
        raise UserError(f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of pp={lay.pp}")
    return m


@dataclass
class _Parts:
    spec: pipeline.PipelineSpec
    layer: compute.LayerCost
    per_stage_tp_exposed: float  # per micro-batch, summed over a rank's chunks
    optimizer: float
    other: float
    comm_total: dict[str, float]


def _parts(cfg: ModelConfig, lay: Layout, preset: ClusterPreset, st: Settings, m: int, policy: str) -> _Parts:
    bpe = bytes_per_element(preset.dtype)
    share = preset.device_share(min(lay.world, preset.devices_per_node))
    dev = DeviceModel.from_preset(preset, bpe, share)
    pb = cfg.block == "parallel" if st.parallel_block is None else st.parallel_block
    cfg = dataclasses.replace(cfg, block="parallel" if pb else "sequential")
    sp = lay.sequence_parallel and lay.tp > 1
    tp_link = collectives.group_link(preset, 1, lay.tp)
    layer = compute.layer_cost(
        cfg,
        dev,
        lay.micro_batch,
        lay.tp,
        sp,
        tp_link,
        pb,
        st.tp_overlap and (st.tp_overlap_branches or not pb),
        lay.recompute,
        preset.sliding_kernel,
    )
    p, v = lay.pp, lay.vpp
    per_chunk = cfg.n_layers // (p * v)
    fwd = [per_chunk * layer.fwd] * (p * v)
    bwd = [per_chunk * layer.bwd] * (p * v)
    ef, eb = compute.embedding_cost(cfg, dev, lay.micro_batch)
    hf, hb = compute.head_cost(cfg, dev, lay.micro_batch, lay.tp)
    fwd[0] += ef
    bwd[0] += eb
    # the vocab-parallel loss's one exchange per micro-batch (ops/cross_entropy.combine_vocab_parts): every
    # tp rank's fp32 logsumexp and target logit per token, waited for at once, on the last stage
    loss_bytes = lay.tp * lay.micro_batch * cfg.seq_len * 2 * max(4, bpe)
    loss_tp = collectives.all_gather(loss_bytes, lay.tp, tp_link)
    fwd[-1] += hf + loss_tp
    bwd[-1] += hb

    act = lay.micro_batch * cfg.seq_len * cfg.d_model * bpe / (lay.tp if sp else 1)
    p2p = [
        collectives.p2p(act, collectives.hop_link(preset, r * lay.tp, ((r + 1) % p) * lay.tp))
        for r in range(p)
    ]
    wb, gb, _ = memory.POLICIES[policy]
    chunk_params = per_chunk * memory.layer_params(cfg) / lay.tp
    dp_link = collectives.group_link(preset, lay.tp * p, lay.dp)
    ag = [collectives.all_gather(chunk_params * wb, lay.dp, dp_link)] * v
    rs = [collectives.reduce_scatter(chunk_params * gb, lay.dp, dp_link)] * v
    emb = memory.embedding_params(cfg) / lay.tp
    ag[0] += collectives.all_gather(emb * wb, lay.dp, dp_link)
    rs[0] += collectives.reduce_scatter(emb * gb, lay.dp, dp_link)
    spec = pipeline.PipelineSpec(
        p, v, m, fwd, bwd, p2p, async_p2p=st.pp_overlap, dp_ag=ag, dp_rs=rs, dp_overlap=st.dp_overlap,
        ahead=st.pp_warmup_ahead,
    )

    n_rank = max(memory.stage_params(cfg, lay.tp, p, s) for s in {0, p - 1})
    optimizer = dev.elementwise(OPTIMIZER_BYTES_PER_PARAM * n_rank / lay.dp, 8)
    # the framework's per-step work (perf/host.py), counted with the optimizer that ends the step
    optimizer = dev.with_host(optimizer, dev.curve.host_step_s + per_chunk * v * dev.curve.host_layer_step_s)
    other = collectives.all_reduce(
        8, lay.world, preset.inter if lay.world > preset.devices_per_node else preset.intra
    )
    if p > 1 and cfg.tie_embeddings:  # first and last stage sum their copies of the embedding gradient
        link = collectives.hop_link(preset, 0, (p - 1) * lay.tp)
        other += collectives.all_reduce(cfg.vocab_size * cfg.d_model / lay.tp * gb, 2, link)
    comm_total = {
        "tp": (layer.tp_comm * cfg.n_layers / p + loss_tp) * m,
        "pp": (sum(p2p) / p) * 2 * m * v if p > 1 else 0.0,
        "dp": sum(ag) + sum(rs),
    }
    # (the loss's exchange is the last stage's: the busiest rank's where the head makes it so)
    per_stage_tp = per_chunk * v * (layer.fwd_tp_exposed + layer.bwd_tp_exposed) + loss_tp
    return _Parts(spec, layer, per_stage_tp, optimizer, other, comm_total)


def predict(
    cfg: ModelConfig,
    lay: Layout,
    preset: ClusterPreset,
    settings: Settings = MEGASCALE,
    global_batch: int = 1,
    policy: str | None = None,
    explain: bool = False,
) -> Prediction:
    """Predict one step. `explain` runs two more simulations to split the time by cause."""
    m = check_layout(cfg, lay, global_batch)
    policy = policy or ("fp32" if preset.dtype in ("fp32", "fp64") else "megatron")
    parts = _parts(cfg, lay, preset, settings, m, policy)
    tl = pipeline.simulate(parts.spec)
    timeline = tl.makespan + parts.optimizer + parts.other
    cpu = rank_cpu_seconds(cfg, lay, preset, settings, m, policy, parts, tl)
    k = min(lay.world, preset.devices_per_node)
    step = max(timeline, k * sum(cpu.values())) if cpu else timeline
    tokens = global_batch * cfg.seq_len
    mfu = model_flops_per_token(cfg) * tokens / (step * lay.world * preset.peak_flops)

    ahead = settings.pp_warmup_ahead if lay.vpp == 1 else 0
    inflight = pipeline.max_inflight(pipeline.schedule(lay.pp, lay.vpp, m, 0, ahead))
    mem = memory.estimate(
        cfg, lay.tp, lay.pp, lay.dp, lay.micro_batch, inflight, lay.vpp, policy,
        act_bytes=bytes_per_element(preset.dtype), sp=lay.sequence_parallel and lay.tp > 1,
        flash=True, recompute=lay.recompute,
    )  # fmt: skip
    fits = mem.total <= USABLE_MEMORY_FRACTION * preset.memory_bytes
    pred = Prediction(lay, settings, global_batch, m, step, tokens / step, mfu, mem, fits,
                      comm_total=parts.comm_total, cpu_seconds=cpu)  # fmt: skip
    if explain:
        pred.breakdown = _breakdown(parts, tl, timeline)
        pred.breakdown.cpu_contention = step - timeline
    return pred


def rank_cpu_seconds(cfg: ModelConfig, lay: Layout, preset: ClusterPreset, st: Settings, m: int,
                     policy: str, parts: _Parts, tl: pipeline.Timeline) -> dict[str, float] | None:
    """The busiest rank's CPU-seconds of one step at a whole core, {"compute", "comm"}, when the
    node's ranks share its cores (`shared_compute`) and its links cost host CPU
    (`Link.cpu_s_per_message`, `cpu_s_per_byte`); None otherwise.

    The timeline gives each rank 1/k of the node and charges nothing for moving data, but gloo's
    copies and the kernel's TCP work run on the same cores, and a collective's wait for a peer that
    is not scheduled is that peer's CPU work. So the step is at least the sum over the node's k
    ranks of these: `predict` bounds it by k times their sum."""
    if not preset.shared_compute or not (preset.intra.cpu_link or preset.inter.cpu_link):
        return None
    free = Link(bandwidth=float("inf"))
    as_cpu = dataclasses.replace(preset, intra=preset.intra.cpu_link or free,
                                 inter=preset.inter.cpu_link or free)
    cpu = _parts(cfg, lay, as_cpu, st, m, policy)  # its "times" of collectives are CPU seconds
    # the rank is on a core 1/k of the time: its compute's wall time at that share is k times its CPU
    # time (a shared_efficiency below 1 made both longer: the slices of a shared core get less done)
    k = max(1, min(lay.world, preset.devices_per_node))
    return {"compute": _rank_compute(parts, tl) / k, "comm": sum(cpu.comm_total.values()) + cpu.other}


def _rank_compute(parts: _Parts, tl: pipeline.Timeline) -> float:
    """The busiest rank's compute seconds of a step: its timeline's busy time less the TP
    communication exposed in it, and the optimizer."""
    return max(tl.busy) - parts.per_stage_tp_exposed * parts.spec.m + parts.optimizer


def _breakdown(parts: _Parts, full: pipeline.Timeline, step: float) -> Breakdown:
    """Split the step by counterfactual: rerun the timeline without DP, then without P2P too."""
    spec = parts.spec
    no_dp = dataclasses.replace(spec, dp_ag=[0.0] * spec.v, dp_rs=[0.0] * spec.v)
    bare = dataclasses.replace(no_dp, p2p=[0.0] * spec.p)
    t_no_dp = pipeline.simulate(no_dp).makespan
    t_bare = pipeline.simulate(bare).makespan
    busiest = max(full.busy)
    tp_exp = parts.per_stage_tp_exposed * spec.m
    return Breakdown(
        compute=_rank_compute(parts, full) - parts.optimizer,
        tp_exposed=tp_exp,
        bubble=t_bare - busiest,
        pp_exposed=t_no_dp - t_bare,
        dp_exposed=full.makespan - t_no_dp,
        optimizer=parts.optimizer,
        other_exposed=parts.other,
    )
