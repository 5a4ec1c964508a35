"""Causal attention kernels: full causal, and sliding-window at O(s * w) cost.

All functions take q, k, v as (..., seq, head_dim) (the model passes (batch, heads, seq,
head_dim) views) and return the same shape. Sliding window of size w means query i sees
keys j with 0 <= i - j < w: itself and the previous w - 1 tokens (MegaScale section 3.1).

Three sliding-window paths, chosen by `sliding_window_attention`:

* `banded_attention`: blocked SDPA, differentiable by autograd, any device and dtype. It is
  the CPU path and the fallback where flex_attention cannot run (no CPU backward in torch
  2.13, no dropout, no float64).
* `dense_band_attention`: all s x s scores under the band as one mask, for the sizes where that
  is cheaper than the blocks (short sequences, windows past ~s / sqrt(3)): perf/sliding_path.py.
* flex_attention with a sliding-window block mask on CUDA: compiled Triton kernel that
  skips the masked-out blocks. Imported lazily so that nothing here needs CUDA at import.

The eager reference (explicit s x s masked softmax) lives in tests/test_attention.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megascale.perf.sliding_path import sliding_window_path


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
    # The choice depends on the sequence and the window only, never on batch, heads or layout:
    # every parallel layout runs the same kernel as one process.
    path = sliding_window_path(q.shape[-2], window)
    if path == "causal":  # the window covers everything: plain causal attention is exact
        return causal_attention(q, k, v, dropout_p)
    if q.is_cuda and dropout_p == 0.0 and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return _flex_sliding(q, k, v, window)
    if path == "dense":
        return dense_band_attention(q, k, v, window, dropout_p)
    return banded_attention(q, k, v, window, dropout_p=dropout_p)


def dense_band_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dropout_p: float = 0.0
) -> torch.Tensor:
    """Sliding-window attention over all s x s scores, the band as one 2-D mask: O(s^2), on
    SDPA's fused kernel (the mask is the same for every batch and head)."""
    band = _dense_band_mask(q.shape[-2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout_p)


@functools.lru_cache(maxsize=4)
def _dense_band_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    # A few only: training asks for one length, but generation past the window asks for each
    # length in turn, and these are s x s (32 of them at s ~7000 would hold 1.6 GB).
    return _band_mask(seq_len, seq_len, 0, window, device)


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
    each query block after the first attends to 2B keys: the previous block and its own, under a
    band mask over those (B, 2B) scores that is the same for every block (it depends only on
    i - j). The first block has no previous one: it attends to its own B keys. Two SDPA calls
    over 4-D tensors (the blocks folded into the heads' dimension) do the work, each with one 2-D
    mask, which keeps SDPA's fused (flash) kernel on CPU; autograd gives the backward. A 5-D call
    or a mask per block sends it to the math path (scores materialised, safe softmax, bmm), which
    made this path 1.07-1.5x slower than FULL causal attention at s 128-2048 (w = s/4, s/8; batch
    2, 4 heads), for half its keys or fewer. Compute is at most 2B keys per query instead of s.
    """
    seq_len = q.shape[-2]
    block = block_size or window
    if block < window - 1 or block <= 0:
        raise ValueError(f"block_size {block} must be >= window - 1 = {window - 1} and > 0")
    n_blocks = -(-seq_len // block)
    pad = n_blocks * block - seq_len
    head_dim, lead = q.shape[-1], q.shape[:-2]

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (..., s, hd) -> (N, n_blocks, B, hd)
        return F.pad(x, (0, 0, 0, pad)).reshape(-1, n_blocks, block, x.shape[-1])

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    own = _block_mask(block, block, 0, window, q.device)
    after = _block_mask(block, 2 * block, block, window, q.device)
    # the first block: its own keys only (padded queries, past the end, see padded keys; dropped)
    first = F.scaled_dot_product_attention(qb[:, :1], kb[:, :1], vb[:, :1], attn_mask=own,
                                           dropout_p=dropout_p)
    if n_blocks == 1:
        out = first
    else:  # every later block: the block before it and its own, 2B keys
        k2 = torch.cat([kb[:, :-1], kb[:, 1:]], dim=-2)
        v2 = torch.cat([vb[:, :-1], vb[:, 1:]], dim=-2)
        rest = F.scaled_dot_product_attention(qb[:, 1:], k2, v2, attn_mask=after, dropout_p=dropout_p)
        out = torch.cat([first, rest], dim=1)
    return out.reshape(*lead, n_blocks * block, head_dim)[..., :seq_len, :]


def _band_mask(rows: int, cols: int, offset: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean (rows, cols) mask, True where query r may see key t, for a query r and key t that are
    tokens `offset + r - t` apart: 0 <= offset + r - t < window.

    dense_band_attention: offset 0 over (s, s). banded_attention: query r of block c is token
    i = cB + r; within its own block key t is token cB + t (offset 0, (B, B)); over the 2B keys of a
    later block key t is token (c - 1)B + t, so i - j = B + r - t for every c (offset B, (B, 2B)).
    Every row keeps its diagonal (t = r, t = offset + r), so no softmax row is empty.
    """
    dist = offset + torch.arange(rows, device=device).unsqueeze(1) - torch.arange(cols, device=device)
    return (dist >= 0) & (dist < window)


_block_mask = functools.lru_cache(maxsize=32)(_band_mask)  # banded_attention's: at most B x 2B each


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
