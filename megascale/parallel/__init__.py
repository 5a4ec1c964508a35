"""Parallelism applied from outside the model: the (dp, pp, tp) mesh, tensor + sequence parallelism.

    mesh = Mesh.build(cfg.parallel)                     # after torch.distributed init (or world 1)
    factory = TPLayerFactory(mesh, cfg.parallel.sequence_parallel)
    model = parallelize(GPT(cfg.model, factory), factory)
    loss = tp_loss(model, factory, idx, targets)        # vocab-parallel, never gathers the logits
    loss.backward(); sync_partial_grads(model, mesh)     # then clip and step with the reducers
"""

from megascale.parallel.mesh import Mesh, coordinates, group_ranks, rank_grid
from megascale.parallel.tensor.apply import TPLayerFactory, check_tp, parallelize, tp_loss
from megascale.parallel.tensor.grads import grad_norm_reducer, lamb_norm_reducer, sync_partial_grads
from megascale.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megascale.parallel.tensor.loss import vocab_parallel_cross_entropy
from megascale.parallel.tensor.state import full_state_dict, load_full_state_dict

__all__ = [
    "ColumnParallelLinear",
    "Mesh",
    "RowParallelLinear",
    "TPLayerFactory",
    "VocabParallelEmbedding",
    "check_tp",
    "coordinates",
    "full_state_dict",
    "grad_norm_reducer",
    "group_ranks",
    "lamb_norm_reducer",
    "load_full_state_dict",
    "parallelize",
    "rank_grid",
    "sync_partial_grads",
    "tp_loss",
    "vocab_parallel_cross_entropy",
]
