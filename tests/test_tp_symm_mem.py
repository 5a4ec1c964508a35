"""parallel.tp_overlap_impl = "symm_mem": the sequence-parallel layers through PyTorch's fused
symmetric-memory ops (parallel/tensor/symm_mem.py) equal the plain TP path.

The ops' own kernels are CUDA-only. On CPU each test worker registers, for the duration of the test,
the reference implementations PyTorch ships for these same ops (`_fused_all_gather_matmul_fallback`,
`_fused_matmul_reduce_scatter_fallback`: the collective then the GEMM, over the group by name) as
their CPU kernels, wrapped to count the calls. So what is tested is ours: which op each layer
calls, with which layout and gather/scatter dimension, the autograd wiring (the backward's fused op
and the weight gradient from the gathered tensor), autocast's dtypes, and the choice of path; the
ops' pipelining itself is PyTorch's and runs only on GPUs (benchmarks/gpu.sh).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from _dist import WorkerPool
from test_tp_overlap import F64, MODELS, STEP_TOL, STEPS, TOL, _model_config, _model_parity, rel

from megascale.config import ConfigError, ParallelConfig
from megascale.parallel.mesh import Mesh
from megascale.parallel.tensor import symm_mem
from megascale.parallel.tensor.flight import overlap_settings
from megascale.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


@contextlib.contextmanager
def cpu_kernels():
    """PyTorch's reference implementations of the two ops as their CPU kernels; counts the calls."""
    import torch.distributed._symmetric_memory as sm

    calls: Counter = Counter()

    def counted(name, fn):
        def kernel(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return kernel

    lib = torch.library.Library("symm_mem", "IMPL")
    try:
        lib.impl("fused_all_gather_matmul",
                 counted("all_gather_matmul", sm._fused_all_gather_matmul_fallback), "CPU")
        lib.impl("fused_matmul_reduce_scatter",
                 counted("matmul_reduce_scatter", sm._fused_matmul_reduce_scatter_fallback), "CPU")
        yield calls
    finally:
        lib._destroy()


def _layers(rank, kind, autocast):
    torch.manual_seed(0)
    mesh = Mesh.build(ParallelConfig(tp=2, sequence_parallel=True))
    dtype = torch.float32 if autocast else F64
    with cpu_kernels() as calls:
        ov = overlap_settings(mesh, 2, "auto", "cpu")
        assert ov.symm_mem
        if kind == "column":
            make = lambda o: ColumnParallelLinear(8, 6, True, mesh, input_mode="gather_seq", overlap=o)  # noqa: E731
        else:
            make = lambda o: RowParallelLinear(8, 6, True, mesh, output_mode="reduce_scatter_seq", overlap=o)  # noqa: E731
        plain, fused = make(None).to(dtype), make(ov).to(dtype)
        fused.load_state_dict(plain.state_dict())
        x = torch.randn(3, 4 if kind == "column" else 8, plain.weight.shape[1], dtype=dtype)
        out = []
        for layer in (plain, fused):
            before = dict(calls)
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(xi)
            (y.float() * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
            out.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
        fused_calls = {k: v - before.get(k, 0) for k, v in calls.items()}
    dtypes = [tuple(t.dtype for t in o) for o in out]
    return [rel(a.double(), b.double()) for a, b in zip(out[1], out[0], strict=True)], fused_calls, dtypes


@pytest.mark.parametrize("kind", ["column", "row"])
def test_fused_layer_equals_the_plain_layer(pool, kind):
    for diffs, calls, dtypes in pool.run(_layers, kind, False):
        assert max(diffs) < TOL, diffs
        # forward and backward: one of each op, nothing chunked or plain
        assert calls == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1}, calls
        assert dtypes[1] == dtypes[0]


@pytest.mark.parametrize("kind", ["column", "row"])
def test_fused_layer_under_autocast_returns_what_autocast_does(pool, kind):
    """bf16 GEMMs as autocast's linear runs them: the output in the plain layer's dtype (the column's
    bf16; the row's bias, added outside the GEMM, promotes it to float32), the gradients in the float32
    of the input and parameters, values as the plain layer's to bf16's precision."""
    out_dtype = torch.bfloat16 if kind == "column" else torch.float32
    for diffs, calls, dtypes in pool.run(_layers, kind, True):
        assert dtypes[1] == dtypes[0] == (out_dtype, *[torch.float32] * 3), dtypes
        assert max(diffs) < 2e-2, diffs
        assert sum(calls.values()) == 2


LAYERS = _model_config("gpt", "sequential").n_layers


def _model(rank, name):
    style, block, sp, fuse, recompute = MODELS[name]
    with cpu_kernels() as calls:
        result = _model_parity(rank, style, block, sp, fuse, recompute, 2, impl="auto")
    return result, dict(calls)


@pytest.mark.parametrize("name", ["gpt-sp", "llama-sp", "gpt-parallel-sp-unfused", "llama-sp-recompute"])
def test_fused_path_matches_plain_tp_loss_grads_and_steps(pool, name):
    """Whole GPTs, three AdamW steps (test_tp_overlap's check, symm_mem instead of chunks)."""
    for (worst, overlapped), calls in pool.run(_model, name):
        assert max(worst.values()) < STEP_TOL, worst
        assert overlapped == 4 * LAYERS + 1  # every block's 4 linears and the head
        # each of the 3 steps: per block, qkv and fc_in take the all-gather op forward and the
        # reduce-scatter op backward, proj and fc_out the other way round; the head one of each;
        # recomputation replays the blocks' forwards
        recompute = MODELS[name][4]
        per_step = 4 * LAYERS + 1 + (2 * LAYERS if recompute else 0)
        assert calls == {"all_gather_matmul": STEPS * per_step, "matmul_reduce_scatter": STEPS * per_step}


def test_the_choice_of_path():
    assert not symm_mem.resolve("chunked", "cpu")
    assert not symm_mem.resolve("auto", "cpu")  # the CPU build has no kernels for them
    with pytest.raises(ConfigError, match="parallel.tp_overlap_impl: symm_mem needs"):
        symm_mem.resolve("symm_mem", "cpu")
    with pytest.raises(ConfigError, match="parallel.tp_overlap_impl: must be one of"):
        symm_mem.resolve("nvshmem", "cpu")
    with cpu_kernels():
        assert symm_mem.resolve("auto", "cpu") and symm_mem.resolve("symm_mem", "cpu")
        assert not symm_mem.resolve("chunked", "cpu")
    assert not symm_mem.has_kernels("cpu")  # unregistered again
