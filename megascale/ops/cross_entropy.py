"""LM head + cross-entropy in chunks of tokens: the full float32 logits never exist.

The unfused loss path materialises logits (tokens, V) from the head, then cross-entropy keeps
its float32 log-probabilities (tokens, V) for backward: at a 50k vocabulary and 16k tokens
per micro-batch that is 3.2 GB, often the largest activation of the whole model. Here one
autograd.Function takes the head's *input* and weight and, per chunk of tokens:

  forward:  logits_c = h_c W^T (float32), keep only logsumexp(logits_c) and the target's logit
            (two numbers per token), drop logits_c;
  backward: recompute logits_c, softmax from the kept logsumexp, subtract the one-hot target,
            and turn that straight into the chunk's dh_c = g W and its share of dW += g^T h_c.

Peak memory is one chunk of logits (CHUNK_ELEMENTS, 32 MiB in float32) instead of all of them;
the price is the head's matmul once more in backward (a third more of the head's FLOPs, which
MFU does not count, as for any recomputation; measured 1.4x the unchunked loss's time on CPU at
2048 tokens x 8192 vocab, for 0.28x its peak memory: benchmarks/fused_ops.py). When all tokens
fit one chunk, that chunk's logits are kept for backward instead: the same peak, no recompute.

Vocab-parallel (tensor parallelism, mesh given): W is this rank's (V/tp, d) slice of the padded
vocabulary, as in parallel/tensor/loss.py; columns past the true vocab_size are masked to -inf. Each
rank's chunks give a local logsumexp and the target's logit where this rank holds the target;
after the last chunk two all-reduces (max, then sum of exp and of the target logits) give the
global logsumexp, the same two collectives as the unchunked vocab-parallel loss, however many
chunks. The backward needs no collective: its dh is this rank's partial sum over its vocab
slice, and the head's input stage (copy_to_tp / gather_seq, applied by the caller) all-reduces
it as it does for the unfused head.

Ignore-index semantics are those of the loss each replaces: targets == ignore_index count for
nothing and the mean is over the others; with none left, the serial loss is NaN like
F.cross_entropy and the vocab-parallel one 0 like vocab_parallel_cross_entropy.

Under autocast the matmuls run in the autocast dtype (as the unfused head does) and the
softmax in float32 (as autocast's cross_entropy does); float64 stays float64 throughout.
The chunk loop is plain PyTorch on every device: the matmuls dominate and are cuBLAS/MKL's
already, and the per-chunk logsumexp is a single kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megascale.observe import timers

CHUNK_ELEMENTS = 1 << 23  # logits per chunk (tokens x local vocab): 32 MiB in float32


def chunk_tokens(n_tokens: int, vocab_local: int) -> int:
    """Tokens per chunk so that one chunk of logits holds about CHUNK_ELEMENTS."""
    return max(1, min(n_tokens, CHUNK_ELEMENTS // max(1, vocab_local)))


def _dtypes(hidden: Tensor, weight: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype, softmax dtype): autocast's when it is on, else the inputs' (promoted)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        mm = torch.get_autocast_dtype(device)
    else:
        mm = torch.promote_types(hidden.dtype, weight.dtype)
    return mm, torch.promote_types(mm, torch.float32)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk: int,
                mesh, vocab_size: int) -> Tensor:
        mm, sm = _dtypes(hidden, weight)
        n, v_local = hidden.shape[0], weight.shape[0]
        start = mesh.tp_rank * v_local if mesh is not None else 0
        pad_from = max(0, vocab_size - start)  # local columns from here on are vocab padding
        valid = target != ignore_index
        local = target - start
        mine = valid & (local >= 0) & (local < v_local)
        local = local.masked_fill(~mine, 0)
        lse = torch.empty(n, dtype=sm, device=hidden.device)
        target_logit = torch.empty(n, dtype=sm, device=hidden.device)
        kept = None  # a single chunk's logits, kept for backward (see below)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(mm)
            for i in range(0, n, chunk):
                j = min(n, i + chunk)
                logits = _chunk_logits(hidden[i:j], w, mm, sm, pad_from)
                lse[i:j] = torch.logsumexp(logits, dim=-1)
                target_logit[i:j] = logits.gather(-1, local[i:j, None]).squeeze(-1)
                if j - i == n:  # one chunk is all: keeping it costs no more than recomputing would hold
                    kept = logits
                del logits
        target_logit.masked_fill_(~mine, 0.0)
        if mesh is not None and mesh.tp > 1:
            lse, target_logit = combine_vocab_parts(mesh, lse, target_logit)
        count = valid.sum()
        if mesh is not None:
            count = count.clamp(min=1)
        loss = ((lse - target_logit) * valid).sum() / count
        ctx.save_for_backward(hidden, weight, lse, local, mine, valid, count, kept)
        ctx.chunk, ctx.pad_from, ctx.mm, ctx.sm = chunk, pad_from, mm, sm
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, lse, local, mine, valid, count, kept = ctx.saved_tensors
        mm, sm, chunk = ctx.mm, ctx.sm, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale = valid.to(sm) * (grad_loss.to(sm) / count)  # d loss / d (lse - target_logit), per token
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                             device=weight.device) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(mm)
            for i in range(0, hidden.shape[0], chunk):
                j = min(hidden.shape[0], i + chunk)
                h = hidden[i:j].to(mm)
                # the forward's logits, used up in place (as parallel/tensor/loss.py), or recomputed
                g = kept if kept is not None else _chunk_logits(h, w, mm, sm, ctx.pad_from)
                g.sub_(lse[i:j, None]).exp_()  # softmax (padding columns: exp(-inf) = 0)
                g.scatter_add_(-1, local[i:j, None], -mine[i:j, None].to(sm))
                g.mul_(scale[i:j, None])
                g = g.to(mm)
                if need_h:
                    if grad_h.dtype == mm:
                        torch.mm(g, w, out=grad_h[i:j])
                    else:
                        grad_h[i:j] = g @ w
                if need_w:
                    if grad_w.dtype == mm:
                        grad_w.addmm_(g.t(), h)  # no (V, d) temporary per chunk
                    else:
                        grad_w += g.t() @ h
                del g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None)


def _chunk_logits(h: Tensor, w: Tensor, mm: torch.dtype, sm: torch.dtype, pad_from: int) -> Tensor:
    logits = F.linear(h.to(mm), w).to(sm)
    if pad_from < logits.shape[-1]:  # this rank holds vocab padding: out of the softmax
        logits[:, pad_from:] = float("-inf")
    return logits


def _check(hidden: Tensor, weight: Tensor, target: Tensor) -> None:
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1] \
            or target.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden (n, d), weight (V, d) and target (n,), got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(target.shape)}")


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -1,
                          chunk: int | None = None) -> Tensor:
    """mean cross_entropy(hidden @ weight^T, target), never holding more than a chunk of logits.

    hidden (n, d), weight (V, d) (the LM head's), target (n,). chunk: tokens per chunk
    (default: chunk_tokens). Equals chunked_cross_entropy_reference."""
    _check(hidden, weight, target)
    chunk = chunk or chunk_tokens(hidden.shape[0], weight.shape[0])
    return _ChunkedHeadCrossEntropy.apply(hidden, weight, target, ignore_index, chunk, None, weight.shape[0])


def combine_vocab_parts(mesh, lse: Tensor, target_logit: Tensor) -> tuple[Tensor, Tensor]:
    """The whole vocab's per-token logsumexp and target logit from each tp rank's over its own columns,
    in ONE exchange: every rank's (lse, target logit) gathered, and combined by each rank alike
    (logsumexp over the ranks, the target's logit from the one rank holding it: the others give 0).
    Megatron-LM takes three all-reduces (max, target logit, sum of exp); this is one round trip
    where each is latency-bound (a few numbers per token). A rank whose columns are all padding
    gives lse = -inf, which adds 0."""
    with timers.comm("all_gather", "tp", "tp", nbytes=2 * lse.numel() * lse.element_size()):
        rows = mesh.all_gather(torch.stack((lse, target_logit)), mesh.tp_group)  # (tp, 2, tokens)
    peak = rows[:, 0].amax(0)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    return peak + (rows[:, 0] - peak).exp().sum(0).log(), rows[:, 1].sum(0)


def vocab_parallel_chunked_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, mesh,
                                         vocab_size: int, ignore_index: int = -1,
                                         chunk: int | None = None) -> Tensor:
    """The vocab-parallel mean cross-entropy of hidden @ weight^T (weight: this rank's (V/tp, d) rows
    of the padded head), chunked over tokens. hidden must have been through the head's input stage
    (its backward sums the partial dh over tp). Equals vocab_parallel_cross_entropy(F.linear(...))."""
    _check(hidden, weight, target)
    chunk = chunk or chunk_tokens(hidden.shape[0], weight.shape[0])
    return _ChunkedHeadCrossEntropy.apply(hidden, weight, target, ignore_index, chunk, mesh, vocab_size)


def chunked_cross_entropy_reference(hidden: Tensor, weight: Tensor, target: Tensor,
                                    ignore_index: int = -1) -> Tensor:
    """The unfused loss path: the full logits from the head, then F.cross_entropy."""
    return F.cross_entropy(F.linear(hidden, weight), target, ignore_index=ignore_index)
