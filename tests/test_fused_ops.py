"""Fused operators (megascale/ops/) against their eager twins, and the model with model.fused_ops.

Each op is checked on values AND gradients of every input: float64 strictly (1e-12: the
compiled kernels may contract a*b - c*d into an FMA, nothing more), float32 and bfloat16 within
their rounding. The op is called as the model calls it, so on CPU this covers the measured
choice of ops/dispatch.py (torch.compile for some ops, eager for others); test_both_cpu_paths
runs each op through the other path too. The Triton kernels need CUDA; where the `triton`
package is installed they run here in its interpreter (TRITON_INTERPRET=1), else that test skips.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megascale.config import Config, ConfigError, ModelConfig, load_config, validate
from megascale.model import GPT
from megascale.model.rotary import Rotary
from megascale.ops import cross_entropy as ce
from megascale.ops import dispatch
from megascale.ops.activations import (
    bias_gelu,
    bias_gelu_reference,
    linear_bias_gelu,
    swiglu,
    swiglu_reference,
)
from megascale.ops.cross_entropy import chunked_cross_entropy, chunked_cross_entropy_reference
from megascale.ops.norms import add_layer_norm, add_layer_norm_reference, add_rms_norm, add_rms_norm_reference
from megascale.ops.rotary import apply_rotary, rotary_reference

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def leaf(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def outputs_and_grads(fn, inputs, seed=99):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    grads_out = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, torch.autograd.grad(outs, leaves, grads_out)


def assert_same_function(fused, reference, inputs, dtype):
    """Values and the gradients of every input that requires grad, within the dtype's tolerance.

    bfloat16 is compared on the float32 scale of the values (its rounding is relative)."""
    outs, grads = outputs_and_grads(fused, inputs)
    ref_outs, ref_grads = outputs_and_grads(reference, inputs)
    rtol, atol = TOL[dtype]
    for got, want in zip((*outs, *grads), (*ref_outs, *ref_grads), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = want.float().abs().max().clamp(min=1).item() if dtype == torch.bfloat16 else 1.0
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale)


DTYPES = [torch.float64, torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------
# The ops, each against its eager twin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_add_layer_norm(dtype, residual):
    x, r = leaf(3, 5, 24, dtype=dtype, seed=1), leaf(3, 5, 24, dtype=dtype, seed=2)
    w, b = leaf(24, dtype=dtype, seed=3), leaf(24, dtype=dtype, seed=4)
    inputs = (x, r if residual else None, w, b, 1e-5)
    assert_same_function(add_layer_norm, add_layer_norm_reference, inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm(dtype, residual):
    x, r = leaf(3, 5, 24, dtype=dtype, seed=1), leaf(3, 5, 24, dtype=dtype, seed=2)
    w = leaf(24, dtype=dtype, seed=3)
    assert_same_function(add_rms_norm, add_rms_norm_reference, (x, r if residual else None, w, 1e-5), dtype)


def test_add_norm_returns_the_stream_and_the_norm():
    x, r = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    h, y = add_layer_norm(x, r, None, None, 1e-5)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (8,), eps=1e-5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(dtype, with_bias):
    x, b = leaf(6, 40, dtype=dtype, seed=1), leaf(40, dtype=dtype, seed=2)
    assert_same_function(bias_gelu, bias_gelu_reference, (x, b if with_bias else None), dtype)


@pytest.mark.parametrize("impl", ["eager", "compile"])
def test_linear_bias_gelu_is_exact_gelu_of_the_biased_linear(monkeypatch, impl):
    """The fused MLP's first half, bias in the GEMM (eager) or in the fused GeLU (compiled), is the
    unfused gelu(linear(x)) with the exact erf GeLU of model/mlp.py."""
    monkeypatch.setitem(dispatch.CPU_IMPL, "bias_gelu", impl)
    assert dispatch.compiled_on_cpu("bias_gelu", torch.zeros(1)) == (impl == "compile")
    lin = torch.nn.Linear(8, 16).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    unfused = lambda x, w, b: F.gelu(F.linear(x, w, b))
    assert_same_function(linear_bias_gelu, unfused, (x, lin.weight, lin.bias), torch.float64)
    assert not torch.allclose(F.gelu(lin(x)), F.gelu(lin(x), approximate="tanh"), rtol=1e-6, atol=1e-6)


def test_bias_gelu_keeps_bf16_activations_bf16_under_autocast():
    x, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8)  # bf16 matmul output, fp32 master bias
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bias_gelu(x, b).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    assert_same_function(swiglu, swiglu_reference, (leaf(3, 7, 2 * 12, dtype=dtype, seed=1),), dtype)


def test_swiglu_reads_the_interleaved_gate_up_layout():
    """Unit i's gate is feature 2i and its up 2i + 1 (model/factory.py's fused layout)."""
    x = torch.randn(5, 2 * 6, dtype=torch.float64)
    want = F.silu(x[:, 0::2]) * x[:, 1::2]
    torch.testing.assert_close(swiglu(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(swiglu_reference(x), want, rtol=0, atol=0)


def rotary_inputs(dtype, s=11, heads=3, hd=8, b=2):
    rot = Rotary(hd, 32).to(dtype if dtype != torch.bfloat16 else torch.float32)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, heads, 3 * hd, generator=g, dtype=torch.float64).to(dtype)
    q = qkv[..., :hd].transpose(1, 2).detach().requires_grad_()  # a strided view, as in the model
    return rot, q


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    rot, q = rotary_inputs(dtype)
    s = q.shape[-2]
    assert_same_function(apply_rotary, rotary_reference, (q, rot.cos[:s], rot.sin[:s]), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotary_twin_is_model_rotary_exactly(dtype):
    """The eager twin is megascale/model/rotary.py's arithmetic, bit for bit, at every dtype."""
    rot, q = rotary_inputs(dtype)
    s = q.shape[-2]
    assert torch.equal(rotary_reference(q, rot.cos[:s], rot.sin[:s]), rot(q))


def test_rotary_rejects_mismatched_tables():
    rot, q = rotary_inputs(torch.float64)
    with pytest.raises(ValueError, match="tables"):
        apply_rotary(q, rot.cos[:3], rot.sin[:3])


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm", "bias_gelu", "swiglu", "rotary"])
def test_both_cpu_paths(monkeypatch, op):
    """Whichever way the table goes, both the compiled and the eager CPU path compute the twin's function."""
    dtype = torch.float64
    x, r = leaf(4, 16, dtype=dtype, seed=0), leaf(4, 16, dtype=dtype, seed=1)
    w, b = leaf(16, dtype=dtype, seed=2), leaf(16, dtype=dtype, seed=3)
    rot, q = rotary_inputs(dtype)
    cases = {
        "add_layer_norm": (add_layer_norm, add_layer_norm_reference, (x, r, w, b, 1e-5)),
        "add_rms_norm": (add_rms_norm, add_rms_norm_reference, (x, r, w, 1e-5)),
        "bias_gelu": (bias_gelu, bias_gelu_reference, (x, b)),
        "swiglu": (swiglu, swiglu_reference, (x,)),
        "rotary": (apply_rotary, rotary_reference, (q, rot.cos[:11], rot.sin[:11])),
    }
    fused, ref, inputs = cases[op]
    other = "eager" if dispatch.CPU_IMPL[op] == "compile" else "compile"
    monkeypatch.setitem(dispatch.CPU_IMPL, op, other)
    assert dispatch.cpu_impl(op) == other
    assert_same_function(fused, ref, inputs, dtype)


# ---------------------------------------------------------------------------------------
# Dispatch: CPU never touches triton; compile failures fall back


def test_cpu_path_never_imports_triton(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: True)  # even where triton is installed
    x = torch.randn(4, 8, requires_grad=True)
    assert not dispatch.use_triton(x)
    h, y = add_rms_norm(x, x, None, 1e-5)
    (y.sum() + swiglu(x).sum() + bias_gelu(x, None).sum()).backward()
    assert "megascale.ops.triton_kernels" not in sys.modules


def test_cpu_impl_override(monkeypatch):
    monkeypatch.setenv("MEGASCALE_FUSED_CPU", "eager")
    assert all(dispatch.cpu_impl(op) == "eager" for op in dispatch.CPU_IMPL)
    monkeypatch.setenv("MEGASCALE_FUSED_CPU", "fast")
    with pytest.raises(ValueError, match="MEGASCALE_FUSED_CPU"):
        dispatch.cpu_impl("swiglu")


def test_failed_compile_falls_back_to_eager_once(monkeypatch):
    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    op = dispatch.CompiledOrEager("swiglu", swiglu_reference)
    op._broken = False
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="swiglu: torch.compile failed"):
        assert torch.equal(op(x), swiglu_reference(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(op(x), swiglu_reference(x))  # eager from now on, silently


@pytest.mark.skipif(not dispatch.triton_importable(), reason="triton not installed (CUDA machines have it)")
def test_triton_kernels_in_the_interpreter():
    """The kernels' arithmetic, run by Triton's CPU interpreter (a CUDA machine compiles the same code)."""
    script = ROOT / "tests" / "_triton_interpret.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all kernels match" in r.stdout


# ---------------------------------------------------------------------------------------
# Chunked head + cross-entropy


def ce_inputs(dtype, n=37, d=12, vocab=29, seed=0, ignored=(0, 5, 6)):
    h = leaf(n, d, dtype=dtype, seed=seed)
    w = leaf(vocab, d, dtype=dtype, seed=seed + 1, scale=0.5)
    g = torch.Generator().manual_seed(seed + 2)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[list(ignored)] = -1
    return h, w, t


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 5, 36, 37, 100])
def test_chunked_cross_entropy(dtype, chunk):
    h, w, t = ce_inputs(dtype)
    assert_same_function(lambda h, w, t: chunked_cross_entropy(h, w, t, -1, chunk=chunk),
                         lambda h, w, t: chunked_cross_entropy_reference(h, w, t, -1), (h, w, t), dtype)


def test_chunked_cross_entropy_under_bf16_autocast():
    """bf16 matmuls and float32 softmax, as the unfused head and autocast's cross_entropy do."""
    h, w, t = ce_inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = outputs_and_grads(lambda *a: chunked_cross_entropy(*a, -1, chunk=8), (h, w, t))
        ref, ref_grads = outputs_and_grads(chunked_cross_entropy_reference, (h, w, t))
    assert loss[0].dtype == ref[0].dtype == torch.float32
    torch.testing.assert_close(loss[0], ref[0], rtol=1e-2, atol=1e-2)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert g.dtype == rg.dtype == torch.float32
        torch.testing.assert_close(g, rg, rtol=2e-2, atol=2e-2 * rg.abs().max().item())


def test_chunked_cross_entropy_ignore_index():
    h, w, t = ce_inputs(torch.float64, ignored=range(0, 37, 2))
    loss = chunked_cross_entropy(h, w, t, -1, chunk=4)
    keep = t != -1
    torch.testing.assert_close(loss, F.cross_entropy(h[keep] @ w.T, t[keep]), rtol=1e-12, atol=1e-12)
    t[:] = -1  # nothing left: NaN, as F.cross_entropy
    assert chunked_cross_entropy(h, w, t, -1, chunk=4).isnan()
    assert F.cross_entropy(h @ w.T, t, ignore_index=-1).isnan()


def test_chunked_cross_entropy_shape_errors():
    h, w, t = ce_inputs(torch.float64)
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_cross_entropy(h, w[:, :5], t)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates (inputs excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_chunked_cross_entropy_holds_one_chunk_of_logits():
    """Forward and backward never create a tensor of (tokens, vocab): the largest is one chunk of logits
    (or the weight's gradient); the unfused loss creates the full logits."""
    n, d, vocab, chunk = 96, 8, 512, 8
    h, w, t = ce_inputs(torch.float32, n=n, d=d, vocab=vocab)
    for fn, limit in ((lambda: chunked_cross_entropy(h, w, t, chunk=chunk), chunk * vocab),
                      (lambda: chunked_cross_entropy_reference(h, w, t), n * vocab)):
        with LargestTensor() as mode:
            fn().backward()
        assert mode.largest == max(limit, vocab * d, n * d)
    assert ce.chunk_tokens(n, vocab) == n  # the default budget: small problems in one chunk
    assert ce.chunk_tokens(10**6, 50304) == ce.CHUNK_ELEMENTS // 50304


# ---------------------------------------------------------------------------------------
# The model: fused_ops on equals off


def tiny(**kw):
    base = dict(vocab_size=257, seq_len=12, n_layers=2, d_model=16, n_heads=4)
    return ModelConfig(**{**base, **kw})


def pair(cfg, dtype=torch.float64):
    torch.manual_seed(0)
    off = GPT(cfg).to(dtype)
    on = GPT(dataclasses.replace(cfg, fused_ops=True)).to(dtype)
    on.load_state_dict(off.state_dict())
    return off, on


STYLES = {
    "gpt": dict(style="gpt"),
    "gpt-parallel": dict(style="gpt", block="parallel"),
    "gpt-nobias-sliding": dict(style="gpt", bias=False, attention="sliding", window=4),
    "llama": dict(style="llama", bias=False, tie_embeddings=False),
    "llama-parallel": dict(style="llama", bias=False, block="parallel"),
}


@pytest.mark.parametrize("name", list(STYLES))
@pytest.mark.parametrize("recompute", [False, True])
def test_model_fused_equals_unfused(monkeypatch, name, recompute):
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 257 * 5)  # 5 tokens a chunk: several chunks
    cfg = tiny(**STYLES[name], dropout=0.1, recompute=recompute)
    off, on = pair(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 257, (3, 12), generator=g)
    targets = torch.randint(0, 257, (3, 12), generator=g)
    targets[0, :4] = -1
    losses = []
    for model in (off, on):
        torch.manual_seed(5)  # the same dropout masks: the fused path draws them in the same order
        loss = model(idx, targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-13, atol=0)
    for (name_, p), q in zip(off.named_parameters(), on.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-11, atol=1e-13, msg=name_)
    off.eval(), on.eval()
    torch.testing.assert_close(on(idx), off(idx), rtol=1e-12, atol=1e-12)  # the logits path


def test_model_fused_float32():
    off, on = pair(tiny(style="llama", bias=False), dtype=torch.float32)
    idx = torch.randint(0, 257, (2, 12))
    for model in (off, on):
        model(idx, idx).backward()
    torch.testing.assert_close(on(idx, idx), off(idx, idx), rtol=1e-5, atol=1e-5)
    for p, q in zip(off.parameters(), on.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)


def test_fused_ops_config_field():
    assert ModelConfig().fused_ops is False  # see README: the benchmark's figures for the default
    assert load_config(None, ["model.fused_ops=true"]).model.fused_ops is True
    with pytest.raises(ConfigError, match=r"^model.fused_ops: expected bool, got 'maybe'"):
        load_config(None, ["model.fused_ops=maybe"])
    with pytest.raises(ConfigError, match=r"^model.fused_ops: must be true or false, got 1$"):
        validate(Config(model=ModelConfig(fused_ops=1)))
