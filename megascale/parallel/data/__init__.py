"""Data parallelism with a ZeRO-2 style distributed optimizer (MegaScale section 3.2, Megatron-Core).

Every DP rank holds the whole model (or its tp x pp part) but only 1/dp of the optimizer state
and updates only 1/dp of the weights. One step:

1. backward accumulates each micro-batch's gradients into flat per-dtype buckets
   (`data.buffers.DPBuffers`); on the last micro-batch each complete bucket is
   reduce-scattered over dp while backward continues (`overlap_grad_reduce`, the off switch);
2. the gradient shard is clipped by the global norm over the whole mesh and the optimizer
   (AdamW or LAMB, unchanged classes) updates this rank's shard (`data.optimizer`);
3. the updated shards are all-gathered back into every rank's parameters.

Communication per step and bucket: one reduce-scatter and one all-gather, the same bytes as
one all-reduce, while optimizer state and its update work are divided by dp.
`memory.py` accounts for the bytes a layout needs per rank.

    opt = DistributedOptimizer(model, cfg.optim, mesh, bucket_size=..., overlap_grad_reduce=True)
    opt.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        with opt.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(x, y) / len(micro_batches)).backward()
    norm = opt.clip_grad_norm_(cfg.optim.grad_clip)
    opt.step()
"""

from megascale.parallel.data.buffers import DEFAULT_BUCKET_SIZE, Bucket, DPBuffers, Piece, plan_buckets
from megascale.parallel.data.optimizer import DistributedOptimizer

__all__ = ["DEFAULT_BUCKET_SIZE", "Bucket", "DPBuffers", "DistributedOptimizer", "Piece", "plan_buckets"]
