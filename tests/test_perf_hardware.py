"""Peak FLOP/s: the GPU table, overrides, and the cached CPU probe."""

import json
import multiprocessing

import pytest

from megascale.errors import UserError
from megascale.perf import hardware


def test_gpu_table_dense_bf16():
    assert hardware.gpu_peak("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert hardware.gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert hardware.gpu_peak("H800", "bf16") == hardware.gpu_peak("H200", "bf16")
    assert hardware.gpu_peak("A100", "fp32") == 19.5e12
    assert hardware.gpu_peak("Tesla T4", "bf16") is None


def test_peak_flops_override_and_errors():
    assert hardware.peak_flops("cpu", "fp32", override=5e9) == 5e9
    assert hardware.peak_flops("A100", "bf16") == 312e12
    with pytest.raises(UserError):
        hardware.peak_flops("Tesla T4", "bf16")
    with pytest.raises(UserError):
        hardware.peak_flops("cpu", "int3")
    with pytest.raises(UserError):
        hardware.peak_flops("cpu", "fp32", override=-1.0)


def test_cpu_probe_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    peak = hardware.measure_cpu_peak("fp32", n=256)
    assert peak > 1e8  # any CPU that runs the tests does more than 0.1 GFLOP/s
    data = json.loads((tmp_path / "hw_peaks.json").read_text())
    (key,) = data
    assert "fp32" in key and "threads=" in key and "torch=" in key
    data[key] = 123.0  # a cached value is returned as is: the probe runs once per machine
    (tmp_path / "hw_peaks.json").write_text(json.dumps(data))
    assert hardware.measure_cpu_peak("fp32", n=256) == 123.0


# --------------------------------------------------------------------------- GPU parts

# (torch.cuda.get_device_name string, table entry, dense bf16, fp32)
GPU_NAMES = [
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312e12, 19.5e12),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312e12, 19.5e12),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312e12, 19.5e12),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312e12, 19.5e12),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12, 67e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, 51e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12, 60e12),
    ("NVIDIA H800", "H800 SXM", 989e12, 67e12),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756e12, 51e12),
    ("NVIDIA H200", "H200 SXM", 989e12, 67e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12, 60e12),
]


@pytest.mark.parametrize("name,entry,bf16,fp32", GPU_NAMES)
def test_gpu_names_resolve_to_their_part(name, entry, bf16, fp32):
    assert hardware.gpu_spec(name).name == entry
    assert hardware.gpu_peak(name, "bf16") == hardware.gpu_peak(name, "fp16") == bf16
    assert hardware.gpu_peak(name, "fp32") == fp32


def test_pcie_and_nvl_parts_are_not_the_sxm_entry():
    sxm = hardware.gpu_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert hardware.gpu_peak("NVIDIA H100 PCIe", "bf16") < hardware.gpu_peak("NVIDIA H100 NVL", "bf16") < sxm
    assert hardware.gpu_peak("NVIDIA H200 NVL", "bf16") < hardware.gpu_peak("NVIDIA H200", "bf16")
    assert hardware.gpu_peak("NVIDIA H800 PCIe", "bf16") < hardware.gpu_peak("NVIDIA H800", "bf16")
    # TF32 dense is half of BF16 dense on every Hopper part; the H800s have almost no FP64
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H800 PCIe"):
        assert hardware.gpu_peak(name, "tf32") == pytest.approx(hardware.gpu_peak(name, "bf16") / 2, rel=2e-3)
    assert hardware.gpu_peak("NVIDIA H800", "fp64") < 2e12 < hardware.gpu_peak("NVIDIA H100 PCIe", "fp64")


# H20 is a much slower Hopper part whose name is a prefix of "H200": it must not match the H200 entry.
@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA GeForce RTX 4090", "NVIDIA L40S", "NVIDIA A10G", "H20"])
def test_unknown_gpus_are_none_and_ask_for_a_figure(name):
    assert hardware.gpu_spec(name) is None and hardware.gpu_peak(name, "bf16") is None
    with pytest.raises(UserError, match="give one explicitly"):
        hardware.peak_info(name, "bf16")


# --------------------------------------------------------------------------- PeakInfo sources


def test_peak_info_override_and_table():
    info = hardware.peak_info("NVIDIA H100 PCIe", "bf16", override=123e12)
    assert info == hardware.PeakInfo(123e12, "override", info.detail) and "123 TFLOP/s" in info.detail
    info = hardware.peak_info("NVIDIA H100 PCIe", "bf16")
    assert (info.flops, info.source) == (756e12, "table")
    assert info.detail == "NVIDIA H100 PCIe: bf16 dense 756 TFLOP/s (NVIDIA H100 PCIe datasheet)"
    info = hardware.peak_info("NVIDIA H100 80GB HBM3", "tf32")
    assert info.source == "table" and "(H100 SXM)" in info.detail and "494 TFLOP/s" in info.detail
    assert hardware.peak_flops("NVIDIA H200 NVL", "bf16") == 835e12
    with pytest.raises(UserError):
        hardware.peak_info("cpu", "fp32", override=float("nan"))


def test_peak_info_cpu_is_the_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    hardware.record_matmul_rate("fp32", 7e9)  # a cached figure: no probe runs in this test
    info = hardware.peak_info("cpu", "fp32")
    assert (info.flops, info.source) == (7e9, "probe")
    assert "CPU matmul probe" in info.detail and "threads" in info.detail and str(tmp_path) in info.detail
    assert hardware.peak_flops("cpu", "fp32") == 7e9


# --------------------------------------------------------------------------- the peak cache


def test_probe_never_reads_below_the_best_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    best = 1e18  # far above what any CPU does: the probe itself cannot reach it
    assert hardware.record_matmul_rate("fp32", best) == best
    assert hardware.measure_cpu_peak("fp32", n=256, refresh=True) >= 0.9 * best  # measured, then max
    assert hardware.measure_cpu_peak("fp32", n=256) >= 0.9 * best  # cached
    info = hardware.peak_info("cpu", "fp32")
    assert info.flops >= 0.9 * best
    # a raw measurement (use_cache=False, for benchmarks) is this moment's rate only, and records nothing
    raw = hardware.measure_cpu_peak("fp32", n=256, use_cache=False)
    assert 1e8 < raw < best
    assert max(json.loads((tmp_path / "hw_peaks.json").read_text()).values()) == best


def test_record_matmul_rate_only_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    assert hardware.record_matmul_rate("bf16", 5e9) == 5e9
    assert hardware.record_matmul_rate("bf16", 1e9) == 5e9  # a slower run never lowers the peak
    assert hardware.record_matmul_rate("bf16", 6e9) == 6e9
    (key,) = json.loads((tmp_path / "hw_peaks.json").read_text())
    assert "|bf16|" in key and "threads=" in key and "torch=" in key  # the probe's key format
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            hardware.record_matmul_rate("bf16", bad)
    with pytest.raises(UserError):
        hardware.record_matmul_rate("int3", 1e9)


def test_unreadable_cache_reads_as_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    for junk in ("{torn", "[1, 2]", '{"a": "fast", "b": 3.0}'):
        (tmp_path / "hw_peaks.json").write_text(junk)
        assert hardware._read_cache() == ({"b": 3.0} if "fast" in junk else {})
    assert hardware.record_matmul_rate("fp32", 2e9) == 2e9  # and is rewritten whole


ROUNDS = 25


def _writer(i: int) -> None:
    # Each process raises its own key and a shared one, round after round: without the lock, two
    # processes that read the file before either replaced it drop the other's key.
    for r in range(1, ROUNDS + 1):
        hardware._update_cache({f"writer{i}": float(r), "shared": float(100 * i + r)})


def test_concurrent_writers_lose_no_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    hardware._update_cache({"before": 1.0})
    ctx = multiprocessing.get_context("fork")  # the children need no torch: forking is cheap
    procs = [ctx.Process(target=_writer, args=(i,)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * 8
    data = json.loads((tmp_path / "hw_peaks.json").read_text())
    assert data == {"before": 1.0, "shared": 100 * 7 + ROUNDS, **{f"writer{i}": ROUNDS for i in range(8)}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hw_peaks.json", "hw_peaks.json.lock"]  # no temps
