"""Dropout random numbers per rank, derived from (seed, step, micro-batch, site, coordinates).

No generator state is kept or checkpointed: every dropout mask is drawn from the default
generator forked to a seed that is a pure function of

    train.seed, the step, the micro-batch's index in the *global* batch, the dropout site
    (a hash of its module name in the one-process GPT: "blocks.5.drop_attn", "embed.drop",
    "blocks.5.attn" for the attention probabilities), and, for split regions, the tp rank.

So a resumed run (same layout) draws exactly the masks of the uninterrupted one, activation
recomputation replays them (the stream travels with the checkpointed block, see
model/block.py run_block), and the rule is Megatron-LM's RNG tracker's
(tensor_parallel/random.py: model_parallel_cuda_manual_seed, whose default generator is
shared by the tp ranks and whose forked 'model-parallel-rng' state is seeded
seed + 2718 + tp_rank):

* replicated regions (identical on every tp rank: the residual-stream and embedding dropout
  without sequence parallelism, and the parallel block's dropout on the partial sums before
  its one reduction) get the same seed on all tp ranks of a replica, else the copies diverge;
* split regions (the attention probabilities of this rank's heads; the residual stream and
  embedding under sequence parallelism, 1/tp of the sequence) get a seed that differs per tp
  rank.
* Data-parallel replicas differ through the micro-batch index: dp rank r's micro-batch i is
  the global batch's micro-batch r * micro_batches + i (each rank trains a contiguous slice of
  the global batch). Pipeline stages and chunks differ through the site (global layer index).

The pipeline rank does not enter, and dp only through the rows a micro-batch holds: a pp or
dp layout draws exactly the masks one process draws for the same micro-batch, and tp layouts
those of any other layout with the same tp. Seeds are 64-bit (SplitMix64 mixing); the CPU
generator (mt19937) uses their low 32 bits, CUDA's Philox all 64.

    seeds = DropoutSeeds(cfg.train.seed, mesh, micro_batches)   # once
    with seeds.step(step, i):                                   # around micro-batch i's forward
        loss = model(x, y)
    loss.backward()                                             # may run outside: recompute replays
    pipeline_step(..., dropout=seeds.for_step(step))           # the pipeline enters it per forward

At model.dropout = 0 the model has no dropout sites: entering a step costs one context-variable
set, and no generator is touched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from megascale.model.factory import DropoutStream, use_stream
from megascale.parallel.mesh import Mesh

MASK64 = (1 << 64) - 1
REPLICATED, SPLIT = 0x5245504C, 0x53504C54  # region tags ("REPL", "SPLT")


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix(*values: int) -> int:
    """A 64-bit hash of a sequence of integers (order matters), stable across processes."""
    h = 0x6A09E667F3BCC908
    for v in values:
        h = _splitmix64(h ^ (v & MASK64))
    return h


class MicroBatchStream(DropoutStream):
    """The seeds of one micro-batch forward on one rank: site -> mix(region key, site)."""

    __slots__ = ("replicated", "split")

    def __init__(self, replicated: int, split: int):
        self.replicated, self.split = replicated, split

    def seed(self, site: int, split: bool) -> int:
        return mix(self.split if split else self.replicated, site)

    def __repr__(self) -> str:
        return f"MicroBatchStream(replicated={self.replicated:#018x}, split={self.split:#018x})"


class DropoutSeeds:
    """This rank's dropout seeds; built once, entered per micro-batch forward (see the module doc).

    micro_batches: this replica's micro-batches per step (train.global_batch / (micro_batch * dp));
    it maps a local micro-batch index to its index in the global batch.
    """

    def __init__(self, seed: int, mesh: Mesh, micro_batches: int = 1):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.seed, self.micro_batches = seed, micro_batches
        self.dp_rank, self.tp_rank = mesh.dp_rank, mesh.tp_rank

    def global_micro(self, micro: int) -> int:
        if not 0 <= micro < self.micro_batches:
            raise ValueError(f"micro-batch {micro} is outside 0 .. {self.micro_batches - 1}")
        return self.dp_rank * self.micro_batches + micro

    def stream(self, step: int, micro: int = 0) -> MicroBatchStream:
        """The pure seeds of (step, micro) on this rank."""
        key = (self.seed, step, self.global_micro(micro))
        return MicroBatchStream(mix(REPLICATED, *key), mix(SPLIT, *key, self.tp_rank))

    @contextmanager
    def step(self, step: int, micro: int = 0) -> Iterator[MicroBatchStream]:
        """Dropout inside (micro-batch `micro` of `step`, this rank) draws the derived masks."""
        stream = self.stream(step, micro)
        with use_stream(stream):
            yield stream

    def for_step(self, step: int) -> Callable[[int], AbstractContextManager]:
        """micro -> the context of `step`'s micro-batch: pipeline_step(..., dropout=...)."""
        return functools.partial(self.step, step)
