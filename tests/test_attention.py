"""Attention kernels against the eager reference: an explicit s x s masked softmax."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import megascale.ops.attention as attention_ops
from megascale.ops.attention import (
    banded_attention,
    causal_attention,
    dense_band_attention,
    sliding_window_attention,
)
from megascale.perf.sliding_path import sliding_window_path


def reference_attention(q, k, v, window=None):
    """Query i sees keys j with 0 <= i - j < window (window None: all j <= i)."""
    s = q.shape[-2]
    i = torch.arange(s)
    dist = i[:, None] - i[None, :]
    allowed = dist >= 0
    if window is not None:
        allowed &= dist < window
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def qkv(s, b=2, h=3, hd=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, hd, dtype=dtype, generator=g, requires_grad=True) for _ in range(3)]


def check_against_reference(fn, s, window):
    q, k, v = qkv(s)
    out = fn(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = reference_attention(q, k, v, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-12)


# (s, w): w dividing s, w not dividing s, w = 1, w = s, w = s - 1, s shorter than one block
SHAPES = [(16, 4), (17, 4), (23, 5), (10, 1), (12, 12), (12, 11), (3, 2), (1, 1)]


@pytest.mark.parametrize("s,w", SHAPES)
def test_banded_equals_reference(s, w):
    check_against_reference(lambda q, k, v: banded_attention(q, k, v, w), s, w)


@pytest.mark.parametrize("block_size", [3, 4, 7, 32])
def test_banded_any_block_at_least_window_minus_one(block_size):
    check_against_reference(lambda q, k, v: banded_attention(q, k, v, 4, block_size=block_size), 19, 4)


def test_banded_rejects_too_small_block():
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match="block_size"):
        banded_attention(q, k, v, 5, block_size=3)


@pytest.mark.parametrize("s,w", SHAPES)
def test_dense_band_equals_reference(s, w):
    check_against_reference(lambda q, k, v: dense_band_attention(q, k, v, w), s, w)


# (8, 20): the window past the sequence; (130, 16), (150, 40): long enough for the blocks
@pytest.mark.parametrize("s,w", SHAPES + [(8, 20), (130, 16), (150, 40), (130, 100)])
def test_sliding_window_dispatch_equals_reference(s, w):
    check_against_reference(lambda q, k, v: sliding_window_attention(q, k, v, w), s, w)


@pytest.mark.parametrize(
    "s,w,path",
    [
        (64, 64, "causal"), (64, 200, "causal"),  # the window covers the sequence
        (64, 8, "dense"), (64, 32, "dense"),  # short: the blocks' extra kernels cost more
        (128, 32, "banded"), (128, 64, "banded"), (4096, 128, "banded"),
        (128, 96, "dense"),  # two blocks, the second padded: 3 x 96^2 scores > 128^2
        (128, 63, "dense"),  # three blocks of 63 (the last 2 tokens): 5 x 63^2 > 128^2
        (2048, 1500, "dense"),
    ],
)  # fmt: skip
def test_the_sliding_window_path_by_size(s, w, path):
    assert sliding_window_path(s, w) == path


@pytest.mark.parametrize("s,w", [(64, 16), (130, 16), (130, 100), (40, 40)])
def test_the_dispatch_runs_the_kernel_its_rule_names(monkeypatch, s, w):
    ran = []
    for name in ("banded_attention", "dense_band_attention", "causal_attention"):
        kernel = getattr(attention_ops, name)
        monkeypatch.setattr(attention_ops, name,
                            lambda *a, _k=kernel, _n=name, **kw: ran.append(_n) or _k(*a, **kw))
    q, k, v = qkv(s, dtype=torch.float32)
    sliding_window_attention(q, k, v, w)
    assert ran == [{"banded": "banded_attention", "dense": "dense_band_attention",
                    "causal": "causal_attention"}[sliding_window_path(s, w)]]


@pytest.mark.parametrize("s", [1, 7, 16])
def test_full_causal_equals_reference(s):
    check_against_reference(causal_attention, s, None)


def test_banded_cost_is_linear_in_sequence_length():
    """O(s * w), not a masked s x s: each block of B queries more adds the same counted FLOPs,
    forward and backward. Counted on SDPA's math path (the flop counter has no formula for the
    CPU flash kernel), which does the same blocks' matmuls."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flops(s):
        q, k, v = qkv(s, b=1, h=1, hd=8, dtype=torch.float32)
        with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
            banded_attention(q, k, v, 16).sum().backward()
        return counter.get_total_flops()

    assert flops(512) > 0
    assert flops(1536) - flops(1024) == flops(1024) - flops(512)
    # The first block of B = 16 queries sees its own 16 keys, each of the other 31 its 2B = 32:
    # scores and values, forward + 2x backward, each 2 FLOPs/MAC, head_dim 8.
    assert flops(512) == 3 * 2 * 2 * (16 * 16 + 31 * 16 * 32) * 8


@pytest.mark.parametrize("kernel", [banded_attention, dense_band_attention])
def test_the_sliding_kernels_run_on_sdpas_fused_kernel(kernel):
    """4-D calls with 2-D masks: on CPU SDPA's flash kernel takes them (a 5-D call or a mask per
    block went to the math path: scores materialised, 1.2-1.5x slower than full causal attention)."""
    q, k, v = qkv(64, dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        kernel(q, k, v, 16).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert any("flash_attention" in n for n in names), sorted(names)
    assert "aten::bmm" not in names and "aten::_softmax" not in names, sorted(names)


def test_banded_under_bf16_autocast_and_dropout():
    q, k, v = qkv(20, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = banded_attention(q, k, v, 6)
    ref = reference_attention(q, k, v, 6)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    out = banded_attention(q, k, v, 6, dropout_p=0.5)
    out.sum().backward()
    assert out.shape == q.shape and torch.isfinite(q.grad).all()
