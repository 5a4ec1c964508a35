"""Tensor-parallel layers (Megatron-LM style, written by hand, picotron-short).

Every split parameter carries three attributes that the rest of megascale reads instead
of guessing from names or shapes:

  tp_split_dim     the dimension split over the tp ranks (None: replicated on every rank)
  tp_full_size     the unpadded full size along that dimension (the vocab pads up to tp)
  tp_partial_grad  True when each rank holds only part of the gradient of a replicated
                   parameter (sequence parallelism, shared parallel-block regions), so the
                   gradients must be summed over tp before the optimizer step

A column-parallel linear splits its output features; a row-parallel linear splits its input
features and sums the partial outputs. How the activations enter and leave the tp region is
a mode of the layer, so the same layer serves plain TP, sequence parallelism, and a region
whose collectives are done once for several layers (the parallel block):

  ColumnParallelLinear.input_mode:   "copy" (all-reduce grads), "gather_seq" (SP), "none"
  RowParallelLinear.output_mode:     "reduce" (all-reduce), "reduce_scatter_seq" (SP), "none"

With an `overlap` setting (parallel.tp_overlap, see overlap.py) a layer whose mode has a
collective runs it in chunks under its GEMM; mode "none" (a shared region) runs as without.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor import comm
from megascale.parallel.tensor.flight import Overlap
from megascale.parallel.tensor.overlap import column_linear, row_linear

INPUT_MODES = {"copy": comm.copy_to_tp, "gather_seq": comm.gather_seq, "none": lambda x, mesh: x}
OUTPUT_MODES = {"reduce": comm.reduce_from_tp, "reduce_scatter_seq": comm.reduce_scatter_seq}


def mark(p: Tensor, split_dim: int | None, full_size: int = 0, partial_grad: bool = False) -> None:
    p.tp_split_dim = split_dim
    p.tp_full_size = full_size
    p.tp_partial_grad = partial_grad


def shard_size(full: int, tp: int, pad: bool, what: str) -> int:
    """Rows per rank; with pad=True the full size is rounded up to a multiple of tp."""
    if full % tp and not pad:
        raise ValueError(f"{what}: {full} does not split over tp={tp}")
    return math.ceil(full / tp)


class ColumnParallelLinear(nn.Module):
    """y[..., local out] = x W_local^T + b_local: each rank computes its slice of the outputs.

    pad=True rounds out_features up to a multiple of tp (the vocab-parallel LM head); the
    padded rows are zero and the loss masks their logits. gather_output=True all-gathers the
    full output (for sampling); training keeps it split for the next row layer or the loss.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, mesh: Mesh, *,
                 input_mode: str = "copy", gather_output: bool = False, pad: bool = False,
                 overlap: Overlap | None = None):
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {tuple(INPUT_MODES)}, got {input_mode!r}")
        self.mesh, self.input_mode, self.gather_output = mesh, input_mode, gather_output
        self.overlap = overlap if mesh.tp > 1 else None
        self.in_features, self.out_features = in_features, out_features
        self.out_local = shard_size(out_features, mesh.tp, pad, "column-parallel out_features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_local)) if bias else None
        self.reset_parameters()
        mark(self.weight, 0, out_features)
        if self.bias is not None:
            mark(self.bias, 0, out_features)

    @property
    def out_start(self) -> int:
        return self.mesh.tp_rank * self.out_local

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            self.bias.zero_()
        zero_padding(self.weight, 0, self.out_features, self.mesh)

    def forward(self, x: Tensor) -> Tensor:
        if self.overlap is not None and self.input_mode != "none":
            y = column_linear(x, self.weight, self.bias, self.input_mode, self.mesh, self.overlap)
        else:
            y = F.linear(INPUT_MODES[self.input_mode](x, self.mesh), self.weight, self.bias)
        if self.gather_output:
            y = comm.gather_from_tp(y, self.mesh)
            if y.shape[-1] != self.out_features:
                y = y[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        chunks = f", overlap={self.overlap.chunks}" if self.overlap is not None else ""
        return (f"{self.in_features}, {self.out_features} ({self.out_local} per rank), "
                f"input={self.input_mode}{chunks}")


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., local in] W_local^T, then + b (replicated, added once).

    With output_mode "none" the partial sum is returned unreduced, for a region that sums
    several layers' outputs before one collective; the bias is then added on tp rank 0 only
    (so it counts once in the sum) and its gradient is marked partial.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, mesh: Mesh, *,
                 output_mode: str = "reduce", input_is_parallel: bool = True,
                 overlap: Overlap | None = None):
        super().__init__()
        if output_mode not in (*OUTPUT_MODES, "none"):
            raise ValueError(f"output_mode must be one of {(*OUTPUT_MODES, 'none')}, got {output_mode!r}")
        self.mesh, self.input_is_parallel = mesh, input_is_parallel
        self.overlap = overlap if mesh.tp > 1 else None
        self.in_features, self.out_features = in_features, out_features
        self.in_local = shard_size(in_features, mesh.tp, False, "row-parallel in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()
        mark(self.weight, 1, in_features)
        self.output_mode = output_mode  # after the bias exists: the setter marks it

    @property
    def output_mode(self) -> str:
        return self._output_mode

    @output_mode.setter
    def output_mode(self, mode: str) -> None:
        self._output_mode = mode
        if self.bias is not None:
            partial = mode != "reduce" and self.mesh.tp > 1
            mark(self.bias, None, self.out_features, partial_grad=partial)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.mesh)
        if self._output_mode == "none":
            # The bias in the GEMM (on tp rank 0 only), so that under autocast every rank's partial sum
            # has the compute dtype: an fp32 bias added after a bf16 GEMM made rank 0's sum fp32 and
            # the collective that adds the ranks' sums a mismatch (the parallel block in bf16).
            return F.linear(x, self.weight, self.bias if self.mesh.tp_rank == 0 else None)
        if self.overlap is not None:
            y = row_linear(x, self.weight, self._output_mode, self.mesh, self.overlap)
        else:
            y = OUTPUT_MODES[self._output_mode](F.linear(x, self.weight), self.mesh)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        chunks = f", overlap={self.overlap.chunks}" if self.overlap is not None else ""
        return (f"{self.in_features} ({self.in_local} per rank), {self.out_features}, "
                f"output={self._output_mode}{chunks}")


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, start + n/tp) of the table (n padded up to tp).

    A rank looks up the ids in its range, writes zeros for the others, and the partial
    results are summed: all-reduced, or reduce-scattered along the sequence under SP (the
    embedding output is then already in the sequence-parallel layout).
    """

    def __init__(self, num_embeddings: int, dim: int, mesh: Mesh, *, sequence_parallel: bool = False):
        super().__init__()
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.num_embeddings, self.dim = num_embeddings, dim
        self.num_local = shard_size(num_embeddings, mesh.tp, True, "vocab")
        self.weight = nn.Parameter(torch.empty(self.num_local, dim))
        self.reset_parameters()
        mark(self.weight, 0, num_embeddings)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        zero_padding(self.weight, 0, self.num_embeddings, self.mesh)

    def forward(self, idx: Tensor) -> Tensor:
        if self.mesh.tp == 1:
            return F.embedding(idx, self.weight)
        start = self.mesh.tp_rank * self.num_local
        outside = (idx < start) | (idx >= start + self.num_local)
        y = F.embedding((idx - start).masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(y, self.mesh)
        return comm.reduce_from_tp(y, self.mesh)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} ({self.num_local} per rank), {self.dim}"


class SequenceParallelPositions(nn.Embedding):
    """Learned positions under SP: the table is replicated, each rank adds its sequence slice.

    The model asks for positions arange(seq); this rank's activations hold only tokens
    [tp_rank * seq/tp, (tp_rank + 1) * seq/tp), so it looks up just those. Each rank's gradient
    covers its slice only: the weight is marked partial and summed over tp.
    """

    def __init__(self, num_embeddings: int, dim: int, mesh: Mesh):
        super().__init__(num_embeddings, dim)
        self.mesh = mesh
        mark(self.weight, None, num_embeddings, partial_grad=mesh.tp > 1)

    def forward(self, positions: Tensor) -> Tensor:
        if positions.shape[-1] % self.mesh.tp:
            raise ValueError(
                f"sequence parallelism: a sequence of {positions.shape[-1]} tokens does not split "
                f"over parallel.tp={self.mesh.tp}"
            )
        return super().forward(positions.chunk(self.mesh.tp, dim=-1)[self.mesh.tp_rank])


@torch.no_grad()
def zero_padding(p: Tensor, dim: int, full_size: int, mesh: Mesh) -> None:
    """Zero the rows of this rank's shard that lie beyond full_size (the vocab padding)."""
    local = p.shape[dim]
    valid = max(0, min(local, full_size - mesh.tp_rank * local))
    if valid < local:
        p.narrow(dim, valid, local - valid).zero_()
