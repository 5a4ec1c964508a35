"""The MLP's activations as single fused ops: bias + GeLU, and SwiGLU on the fused gate|up output.

* bias_gelu(x, bias) = gelu(x + bias), exact (erf) GeLU as megascale/model/mlp.py uses. The
  MLP hands it fc_in's matmul without the bias (Megatron's skip_bias_add; linear_bias_gelu),
  so the bias add, the GeLU and, in backward, the GeLU's gradient are one pass. The bias is
  cast to x's dtype first, as the linear layer does under autocast, so bf16 stays bf16.
* swiglu(x) = silu(gate) * up where x is fc_in's fused output laid out (ffn, [gate, up]):
  gate unit i at x[..., 2i], its up partner at x[..., 2i + 1] (see model/factory.py). The
  unfused path splits it into two strided views, runs silu, then multiplies; fused, both are
  read once and the product written once, and backward recomputes silu instead of keeping it.

The eager twins (`*_reference`) are exactly what the model runs with model.fused_ops off.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from megascale.ops import dispatch


def bias_gelu_reference(x: Tensor, bias: Tensor | None) -> Tensor:
    return F.gelu(x if bias is None else x + bias.to(x.dtype))


def swiglu_reference(x: Tensor) -> Tensor:
    gate, up = x.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def bias_gelu(x: Tensor, bias: Tensor | None) -> Tensor:
    """gelu(x + bias) (exact GeLU); bias None: gelu(x)."""
    if dispatch.use_triton(x, *([] if bias is None else [bias])):
        return dispatch.triton_kernels().bias_gelu(x, bias)
    return dispatch.pick("bias_gelu", bias_gelu_reference, x)(x, bias)


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """gelu(x @ weight^T + bias): the GeLU MLP's first half, as the fused MLP calls it.

    Where bias_gelu has a kernel of its own (Triton; the compiled twin on CPU) the matmul leaves
    the bias to it. Where it would be the eager twin, the bias stays in the GEMM (addmm: eager
    PyTorch's own fusion of it), which beats a separate add; the same function either way.
    """
    if bias is not None and (dispatch.use_triton(x, bias) or dispatch.compiled_on_cpu("bias_gelu", x)):
        return bias_gelu(F.linear(x, weight), bias)
    return F.gelu(F.linear(x, weight, bias))


def swiglu(x: Tensor) -> Tensor:
    """silu(x[..., 0::2]) * x[..., 1::2]: (..., 2f) -> (..., f)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: the gate|up features must be even, got {x.shape[-1]}")
    if dispatch.use_triton(x):
        return dispatch.triton_kernels().swiglu(x)
    return dispatch.pick("swiglu", swiglu_reference, x)(x)
