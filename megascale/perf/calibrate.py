"""`megascale plan --calibrate`: measure the GEMM curve and memory bandwidth of the machine at hand.

The planner's compute model (perf/gemm.py) has three GEMM parameters and a memory bandwidth.
On a GPU cluster the shipped presets carry chosen priors; here we replace them with
measurements: a dozen matmuls of the shapes a transformer layer runs (square, tall-skinny,
small head dimensions), timed after a warm-up, and a large elementwise add for bandwidth.
`half_dim` is chosen on a grid and `max_efficiency` by least squares in log-time, so a
handful of points is enough; `overhead_s` is the time of a tiny matmul (kernel launch or,
on a CPU, PyTorch's dispatch); the framework's work beyond its kernels, and how much slower a
layer's kernels run in place than alone, come from the real Trainer's steps less what the fitted
kernel model gives them (perf/host.py). The
result is stored per preset (~/.cache/megascale/calibration/NAME.json) and overlaid on the
preset from then on.

torch is imported inside the functions: the planner itself must not need it.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from megascale.errors import UserError
from megascale.perf import host
from megascale.perf.gemm import DeviceModel, shape_efficiency
from megascale.perf.presets import ClusterPreset, GemmCurve, calibration_path
from megascale.perf.step import bytes_per_element

SHAPES = [  # (m, n, k): square, token x hidden projections, attention-like small k
    (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
    (2048, 256, 256), (2048, 768, 256), (2048, 1024, 256), (2048, 256, 1024),
    (4096, 384, 384), (4096, 1536, 384), (4096, 384, 1536),
    (256, 256, 64), (256, 64, 256), (64, 64, 64), (2048, 64, 2048),
]  # fmt: skip
_BUDGET_S = 0.25  # per shape
_COLD_BYTES = 64 << 20  # more than a server CPU's last-level cache (32 MB on this EPYC)


def cpu_clock(threads: int):
    """A clock that advances with the CPU time this process gets, divided by its thread count.

    On a machine shared with other jobs, wall time measures the neighbours as much as the code;
    CPU time per thread is what an idle machine's wall time would be for well-parallelised
    kernels, so calibration and measurement can both use it and still compare.
    """
    return lambda: time.process_time() / threads


def _time(fn, budget: float, clock=time.perf_counter) -> float:
    fn()  # warm-up
    times: list[float] = []
    t_end = time.perf_counter() + budget
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 50):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    # The median, as the training-step measurement it is compared with uses: on a shared machine
    # both then see the same typical load (the fastest run would be a lucky quiet moment).
    return statistics.median(times)


def measure(device: str, dtype: str, shapes=SHAPES, budget: float = _BUDGET_S, clock: str = "wall") -> dict:
    import torch

    tick = cpu_clock(torch.get_num_threads()) if clock == "cpu" else time.perf_counter
    from megascale.perf.hardware import _torch_dtype

    dt = _torch_dtype(torch, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # Two interleaved rounds, median per shape: a burst of load from other jobs then hits one
    # sample of many shapes rather than every sample of one shape.
    samples: dict[tuple[int, int, int], list[float]] = {shape: [] for shape in shapes}
    for _ in range(2):
        for m, n, k in shapes:
            # Cycle through enough operand copies to overflow the last-level cache: in a training
            # step a GEMM's inputs come cold from memory, after other kernels evicted them.
            size = (m * k + k * n) * torch.finfo(dt).bits // 8
            copies = max(1, min(16, -(-_COLD_BYTES // size)))
            ops = [
                (torch.randn(m, k, device=device, dtype=dt), torch.randn(k, n, device=device, dtype=dt))
                for _ in range(copies)
            ]
            turn = [0]

            def run(ops=ops, turn=turn):
                a, b = ops[turn[0] % len(ops)]
                turn[0] += 1
                torch.mm(a, b)
                sync()

            samples[(m, n, k)].append(_time(run, budget / 2, tick))
    points = [{"m": m, "n": n, "k": k, "seconds": statistics.median(t)} for (m, n, k), t in samples.items()]
    tiny_a = torch.randn(8, 8, device=device, dtype=dt)
    overhead = _time(lambda: (torch.mm(tiny_a, tiny_a), sync()), 0.1, tick)
    numel = 1 << 24
    x, y, z = (torch.randn(numel, device=device, dtype=dt) for _ in range(3))
    t_add = _time(lambda: (torch.add(x, y, out=z), sync()), 0.5, tick)
    memory_bw = 3 * numel * x.element_size() / t_add
    kernels = _measure_kernels(torch, device, dt, sync, budget, tick, memory_bw)
    return {"points": points, "overhead_s": overhead, "memory_bw": memory_bw, **kernels}


def _measure_kernels(torch, device, dt, sync, budget, tick, memory_bw) -> dict:
    """Causal SDPA forward+backward, and GeLU / SiLU forward and backward per element."""
    import torch.nn.functional as F

    b, h, s, d = 8, 4, 256, 64
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=dt)

    def attn():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        sync()

    out = {"attention": {"b": b, "h": h, "s": s, "d": d, "seconds": _time(attn, budget * 2, tick)}}
    n = 1 << 22
    x = torch.randn(n, device=device, dtype=dt, requires_grad=True)
    g = torch.randn(n, device=device, dtype=dt)
    bpe = x.element_size()
    for name, fn in (("gelu", F.gelu), ("silu", F.silu)):
        t_f = _time(lambda fn=fn: (fn(x.detach()), sync()), budget, tick)
        t_fb = _time(lambda fn=fn: (fn(x).backward(g), sync()), budget, tick)
        # What the memory traffic (counted elsewhere) does not explain: forward reads + writes one
        # element, backward reads two and writes one.
        out[f"{name}_fwd_s"] = max(0.0, t_f / n - 2 * bpe / memory_bw)
        out[f"{name}_bwd_s"] = max(0.0, (t_fb - t_f) / n - 3 * bpe / memory_bw)
    return out


def attention_efficiency(curve: GemmCurve, peak: float, meas: dict) -> float:
    """Measured causal SDPA forward+backward against plain GEMMs of the same (causal) FLOPs."""
    a = meas["attention"]
    dev = DeviceModel(peak, meas["memory_bw"], curve, 4)
    frac = (a["s"] + 1) / 2 / a["s"]
    batch = a["b"] * a["h"]
    fwd = dev.gemm(a["s"], a["s"], a["d"], batch, frac, fused=True) + dev.gemm(
        a["s"], a["d"], a["s"], batch, frac, fused=True
    )
    return 3 * fwd / a["seconds"]  # backward ~ twice the forward's GEMMs


def fit(points: list[dict], peak: float, overhead: float) -> GemmCurve:
    """Least-squares fit (in log time) of max_efficiency and half_dim to measured GEMMs."""
    best: tuple[float, float, float] | None = None
    for i in range(41):
        half = 2 ** (i / 4)  # 1 .. 1024, four points per octave
        probe = GemmCurve(max_efficiency=1.0, half_dim=half, overhead_s=overhead)
        logs = []
        for p in points:
            compute_t = max(p["seconds"] - overhead, 1e-9)
            eff = 2 * p["m"] * p["n"] * p["k"] / compute_t / peak
            logs.append(math.log(eff / shape_efficiency(probe, p["m"], p["n"], p["k"])))
        log_e = statistics.fmean(logs)
        err = sum((v - log_e) ** 2 for v in logs)
        if best is None or err < best[0]:
            best = (err, half, math.exp(log_e))
    assert best is not None
    return GemmCurve(max_efficiency=best[2], half_dim=best[1], overhead_s=overhead, memory_efficiency=1.0)


def calibrate(preset: ClusterPreset, out: Path | None = None, clock: str = "wall") -> dict:
    """Measure on this machine, fit, store beside the preset name; returns what was stored."""
    import torch

    if preset.device == "cpu":
        device = "cpu"
        from megascale.perf.hardware import measure_cpu_peak

        peak = measure_cpu_peak(preset.dtype, refresh=True)
    else:
        if not torch.cuda.is_available():
            raise UserError(f"--calibrate --cluster {preset.name}: needs a GPU of that kind here; none found")
        device = "cuda"
        peak = preset.peak_flops  # the datasheet peak stays the MFU denominator
    meas = measure(device, preset.dtype, clock=clock if device == "cpu" else "wall")
    curve = fit(meas["points"], peak, meas["overhead_s"])
    extra = {k: meas[k] for k in ("gelu_fwd_s", "gelu_bwd_s", "silu_fwd_s", "silu_bwd_s")}
    curve = replace(curve, attention_efficiency=attention_efficiency(curve, peak, meas), **extra)
    # last, against the kernel model just fitted: what the framework adds (perf/host.py)
    bpe = bytes_per_element(preset.dtype)
    kernels = DeviceModel(peak, meas["memory_bw"], curve, bpe, host_async=device != "cpu")
    try:  # a GPU runs the host work ahead of its kernels: fewer steps, its terms matter less there
        rounds, steps = (3, 6) if device == "cpu" else (2, 4)
        host_terms, host_times = host.measure(device, preset.dtype, kernels,
                                              clock if device == "cpu" else "wall", rounds, steps)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # the kernels' curve is still worth keeping
        print(f"calibrate: the framework's host work was not measured (its terms stay 0): {e}",
              file=sys.stderr)
        host_terms, host_times = {}, {"error": str(e)[-2000:]}
    curve = replace(curve, **host_terms)
    result = {
        "preset": preset.name,
        "peak_flops": peak,
        "memory_bw": meas["memory_bw"],
        "gemm": asdict(curve),
        "points": meas["points"],
        "host_times": host_times,  # perf/host.py: the tiny and wide Trainer steps the host terms came from
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": clock,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    from megascale.data.atomic import write_text_atomic  # (perf/ imports no runtime at module level)

    path = out or calibration_path(preset.name)
    try:  # atomically: a full disk leaves the calibration before, not half a file the planner cannot read
        write_text_atomic(path, json.dumps(result, indent=1))
    except OSError as e:
        raise UserError(f"cannot store the calibration in {path} ({e.strerror or e}); free space there or "
                        "set MEGASCALE_CACHE to a writable directory") from None
    result["path"] = str(path)
    return result
