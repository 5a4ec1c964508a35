"""Cross-entropy over vocab-parallel logits, without ever gathering them (Megatron-LM).

Each tp rank holds logits for vocab ids [start, start + V_local). The softmax needs two
numbers per token over the whole vocab, its logsumexp and the target's logit, and only
each rank's own share of those crosses the wire, in one exchange (ops/cross_entropy.py
combine_vocab_parts; Megatron-LM takes three all-reduces). Memory and traffic per rank are
O(tokens * V/tp), not O(tokens * V).

The vocab is padded up to a multiple of tp; the padded columns are set to -inf before the
softmax, so they get probability 0 and gradient 0 and the loss equals the unpadded one.

The backward is written out: d loss / d logit = (softmax - onehot(target)) / n_valid,
from the softmax kept by the forward (as Megatron does, instead of autograd's graph
through the collectives).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megascale.ops.cross_entropy import combine_vocab_parts
from megascale.parallel.mesh import Mesh


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, mesh: Mesh, vocab_size: int, ignore_index: int):
        n_local = logits.shape[-1]
        ctx.logits_dtype = logits.dtype
        start = mesh.tp_rank * n_local
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: fp32 softmax
        logits = logits.to(compute_dtype, copy=True)
        if start + n_local > vocab_size:  # this rank holds padding: out of the softmax
            logits[:, max(0, vocab_size - start) :] = float("-inf")

        valid = target != ignore_index
        local = target - start
        mine = valid & (local >= 0) & (local < n_local)
        local = local.masked_fill(~mine, 0)
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)

        maxes = logits.max(dim=-1).values  # this rank's columns only (all padding: -inf, shifted by 0)
        maxes = torch.where(torch.isfinite(maxes), maxes, torch.zeros_like(maxes))
        probs = logits.sub_(maxes.unsqueeze(-1)).exp_()  # our own copy: in place, kept for the backward
        lse = probs.sum(dim=-1).log_().add_(maxes)  # over this rank's columns
        if mesh.tp > 1:
            lse, target_logit = combine_vocab_parts(mesh, lse, target_logit)
        probs *= (maxes - lse).exp_().unsqueeze(-1)  # exp(logits - lse): the whole vocab's softmax

        count = valid.sum().clamp(min=1)
        loss = ((lse - target_logit) * valid).sum() / count
        ctx.save_for_backward(probs, local, mine, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        probs, local, mine, valid, count = ctx.saved_tensors
        grad = probs  # reused in place: the forward's softmax is not needed again
        grad.scatter_add_(-1, local.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad *= (valid.to(grad.dtype) * (grad_loss / count)).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, mesh: Mesh, vocab_size: int, ignore_index: int = -1
) -> Tensor:
    """Mean cross-entropy of (tokens, V_local) logits against (tokens,) ids; ids == ignore_index skip."""
    if logits.ndim != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (n, V/tp) and target (n,), got {tuple(logits.shape)}, "
                         f"{tuple(target.shape)}")
    return _VocabParallelCrossEntropy.apply(logits, target, mesh, vocab_size, ignore_index)
