"""Sliding-window (banded) vs full causal attention: forward + backward time against sequence length.

MegaScale uses sliding-window attention to cut attention cost from O(s^2) to O(s * w). This
prints the time of both paths for growing s at a fixed window; the banded path's time per
token should stay flat (linear total), the full path's grow with s. Beside them the dense band
(all s x s scores, the band a mask) and the path the model's dispatcher takes at that size
(perf/sliding_path.py): the dense band where it is the cheaper of the two, short sequences and
windows past ~s / sqrt(3) (`--seq 64 128 256 --window 96` shows both sides).

    .venv/bin/python benchmarks/attention_scaling.py [--window 128] [--heads 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megascale.ops.attention import banded_attention, dense_band_attention
from megascale.perf.flops import attended_keys
from megascale.perf.sliding_path import sliding_window_path


def time_fwd_bwd(fn, q, k, v, repeats: int) -> float:
    """Median seconds of one forward + backward, after a warm-up call."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        if i:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def banded(q, k, v):
        return banded_attention(q, k, v, args.window)

    def dense(q, k, v):
        return dense_band_attention(q, k, v, args.window)

    def full(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    print(
        f"fwd+bwd, float32, batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, "
        f"window {args.window}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'seq':>6} {'banded ms':>10} {'us/token':>9} {'full ms':>9} {'us/token':>9} {'speed-up':>9} "
          f"{'dense band ms':>14} {'model runs':>10} {'keys/query (window / full)':>27}")  # fmt: skip
    for s in args.seq:
        shape = (args.batch, args.heads, s, args.head_dim)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        t_band = time_fwd_bwd(banded, q, k, v, args.repeats)
        t_full = time_fwd_bwd(full, q, k, v, args.repeats)
        t_dense = time_fwd_bwd(dense, q, k, v, args.repeats)
        tokens = args.batch * s
        print(
            f"{s:>6} {t_band * 1e3:>10.2f} {t_band / tokens * 1e6:>9.2f} {t_full * 1e3:>9.2f} "
            f"{t_full / tokens * 1e6:>9.2f} {t_full / t_band:>8.2f}x {t_dense * 1e3:>14.2f} "
            f"{sliding_window_path(s, args.window):>10} "
            f"{attended_keys(s, args.window):>13.1f} / {attended_keys(s):.1f}"
        )


if __name__ == "__main__":
    main()
