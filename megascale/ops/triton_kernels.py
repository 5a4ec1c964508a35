"""Triton kernels of the fused ops, for CUDA tensors. Imported only by ops/dispatch.py's
triton_kernels(), after use_triton() found a CUDA tensor and the triton package: a CPU run never
imports this module (tests/test_fused_ops.py checks it).

Each op is an autograd.Function over small kernels that read their inputs once and write their
outputs once, computing in float32 and storing in the tensors' dtype, rounded where the eager
twin rounds (the new residual stream before the norm, the bias cast to x's dtype, the rotary
tables cast to x's dtype). Shapes are flattened to rows over the last dimension; anything the
kernels do not cover goes back to the eager twin before it gets here (see the ops' modules).
Kept deliberately short: the point is one pass over memory per op, not the last few percent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def _block(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


# ---------------------------------------------------------------------------------------
# add + LayerNorm / RMSNorm: one program per row forward; backward rows strided over a grid,
# each program summing its rows' weight/bias gradients, then one small torch sum over programs.


@triton.jit
def _add_norm_fwd(X, R, W, B, H, Y, Mean, Rstd, N, eps,
                  HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        x = x + tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        h = x.to(H.dtype.element_ty)
        tl.store(H + row * N + cols, h, mask=mask)
        x = h.to(tl.float32)  # normalise the stream as stored, as the eager add + norm does
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        tl.store(Mean + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(Rstd + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_norm_bwd(Hs, DY, DH, W, Mean, Rstd, DX, DW, DB, M, N,
                  HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full((BLOCK,), 1.0, dtype=tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, M, programs):
        off = row * N + cols  # row is int64 (pid is): no overflow past 2**31 elements
        x = tl.load(Hs + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
        wdy = dy * w
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DH:  # the gradient of the returned stream h joins the norm's
            dx = dx + tl.load(DH + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=mask)


class _AddNorm(torch.autograd.Function):
    """(h, y) = (x + residual, norm(x + residual)); with residual None, y = norm(x) alone."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        shape, n = x.shape, x.shape[-1]
        xr = _rows(x)
        has_r = residual is not None
        stream = torch.promote_types(x.dtype, residual.dtype) if has_r else x.dtype
        h = torch.empty(xr.shape, dtype=stream, device=x.device) if has_r else xr
        y = torch.empty(xr.shape, dtype=stream, device=x.device)
        m = xr.shape[0]
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        _add_norm_fwd[(m,)](xr, _rows(residual) if has_r else xr, weight if weight is not None else xr,
                            bias if bias is not None else xr, h, y, mean, rstd, n, eps, HAS_R=has_r,
                            HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, BLOCK=_block(n),
                            num_warps=4 if n <= 4096 else 8)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.has_r, ctx.has_b, ctx.rms, ctx.shape = has_r, bias is not None, rms, shape
        ctx.dtypes = (x.dtype, residual.dtype if has_r else None)
        if has_r:
            return h.view(shape), y.view(shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, *grads):
        dh, dy = grads if ctx.has_r else (None, grads[0])
        h, weight, mean, rstd = ctx.saved_tensors
        m, n = h.shape
        dyr = _rows(dy) if dy is not None else torch.zeros_like(h)  # y unused: only h's gradient
        dhr = _rows(dh) if dh is not None else None
        dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 1
        programs = max(1, min(m, 4 * sms))
        dw = torch.empty((programs, n), dtype=torch.float32, device=h.device) if weight is not None else None
        db = torch.empty((programs, n), dtype=torch.float32, device=h.device) if ctx.has_b else None
        _add_norm_bwd[(programs,)](h, dyr, dhr if dhr is not None else dyr,
                                   weight if weight is not None else h, mean, rstd, dx,
                                   dw if dw is not None else dx, db if db is not None else dx, m, n,
                                   HAS_DH=dhr is not None, HAS_W=weight is not None, HAS_B=ctx.has_b,
                                   RMS=ctx.rms, BLOCK=_block(n), num_warps=4 if n <= 4096 else 8)
        dx = dx.view(ctx.shape)
        gx = dx.to(ctx.dtypes[0])
        gr = dx.to(ctx.dtypes[1]) if ctx.has_r else None
        gw = dw.sum(0).to(weight.dtype) if weight is not None else None
        gb = db.sum(0).to(weight.dtype if weight is not None else h.dtype) if ctx.has_b else None
        return gx, gr, gw, gb, None, None


def _add_norm(x, residual, weight, bias, eps, rms) -> tuple[Tensor, Tensor]:
    if residual is None:
        return x, _AddNorm.apply(x, None, weight, bias, eps, rms)
    return _AddNorm.apply(x, residual, weight, bias, eps, rms)


def add_layer_norm(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                   eps: float) -> tuple[Tensor, Tensor]:
    return _add_norm(x, residual, weight, bias, eps, False)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                 eps: float) -> tuple[Tensor, Tensor]:
    return _add_norm(x, residual, weight, None, eps, True)


# ---------------------------------------------------------------------------------------
# bias + GeLU (exact): elementwise over (rows, f); the bias gradient is a torch sum of dx.


@triton.jit
def _bias_gelu(X, B, DY, OUT, total, F, HAS_B: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_B:  # the bias rounded to x's dtype, then the sum rounded, as the eager twin does
        b = tl.load(B + offs % F, mask=mask, other=0.0).to(x.dtype)
        x = (x.to(tl.float32) + b.to(tl.float32)).to(X.dtype.element_ty)
    z = x.to(tl.float32)
    cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
    if BACKWARD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        out = dy * (cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z))
    else:
        out = z * cdf
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        xr = _rows(x)
        y = torch.empty_like(xr)
        total, f = xr.numel(), xr.shape[-1]
        grid = (triton.cdiv(total, 1024),)
        _bias_gelu[grid](xr, bias if bias is not None else xr, xr, y, total, f, HAS_B=bias is not None,
                         BACKWARD=False, BLOCK=1024)
        ctx.save_for_backward(xr, bias)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xr, bias = ctx.saved_tensors
        dx = torch.empty_like(xr)
        total, f = xr.numel(), xr.shape[-1]
        _bias_gelu[(triton.cdiv(total, 1024),)](xr, bias if bias is not None else xr, _rows(dy), dx, total, f,
                                                HAS_B=bias is not None, BACKWARD=True, BLOCK=1024)
        db = dx.sum(0, dtype=torch.float32).to(bias.dtype) if bias is not None else None
        return dx.view(ctx.shape), db


def bias_gelu(x: Tensor, bias: Tensor | None) -> Tensor:
    return _BiasGelu.apply(x, bias)


# ---------------------------------------------------------------------------------------
# SwiGLU on the interleaved (ffn, [gate, up]) layout: output i reads x[2i] and x[2i + 1].


@triton.jit
def _swiglu(X, DY, OUT, total, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # output (f) index, flat
    mask = offs < total
    g = tl.load(X + 2 * offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    if BACKWARD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + 2 * offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(OUT.dtype.element_ty), mask=mask)
        tl.store(OUT + 2 * offs + 1, (dy * g * sig).to(OUT.dtype.element_ty), mask=mask)
    else:
        # silu(gate) rounded to x's dtype before the product, as the eager twin does
        a = (g * sig).to(X.dtype.element_ty).to(tl.float32)
        tl.store(OUT + offs, (a * u).to(OUT.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        xr = _rows(x)
        y = torch.empty((xr.shape[0], xr.shape[1] // 2), dtype=x.dtype, device=x.device)
        total = y.numel()
        _swiglu[(triton.cdiv(total, 1024),)](xr, xr, y, total, BACKWARD=False, BLOCK=1024)
        ctx.save_for_backward(xr)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (xr,) = ctx.saved_tensors
        dx = torch.empty_like(xr)
        total = dx.numel() // 2
        _swiglu[(triton.cdiv(total, 1024),)](xr, _rows(dy), dx, total, BACKWARD=True, BLOCK=1024)
        return dx.view(ctx.shape)


def swiglu(x: Tensor) -> Tensor:
    return _SwiGLU.apply(x)


# ---------------------------------------------------------------------------------------
# Rotary: x (B, H, S, D) of any strides (q and k are views of the qkv output), tables (S, D/2);
# y contiguous. Backward is the same kernel rotating by -angle (SIGN = -1).


@triton.jit
def _rotary(X, COS, SIN, Y, H, S, sxb, sxh, sxs, syb, syh, sys, SIGN: tl.constexpr, HALF: tl.constexpr,
            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (s < S) & (d < HALF)
    xp = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + s * sxs + d
    x1 = tl.load(xp, mask=mask, other=0.0)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0)
    # the tables rounded to x's dtype first, as Rotary.forward does
    c = tl.load(COS + s * HALF + d, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    sn = SIGN * tl.load(SIN + s * HALF + d, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    yp = Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh + s * sys + d
    tl.store(yp, (a1 * c - a2 * sn).to(Y.dtype.element_ty), mask=mask)
    tl.store(yp + HALF, (a2 * c + a1 * sn).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: int) -> Tensor:
    B, H, S, D = x.shape
    y = torch.empty((B, H, S, D), dtype=x.dtype, device=x.device)
    block_s = 16
    _rotary[(B * H, triton.cdiv(S, block_s))](x, cos, sin, y, H, S, x.stride(0), x.stride(1), x.stride(2),
                                              y.stride(0), y.stride(1), y.stride(2), SIGN=sign, HALF=D // 2,
                                              BLOCK_S=block_s, BLOCK_D=_block(D // 2))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _rotate(dy, cos, sin, -1), None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, D) with a unit last stride; other shapes take the eager twin (see ops/rotary.py)."""
    if x.ndim != 4 or x.stride(-1) != 1:
        from megascale.ops.rotary import rotary_reference

        return rotary_reference(x, cos, sin)
    return _Rotary.apply(x, cos.contiguous(), sin.contiguous())
