"""Peak FLOP/s of the device at hand: a GPU table, and a measured CPU probe.

MFU is achieved FLOP/s divided by the device's peak. For GPUs the peak is the vendor's
dense (no 2:4 sparsity) tensor-core figure, taken from a table with its source beside
it. A CPU has no published "peak" that a PyTorch matmul can reach (it depends on the
BLAS library, the vector units it uses and the thread count), so we *measure* it: a
short square matmul probe, warm-up first, median of several timed runs. The result is
cached in ~/.cache/megascale/hw_peaks.json, keyed by CPU model, thread count, dtype and
torch version, so a machine is probed once.

Some dtypes are pathologically slow on some CPUs (bf16 matmul on an AVX2-only CPU runs
at well under 1 GFLOP/s), so the probe first times a small matrix and shrinks `n` until
one run fits a time budget: a probe must never hold up a training run for minutes.

This module imports torch only inside the probe: the planner imports it on a laptop.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from megascale.errors import UserError

# Dense (non-sparse) peak FLOP/s by device family and dtype.
# Sources:
#  - A100 SXM4: NVIDIA A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/
#    pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5 TFLOPS, TF32 156,
#    BF16/FP16 312 TFLOPS (dense; 624 with sparsity), FP64 9.7 (19.5 tensor core).
#  - H100 SXM5: NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100/): BF16 1,979 TFLOPS
#    *with sparsity* -> 989 dense; TF32 989 sparse -> 494 dense; FP32 67; FP64 34 (67 tensor core).
#  - H800 SXM5: the export variant of H100 SXM: same compute, NVLink cut to 400 GB/s.
#  - H200 SXM: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200/): same GH100 compute as
#    H100 SXM (BF16 1,979 sparse -> 989 dense), more and faster HBM (141 GB HBM3e, 4.8 TB/s).
GPU_PEAKS: dict[str, dict[str, float]] = {
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12},
    "h100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12, "fp64": 67e12},
    "h800": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12, "fp64": 67e12},
    "h200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12, "fp64": 67e12},
}

DTYPES = ("fp32", "bf16", "fp16", "fp64", "tf32")
_PROBE_BUDGET_S = 0.5  # one timed matmul should take at most this long
_PROBE_RUNS = 5


def gpu_peak(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a GPU from its name (as torch.cuda.get_device_name gives it), or None.

    Matching is by family substring ("NVIDIA A100-SXM4-80GB" -> a100), so unknown GPUs return
    None and the caller must ask the user for a figure rather than guess one.
    """
    name = device_name.lower()
    for family, peaks in GPU_PEAKS.items():
        if family in name:
            return peaks.get(dtype)
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cache_path() -> Path:
    root = Path(os.environ.get("MEGASCALE_CACHE", Path.home() / ".cache" / "megascale"))
    return root / "hw_peaks.json"


def _read_cache() -> dict[str, float]:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, value: float) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = value
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent probes never leave a torn file
    except OSError:
        pass  # a read-only home only costs a re-probe next time


def _torch_dtype(torch, dtype: str):
    table = {
        "fp32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp64": torch.float64,
    }
    if dtype not in table:
        raise UserError(f"dtype {dtype!r}: unknown (known: {', '.join(DTYPES)})")
    return table[dtype]


def _time_matmul(torch, n: int, dt, runs: int) -> list[float]:
    a = torch.randn(n, n).to(dt)
    b = torch.randn(n, n).to(dt)
    torch.mm(a, b)  # warm-up: thread pool start, BLAS kernel selection, page faults
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return times


def measure_cpu_peak(
    dtype: str = "fp32", n: int = 2048, use_cache: bool = True, refresh: bool = False
) -> float:
    """Achievable matmul FLOP/s of this CPU for `dtype`: the best of several n x n x n matmuls.

    The best, not the median: other load on the machine only ever slows a run down, so the
    fastest run is the closest to what the hardware can do (and the figure gets cached).

    `n` is an upper bound: a 256^3 trial is timed first and n is shrunk (in steps of 2x, not
    below 128) until one matmul is predicted to take at most ~0.5 s. That keeps the probe to a
    few seconds even for dtypes the CPU has no vector units for. `refresh` re-measures and
    caches the better of the new and the cached figure (the calibration does, so MFU and the
    planner agree; the trainer does when it sees a step faster than the cached peak).
    """
    import torch

    dt = _torch_dtype(torch, dtype)
    key = f"{_cpu_model()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    if use_cache and not refresh:
        cached = _read_cache().get(key)
        if cached:
            return float(cached)
    trial = 256
    t_trial = min(_time_matmul(torch, trial, dt, runs=1))
    rate = 2 * trial**3 / max(t_trial, 1e-9)
    while n > 128 and 2 * n**3 / rate > _PROBE_BUDGET_S:
        n //= 2
    times = _time_matmul(torch, n, dt, runs=_PROBE_RUNS)
    peak = 2 * n**3 / min(times)
    if use_cache:
        # Keep the best figure ever seen: a probe taken while other work shared the cores reads
        # low, never high, and a low peak would inflate every MFU computed from it.
        peak = max(peak, float(_read_cache().get(key) or 0.0))
        _write_cache(key, peak)
    return peak


def peak_flops(device: str, dtype: str, override: float | None = None) -> float:
    """Peak FLOP/s used as the MFU denominator.

    `device` is "cpu", "cuda" (the current GPU's name is looked up) or a GPU name such as
    "A100". An explicit `override` (e.g. from the config or a cluster preset) always wins.
    """
    if override is not None:
        if override <= 0:
            raise UserError(f"peak FLOP/s override must be > 0, got {override}")
        return float(override)
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: unknown (known: {', '.join(DTYPES)})")
    if device == "cpu":
        return measure_cpu_peak(dtype)
    name = device
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
    peak = gpu_peak(name, dtype)
    if peak is None:
        raise UserError(
            f"device {name!r}: no peak FLOP/s known for {dtype} (known: {', '.join(GPU_PEAKS)}); "
            "give one explicitly"
        )
    return peak
