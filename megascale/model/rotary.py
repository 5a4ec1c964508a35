"""Rotary position embedding (RoPE, Su et al. 2021) for the Llama style.

Rotates each (x[k], x[k + hd/2]) pair of a query/key by angle pos * theta^(-2k/hd), so the
dot product of a query at position i and a key at j depends on i - j only. We use the
"rotate half" pairing of GPT-NeoX and Hugging Face Llama (not Meta's interleaved pairs), so
exported weights need no permutation.

One `Rotary` module owns the cos/sin tables and is shared by every attention layer: the
tables are non-persistent buffers (not in checkpoints, rebuilt from the config) and follow
the model through .to(device/dtype).
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def _tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # Built in float64 so that fp32 and fp64 models get correctly rounded tables.
        half = self.head_dim // 2
        inv_freq = self.theta ** (-torch.arange(half, dtype=torch.float64, device=device) / half)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute the tables in float64 and round them once to the buffers' dtype."""
        cos, sin = self._tables(self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _apply(self, fn, recurse=True):
        # After .to(dtype/device), rebuild instead of converting: a float64 model then gets
        # exact float64 tables rather than float32 values widened.
        super()._apply(fn, recurse)
        if self.cos.device.type != "meta":
            self.reset_parameters()
        return self

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate x of shape (..., seq, head_dim) whose first token sits at position `offset`."""
        seq_len = x.shape[-2]
        cos = self.cos[offset : offset + seq_len].to(x.dtype)
        sin = self.sin[offset : offset + seq_len].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
