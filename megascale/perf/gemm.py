"""Time of one GEMM and of one memory-bound kernel on a device described by a preset.

A GEMM of shape (m x k) @ (k x n) does 2*m*n*k FLOPs. Real kernels reach a fraction of the
peak that depends on the shape: tiles are partly empty when a dimension is small, and a
skinny GEMM is bound by memory, not by the tensor cores. The curve used here is

    eff(m, n, k) = max_efficiency * g(m) * g(n) * g(k),   g(x) = x / (x + half_dim)
    t = overhead_s + max(2*m*n*k / (peak * eff), bytes / (memory_bw * memory_efficiency))

`g` is a saturating curve: a dimension of `half_dim` halves the throughput, large ones
cost nothing. Three parameters capture what matters for an LLM layer (huge square-ish
GEMMs near the plateau, small head dimensions in attention well below it) and can be
fitted by least squares to a handful of measured matmuls (`perf/calibrate.py`), which
a free-form table could not be on a 2-core machine within a minute.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.perf.presets import ClusterPreset, GemmCurve


def shape_efficiency(curve: GemmCurve, m: float, n: float, k: float) -> float:
    g = 1.0
    for x in (m, n, k):
        g *= x / (x + curve.half_dim)
    return curve.max_efficiency * g


@dataclass(frozen=True)
class DeviceModel:
    """Compute-time model of one device: FLOP/s peak, efficiency curve, memory bandwidth."""

    peak_flops: float
    memory_bw: float
    curve: GemmCurve
    bytes_per_element: int
    # The fraction of the device's throughput this rank gets (shared_compute: ranks time-slicing a
    # CPU's cores); peak_flops and memory_bw are already scaled by it, per-kernel and per-element CPU
    # costs are scaled where they are used. A CPU runs the framework's host work (curve.host_layer_*)
    # on the cores that run the kernels; a GPU runs it ahead of its kernels, asynchronously.
    share: float = 1.0
    host_async: bool = False

    @classmethod
    def from_preset(cls, preset: ClusterPreset, bytes_per_element: int, share: float = 1.0) -> DeviceModel:
        return cls(preset.peak_flops * share, preset.memory_bw * share, preset.gemm, bytes_per_element,
                   share=share, host_async=preset.device != "cpu")

    def with_host(self, kernels: float, host_cpu_s: float) -> float:
        """Seconds of a stretch of kernels that also costs the host `host_cpu_s` CPU-seconds: the sum on
        a CPU (same cores, at this device's share), the longer of the two on a GPU (the host runs ahead
        and the kernels wait only when it falls behind)."""
        host = host_cpu_s / self.share
        return max(kernels, host) if self.host_async else kernels + host

    def gemm(
        self,
        m: float,
        n: float,
        k: float,
        batch: float = 1.0,
        flop_scale: float = 1.0,
        eff_scale: float = 1.0,
        fused: bool = False,
    ) -> float:
        """Seconds for `batch` GEMMs of (m x k) @ (k x n); `flop_scale` < 1 for causal masking,
        `eff_scale` for kernels that are GEMM-like but slower (fused attention). A `fused` GEMM
        (inside an attention kernel) does not write its m x n result to memory: a flash kernel keeps
        it on chip (the CPU's banded sliding-window kernel runs on one too)."""
        flops = 2.0 * m * n * k * batch * flop_scale
        eff = shape_efficiency(self.curve, m, n, k) * eff_scale
        moved = (m * k + k * n + (0 if fused else m * n)) * batch * self.bytes_per_element
        t_compute = flops / (self.peak_flops * eff)
        t_memory = moved / (self.memory_bw * self.curve.memory_efficiency)
        return self.curve.overhead_s / self.share + max(t_compute, t_memory)

    def elementwise(self, n_bytes: float, n_kernels: int = 1) -> float:
        """Seconds for memory-bound kernels moving `n_bytes` in total (reads + writes)."""
        return (n_kernels * self.curve.overhead_s / self.share
                + n_bytes / (self.memory_bw * self.curve.memory_efficiency))
