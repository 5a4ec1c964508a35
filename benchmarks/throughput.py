"""Training throughput of one process: tokens/s, achieved GFLOP/s and MFU for a named config.

    python benchmarks/throughput.py --config configs/bench_gpt_19m.toml [--dtype bf16] [--steps 8]

It times, in one run on the same machine state:
  * ours: `Trainer.train_step` (data loader, forward, backward, clipping, optimizer) on the
    bundled data, so every piece of machinery on the path is counted;
  * a plain, well-written PyTorch GPT (nanoGPT style, ~40 lines below) with the same shapes,
    AdamW and the same batches: the reference the project must match;
  * the peak: every GEMM shape the model runs (forward and both backward products), timed
    alone and weighted by its FLOPs, i.e. the best this machine does on *these* matrices;
    and the 2048^3 square-matmul peak for comparison.
Medians over the timed steps after warm-up; the machine is noisy, so compare the ratios.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale.config import load_config  # noqa: E402
from megascale.perf.flops import model_flops_per_token  # noqa: E402
from megascale.perf.hardware import measure_cpu_peak  # noqa: E402
from megascale.train import Trainer  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- reference GPT


class RefBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class RefGPT(nn.Module):
    """nanoGPT's model, trimmed: learned positions, tied head, no dropout."""

    def __init__(self, vocab, seq, d, h, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(RefBlock(d, h) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------- timing


def gemm_shapes(cfg, tokens):
    """(m, k, n, count) of every matmul in one micro-batch's forward and backward."""
    d, f, v, L = cfg.d_model, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers
    swiglu = cfg.style == "llama"
    fwd = [(tokens, d, 3 * d, L), (tokens, d, d, L), (tokens, d, (2 if swiglu else 1) * f, L),
           (tokens, f, d, L), (tokens, d, v, 1)]
    shapes = []
    for m, k, n, c in fwd:
        shapes += [(m, k, n, c), (m, n, k, c), (k, m, n, c)]  # forward, grad input, grad weight
    return shapes


def time_gemm(m, k, n, dtype, reps=5):
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def gemm_shape_peak(cfg, tokens, dtype):
    flops = secs = 0.0
    for m, k, n, c in gemm_shapes(cfg, tokens):
        flops += 2 * m * k * n * c
        secs += time_gemm(m, k, n, dtype) * c
    return flops / secs


def time_interleaved(step_fns: dict, warmup: int, steps: int) -> dict[str, float]:
    """Median step time of each function, timed in alternation so drifting load hits all alike."""
    for fn in step_fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in step_fns}
    for _ in range(steps):
        for name, fn in step_fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench_gpt_19m.toml")
    ap.add_argument("--dtype", choices=list(DT), default="fp32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch reference GPT")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    cfg = load_config(args.config, [*args.overrides, f"train.dtype={args.dtype}", "log.progress=false",
                                    "log.tensorboard=false", "log.jsonl=false"])
    torch.manual_seed(0)
    trainer = Trainer(cfg, resume=False, quiet=True)
    m, t = cfg.model, cfg.train
    tokens_per_step = t.global_batch * m.seq_len
    fpt = model_flops_per_token(m)
    n_params = trainer.model.num_params()
    print(f"config {args.config}: {n_params / 1e6:.1f}M params, {m.n_layers} layers, d_model {m.d_model}, "
          f"{m.n_heads} heads, seq {m.seq_len}, micro-batch {t.micro_batch}, global batch {t.global_batch}, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print(f"model FLOPs per token (training, fwd+bwd): {fpt / 1e6:.1f} MFLOP")

    square = measure_cpu_peak(args.dtype, use_cache=False)
    shaped = gemm_shape_peak(m, t.micro_batch * m.seq_len, DT[args.dtype])
    steps = {"megascale Trainer.train_step": trainer.train_step}
    if not args.no_reference and m.style == "gpt" and m.attention == "full":
        torch.manual_seed(0)
        ref = RefGPT(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_layers)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, foreach=True)
        x, y = trainer.loader.next_batch()
        n_micro, mb = t.global_batch // t.micro_batch, t.micro_batch
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16"
               else torch.autocast("cpu", enabled=False))

        def ref_step():
            for i in range(n_micro):
                with ctx:
                    loss = ref(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb])
                (loss / n_micro).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps["plain PyTorch GPT (nanoGPT style)"] = ref_step
    rows = list(time_interleaved(steps, args.warmup, args.steps).items())

    print(f"peak: {square / 1e9:.1f} GFLOP/s on 2048^3 matmul; {shaped / 1e9:.1f} GFLOP/s on this model's "
          f"GEMM shapes (MFU below uses the latter)")
    print(f"{'':38s} {'step s':>8s} {'tokens/s':>10s} {'GFLOP/s':>9s} {'MFU':>7s}")
    for name, sec in rows:
        tps = tokens_per_step / sec
        gf = tps * fpt
        print(f"{name:38s} {sec:8.3f} {tps:10,.0f} {gf / 1e9:9.1f} {100 * gf / shaped:6.1f}%")
    if len(rows) == 2:
        print(f"ours / reference tokens/s: {rows[1][1] / rows[0][1]:.3f}")
    trainer.loader.close()
    return 0 if all(math.isfinite(sec) for _, sec in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
