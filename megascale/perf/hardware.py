"""Peak FLOP/s of the device at hand: a GPU table, and a measured CPU probe.

MFU is achieved FLOP/s divided by the device's peak. For GPUs the peak is the vendor's
dense (no 2:4 sparsity) tensor-core figure, taken from a table with its source beside
it, one entry per part: an H100 PCIe or NVL board has 15-25% less compute than an SXM one,
and dividing by the wrong entry would understate its MFU by as much. A CPU has no published
"peak" that a PyTorch matmul can reach (it depends on the BLAS library, the vector units it
uses and the thread count), so we *measure* it: a short square matmul probe, warm-up first,
best of several timed runs. The result is cached in ~/.cache/megascale/hw_peaks.json, keyed
by CPU model, thread count, dtype and torch version, so a machine is probed once; the cache
keeps the best rate ever seen per key (a probe or any matmul work `record_matmul_rate` is
told about), since load only slows a probe and a low peak inflates MFU.

`peak_info` returns the figure with where it came from (`PeakInfo`), so a logged MFU says
what it was divided by; `peak_flops` is its bare number.

Some dtypes are pathologically slow on some CPUs (bf16 matmul on an AVX2-only CPU runs
at well under 1 GFLOP/s), so the probe first times a small matrix and shrinks `n` until
one run fits a time budget: a probe must never hold up a training run for minutes.

This module imports torch only inside the probe: the planner imports it on a laptop.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megascale.errors import UserError

try:  # POSIX; without it (Windows) cache updates are merely atomic, not serialised
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

DTYPES = ("fp32", "bf16", "fp16", "fp64", "tf32")
_PROBE_BUDGET_S = 0.5  # one timed matmul should take at most this long
_PROBE_RUNS = 5
SOURCES = ("probe", "table", "override")


@dataclass(frozen=True)
class PeakInfo:
    """The MFU denominator and where it came from, so a logged MFU can be checked by hand.

    `source` is "probe" (measured on this CPU), "table" (a GPU datasheet figure) or "override"
    (given by the user or a cluster preset); `detail` says which entry, run or setting it was.
    """

    flops: float
    source: str
    detail: str


@dataclass(frozen=True)
class GpuSpec:
    """One GPU part's dense peaks. `family` must appear in the lower-cased device name; a part with
    `markers` is chosen when one of them appears too, the part without markers (SXM) otherwise."""

    name: str
    family: str
    markers: tuple[str, ...]
    peaks: dict[str, float]
    source: str


def _peaks(bf16: float, tf32: float, fp32: float, fp64: float) -> dict[str, float]:
    return {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32, "fp64": fp64}


# Dense (no 2:4 sparsity) peak FLOP/s per part. NVIDIA prints the BF16/FP16/TF32 tensor-core figures
# *with* sparsity; the dense ones below are half of them. fp64 is the FP64 tensor-core figure (what a
# DGEMM reaches), fp32 the non-tensor FP32 one (a plain FP32 matmul without TF32).
#
# Why the variants matter: the PCIe/NVL boards run fewer SMs (H100 PCIe: 114 of 132) at lower clocks
# and power. Matching "H100 PCIe" to the SXM entry overstates its peak by 31% (989 vs 756) and so
# understates its MFU by 24% (16% for an NVL board: 989 vs 835).
#
# Sources:
#  - A100 SXM4 / PCIe: NVIDIA A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/
#    pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), one column per form factor with the same
#    compute: BF16/FP16 312 TFLOPS (624 sparse), TF32 156 (312 sparse), FP32 19.5, FP64 tensor core 19.5.
#    The PCIe card (250-300 W) sustains lower clocks under load, but its datasheet peak is the same.
#  - H100 SXM5 / PCIe / NVL: NVIDIA H100 datasheet and product page (nvidia.com/en-us/data-center/h100/):
#    SXM BF16 1,979 sparse -> 989 dense, TF32 989 -> 494, FP32 67, FP64 TC 67; PCIe BF16 1,513 -> 756,
#    TF32 756 -> 378, FP32 51, FP64 TC 51; NVL (per GPU, not per NVLink pair) BF16 1,671 -> 835,
#    TF32 835 -> 417, FP32 60, FP64 TC 60. The same dense figures are in torchtitan's get_peak_flops.
#  - H800 SXM5 / PCIe: the export variants of H100 SXM / PCIe: same tensor-core and FP32 compute
#    (DeepSeek's FlashMLA maintainers: H800 SXM5 989 dense / 1,979 sparse BF16), NVLink cut to 400 GB/s
#    and FP64 cut to about 1 TFLOPS (SXM) / 0.8 TFLOPS (PCIe) (NVIDIA H800 product briefs).
#  - H200 SXM / NVL: NVIDIA H200 product page (nvidia.com/en-us/data-center/h200/): the same GH100
#    compute as H100 SXM / NVL (SXM BF16 1,979 sparse -> 989, NVL 1,671 -> 835, FP32 67 / 60, FP64 TC
#    67 / 60) with 141 GB HBM3e at 4.8 TB/s. Some driver tables name the NVL board "H200 PCIe", so
#    "pcie" selects it too. GH200's name contains "h200" and its GPU has the same SXM figures.
GPU_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("A100 SXM", "a100", (), _peaks(312e12, 156e12, 19.5e12, 19.5e12), "NVIDIA A100 datasheet"),
    GpuSpec("A100 PCIe", "a100", ("pcie",), _peaks(312e12, 156e12, 19.5e12, 19.5e12),
            "NVIDIA A100 datasheet, PCIe column"),
    GpuSpec("H100 SXM", "h100", (), _peaks(989e12, 494e12, 67e12, 67e12), "NVIDIA H100 SXM datasheet"),
    GpuSpec("H100 PCIe", "h100", ("pcie",), _peaks(756e12, 378e12, 51e12, 51e12),
            "NVIDIA H100 PCIe datasheet"),
    GpuSpec("H100 NVL", "h100", ("nvl",), _peaks(835e12, 417e12, 60e12, 60e12), "NVIDIA H100 NVL datasheet"),
    GpuSpec("H800 SXM", "h800", (), _peaks(989e12, 494e12, 67e12, 1e12), "NVIDIA H800 SXM5 product brief"),
    GpuSpec("H800 PCIe", "h800", ("pcie",), _peaks(756e12, 378e12, 51e12, 0.8e12),
            "NVIDIA H800 PCIe product brief"),
    GpuSpec("H200 SXM", "h200", (), _peaks(989e12, 494e12, 67e12, 67e12), "NVIDIA H200 SXM datasheet"),
    GpuSpec("H200 NVL", "h200", ("nvl", "pcie"), _peaks(835e12, 417e12, 60e12, 60e12),
            "NVIDIA H200 NVL datasheet"),
)
GPU_PEAKS: dict[str, dict[str, float]] = {spec.name: spec.peaks for spec in GPU_SPECS}


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The table entry for a GPU name as torch.cuda.get_device_name gives it, or None if unknown.

    Most specific first: a part whose marker ("pcie", "nvl") is in the name wins over its family's
    default, which is the SXM part ("NVIDIA H100 80GB HBM3", "NVIDIA H200" and "NVIDIA H800" name no
    form factor). Unknown GPUs return None so that the caller asks the user instead of guessing.
    """
    name = device_name.lower()
    family = [spec for spec in GPU_SPECS if spec.family in name]
    for spec in family:
        if any(marker in name for marker in spec.markers):
            return spec
    return next((spec for spec in family if not spec.markers), None)


def gpu_peak(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a GPU from its name, or None (see `gpu_spec`)."""
    spec = gpu_spec(device_name)
    return spec.peaks.get(dtype) if spec else None


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.4g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.4g} GFLOP/s"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


# --------------------------------------------------------------------------- the peak cache
#
# hw_peaks.json maps a key (CPU model, threads, dtype, torch version) to the best matmul FLOP/s ever
# seen for it. Several processes update it at once (the ranks of a job, parallel test runs, a benchmark
# beside a training run), so an update is a read-merge-write under an exclusive flock on a lock file
# next to it: without the lock two writers of different keys both read the old file and the second
# replace drops the first one's key. The merge keeps the max per key (a figure only ever rises), and
# the write goes to a temp file then os.replace, so a reader never sees a torn file.


def _cache_path() -> Path:
    root = Path(os.environ.get("MEGASCALE_CACHE", Path.home() / ".cache" / "megascale"))
    return root / "hw_peaks.json"


def _read_cache() -> dict[str, float]:
    """The cache's entries; a missing, torn or hand-edited-to-garbage file reads as no entries."""
    try:
        raw = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: float(v) for k, v in raw.items() if isinstance(v, (int, float)) and math.isfinite(v)}


@contextmanager
def _locked(path: Path):
    """Hold an exclusive flock on `path`.lock: one read-merge-write of the cache at a time."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write_json(path: Path, data: dict[str, float]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _merge(data: dict[str, float], entries: dict[str, float]) -> dict[str, float]:
    return {**data, **{k: max(float(v), data.get(k, 0.0)) for k, v in entries.items()}}


def _update_cache(entries: dict[str, float]) -> dict[str, float]:
    """Raise the cached figures to `entries` where higher (max per key); returns the merged cache.

    A read-only or full disk costs only the record (the merged figures are still returned).
    """
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            data = _read_cache()
            merged = _merge(data, entries)
            if merged != data:
                _write_json(path, merged)
            return merged
    except OSError:
        return _merge(_read_cache(), entries)


def _write_cache(key: str, value: float) -> None:
    """Record `value` for `key` (kept for callers of the old name; it now never lowers a figure)."""
    _update_cache({key: value})


def _cpu_key(torch, dtype: str) -> str:
    return f"{_cpu_model()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"


def record_matmul_rate(dtype: str, flops_per_s: float) -> float:
    """Record a matmul rate this process has just achieved; returns the best recorded for its key.

    Any code that timed real matmul work on this CPU calls it: the trainer seeing a step faster than
    the peak, the calibration, benchmarks. Achieved work is a lower bound on what the hardware can do,
    so it can only raise the cached peak, and the next probe (even one taken on a busy machine) reads
    at least this figure. The key is this process's: CPU model, torch.get_num_threads(), dtype, torch.
    """
    import torch

    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: unknown (known: {', '.join(DTYPES)})")
    if not (math.isfinite(flops_per_s) and flops_per_s > 0):
        raise ValueError(f"flops_per_s must be finite and > 0, got {flops_per_s}")
    key = _cpu_key(torch, dtype)
    return _update_cache({key: flops_per_s}).get(key, float(flops_per_s))


# --------------------------------------------------------------------------- the CPU probe


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


def _probe(torch, dt, n: int) -> tuple[float, int]:
    """(best FLOP/s of _PROBE_RUNS n x n x n matmuls, the n used), n shrunk to fit the time budget."""
    trial = 256
    t_trial = min(_time_matmul(torch, trial, dt, runs=1))
    rate = 2 * trial**3 / max(t_trial, 1e-9)
    while n > 128 and 2 * n**3 / rate > _PROBE_BUDGET_S:
        n //= 2
    times = _time_matmul(torch, n, dt, runs=_PROBE_RUNS)
    return 2 * n**3 / max(min(times), 1e-12), n


def _cpu_peak(dtype: str, n: int, use_cache: bool, refresh: bool) -> PeakInfo:
    import torch

    dt = _torch_dtype(torch, dtype)
    key = _cpu_key(torch, dtype)
    what = f"CPU matmul probe ({_cpu_model()}, {torch.get_num_threads()} threads, {dtype})"
    if use_cache and not refresh:
        cached = _read_cache().get(key)
        if cached:
            return PeakInfo(cached, "probe", f"{what}: best rate recorded, cached in {_cache_path()}")
    measured, n = _probe(torch, dt, n)
    runs = f"best of {_PROBE_RUNS} runs of {n}^3"
    if not use_cache:
        return PeakInfo(measured, "probe", f"{what}: {runs}, measured now, not cached")
    # Load on the machine only ever slows a probe down, never speeds it up: the fastest matmul this
    # key has ever done is the closest figure to the hardware's, and a low one would inflate every MFU
    # divided by it (one probe under load gave 1000% MFU). So the probe returns the best recorded.
    best = max(measured, _update_cache({key: measured}).get(key, measured))
    how = f"{runs}: {_rate(measured)} now" + (f", {_rate(best)} recorded before" if best > measured else "")
    return PeakInfo(best, "probe", f"{what}: {how}, cached in {_cache_path()}")


def measure_cpu_peak(
    dtype: str = "fp32", n: int = 2048, use_cache: bool = True, refresh: bool = False
) -> float:
    """Achievable matmul FLOP/s of this CPU for `dtype`: the best of several n x n x n matmuls.

    The best, not the median: other load on the machine only ever slows a run down, so the
    fastest run is the closest to what the hardware can do. For the same reason, with the cache
    on the result is max(measured, best ever recorded for this key): it is never below a rate this
    machine has achieved (see `record_matmul_rate`), however busy the machine is during the probe.

    `n` is an upper bound: a 256^3 trial is timed first and n is shrunk (in steps of 2x, not
    below 128) until one matmul is predicted to take at most ~0.5 s. That keeps the probe to a
    few seconds even for dtypes the CPU has no vector units for. Without `refresh` a cached figure
    is returned as is (the probe runs once per machine); `refresh` measures again and records the
    result (the calibration does, so MFU and the planner agree). `use_cache=False` is a raw
    measurement of this moment, neither read from nor written to the cache (benchmarks compare it
    with other rates measured alongside).
    """
    return _cpu_peak(dtype, n, use_cache, refresh).flops


# --------------------------------------------------------------------------- the MFU denominator


def peak_info(device: str, dtype: str, override: float | None = None) -> PeakInfo:
    """Peak FLOP/s used as the MFU denominator, with its source ("override", "table" or "probe").

    `device` is "cpu" (the cached matmul probe), "cuda"/"cuda:N" (the current GPU's name is looked up)
    or a GPU name such as "A100" or "NVIDIA H100 PCIe". An explicit `override` (e.g. from the config
    or a cluster preset) always wins. An unknown GPU is a UserError asking for an override.
    """
    if override is not None:
        if not override > 0:
            raise UserError(f"peak FLOP/s override must be > 0, got {override}")
        return PeakInfo(float(override), "override", f"{_rate(override)} per device, given explicitly")
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: unknown (known: {', '.join(DTYPES)})")
    if device == "cpu":
        return _cpu_peak(dtype, 2048, use_cache=True, refresh=False)
    name = device
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
    spec = gpu_spec(name)
    if spec is None or dtype not in spec.peaks:
        raise UserError(
            f"device {name!r}: no peak FLOP/s known for {dtype} (known: {', '.join(GPU_PEAKS)}); "
            "give one explicitly"
        )
    part = name if spec.name.lower() in name.lower() else f"{name} ({spec.name})"
    detail = f"{part}: {dtype} dense {_rate(spec.peaks[dtype])} ({spec.source})"
    return PeakInfo(spec.peaks[dtype], "table", detail)


def peak_flops(device: str, dtype: str, override: float | None = None) -> float:
    """Peak FLOP/s used as the MFU denominator: `peak_info(...).flops`."""
    return peak_info(device, dtype, override).flops
