"""Causal attention kernels: full causal, and sliding-window at O(s * w) cost.

All functions take q, k, v as (..., seq, head_dim) (the model passes (batch, heads, seq,
head_dim) views) and return the same shape. Sliding window of size w means query i sees
keys j with 0 <= i - j < w: itself and the previous w - 1 tokens (MegaScale section 3.1).

Two sliding-window paths, chosen by `sliding_window_attention`:

* `banded_attention`: blocked SDPA, differentiable by autograd, any device and dtype. It is
  the CPU path and the fallback where flex_attention cannot run (no CPU backward in torch
  2.13, no dropout, no float64).
* flex_attention with a sliding-window block mask on CUDA: compiled Triton kernel that
  skips the masked-out blocks. Imported lazily so that nothing here needs CUDA at import.

The eager reference (explicit s x s masked softmax) lives in tests/test_attention.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Full causal attention; SDPA picks the fused kernel (flash on CPU and CUDA)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention restricted to the last `window` keys, dispatched to the best path."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    seq_len = q.shape[-2]
    if window >= seq_len:  # the window covers everything: plain causal attention is exact
        return causal_attention(q, k, v, dropout_p)
    if q.is_cuda and dropout_p == 0.0 and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return _flex_sliding(q, k, v, window)
    return banded_attention(q, k, v, window, dropout_p=dropout_p)


# ---------------------------------------------------------------------------------------
# Banded (blocked) path


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    block_size: int | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Sliding-window attention in O(s * block) time and memory, by blocks of queries.

    The sequence is cut into blocks of B >= window - 1 queries (default B = window), padded to a
    multiple of B. Every key query i may see lies in i's own block or the one before it, so
    each query block attends to 2B keys: the previous block and its own. The band mask over
    those (B, 2B) scores is the same for every block because it depends only on i - j; only
    block 0, whose "previous block" is padding, additionally masks that half. One SDPA call
    over the reshaped (..., n_blocks, B, head_dim) tensors does the work, and autograd gives
    the backward. Compute is 2 * B keys per query instead of s.
    """
    seq_len = q.shape[-2]
    block = block_size or window
    if block < window - 1 or block <= 0:
        raise ValueError(f"block_size {block} must be >= window - 1 = {window - 1} and > 0")
    n_blocks = -(-seq_len // block)
    pad = n_blocks * block - seq_len

    # Queries: (..., n_blocks, B, hd). Padded queries see only padded keys and are dropped.
    qb = F.pad(q, (0, 0, 0, pad)).unflatten(-2, (n_blocks, block))
    kb = _with_previous_block(F.pad(k, (0, 0, 0, pad)).unflatten(-2, (n_blocks, block)))
    vb = _with_previous_block(F.pad(v, (0, 0, 0, pad)).unflatten(-2, (n_blocks, block)))
    mask = _band_mask(n_blocks, block, window, q.device)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout_p)
    return out.flatten(-3, -2)[..., :seq_len, :]


def _with_previous_block(x: torch.Tensor) -> torch.Tensor:
    """(..., n, B, hd) -> (..., n, 2B, hd): each block preceded by the one before (zeros for block 0).

    A contiguous concatenation rather than an overlapping unfold view: the batched matmuls
    then read dense memory, and measured faster and steadier on CPU.
    """
    previous = F.pad(x[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
    return torch.cat([previous, x], dim=-2)


@functools.lru_cache(maxsize=16)
def _band_mask(n_blocks: int, block: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean (n_blocks, B, 2B) mask, True where query r of a block may see key t of its 2B keys.

    Query r of block c is token i = cB + r; key t is token j = (c - 1)B + t, so i - j = B + r - t
    for every c, and the band is 0 <= B + r - t < window. Block 0's first B keys are padding.
    Every row keeps its diagonal (t = B + r), so no softmax row is empty.
    """
    r = torch.arange(block, device=device).unsqueeze(1)
    t = torch.arange(2 * block, device=device).unsqueeze(0)
    dist = block + r - t
    band = (dist >= 0) & (dist < window)
    mask = band.expand(n_blocks, block, 2 * block).clone()
    mask[0, :, :block] = False
    return mask


# ---------------------------------------------------------------------------------------
# flex_attention path (CUDA)


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention materialises s x s scores; only the compiled kernel skips blocks.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def _flex_block_mask(seq_len: int, window: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding(b, h, q_idx, kv_idx):
        dist = q_idx - kv_idx
        return (dist >= 0) & (dist < window)

    return create_block_mask(sliding, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)


def _flex_sliding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    block_mask = _flex_block_mask(q.shape[-2], window, q.device)
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask)
