"""The planner's cost models: collectives, GEMM FLOPs, pipeline timeline, memory, presets."""

import dataclasses
import math

import pytest
import torch

from megascale.config import ModelConfig
from megascale.errors import UserError
from megascale.perf import collectives, compute, memory, pipeline
from megascale.perf.calibrate import fit
from megascale.perf.flops import forward_flops_per_token
from megascale.perf.gemm import DeviceModel, shape_efficiency
from megascale.perf.presets import GemmCurve, Link, builtin_names, load_preset


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=97, seq_len=32, n_layers=2, d_model=48, n_heads=4)
    return ModelConfig(**{**base, **kw})


# ---- collectives ------------------------------------------------------------------------


def test_ring_collectives_alpha_beta():
    link = Link(bandwidth=100.0, efficiency=0.5, latency_s=1.0)  # 50 bytes/s effective
    assert collectives.all_gather(400.0, 4, link) == pytest.approx(3 * 1.0 + 0.75 * 400 / 50)
    assert collectives.reduce_scatter(400.0, 4, link) == collectives.all_gather(400.0, 4, link)
    assert collectives.all_reduce(400.0, 4, link) == pytest.approx(2 * (3 + 6))  # ring beats tree here
    assert collectives.p2p(100.0, link) == pytest.approx(1.0 + 2.0)
    assert collectives.all_gather(1e9, 1, link) == 0.0 and collectives.all_reduce(1e9, 1, link) == 0.0


def test_all_reduce_uses_tree_for_small_messages_at_scale():
    link = Link(bandwidth=1e9, latency_s=1e-5)
    n = 4096
    tree = 2 * math.ceil(math.log2(n)) * 1e-5 + 2 * 8 / 1e9
    assert collectives.all_reduce(8, n, link) == pytest.approx(tree)


def test_group_links_follow_nodes():
    a100 = load_preset("a100", use_calibration=False)
    assert collectives.group_link(a100, 1, 8) is a100.intra  # tp 8 inside a node
    assert collectives.group_link(a100, 64, 2) is a100.inter  # dp across tp*pp = 64
    assert collectives.hop_link(a100, 0, 8) is a100.inter
    assert collectives.hop_link(a100, 0, 4) is a100.intra


# ---- compute -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{}, {"style": "llama", "bias": False}, {"attention": "sliding", "window": 8}, {"block": "parallel"}],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layer_gemm_flops_match_flops_module(kw, tp):
    cfg = small(**kw)
    mb = 3
    groups = compute.layer_gemms(cfg, mb * cfg.seq_len, mb, tp, cfg.block == "parallel")
    per_rank = sum(g.flops for grp in groups for g in grp)
    want = forward_flops_per_token(cfg).blocks / cfg.n_layers * mb * cfg.seq_len / tp
    assert per_rank == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seq,window,path", [(64, 16, "dense"), (256, 32, "banded"), (256, 200, "dense")])
def test_the_planner_costs_the_sliding_kernel_the_model_runs_on_cpu(seq, window, path):
    """The banded kernels' attention core: blocks of `window` queries over 2 x window keys where the
    model runs the blocks (perf/sliding_path.py), every score of the square where it runs the band as
    a mask; only the blocks pay for their layout copies."""
    cfg = small(seq_len=seq, attention="sliding", window=window)
    core = compute.layer_gemms(cfg, 2 * seq, 2, 1, False, sliding_kernel="banded")[1]
    scores = sum(g.m * g.n * g.batch * g.flop_scale for g in core[:1])
    blocks = -(-seq // window)
    assert scores == 2 * cfg.n_heads * (seq * seq if path == "dense" else blocks * window * 2 * window)
    copies = compute.elementwise_bytes(cfg, seq, 1, False, False, 4, "banded")[0]
    flex = compute.elementwise_bytes(cfg, seq, 1, False, False, 4, "flex")[0]
    assert (copies > flex) == (path == "banded")


def test_gemm_curve_saturates():
    c = GemmCurve(max_efficiency=0.8, half_dim=64.0)
    assert shape_efficiency(c, 64, 1e9, 1e9) == pytest.approx(0.4, rel=1e-6)
    assert shape_efficiency(c, 1e9, 1e9, 1e9) == pytest.approx(0.8, rel=1e-6)


def test_calibration_fit_recovers_a_known_curve():
    truth = GemmCurve(max_efficiency=0.7, half_dim=2 ** (20 / 4), overhead_s=1e-5)
    peak = 1e11
    pts = []
    for m, n, k in [(64, 64, 64), (128, 512, 256), (2048, 256, 64), (1024, 1024, 1024), (4096, 384, 384)]:
        t = truth.overhead_s + 2 * m * n * k / (peak * shape_efficiency(truth, m, n, k))
        pts.append({"m": m, "n": n, "k": k, "seconds": t})
    got = fit(pts, peak, truth.overhead_s)
    assert got.half_dim == pytest.approx(truth.half_dim)
    assert got.max_efficiency == pytest.approx(0.7, rel=1e-9)


def test_tp_overlap_hides_communication_but_not_more_than_the_gemm():
    cfg = small(d_model=1024, n_heads=8, seq_len=1024)
    a100 = load_preset("a100", use_calibration=False)
    dev = DeviceModel.from_preset(a100, 2)
    off = compute.layer_cost(cfg, dev, 1, 8, True, a100.intra, False, False, False)
    on = compute.layer_cost(cfg, dev, 1, 8, True, a100.intra, False, True, False)
    assert off.fwd_tp_exposed > on.fwd_tp_exposed > 0
    assert off.tp_comm == pytest.approx(on.tp_comm)
    par = compute.layer_cost(cfg, dev, 1, 8, True, a100.intra, True, False, False)
    assert par.tp_comm == pytest.approx(off.tp_comm / 2)  # parallel block: one AG + one RS each way


@pytest.mark.parametrize("parallel_block", [False, True])
def test_tp_overlap_hides_the_own_rows_and_the_column_wgrad_as_the_runtime_runs_them(parallel_block):
    """On a link slow enough that every collective outlasts its GEMMs, the overlap hides exactly what
    parallel/tensor/overlap.py runs under the wire (one chunk split by rank): forward, the own rows'
    GEMMs (1/tp of each group); backward, the own rows' input-gradient GEMM (1/tp of its half) and,
    under a column layer's reduce-scatter, the whole weight-gradient GEMM. The fused parallel block:
    half of the own rows' MLP under each of its two collectives (parallel/tensor/branches.py)."""
    cfg, tp = small(d_model=256, n_heads=8, seq_len=256), 4
    a100 = load_preset("a100", use_calibration=False)
    dev = DeviceModel.from_preset(a100, 1)
    slow = Link(bandwidth=1e6)
    off, on = (compute.layer_cost(cfg, dev, 1, tp, True, slow, parallel_block, ov, False)
               for ov in (False, True))
    groups = compute.layer_gemms(cfg, cfg.seq_len, 1, tp, parallel_block)
    def gemm_fwd(g):
        return dev.gemm(g.m, g.n, g.k, g.batch, g.flop_scale)

    def gemm_bwd(g):
        return dev.gemm(g.m, g.k, g.n, g.batch, g.flop_scale) + dev.gemm(g.k, g.n, g.m, g.batch, g.flop_scale)

    fwd = [sum(map(gemm_fwd, group)) for group in groups]
    bwd = [sum(map(gemm_bwd, group)) for group in groups]
    if parallel_block:  # branches.py: each of the two collectives under half of the own rows' MLP
        mlp = [*groups[0][1:], *groups[2][1:]]
        assert off.fwd_tp_exposed - on.fwd_tp_exposed == pytest.approx(sum(map(gemm_fwd, mlp)) / tp)
        assert off.bwd_tp_exposed - on.bwd_tp_exposed == pytest.approx(sum(map(gemm_bwd, mlp)) / tp)
        return
    projections = [i for i in range(len(groups)) if i != 1]  # not the attention core
    assert off.fwd_tp_exposed - on.fwd_tp_exposed == pytest.approx(sum(fwd[i] / tp for i in projections))
    hidden_bwd = sum(bwd[i] / (2 * tp) + (bwd[i] / 2 if i in {0, 3} else 0.0) for i in projections)
    assert off.bwd_tp_exposed - on.bwd_tp_exposed == pytest.approx(hidden_bwd)


# ---- pipeline ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p,v,m", [(1, 1, 5), (2, 1, 4), (4, 1, 8), (4, 1, 3), (4, 2, 8), (4, 3, 4), (8, 6, 16)]
)
def test_simulated_bubble_equals_closed_form_without_communication(p, v, m):
    tf, tb = 1.0 / v, 2.0 / v
    tl = pipeline.simulate(pipeline.PipelineSpec(p, v, m, [tf] * (p * v), [tb] * (p * v)))
    bubble = (tl.makespan - max(tl.busy)) / tl.makespan
    assert bubble == pytest.approx(pipeline.closed_form_bubble(p, v, m), abs=1e-12)
    assert tl.makespan == pytest.approx((v * m + p - 1) * (tf + tb))


def test_schedule_runs_every_op_once_and_bounds_memory():
    p, v, m = 4, 2, 8
    for r in range(p):
        ops = pipeline.schedule(p, v, m, r)
        assert sorted((o.kind, o.chunk, o.mb) for o in ops) == sorted(
            (k, c, i) for k in "FB" for c in range(v) for i in range(m)
        )
    assert pipeline.max_inflight(pipeline.schedule(4, 1, 8, 0)) == 4  # 1F1B: the first stage holds p
    assert pipeline.max_inflight(pipeline.schedule(4, 1, 8, 3)) == 1
    with pytest.raises(UserError):
        pipeline.schedule(4, 2, 6, 0)


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (2, 2), (4, 2), (3, 3)])
def test_the_planners_schedule_is_the_one_the_runtime_runs(p, v):
    """perf imports no runtime, so it keeps op lists of its own: they must be the runtime's
    (parallel/pipeline/schedule.py) op for op, on every rank, for 1F1B with and without a run-ahead
    and for interleaved 1F1B, m == p (all warm-up) included."""
    from megascale.parallel.pipeline.schedule import schedule_ops

    name = "1f1b" if v == 1 else "interleaved"
    for m in (p, 2 * p, 3 * p):
        for ahead in (0, 1) if v == 1 else (0,):
            for r in range(p):
                mine = [(o.kind, o.chunk, o.mb) for o in pipeline.schedule(p, v, m, r, ahead)]
                theirs = [(o.kind, o.chunk, o.microbatch) for o in schedule_ops(name, p, r, m, v, ahead)]
                assert mine == theirs, (p, v, m, r, ahead)


def test_blocking_p2p_costs_more_than_async_and_dp_overlap_hides_traffic():
    p, v, m = 4, 2, 8
    base = pipeline.PipelineSpec(p, v, m, [0.5] * 8, [1.0] * 8, p2p=[0.1] * p)
    t_async = pipeline.simulate(base).makespan
    t_block = pipeline.simulate(dataclasses.replace(base, async_p2p=False)).makespan
    t_free = pipeline.simulate(dataclasses.replace(base, p2p=[0.0] * p)).makespan
    assert t_free < t_async < t_block
    dp = dataclasses.replace(base, dp_ag=[0.3, 0.3], dp_rs=[0.3, 0.3])
    t_overlap = pipeline.simulate(dp).makespan
    t_serial = pipeline.simulate(dataclasses.replace(dp, dp_overlap=False)).makespan
    assert t_serial == pytest.approx(t_async + 1.2)  # all four collectives fully exposed
    assert t_async <= t_overlap < t_serial


def test_a_1f1b_run_ahead_takes_the_round_trip_out_of_the_steady_phase_for_a_micro_batch_of_memory():
    # pp2, 8 micro-batches, F 1 s, B 2 s, 0.3 s a message: with Megatron's warm-up every steady
    # backward of rank 0 waits for its activation's round trip; one forward ahead leaves only the
    # warm-up's and cool-down's messages exposed
    spec = pipeline.PipelineSpec(2, 1, 8, [1.0, 1.0], [2.0, 2.0], p2p=[0.3, 0.3])
    ideal = (8 + 2 - 1) * 3.0
    megatron = pipeline.simulate(spec).makespan
    ahead = pipeline.simulate(dataclasses.replace(spec, ahead=1)).makespan
    assert ahead == pytest.approx(ideal + 2 * 0.3)  # the first activation out, the last gradient back
    assert megatron > ahead + 1.0
    # blocking sends stall the sender: running ahead buys nothing there
    blocking = dataclasses.replace(spec, async_p2p=False)
    assert pipeline.simulate(dataclasses.replace(blocking, ahead=1)).makespan == pytest.approx(
        pipeline.simulate(blocking).makespan)
    assert pipeline.max_inflight(pipeline.schedule(2, 1, 8, 0, ahead=1)) == 3  # one more than p
    assert pipeline.max_inflight(pipeline.schedule(2, 1, 8, 1, ahead=1)) == 1  # the last rank as before


# ---- memory ------------------------------------------------------------------------------


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)


@pytest.mark.parametrize(
    "kw", [{}, {"tie_embeddings": False}, {"style": "llama", "bias": False}, {"bias": False}]
)
def test_memory_matches_a_real_model_and_adamw(kw):
    from megascale.model.gpt import GPT

    cfg = small(**kw)
    model = GPT(cfg)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert memory.total_params(cfg) == n
    opt = torch.optim.AdamW(params, lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    model(idx, idx).backward()
    opt.step()
    est = memory.estimate(cfg, 1, 1, 1, 2, 1, policy="fp32", act_bytes=4)
    assert est.params == sum(p.numel() * p.element_size() for p in params)
    assert est.grads == sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert est.optimizer == _state_bytes(opt)


def test_memory_sharding_and_recompute():
    cfg = small(n_layers=8)
    full = memory.estimate(cfg, 2, 2, 4, 1, 2, policy="megatron")
    busiest = max(memory.stage_params(cfg, 2, 2, s) for s in (0, 1))
    assert full.optimizer == pytest.approx(busiest * 12 / 4)
    assert full.activations_recompute < full.activations
    assert memory.estimate(cfg, 2, 2, 4, 1, 2, recompute=True).total < full.total


# ---- presets -----------------------------------------------------------------------------


def test_builtin_presets_load_and_user_files_are_checked(tmp_path):
    assert {"a100", "h100", "h800", "h200", "cpu"} <= set(builtin_names())
    a100 = load_preset("a100", use_calibration=False)
    assert a100.peak_flops == 312e12 and a100.devices_per_node == 8
    assert a100.inter.bandwidth == 25e9  # 8 x 200 Gb/s NICs per 8 GPUs
    assert load_preset("h800", use_calibration=False).intra.bandwidth < load_preset("h100").intra.bandwidth
    text = (a100.source and open(a100.source).read()).replace('name = "a100"', 'name = "mine"')
    mine = tmp_path / "mine.toml"
    mine.write_text(text)
    assert load_preset(str(mine), use_calibration=False).name == "mine"
    mine.write_text(text.replace("memory_bw = 2.039e12", ""))
    with pytest.raises(UserError, match="memory_bw"):
        load_preset(str(mine))
    with pytest.raises(UserError):
        load_preset("no-such-cluster")


def test_a_preset_links_cpu_cost_is_read_and_checked(tmp_path):
    a100 = load_preset("a100", use_calibration=False)
    assert a100.intra.cpu_link is None  # GPU links cost the host nothing
    text = open(a100.source).read()
    mine = tmp_path / "mine.toml"
    assert "bandwidth = 300e9\n" in text  # [links.intra]
    mine.write_text(text.replace("bandwidth = 300e9\n", "bandwidth = 300e9\ncpu_s_per_message = 2e-3\n"))
    link = load_preset(str(mine), use_calibration=False).intra
    assert link.cpu_s_per_message == 2e-3 and link.cpu_link.latency_s == 2e-3
    mine.write_text(text.replace("bandwidth = 300e9\n", "bandwidth = 300e9\ncpu_s_per_byte = -1\n"))
    with pytest.raises(UserError, match=r"\[links.intra\]: cpu_s_per_byte must be a number >= 0"):
        load_preset(str(mine), use_calibration=False)


# ---- the CPU a shared node's ranks need (perf/step.py rank_cpu_seconds) ---------------------


def _shared_node(cpu_s_per_message: float, cpu_s_per_byte: float, shared: bool = True):
    link = Link(bandwidth=1e9, latency_s=1e-4, cpu_s_per_message=cpu_s_per_message,
                cpu_s_per_byte=cpu_s_per_byte)
    cpu = load_preset("cpu", use_calibration=False)
    return dataclasses.replace(cpu, devices_per_node=2, intra=link, inter=link, shared_compute=shared)


def test_ranks_sharing_cores_are_bounded_by_their_compute_and_messages_cpu():
    from megascale.perf.step import MEGATRON, Layout, predict

    cfg, lay, batch = small(), Layout(tp=2, micro_batch=2), 8
    free = predict(cfg, lay, _shared_node(0, 0), MEGATRON, global_batch=batch, explain=True)
    assert free.breakdown.cpu_contention == 0  # links that cost no CPU: the timeline alone
    busy = predict(cfg, lay, _shared_node(1e-3, 1e-9), MEGATRON, global_batch=batch, explain=True)
    # by hand (the sequential block): each of the 2 ranks' compute at the whole node's speed plus
    # its collectives' CPU (per layer and micro-batch 4 all-gathers / reduce-scatters of a full
    # activation, forward and backward: 8 ring steps of one message and half the bytes; per micro-batch
    # the loss's all-gather of 2 fp32 numbers per token and rank; one 8-byte all-reduce, 2 steps, for
    # the grad norm)
    act = 2 * cfg.seq_len * cfg.d_model * 4
    per_layer = 8 * (1e-3 + act / 2 * 1e-9)
    loss = 1e-3 + 2 * 2 * cfg.seq_len * 2 * 4 / 2 * 1e-9
    comm = (per_layer * cfg.n_layers + loss) * free.micro_batches + 2 * (1e-3 + 8 / 2 * 1e-9)
    compute = (free.breakdown.compute + free.breakdown.optimizer) / 2  # the timeline gives each half
    assert busy.step_time == pytest.approx(2 * (compute + comm))
    assert busy.cpu_seconds == pytest.approx({"compute": compute, "comm": comm}) and free.cpu_seconds is None
    assert busy.breakdown.cpu_contention == pytest.approx(busy.step_time - free.step_time)
    from megascale.perf.report import explain
    assert "cpu contention" in explain(busy) and "cpu contention" not in explain(free)  # plan --explain
    # a cluster whose ranks do not share cores (GPUs) never pays it
    gpu_like = predict(cfg, lay, _shared_node(1e-3, 1e-9, shared=False), global_batch=batch)
    no_cost = predict(cfg, lay, _shared_node(0, 0, shared=False), global_batch=batch)
    assert gpu_like.step_time == pytest.approx(no_cost.step_time)


def test_ranks_time_slicing_a_core_lose_its_measured_efficiency(tmp_path):
    from megascale.perf.step import MEGATRON, Layout, predict

    cfg, lay, batch = small(), Layout(tp=2, micro_batch=2), 8
    node = _shared_node(1e-3, 1e-9)
    full = predict(cfg, lay, node, MEGATRON, global_batch=batch, explain=True)
    half = predict(cfg, lay, dataclasses.replace(node, shared_efficiency=0.5), MEGATRON, global_batch=batch,
                   explain=True)
    # the compute takes twice the wall time and twice the CPU; the messages' CPU is the links' own
    assert half.breakdown.compute == pytest.approx(2 * full.breakdown.compute)
    assert half.cpu_seconds["compute"] == pytest.approx(2 * full.cpu_seconds["compute"])
    assert half.cpu_seconds["comm"] == pytest.approx(full.cpu_seconds["comm"])
    # a rank alone on the node keeps its whole core
    alone = Layout(micro_batch=2)
    assert predict(cfg, alone, dataclasses.replace(node, shared_efficiency=0.5), MEGATRON,
                   global_batch=batch).step_time == pytest.approx(
        predict(cfg, alone, node, MEGATRON, global_batch=batch).step_time)
    text = open(load_preset("cpu", use_calibration=False).source).read()
    mine = tmp_path / "mine.toml"
    top = text.index("\n[")  # a top-level key goes before the first table
    mine.write_text(text[:top] + "\nshared_efficiency = 0.7" + text[top:])
    assert load_preset(str(mine), use_calibration=False).shared_efficiency == 0.7
    mine.write_text(text[:top] + "\nshared_efficiency = 1.5" + text[top:])
    with pytest.raises(UserError, match=r"shared_efficiency must be a number in \(0, 1\], got 1.5"):
        load_preset(str(mine), use_calibration=False)
