"""Run megascale/ops/triton_kernels.py in Triton's CPU interpreter against the eager twins.

Started by tests/test_fused_ops.py with TRITON_INTERPRET=1 where the `triton` package is
installed (it must be set before triton.jit runs). Values and gradients, float32 and bf16.
"""

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from megascale.ops import triton_kernels as tk  # noqa: E402
from megascale.ops.activations import bias_gelu_reference, swiglu_reference  # noqa: E402
from megascale.ops.norms import add_layer_norm_reference, add_rms_norm_reference  # noqa: E402
from megascale.ops.rotary import rotary_reference  # noqa: E402

failures = []


def check(name, fused, reference, inputs, tol):
    def run(fn):
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(7)
        grads_out = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        return [*outs, *torch.autograd.grad(outs, leaves, grads_out)]

    got, want = run(fused), run(reference)
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1)).item()
              for a, b in zip(got, want, strict=True))
    print(f"{name:24s} max error {err:.1e}")
    if err > tol or any(a.dtype != b.dtype or a.shape != b.shape for a, b in zip(got, want, strict=True)):
        failures.append(name)


def leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).requires_grad_()


torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    x, r = leaf(5, 3, 40, dtype=dtype), leaf(5, 3, 40, dtype=dtype)
    w, b = leaf(40, dtype=dtype), leaf(40, dtype=dtype)
    tag = str(dtype).split(".")[-1]
    check(f"add_layer_norm {tag}", lambda *a: tk.add_layer_norm(*a, 1e-5),
          lambda *a: add_layer_norm_reference(*a, 1e-5), (x, r, w, b), tol)
    check(f"layer_norm {tag}", lambda x, w, b: tk.add_layer_norm(x, None, w, b, 1e-5),
          lambda x, w, b: add_layer_norm_reference(x, None, w, b, 1e-5), (x, w, b), tol)
    check(f"add_norm no affine {tag}", lambda x, r: tk.add_layer_norm(x, r, None, None, 1e-5),
          lambda x, r: add_layer_norm_reference(x, r, None, None, 1e-5), (x, r), tol)
    check(f"add_rms_norm {tag}", lambda *a: tk.add_rms_norm(*a, 1e-5),
          lambda *a: add_rms_norm_reference(*a, 1e-5), (x, r, w), tol)
    check(f"rms_norm {tag}", lambda x, w: tk.add_rms_norm(x, None, w, 1e-5),
          lambda x, w: add_rms_norm_reference(x, None, w, 1e-5), (x, w), tol)
    xg, bg = leaf(7, 33, dtype=dtype), leaf(33)  # a float32 master bias on bf16 activations
    check(f"bias_gelu {tag}", tk.bias_gelu, bias_gelu_reference, (xg, bg), tol)
    check(f"gelu {tag}", lambda x: tk.bias_gelu(x, None), lambda x: bias_gelu_reference(x, None), (xg,), tol)
    check(f"swiglu {tag}", tk.swiglu, swiglu_reference, (leaf(3, 5, 18, dtype=dtype),), tol)
    qkv = torch.randn(2, 37, 3, 3 * 8).to(dtype)
    q = qkv[..., :8].transpose(1, 2).detach().requires_grad_()  # strided, as the model's q and k
    cos, sin = torch.randn(37, 4), torch.randn(37, 4)
    check(f"rotary {tag}", tk.rotary, rotary_reference, (q, cos, sin), tol)

if failures:
    print("mismatch:", ", ".join(failures))
    sys.exit(1)
print("all kernels match")
