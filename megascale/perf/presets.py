"""Cluster presets: what one device and its links can do, read from a small TOML file.

A preset names the device's peak FLOP/s and memory, the GEMM efficiency curve, and two
link classes: `intra` (inside a node: NVLink, or loopback on a CPU) and `inter` (across
nodes: RDMA NICs). Built-in presets live beside this file (`presets/*.toml`, each figure
with its source in a comment); `--cluster` also takes a path to a user's own file with
the same fields.

A calibration (`megascale plan --calibrate --cluster NAME`) measures the GEMM curve and
the memory bandwidth on the machine at hand and stores them per preset in
~/.cache/megascale/calibration/NAME.json; loading a preset overlays that file, so a
calibrated preset is used from then on without editing the shipped TOML.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megascale.errors import UserError

PRESET_DIR = Path(__file__).with_name("presets")


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: `latency_s` per message (alpha), `bandwidth * efficiency` bytes/s (1/beta)."""

    bandwidth: float  # bytes/s per device per direction
    efficiency: float = 1.0  # fraction of `bandwidth` that collectives reach on large messages
    latency_s: float = 0.0
    # Host CPU a rank spends per message and per byte it sends (gloo's copies, the kernel's TCP work).
    # 0 on GPU clusters, where NICs and copy engines move data; on a shared_compute preset it competes
    # with the ranks' compute for the node's cores (perf/step.py bounds the step by the sum).
    cpu_s_per_message: float = 0.0
    cpu_s_per_byte: float = 0.0

    @property
    def cpu_link(self) -> Link | None:
        """The host CPU time of a collective over this link, as a link: `collectives` then gives a
        rank's CPU seconds instead of wall seconds (alpha per message, beta per byte sent)."""
        if not (self.cpu_s_per_message or self.cpu_s_per_byte):
            return None
        return Link(bandwidth=1.0 / max(self.cpu_s_per_byte, 1e-30), latency_s=self.cpu_s_per_message)

    @property
    def effective_bw(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class GemmCurve:
    """Parameters of the GEMM efficiency curve (see perf/gemm.py for the formula and why)."""

    max_efficiency: float = 0.85
    half_dim: float = 64.0
    overhead_s: float = 5e-6
    memory_efficiency: float = 0.8  # fraction of memory_bw that elementwise kernels reach
    # The attention kernel (flash/SDPA) runs its GEMM-equivalent FLOPs this much slower or faster than
    # plain GEMMs of the same shapes would (softmax, exp and rescaling are inside it).
    attention_efficiency: float = 1.0
    # Seconds per element of activation functions beyond their memory traffic (0 on GPUs, where they
    # are memory-bound; on CPUs erf/exp make them compute-bound). Forward and backward.
    gelu_fwd_s: float = 0.0
    gelu_bwd_s: float = 0.0
    silu_fwd_s: float = 0.0
    silu_bwd_s: float = 0.0
    # The framework's own seconds per layer and micro-batch (Python modules, autograd, allocations;
    # perf/host.py), forward and backward: they add to a CPU's kernels and hide under a GPU's.
    host_layer_fwd_s: float = 0.0
    host_layer_bwd_s: float = 0.0
    host_microbatch_s: float = 0.0  # outside the layers: embedding, head, loss; forward + backward
    host_tp_call_s: float = 0.0  # each TP collective call's functions (compute.tp_calls_per_layer)
    host_tp_microbatch_s: float = 0.0  # what tp > 1 adds per micro-batch outside the layers
    host_step_s: float = 0.0  # per step: the loader, the timers, the optimizer's set-up
    host_layer_step_s: float = 0.0  # per step and layer a rank holds: optimizer, clipping, zeroing
    # A layer's kernels but its projections' GEMMs (attention, memory-bound kernels) in the Trainer against
    # the kernel model's, each timed alone; measured at a typical small layer (perf/host.py), at tp 1 and
    # under tp > 1 (with SP's layout copies)
    in_place_factor: float = 1.0
    in_place_factor_tp: float = 1.0


@dataclass(frozen=True)
class ClusterPreset:
    name: str
    device: str
    dtype: str
    peak_flops: float  # dense FLOP/s of one device in `dtype`
    memory_bytes: float  # per device
    memory_bw: float  # bytes/s, per device
    devices_per_node: int
    intra: Link
    inter: Link
    gemm: GemmCurve = field(default_factory=GemmCurve)
    shared_compute: bool = False  # CPU processes on one node share its cores
    # shared_compute: the fraction of its throughput a core keeps when it time-slices several ranks
    # (benchmarks/ablation.py measures it on its cluster: 4 tp2 ranks a core did their work at 0.78-0.83
    # of the speed they had on a core each). 1: no loss.
    shared_efficiency: float = 1.0
    # How sliding-window attention runs: "flex" skips masked blocks (FlexAttention on CUDA); "banded"
    # computes each query block against two key blocks with a mask (megascale.ops, CPU path).
    sliding_kernel: str = "flex"
    calibrated: bool = False
    source: str = ""

    def device_share(self, devices_on_node: int) -> float:
        """Fraction of the calibrated throughput one device gets when `devices_on_node` run at once."""
        if not self.shared_compute:
            return 1.0
        k = max(1, devices_on_node)
        return (self.shared_efficiency if k > 1 else 1.0) / k


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def calibration_path(name: str) -> Path:
    root = Path(os.environ.get("MEGASCALE_CACHE", Path.home() / ".cache" / "megascale"))
    return root / "calibration" / f"{name}.json"


def load_preset(name_or_path: str, use_calibration: bool = True) -> ClusterPreset:
    """A preset by built-in name ("a100", "cpu", ...) or by path to a TOML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise UserError(
                f"--cluster {name_or_path}: no such preset (built-in: {', '.join(builtin_names())}; "
                "or give a path to a .toml file)"
            )
    elif not path.is_file():
        raise UserError(f"--cluster {name_or_path}: file does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--cluster {path}: not valid TOML ({e})") from None
    preset = _from_dict(raw, str(path))
    if use_calibration:
        preset = apply_calibration(preset)
    return preset


def apply_calibration(preset: ClusterPreset, path: Path | None = None) -> ClusterPreset:
    """Overlay the stored calibration of this preset (or the one at `path`), if one exists."""
    path = path or calibration_path(preset.name)
    try:
        cal = json.loads(path.read_text())
    except (OSError, ValueError):
        return preset
    gemm = replace(preset.gemm, **{k: float(v) for k, v in cal.get("gemm", {}).items()})
    return replace(
        preset,
        gemm=gemm,
        peak_flops=float(cal.get("peak_flops", preset.peak_flops)),
        memory_bw=float(cal.get("memory_bw", preset.memory_bw)),
        calibrated=True,
    )


def _need(raw: dict[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise UserError(f"cluster preset {where}: missing field {key!r}")
    return raw[key]


def _num(raw: dict[str, Any], key: str, where: str) -> float:
    value = _need(raw, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"cluster preset {where}: {key} must be a number > 0, got {value!r}")
    return float(value)


def _link(raw: dict[str, Any], which: str, where: str) -> Link:
    sect = _need(_need(raw, "links", where), which, where)
    return Link(
        bandwidth=_num(sect, "bandwidth", f"{where} [links.{which}]"),
        efficiency=float(sect.get("efficiency", 1.0)),
        latency_s=float(sect.get("latency_s", 0.0)),
        cpu_s_per_message=_at_least_0(sect, "cpu_s_per_message", f"{where} [links.{which}]"),
        cpu_s_per_byte=_at_least_0(sect, "cpu_s_per_byte", f"{where} [links.{which}]"),
    )


def _at_least_0(raw: dict[str, Any], key: str, where: str) -> float:
    value = raw.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise UserError(f"cluster preset {where}: {key} must be a number >= 0, got {value!r}")
    return float(value)


def _fraction(raw: dict[str, Any], key: str, where: str) -> float:
    value = raw.get(key, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UserError(f"cluster preset {where}: {key} must be a number in (0, 1], got {value!r}")
    return float(value)


def _from_dict(raw: dict[str, Any], where: str) -> ClusterPreset:
    dtype = str(raw.get("dtype", "bf16"))
    peak = raw.get("peak_flops")
    if peak == "probe":
        from megascale.perf.hardware import measure_cpu_peak

        peak = measure_cpu_peak(dtype)
    mem = raw.get("memory_bytes")
    if mem == "probe":
        mem = _total_ram()
    g = raw.get("gemm", {})
    known = {f for f in GemmCurve.__dataclass_fields__}
    unknown = set(g) - known
    if unknown:
        raise UserError(f"cluster preset {where}: unknown [gemm] field(s) {sorted(unknown)}")
    return ClusterPreset(
        name=str(_need(raw, "name", where)),
        device=str(raw.get("device", "")),
        dtype=dtype,
        peak_flops=_num({"peak_flops": peak}, "peak_flops", where),
        memory_bytes=_num({"memory_bytes": mem}, "memory_bytes", where),
        memory_bw=_num(raw, "memory_bw", where),
        devices_per_node=int(_num(raw, "devices_per_node", where)),
        intra=_link(raw, "intra", where),
        inter=_link(raw, "inter", where),
        gemm=GemmCurve(**{k: float(v) for k, v in g.items()}),
        shared_compute=bool(raw.get("shared_compute", False)),
        shared_efficiency=_fraction(raw, "shared_efficiency", where),
        sliding_kernel=str(raw.get("sliding_kernel", "flex")),
        source=where,
    )


def _total_ram() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9
