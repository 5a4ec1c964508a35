"""Residual add fused with LayerNorm / RMSNorm (Megatron's and Apex's "add + norm").

    h = x + residual;  y = norm(h)       ->  returns (h, y)

In the sequential block the second norm reads the stream right after the attention branch is
added to it: one fused op reads x and the branch once and writes both the new stream h (the
block adds the MLP branch to it) and the normalised y (the MLP's input). On GPU that is one
Triton kernel each way instead of an add, a norm and, in backward, the norm's gradient plus
the add of the residual's gradient. residual=None is the norm alone.

The eager twins (`*_reference`) are the ops the model runs with model.fused_ops off, so the
two paths compute the same function; tests/test_fused_ops.py holds them to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megascale.ops import dispatch


def add_layer_norm_reference(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                             bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    h = x if residual is None else x + residual
    return h, F.layer_norm(h, h.shape[-1:], weight, bias, eps)


def add_rms_norm_reference(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                           eps: float) -> tuple[Tensor, Tensor]:
    h = x if residual is None else x + residual
    return h, F.rms_norm(h, h.shape[-1:], weight, eps)


def _triton_ok(x: Tensor, residual: Tensor | None, *params: Tensor | None) -> bool:
    """The kernel computes in float32 and returns the stream's dtype (x + residual promoted). Under
    autocast the norms run in float32 and return float32, so there only a float32 stream qualifies."""
    if not dispatch.use_triton(*(t for t in (x, residual, *params) if t is not None)):
        return False
    stream = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return stream == torch.float32 or not torch.is_autocast_enabled(x.device.type)


def add_layer_norm(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                   eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, LayerNorm(x + residual)) over the last dimension."""
    if _triton_ok(x, residual, weight, bias):
        return dispatch.triton_kernels().add_layer_norm(x, residual, weight, bias, eps)
    return dispatch.pick("add_layer_norm", add_layer_norm_reference, x)(x, residual, weight, bias, eps)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                 eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, RMSNorm(x + residual)) over the last dimension."""
    if _triton_ok(x, residual, weight):
        return dispatch.triton_kernels().add_rms_norm(x, residual, weight, eps)
    return dispatch.pick("add_rms_norm", add_rms_norm_reference, x)(x, residual, weight, eps)


def add_norm(x: Tensor, residual: Tensor | None, norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(x + residual, norm(x + residual)) for the model's nn.LayerNorm or nn.RMSNorm module.

    The parameters stay in the module (same names, init and checkpoints as the unfused model).
    """
    if isinstance(norm, nn.LayerNorm):
        return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    if isinstance(norm, nn.RMSNorm):
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return add_rms_norm(x, residual, norm.weight, eps)
    raise TypeError(f"add_norm: expected nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}")
