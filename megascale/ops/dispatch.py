"""Which implementation a fused op runs, decided at run time from the tensor in hand.

* CUDA tensor and `triton` importable: the op's Triton kernel (ops/triton_kernels.py). The
  check looks for the package without importing it; the kernels module is imported only here,
  on that path, so a CPU run never imports triton.
* Otherwise (CPU, or CUDA without triton, or float64 which the kernels do not cover): the
  op's CPU choice below, `torch.compile` of its eager twin or the eager twin itself.

The CPU choice is per op, from `python benchmarks/fused_ops.py --rounds 31 --skip-e2e` on the
2-core development machine (Intel Xeon with AVX2/FMA, 2 threads, torch 2.13 CPU, a machine
shared with other jobs, so single figures wobble by 10-20%): fwd+bwd medians at the 19M
benchmark model's shapes (2048 tokens, d_model 512, ffn 2048 GeLU / 1408 SwiGLU, 8 heads of 64),
eager twin vs its torch.compile, and peak memory of one fwd+bwd:

    op               eager ms  compiled ms  eager/compiled  compiled/eager memory  choice
    add + LayerNorm      7.60         7.52            1.01                   1.00  eager
    add + RMSNorm       18.83         6.73            2.80                   0.39  compile
    bias + GeLU         21.13        18.42            1.15                   1.00  eager
    SwiGLU              46.54        29.96            1.55                   0.33  compile
    rotary              10.76         2.96            3.64                   0.49  compile

add + LayerNorm: ATen's layer_norm kernels are as fast as the generated ones; no reason to pay
compile time. bias + GeLU: within the noise of this machine (1.04 to 1.2 over three runs), and
eager keeps the bias inside the GEMM (ops/activations.linear_bias_gelu) and the GPT style free
of compiling altogether. RMSNorm (eager: a chain of ops on CPU), SwiGLU (two strided views,
silu, product) and rotary (chunk, four products, two sums, cat) each become one generated
kernel each way, and keep less for backward. Rerun the benchmark on another machine and change
the table if its figures differ. Nothing here reads CPU features: whether compiling works at all
is found out at run time (a C++ compiler on PATH, and the first compiled call succeeding); if
it does not, the op warns once and stays on its eager twin, which computes the same function.

MEGASCALE_FUSED_CPU=eager|compile overrides the table for every op (benchmarks, debugging).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import warnings
from collections.abc import Callable

import torch

# op -> "compile" or "eager" on CPU (see the table above)
CPU_IMPL = {
    "add_layer_norm": "eager",
    "add_rms_norm": "compile",
    "bias_gelu": "eager",
    "swiglu": "compile",
    "rotary": "compile",
}

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_importable() -> bool:
    """Whether the triton package is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    """The Triton kernels take CUDA tensors of 16/32-bit floats, with triton installed (and not while
    train.compile traces the model: inductor generates its own kernels for the eager twins)."""
    return (all(t.is_cuda and t.dtype in TRITON_DTYPES for t in tensors) and not torch.compiler.is_compiling()
            and triton_importable())


def triton_kernels():
    """The kernels module; import it only where use_triton() said yes."""
    from megascale.ops import triton_kernels

    return triton_kernels


@functools.cache
def _compiler_found() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


def cpu_impl(op: str) -> str:
    """"compile" or "eager" for `op` on CPU: MEGASCALE_FUSED_CPU, else the measured table."""
    forced = os.environ.get("MEGASCALE_FUSED_CPU", "")
    if forced:
        if forced not in ("compile", "eager"):
            raise ValueError(f"MEGASCALE_FUSED_CPU must be compile or eager, got {forced!r}")
        return forced
    return CPU_IMPL[op]


class CompiledOrEager:
    """`torch.compile(eager)` where it works, else `eager`: the same function either way.

    The compiled graph is built on the first call (seconds, cached on disk by inductor); a
    failure there (no working C++ toolchain, an unsupported case) is reported once and the op
    stays eager from then on. Inputs the eager twin rejects too raise its error and change nothing.
    """

    def __init__(self, op: str, eager: Callable):
        self.op, self.eager = op, eager
        self._compiled: Callable | None = None
        self._broken = not _compiler_found()

    def __call__(self, *args):
        if self._broken:
            return self.eager(*args)
        if self._compiled is None:
            # Not fullgraph: past dynamo's recompile limit (new dtypes, shapes, grad modes) a call
            # runs the eager twin instead of failing; the functions have no graph breaks.
            self._compiled = torch.compile(self.eager)
        try:
            return self._compiled(*args)
        except Exception as e:  # noqa: BLE001 - a compile failure: fall back, say so once
            out = self.eager(*args)  # bad inputs raise here, as they would unfused, and change nothing
            self._broken = True
            warnings.warn(f"fused op {self.op}: torch.compile failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using the eager version",
                          RuntimeWarning, stacklevel=2)
            return out


def pick(op: str, eager: Callable, x: torch.Tensor) -> Callable:
    """The non-Triton implementation of `op` for tensors like x: on CPU per cpu_impl(op) (compiled
    or eager), elsewhere the eager twin (inductor would want triton on CUDA)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():  # inside train.compile: its graph fuses it
        return eager
    if cpu_impl(op) == "eager":
        return eager
    if op not in _COMPILED:
        _COMPILED[op] = CompiledOrEager(op, eager)
    return _COMPILED[op]


def compiled_on_cpu(op: str, x: torch.Tensor) -> bool:
    """Whether `op` on tensors like x would run its compiled twin (CPU, the table says compile, and
    compiling has not failed)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or cpu_impl(op) == "eager":
        return False
    fn = _COMPILED.get(op)
    return not (fn._broken if fn is not None else not _compiler_found())


_COMPILED: dict[str, CompiledOrEager] = {}  # op -> its one compiled twin (one per process)
