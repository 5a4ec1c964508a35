"""The planner's host term (perf/host.py): the framework's work per layer and micro-batch beyond its
kernels, added to a CPU's kernels and hidden under a GPU's."""

import dataclasses

import pytest
import torch

from megascale.config import ModelConfig
from megascale.perf import compute, host
from megascale.perf.gemm import DeviceModel
from megascale.perf.presets import load_preset


def _cpu(**host_terms) -> DeviceModel:
    cpu = load_preset("cpu", use_calibration=False)
    cpu = dataclasses.replace(cpu, gemm=dataclasses.replace(cpu.gemm, **host_terms))
    return DeviceModel.from_preset(cpu, 4)


def test_host_work_adds_on_a_cpu_at_its_share_and_hides_under_a_gpus_kernels():
    cpu = _cpu()
    assert cpu.with_host(1.0, 0.25) == pytest.approx(1.25)
    # a quarter of the cores: the same CPU-seconds take four times as long, like the kernels
    quarter = DeviceModel.from_preset(load_preset("cpu", use_calibration=False), 4, share=0.25)
    assert quarter.with_host(1.0, 0.25) == pytest.approx(2.0)
    gpu = DeviceModel.from_preset(load_preset("h100", use_calibration=False), 2)
    assert gpu.host_async and not cpu.host_async
    assert gpu.with_host(1.0, 0.25) == 1.0 and gpu.with_host(0.1, 0.25) == 0.25  # launch-bound


def test_a_layer_and_a_micro_batch_carry_the_calibrated_host_terms():
    cfg = ModelConfig(vocab_size=97, seq_len=32, n_layers=2, d_model=48, n_heads=4)
    bare, loaded = _cpu(), _cpu(host_layer_fwd_s=1e-3, host_layer_bwd_s=2e-3, host_microbatch_s=3e-3)
    for tp, sp in ((1, False), (2, True)):
        a = compute.layer_cost(cfg, bare, 2, tp, sp, None, False, False, False)
        b = compute.layer_cost(cfg, loaded, 2, tp, sp, None, False, False, False)
        assert (b.fwd - a.fwd, b.bwd - a.bwd) == pytest.approx((1e-3, 2e-3))
        # recomputation reruns the forward, its framework work included
        r = compute.layer_cost(cfg, loaded, 2, tp, sp, None, False, False, True)
        assert r.bwd - a.bwd == pytest.approx(b.fwd - a.fwd + 2e-3 + a.fwd)
    head_a, head_b = compute.head_cost(cfg, bare, 2, 1), compute.head_cost(cfg, loaded, 2, 1)
    assert head_b[0] == head_a[0] and head_b[1] - head_a[1] == pytest.approx(3e-3)


def test_the_step_prediction_grows_by_the_host_work_of_every_layer_and_micro_batch():
    from megascale.perf.step import MEGATRON, Layout, predict

    cfg = ModelConfig(vocab_size=97, seq_len=32, n_layers=2, d_model=48, n_heads=4)
    lay, base = Layout(micro_batch=2), load_preset("cpu", use_calibration=False)
    terms = {"host_layer_fwd_s": 1e-3, "host_layer_bwd_s": 2e-3, "host_microbatch_s": 4e-3}
    with_host = dataclasses.replace(base, gemm=dataclasses.replace(base.gemm, **terms))
    a = predict(cfg, lay, base, MEGATRON, global_batch=8)
    b = predict(cfg, lay, with_host, MEGATRON, global_batch=8)
    # one rank, 4 micro-batches of 2 layers: 4 x (2 x 3 ms + 4 ms)
    assert b.step_time - a.step_time == pytest.approx(4 * (2 * 3e-3 + 4e-3))


def test_measuring_keeps_only_what_the_kernel_model_does_not_explain():
    torch.manual_seed(0)
    stale = _cpu(host_layer_fwd_s=5.0, host_layer_bwd_s=5.0, host_microbatch_s=5.0)  # ignored
    # kernels modelled as free: all the tiny block's and GPT's time is the framework's
    free = dataclasses.replace(stale, peak_flops=1e18, memory_bw=1e18,
                               curve=dataclasses.replace(stale.curve, overhead_s=0.0))
    got = host.measure("cpu", "fp32", free)
    assert set(got) == {"host_layer_fwd_s", "host_layer_bwd_s", "host_microbatch_s"}
    assert all(0.0 < v < 0.5 for v in got.values())  # some, and far below the stale 5 s
    # a kernel model that already gives them more time than they took leaves nothing to add
    slow = dataclasses.replace(stale, peak_flops=1e3, memory_bw=1e3)
    assert host.measure("cpu", "fp32", slow) == {"host_layer_fwd_s": 0.0, "host_layer_bwd_s": 0.0,
                                                 "host_microbatch_s": 0.0}
