"""Sequence-parallel GEMMs fused with their collectives by PyTorch's symmetric-memory ops (async TP).

Why: on GPUs linked by NVLink, PyTorch's `symm_mem` ops pipeline a GEMM with its all-gather or
reduce-scatter inside one operator: each rank's shard is copied peer to peer (the copy engines, no
SMs) while the GEMM runs on the shards already there, which is what torchtitan's async TP and
Megatron's TP comm overlap do, and finer than overlap.py's chunks, whose every collective is a
separate NCCL call. parallel.tp_overlap_impl picks the path:

  "chunked"   overlap.py everywhere (our chunks and async collectives; any backend)
  "symm_mem"  these ops for the sequence-parallel layers; an error where the device has no kernel for them
  "auto"      "symm_mem" where the device has a kernel for both ops (CUDA builds), else "chunked"

Under symm_mem:
  column, SP   fwd: fused_all_gather_matmul(x, W^T) -> y, and the gathered x (kept for the wgrad)
               bwd: fused_matmul_reduce_scatter(g, W) -> dx; dW = g^T x_gathered
  row, SP      fwd: fused_matmul_reduce_scatter(x, W^T) -> y
               bwd: fused_all_gather_matmul(g, W) -> dx, and the gathered g for dW = g^T x
Plain TP's all-reduces have no fused op: those layers keep overlap.py's chunks, as do the layers
outside a collective (the parallel block's shared regions).

The sequence is dim 1, rank r's shard its r-th slice: the ops' gather_dim / scatter_dim = 1 give
exactly gather_seq's and reduce_scatter_seq's layouts. Autocast does not reach custom ops, so the
GEMM's dtype is chosen here as autocast would (its dtype where it is on) and the gradients return
in the inputs' dtypes. The ops run on the overlap's own process group (overlap.py: its own NCCL
communicator), by its name. Their communication is inside the operator, so the timers see the
layer's time as compute: the exposed TP figure counts only the other TP collectives.
"""

from __future__ import annotations

import torch
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

from megascale.config import ConfigError

IMPLS = ("auto", "chunked", "symm_mem")


def _ops():
    """The two fused ops, or None where this torch build has no symm_mem namespace."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers the ops' Python kernels)

        ns = torch.ops.symm_mem
        return ns.fused_all_gather_matmul, ns.fused_matmul_reduce_scatter
    except (ImportError, AttributeError, RuntimeError):
        return None


def has_kernels(device: torch.device | str) -> bool:
    """Whether both ops run on this device type: CUDA builds register them; a CPU build has none."""
    ops = _ops()
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(torch.device(device).type)
    if ops is None or key is None:
        return False
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(op.default.name(), key) for op in ops)


def resolve(impl: str, device: torch.device | str) -> bool:
    """Whether the symm_mem path runs (parallel.tp_overlap_impl); a ConfigError where it was asked for
    by name and cannot."""
    if impl not in IMPLS:
        raise ConfigError(f"parallel.tp_overlap_impl: must be one of {IMPLS}, got {impl!r}")
    if impl == "chunked":
        return False
    if has_kernels(device):
        return True
    if impl == "symm_mem":
        raise ConfigError(f"parallel.tp_overlap_impl: symm_mem needs PyTorch's symmetric-memory ops on "
                          f"{torch.device(device).type}, and this build has no kernel for them there "
                          f"(they run on CUDA): use 'auto' or 'chunked'")
    return False


def _compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _GatherColumn(torch.autograd.Function):
    """y = gather_seq(x) W^T + b, the all-gather inside the GEMM."""

    @staticmethod
    def forward(ctx, x, w, b, group_name):
        dt = _compute_dtype(x)
        gather, _ = _ops()
        w_c = w.to(dt)  # one cast (a copy under autocast), for the GEMM and the backward
        xg, (y,) = gather(x.to(dt), [w_c.t()], 1, group_name)
        ctx.group_name, ctx.dtypes, ctx.has_bias = group_name, (x.dtype, w.dtype), b is not None
        ctx.save_for_backward(xg, w_c)
        return y if b is None else y + b.to(dt)

    @staticmethod
    def backward(ctx, g):
        xg, w = ctx.saved_tensors
        _, reduce_scatter = _ops()
        g = g.to(w.dtype).contiguous()
        dx = reduce_scatter(g, w, "sum", 1, ctx.group_name)
        dw = (g.flatten(0, -2).T @ xg.flatten(0, -2)).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        db = g.sum((0, 1)).to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx.to(ctx.dtypes[0]), dw, db, None


class _RowReduceScatter(torch.autograd.Function):
    """y = reduce_scatter_seq(x W^T), the reduce-scatter inside the GEMM."""

    @staticmethod
    def forward(ctx, x, w, group_name):
        tp = c10d._get_group_size_by_name(group_name)
        if x.shape[1] % tp:
            raise ValueError(f"dimension 1 of size {x.shape[1]} does not split over tp={tp}")
        dt = _compute_dtype(x)
        _, reduce_scatter = _ops()
        x_c, w_c = x.to(dt).contiguous(), w.to(dt)
        ctx.group_name, ctx.dtypes = group_name, (x.dtype, w.dtype)
        ctx.save_for_backward(x_c, w_c)
        return reduce_scatter(x_c, w_c.t(), "sum", 1, group_name)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gather, _ = _ops()
        gg, (dx,) = gather(g.to(w.dtype).contiguous(), [w], 1, ctx.group_name)
        dw = (gg.flatten(0, -2).T @ x.flatten(0, -2)).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return dx.to(ctx.dtypes[0]), dw, None


@torch.compiler.disable  # as overlap.py's: run eagerly, a graph break at each call
def gather_column(x: Tensor, w: Tensor, b: Tensor | None, group_name: str) -> Tensor:
    return _GatherColumn.apply(x, w, b, group_name)


@torch.compiler.disable
def row_reduce_scatter(x: Tensor, w: Tensor, group_name: str) -> Tensor:
    return _RowReduceScatter.apply(x, w, group_name)
