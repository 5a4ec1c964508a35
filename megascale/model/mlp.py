"""Feed-forward networks: GPT's GeLU MLP and Llama's SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megascale.config import ModelConfig
from megascale.model.factory import LayerFactory
from megascale.ops.activations import linear_bias_gelu, swiglu


class GeluMLP(nn.Module):
    """fc_out(gelu(fc_in x)) with the exact (erf) GeLU.

    Not GPT-2's tanh approximation: on CPU the exact kernel is about 2x faster forward and
    backward (measured in benchmarks/throughput.py's profile), and the planner's calibration
    times this same kernel."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory):
        super().__init__()
        self.fc_in = factory.linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias, style="column")
        self.fc_out = factory.linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias, style="row")
        # model.fused_ops: fc_in's matmul run here, its bias added inside the fused GeLU (Megatron's
        # skip_bias_add; ops/activations.py). Tensor parallelism then brings the input in at the
        # MLP's entry instead of inside fc_in (tensor.apply.gather_before_mlp); same parameters.
        self.fused_bias_gelu = cfg.fused_ops
        # read outside their own call: DP's parameter gather waits for them here (data/optimizer.py)
        self.reads_child_weights = ("fc_in",) if cfg.fused_ops else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_bias_gelu:
            return self.fc_out(linear_bias_gelu(x, self.fc_in.weight, self.fc_in.bias))
        return self.fc_out(F.gelu(self.fc_in(x)))


class SwiGLU(nn.Module):
    """fc_out(silu(gate x) * up x) (Shazeer 2020), with gate and up fused in one matmul.

    The fused output is ordered (ffn, [gate, up]): unit i's gate and up are adjacent rows,
    so any column-parallel split of an even number of rows keeps each pair on one rank.
    """

    def __init__(self, cfg: ModelConfig, factory: LayerFactory):
        super().__init__()
        self.fc_in = factory.linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False, style="column")
        self.fc_out = factory.linear(cfg.ffn_dim, cfg.d_model, bias=False, style="row")
        self.fused = cfg.fused_ops  # silu(gate) * up as one op (megascale/ops/activations.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.fc_out(swiglu(self.fc_in(x)))
        gate, up = self.fc_in(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.fc_out(F.silu(gate) * up)
