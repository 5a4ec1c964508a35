"""What a layer costs the host beyond its kernels: the framework's work per layer and micro-batch.

The kernel model (perf/gemm.py) times GEMMs and memory-bound kernels, each with a small dispatch
`overhead_s`. A training step also runs Python: the layer's modules, autograd's graph (built in the
forward, walked in the backward), tensor allocations. On a GPU that work runs ahead of the kernels,
asynchronously, and is hidden while kernels are longer; on a CPU the same core runs it between the
kernels, so it adds. Measured on a 2-core EPYC: ~0.06 ms forward and ~0.12-0.19 ms backward per layer
and micro-batch and ~0.12 ms around the layers, a few percent of a d_model 256 layer's ~15 ms. Inside
the Trainer the same code costs about twice that (py-spy: the loop here runs hotter), which the planner
does not know yet.

`measure` times the real block (megascale/model/block.py), sequential and parallel, and a
one-layer GPT's loss step (the embedding, head and loss around the layers), at a shape so small
that their kernels take almost nothing, and keeps what the kernel model does not already explain.
torch is imported inside: the planner itself must not need it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from megascale.config import ModelConfig
from megascale.perf import compute
from megascale.perf.gemm import DeviceModel

# Small enough that the kernels are ~0.1 of the time, large enough to run the same code paths
# (several heads, a real MLP, a micro-batch of 2 as a CPU run uses).
TINY = {"d_model": 64, "n_heads": 4, "seq_len": 16}
MICRO_BATCH = 2
BUDGET_S = 0.1  # per timing: up to 50 calls of a fraction of a millisecond


def median_time(fn, budget: float, clock) -> float:
    from megascale.perf.calibrate import _time  # calibrate imports this module: not at the top

    return _time(fn, budget, clock)


def measure(device: str, dtype: str, dev: DeviceModel, clock=time.perf_counter) -> dict[str, float]:
    """{"host_layer_fwd_s", "host_layer_bwd_s", "host_microbatch_s"}: the framework's seconds per layer
    (the mean of the two blocks) and around the layers, per micro-batch, that `dev` (the calibrated
    kernel model) does not account for."""
    import torch

    from megascale.model.block import Block
    from megascale.model.factory import LayerFactory
    from megascale.perf.hardware import _torch_dtype

    # the kernels alone: a curve that already carries host terms would take them off twice
    curve = dataclasses.replace(dev.curve, host_layer_fwd_s=0.0, host_layer_bwd_s=0.0, host_microbatch_s=0.0)
    dev = dataclasses.replace(dev, curve=curve)
    dt = _torch_dtype(torch, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fwd, bwd, blocks = [], [], {}
    for block in ("sequential", "parallel"):
        cfg = ModelConfig(**TINY, n_layers=1, block=block, dropout=0.0, vocab_size=256)
        layer = Block(cfg, LayerFactory()).to(device=device, dtype=dt)
        x = torch.randn(MICRO_BATCH, cfg.seq_len, cfg.d_model, device=device, dtype=dt, requires_grad=True)
        grad = torch.randn_like(x)

        def forward(layer=layer, x=x):
            layer(x)
            sync()

        def forward_backward(layer=layer, x=x, grad=grad):
            layer(x).backward(grad)
            sync()

        t_f = median_time(forward, BUDGET_S, clock)
        t_fb = median_time(forward_backward, BUDGET_S, clock)
        kernels = compute.layer_cost(cfg, dev, MICRO_BATCH, 1, False, None, block == "parallel", False, False)
        fwd.append(max(0.0, t_f - kernels.fwd))
        bwd.append(max(0.0, t_fb - t_f - kernels.bwd))
        blocks[block] = t_fb
    return {"host_layer_fwd_s": statistics.fmean(fwd), "host_layer_bwd_s": statistics.fmean(bwd),
            "host_microbatch_s": _ends(device, dt, dev, sync, clock, blocks["sequential"])}


def _ends(device, dt, dev: DeviceModel, sync, clock, block_s: float) -> float:
    """The framework's seconds per micro-batch outside the layers, forward and backward: the tiny
    one-layer GPT's loss step (embedding, final norm, head, cross-entropy, autograd's start) less its
    layer (`block_s`, measured) and less the kernel model's embedding and head."""
    import torch

    from megascale.model.gpt import GPT

    cfg = ModelConfig(**TINY, n_layers=1, dropout=0.0, vocab_size=256)
    model = GPT(cfg).to(device=device, dtype=dt)
    idx = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), device=device)

    def loss_step():
        model(idx, idx).backward()
        sync()

    kernels = sum(compute.head_cost(cfg, dev, MICRO_BATCH, 1))
    kernels += sum(compute.embedding_cost(cfg, dev, MICRO_BATCH))
    return max(0.0, median_time(loss_step, BUDGET_S, clock) - block_s - kernels)
