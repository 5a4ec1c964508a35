"""Which kernel a sliding-window attention of this size runs where flex_attention does not (CPU).

Torch-free and under perf/, so that the planner (perf/compute.py) costs the kernel the model
(ops/attention.py) runs, without importing torch.

* "causal": the window covers the sequence, plain causal attention is exact.
* "banded": ops.attention.banded_attention, blocks of `window` queries over 2 x window keys:
  O(s * w), but padded to whole blocks and laid out with copies.
* "dense": SDPA over all s x s scores with the band as one mask (the fused kernel; nothing
  skipped). It wins where the blocks would score more keys than the whole square does
  (window > s / sqrt(3) or so: two blocks, the second padded), and on short sequences, where the
  blocks' extra kernels cost more than a few masked scores. Measured fwd + bwd, float32, one
  thread (/tmp probe of session 33, batch 2 x 2 and 8 x 4 heads, head_dim 64): dense/banded
  0.36-0.57 where the blocks score more keys, 0.69-1.00 at s 64 (every window), 1.1-3.4 where
  banded is chosen from s 128 on (0.95-1.05 at w = s/2 of s 128).
"""

from __future__ import annotations

# At and under this length a dense band is never slower here (s 64: 0.69-1.00 of the blocks' time).
DENSE_MAX_SEQ = 64


def sliding_window_path(seq_len: int, window: int) -> str:
    """"causal", "dense" or "banded" for a sequence of `seq_len` under a window of `window` keys."""
    if window >= seq_len:
        return "causal"
    if seq_len <= DENSE_MAX_SEQ:
        return "dense"
    blocks = -(-seq_len // window)  # banded_attention's default block is the window
    # first block: window x window scores; every later one window x 2 window
    banded_scores = window * window * (2 * blocks - 1)
    return "dense" if banded_scores > seq_len * seq_len else "banded"
