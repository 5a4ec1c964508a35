"""Shared pieces of the parity tests (tp, pp, dp): a learnable token stream and the optimizer.

Every parity test trains the same kind of tiny model on the same kind of data, once on one
process and once on a layout, and compares; keeping the data and optimizer settings here
means the layouts are held to one standard.
"""

from __future__ import annotations

import torch

from megascale.config import ModelConfig, OptimConfig


class SyntheticSamples:
    """In-memory stand-in for PackedSamples: rows of seq_len + 1 tokens of a learnable stream
    (each token is the previous one plus 1 to 3, modulo the vocabulary)."""

    name = "train"

    def __init__(self, n: int, seq_len: int, vocab: int):
        self.seq_len = seq_len
        g = torch.Generator().manual_seed(0)
        steps = torch.randint(1, 4, (n, seq_len + 1), generator=g)
        self.tokens = (torch.randint(0, vocab, (n, 1), generator=g) + steps.cumsum(1)) % vocab
        self.num_tokens = self.tokens.numel()

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, indices) -> torch.Tensor:
        return self.tokens[torch.as_tensor(indices)]


def optim_config(name: str) -> OptimConfig:
    """Warm-up, cosine decay, weight decay and clipping that is active from the first step."""
    return OptimConfig(name=name, lr=1e-2, min_lr=1e-3, warmup_steps=3, weight_decay=0.1, grad_clip=0.5)


def split_key_bias(weights: dict, mcfg: ModelConfig) -> dict:
    """The key part of each fused qkv bias as an entry of its own ("<name>#key").

    Its true gradient is exactly zero (softmax is shift-invariant), so in float32 Adam steps
    on rounding noise alone and two exact implementations drift apart there; the tests bound
    it separately in float32 and check it strictly in float64.
    """
    out = {}
    for name, w in weights.items():
        if name.endswith("attn.qkv.bias"):
            qkv = w.view(mcfg.n_heads, 3, mcfg.head_dim)
            out[name], out[name + "#key"] = qkv[:, ::2].flatten(), qkv[:, 1].flatten()
        else:
            out[name] = w
    return out
