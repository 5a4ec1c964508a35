"""The planner's host terms (perf/host.py): the framework's work per layer, micro-batch and step beyond
its kernels, added to a CPU's kernels and hidden under a GPU's, as measured in the real Trainer."""

import dataclasses
import time

import pytest

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
    bare, loaded = _cpu(), _cpu(host_layer_fwd_s=1e-3, host_layer_bwd_s=2e-3, host_microbatch_s=3e-3,
                                host_tp_call_s=1e-4, host_tp_microbatch_s=5e-3)
    for tp, sp in ((1, False), (2, True)):
        a = compute.layer_cost(cfg, bare, 2, tp, sp, None, False, False, False)
        b = compute.layer_cost(cfg, loaded, 2, tp, sp, None, False, False, False)
        calls = 4e-4 if tp > 1 else 0.0  # the sequential block's four TP collectives each way
        assert (b.fwd - a.fwd, b.bwd - a.bwd) == pytest.approx((1e-3 + calls, 2e-3 + calls))
        # recomputation reruns the forward, its framework work included
        r = compute.layer_cost(cfg, loaded, 2, tp, sp, None, False, False, True)
        assert r.bwd - a.bwd == pytest.approx(b.fwd - a.fwd + 2e-3 + calls + a.fwd)
        head_a, head_b = compute.head_cost(cfg, bare, 2, tp), compute.head_cost(cfg, loaded, 2, tp)
        assert head_b[0] == head_a[0]
        assert head_b[1] - head_a[1] == pytest.approx(3e-3 + (5e-3 if tp > 1 else 0.0))


def test_tp_collective_calls_are_counted_as_the_layer_makes_them():
    assert compute.tp_calls_per_layer(1, False) == 0
    assert compute.tp_calls_per_layer(2, False) == 4  # gather, scatter; attention and MLP
    assert compute.tp_calls_per_layer(2, True) == 2  # the parallel block shares them


def test_the_in_place_factor_scales_the_layers_kernels_but_its_projections_and_host_work():
    cfg = ModelConfig(vocab_size=97, seq_len=32, n_layers=2, d_model=48, n_heads=4)
    host_terms = {"host_layer_fwd_s": 1e-3, "host_layer_bwd_s": 2e-3}
    base, slow = _cpu(**host_terms), _cpu(**host_terms, in_place_factor=1.5, in_place_factor_tp=2.0)
    for tp, factor in ((1, 1.5), (2, 2.0)):
        a = compute.layer_cost(cfg, base, 2, tp, tp > 1, None, False, False, False)
        b = compute.layer_cost(cfg, slow, 2, tp, tp > 1, None, False, False, False)
        # the projections' GEMMs (forward, input- and weight-gradient) as calibrated: all but the core's
        groups = compute.layer_gemms(cfg, 2 * cfg.seq_len, 2, tp, False)
        gemms = sum(base.gemm(g.m, g.n, g.k) + base.gemm(g.m, g.k, g.n) + base.gemm(g.k, g.n, g.m)
                    for i, group in enumerate(groups) if i != 1 for g in group)
        assert a.in_place_base == pytest.approx(a.fwd + a.bwd - 3e-3 - gemms)
        assert 0 < a.in_place_base < a.fwd + a.bwd - 3e-3
        assert (b.fwd + b.bwd) - (a.fwd + a.bwd) == pytest.approx((factor - 1) * a.in_place_base)


def test_the_step_prediction_grows_by_the_host_work_of_every_layer_micro_batch_and_step():
    from megascale.perf.step import MEGATRON, Layout, predict

    cfg = ModelConfig(vocab_size=97, seq_len=32, n_layers=2, d_model=48, n_heads=4)
    lay, base = Layout(micro_batch=2), load_preset("cpu", use_calibration=False)
    terms = {"host_layer_fwd_s": 1e-3, "host_layer_bwd_s": 2e-3, "host_microbatch_s": 4e-3,
             "host_step_s": 7e-3, "host_layer_step_s": 5e-4}
    with_host = dataclasses.replace(base, gemm=dataclasses.replace(base.gemm, **terms))
    a = predict(cfg, lay, base, MEGATRON, global_batch=8)
    b = predict(cfg, lay, with_host, MEGATRON, global_batch=8)
    # one rank, 4 micro-batches of 2 layers: 4 x (2 x 3 ms + 4 ms), and once a step 7 ms + 2 x 0.5 ms
    assert b.step_time - a.step_time == pytest.approx(4 * (2 * 3e-3 + 4e-3) + 7e-3 + 2 * 5e-4)


def _bare() -> DeviceModel:
    dev = _cpu()
    return dataclasses.replace(dev, curve=dataclasses.replace(
        dev.curve, **dict.fromkeys(host.TERMS, 0.0), **dict.fromkeys(host.FACTORS, 1.0)))


WANT = {"S": 3e-3, "P": 4e-4, "B": 2e-4, "H": 1.5e-4, "f": 1.2}


def _made_of(dev: DeviceModel, tp: int, slow: float = 1.0) -> dict:
    """The step times perf/host.py would measure if the framework cost exactly WANT, on a machine
    running `slow` times slower than calibrated."""
    layer = compute.layer_cost(ModelConfig(**host.WIDE, n_layers=1), dev, host.MICRO_BATCH, tp, tp > 1,
                               None, False, False, False)
    times = {"ref": slow * sum(dev.gemm(*g) for g in host.reference_gemms(tp))}
    for shape, grid in ((host.TINY, host.GRID), (host.WIDE, host.WIDE_GRID)):
        excess = (WANT["f"] - 1) * layer.in_place_base if shape is host.WIDE else 0.0
        for L, M in grid:
            host_s = WANT["S"] + L * WANT["P"] + M * (WANT["B"] + L * (WANT["H"] + excess))
            times[shape["d_model"], L, M] = slow * (host.kernels(dev, tp, L, M, shape) + host_s)
    return times


def test_the_fit_recovers_the_terms_the_step_times_were_made_of():
    dev = _bare()
    for tp in (1, 2):
        got = host.fit(dev, tp, _made_of(dev, tp, slow=1.25))  # a machine at 80% of the calibrated speed
        assert got.pop("speed") == pytest.approx(0.8)
        assert got == pytest.approx(WANT)


def test_a_gpu_keeps_its_kernels_in_place_factor_at_one(monkeypatch):
    """On a GPU the wide step is launch-bound: what it adds over the kernel model is host work, which a
    factor on the kernels would multiply into every large layer the planner sizes."""
    cpu = _bare()
    gpu = dataclasses.replace(cpu, host_async=True)
    monkeypatch.setattr(host, "_run", lambda tp, *a: _made_of(cpu, tp))
    on_cpu, _ = host.measure("cpu", "fp32", cpu)
    assert (on_cpu["in_place_factor"], on_cpu["in_place_factor_tp"]) == pytest.approx((1.2, 1.2))
    assert on_cpu["host_tp_call_s"] == pytest.approx(0.0, abs=1e-12)  # the same host work at tp 1 and 2
    on_gpu, _ = host.measure("cuda", "bf16", gpu)
    assert on_gpu["in_place_factor"] == on_gpu["in_place_factor_tp"] == 1.0
    assert on_gpu["host_step_s"] == pytest.approx(WANT["S"])


@pytest.fixture(scope="module")
def trainer_steps():
    """host._run (a subprocess timing the real Trainer's steps, ~10 s each tp), memoised for this module:
    the two tests that measure fit different kernel models to the same kind of step times."""
    runs, real = {}, host._run

    def run(*args):
        if args not in runs:
            runs[args] = real(*args)
        return runs[args]
    return run


def test_measuring_runs_the_trainer_and_keeps_only_what_the_kernel_model_does_not_explain(monkeypatch,
                                                                                          trainer_steps):
    monkeypatch.setattr(host, "_run", trainer_steps)
    # kernels modelled as free: all of the tiny Trainer's time is the framework's
    stale = _cpu(host_layer_fwd_s=5.0, host_step_s=5.0, in_place_factor=9.0)  # ignored
    free = dataclasses.replace(stale, peak_flops=1e18, memory_bw=1e18,
                               curve=dataclasses.replace(stale.curve, overhead_s=0.0))
    got, times = host.measure("cpu", "fp32", free, rounds=1, steps=2)
    assert set(got) == {*host.TERMS, *host.FACTORS}
    assert set(times) == {1, 2} and {"ref", "64,1,2", "256,3,4"} <= set(times[2])
    assert 0.0 < got["host_layer_fwd_s"] + got["host_layer_bwd_s"] + got["host_microbatch_s"] < 0.5
    assert 0.0 < got["host_step_s"] + got["host_layer_step_s"] < 0.5
    assert got["host_tp_call_s"] + got["host_tp_microbatch_s"] > 0.0  # the tp path's functions cost some
    assert got["in_place_factor"] >= 1.0 and got["in_place_factor_tp"] >= 1.0


def test_plan_calibrate_stores_and_prints_the_framework_terms(tmp_path, monkeypatch, capsys, trainer_steps):
    """`megascale plan --calibrate --cluster cpu` end to end: kernels, then the Trainer's host work, one
    file the preset is overlaid with (from its default place, or from a path as benchmarks/ablation.py
    keeps its own)."""
    import json

    from megascale.perf import calibrate, cli
    from megascale.perf.presets import apply_calibration, calibration_path

    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    # every path of a calibration, at a fraction of its samples: each kernel timed for 10 ms, not 250,
    # and one round of 2 Trainer steps, the ones the test above timed (where it ran first)
    monkeypatch.setattr(host, "_run", trainer_steps)
    timed, measured = calibrate._time, host.measure
    monkeypatch.setattr(calibrate, "_time", lambda fn, budget, clock=time.perf_counter:
                        timed(fn, min(budget, 0.01), clock))
    monkeypatch.setattr(host, "measure", lambda device, dtype, dev, clock, rounds, steps:
                        measured(device, dtype, dev, clock, 1, 2))
    assert cli.main(["--calibrate", "--cluster", "cpu"]) == 0
    assert "framework, ms:" in capsys.readouterr().out
    path = calibration_path("cpu")
    stored = json.loads(path.read_text())
    assert {*host.TERMS, *host.FACTORS} <= set(stored["gemm"]) and set(stored["host_times"]) == {"1", "2"}
    # the framework's work beyond its kernels, in sum (one noisy round may put a single term at 0)
    assert sum(stored["gemm"][t] for t in host.TERMS) > 0 and stored["gemm"]["in_place_factor"] >= 1.0
    moved = tmp_path / "elsewhere.json"
    path.rename(moved)
    bare = load_preset("cpu", use_calibration=False)
    assert not apply_calibration(bare).calibrated  # nothing left in the default place
    mine = apply_calibration(bare, moved)
    assert mine.calibrated and mine.gemm.in_place_factor_tp == stored["gemm"]["in_place_factor_tp"]


def test_calibration_keeps_the_kernels_curve_when_the_host_measurement_fails(tmp_path, monkeypatch, capsys):
    """A Trainer that cannot run here (a device's quirk, a missing backend) costs the host terms, not the
    GEMM curve the calibration exists for: one line on stderr, terms 0, the error kept in the file."""
    import json

    from megascale.perf import calibrate, hardware

    def kernels_measured(*_a, **_k):
        points = [{"m": m, "n": n, "k": k, "seconds": 1e-5 + 2 * m * n * k / 5e10}
                  for m, n, k in calibrate.SHAPES]
        return {"points": points, "overhead_s": 1e-5, "memory_bw": 2e10, "gelu_fwd_s": 0.0, "gelu_bwd_s": 0.0,
                "silu_fwd_s": 0.0, "silu_bwd_s": 0.0,
                "attention": {"b": 8, "h": 4, "s": 256, "d": 64, "seconds": 1e-2}}

    def broken(*_a, **_k):
        raise RuntimeError("measuring the framework's host work at tp 2 failed (exit 1)")

    monkeypatch.setattr(hardware, "measure_cpu_peak", lambda *a, **k: 1e11)
    monkeypatch.setattr(calibrate, "measure", kernels_measured)
    monkeypatch.setattr(host, "measure", broken)
    out = calibrate.calibrate(load_preset("cpu", use_calibration=False), out=tmp_path / "cpu.json")
    assert "host work was not measured" in capsys.readouterr().err
    stored = json.loads((tmp_path / "cpu.json").read_text())
    assert stored["gemm"]["max_efficiency"] == out["gemm"]["max_efficiency"] > 0
    assert all(stored["gemm"][t] == 0.0 for t in host.TERMS)
    assert "tp 2 failed" in stored["host_times"]["error"]


def test_a_calibration_that_cannot_be_stored_is_one_clear_error(tmp_path, monkeypatch):
    """Minutes of measuring, then a store that fails (a full disk, a cache directory under a file): one line
    that says where and what to do, and no half-written file for the planner to choke on later."""
    from megascale.errors import UserError
    from megascale.perf import calibrate, hardware

    monkeypatch.setattr(hardware, "measure_cpu_peak", lambda *a, **k: 1e11)
    points = [{"m": m, "n": n, "k": k, "seconds": 1e-5 + 2 * m * n * k / 5e10}
              for m, n, k in calibrate.SHAPES]
    measured = {"points": points, "overhead_s": 1e-5, "memory_bw": 2e10, "gelu_fwd_s": 0.0, "gelu_bwd_s": 0.0,
                "silu_fwd_s": 0.0, "silu_bwd_s": 0.0,
                "attention": {"b": 8, "h": 4, "s": 256, "d": 64, "seconds": 1e-2}}
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: measured)
    monkeypatch.setattr(host, "measure", lambda *a, **k: ({t: 0.0 for t in host.TERMS}, {}))
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "cpu.json"
    with pytest.raises(UserError, match=f"cannot store the calibration in {out} .*MEGASCALE_CACHE"):
        calibrate.calibrate(load_preset("cpu", use_calibration=False), out=out)
