"""Peak FLOP/s: the GPU table, overrides, and the cached CPU probe."""

import json

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
