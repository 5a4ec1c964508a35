"""Fused operators against their eager twins, per op and end to end (model.fused_ops on vs off).

    python benchmarks/fused_ops.py [--rounds 15] [--e2e-rounds 5] [--steps 6] [--config FILE]
                                   [--tokens 2048] [--d-model 512] [--vocab 8192] [--skip-e2e]
                                   [--cpu-impl eager|compile] [overrides for the end-to-end runs]

Per op (this process): forward + backward of the eager twin, the torch.compile'd twin and the
op as the model calls it (`fused`: the CPU choice of megascale/ops/dispatch.py; Triton on a CUDA
machine), in alternation, round after round (every other round in reverse order); the median
time of each, and the peak memory of one forward + backward above what was live before it
(resident-set high-water mark, with glibc's malloc made to hand large blocks back to the kernel
at once, so that what is freed does not stay resident and what is allocated shows). The shapes
default to those of configs/bench_gpt_19m.toml (micro-batch 8 x 256 tokens, d_model 512, 8
heads): the add + norms on (tokens, d_model), bias + GeLU on (tokens, 4 d_model), SwiGLU on
(tokens, 2 ffn), rotary on the query view of the qkv output; the chunked head + cross-entropy
at --vocab (default 8192: the byte tokenizer's 256 would fit one chunk, and a 50k vocabulary
takes minutes a round on 2 cores; the memory saving grows with the vocabulary).

End to end: tokens/s of Trainer.train_step on --config with model.fused_ops=false and =true,
in alternation (off, on, off, on, ...), one fresh process per measurement so machine noise
falls on both alike; each measurement is the median step time after two warm-up steps (the
first compiles the CPU-compiled ops). Printed: each round, the medians and the on/off ratio
per round (median, min, max), the same ratio from each run's best step (steadier on a shared
machine, where other work only ever slows a step down), and the processes' peak RSS. Nothing
asserts on time.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _trainer_probe import measure  # noqa: E402

from megascale.ops import dispatch  # noqa: E402
from megascale.ops.activations import bias_gelu, bias_gelu_reference, swiglu, swiglu_reference  # noqa: E402
from megascale.ops.cross_entropy import chunked_cross_entropy, chunked_cross_entropy_reference  # noqa: E402
from megascale.ops.norms import (  # noqa: E402
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
)
from megascale.ops.rotary import apply_rotary, rotary_reference  # noqa: E402

# ---------------------------------------------------------------------------------------
# Peak memory: resident-set high-water mark of one forward + backward


def _malloc_returns_large_blocks() -> bool:
    """mmap every block of 64 KiB or more and trim the heap at once: freed tensors leave the RSS."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 1 << 16) and libc.mallopt(-1, 1 << 16))  # M_MMAP_, M_TRIM_THRESHOLD
    except OSError:
        return False


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_bytes(step) -> float:
    """Bytes of resident memory one call of step() adds at its peak (nan where Linux cannot tell)."""
    gc.collect()
    if not _reset_peak():
        return float("nan")
    base = _status("VmRSS")
    step()
    return max(0, _status("VmHWM") - base)


# ---------------------------------------------------------------------------------------
# The ops at the 19M model's shapes


def _leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_()


def op_cases(tokens: int, d: int, vocab: int, heads: int):
    """name -> (eager twin, compiled twin, fused (the model's call), make inputs)."""
    hd, seq = d // heads, 256 if tokens % 256 == 0 else tokens
    batch = tokens // seq
    ffn_swiglu = 64 * ((int(8 * d / 3) + 63) // 64)

    def norm_inputs(bias: bool):
        def make():
            x, r = _leaf(tokens, d), _leaf(tokens, d)
            w, b = _leaf(d, scale=0.1), _leaf(d, scale=0.1)
            return (x, r, w, b, 1e-5) if bias else (x, r, w, 1e-5)
        return make

    def rotary_inputs():
        qkv = torch.randn(batch, seq, heads, 3 * hd)
        q = qkv[..., :hd].transpose(1, 2).detach().requires_grad_()  # (b, heads, s, hd), strided, as q is
        inv_freq = 10000.0 ** (-torch.arange(hd // 2, dtype=torch.float64) / (hd // 2))
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
        return q, angles.cos().float(), angles.sin().float()

    def ce_inputs():
        h, w = _leaf(tokens, d), _leaf(vocab, d, scale=0.02)
        return h, w, torch.randint(0, vocab, (tokens,))

    return {
        "add + LayerNorm": (add_layer_norm_reference, "add_layer_norm", add_layer_norm, norm_inputs(True)),
        "add + RMSNorm": (add_rms_norm_reference, "add_rms_norm", add_rms_norm, norm_inputs(False)),
        "bias + GeLU": (bias_gelu_reference, "bias_gelu", bias_gelu,
                        lambda: (_leaf(tokens, 4 * d), _leaf(4 * d, scale=0.1))),
        "SwiGLU": (swiglu_reference, "swiglu", swiglu, lambda: (_leaf(tokens, 2 * ffn_swiglu),)),
        "rotary": (rotary_reference, "rotary", apply_rotary, rotary_inputs),
        f"head + cross-entropy (V={vocab})": (chunked_cross_entropy_reference, None, chunked_cross_entropy,
                                              ce_inputs),
    }


def _fwd_bwd(fn, args, grads_out):
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            a.grad = None
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads_out(outs))


def bench_ops(a) -> None:
    cases = op_cases(a.tokens, a.d_model, a.vocab, a.heads)
    memory_ok = _malloc_returns_large_blocks() and _reset_peak()
    print(f"per op: forward + backward, median of {a.rounds} alternating rounds, {torch.get_num_threads()} "
          f"threads; peak = resident memory added at the peak of one forward + backward"
          f"{'' if memory_ok else ' (not measurable here: n/a)'}")
    print(f"{'op':32s} {'eager ms':>9s} {'compile ms':>10s} {'fused ms':>9s} {'eager/fused':>11s} "
          f"{'eager MiB':>9s} {'fused MiB':>9s} {'fused/eager mem':>15s}  fused is")
    for name, (eager, op, fused, make) in cases.items():
        args = make()
        g = torch.Generator().manual_seed(1)
        fixed: dict = {}

        def grads_out(outs, fixed=fixed, g=g):
            key = tuple(o.shape for o in outs)
            if key not in fixed:
                fixed[key] = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]
            return fixed[key]

        variants = {"eager": eager, "fused": fused}
        if op is not None and a.compile:
            variants["compile"] = dispatch.CompiledOrEager(op, eager)
        for fn in variants.values():  # warm-up: compiles, first-touch of the buffers
            _fwd_bwd(fn, args, grads_out)
            _fwd_bwd(fn, args, grads_out)
        times: dict[str, list[float]] = {k: [] for k in variants}
        order = list(variants.items())
        for r in range(a.rounds):  # alternating, every other round in reverse: no variant always runs first
            for k, fn in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                _fwd_bwd(fn, args, grads_out)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        mem = {k: peak_bytes(lambda fn=fn, args=args: _fwd_bwd(fn, args, grads_out)) / 2**20
               for k, fn in variants.items()}
        how = ("chunked (eager)" if op is None else
               f"{dispatch.cpu_impl(op)}" + (" (MEGASCALE_FUSED_CPU)" if os.environ.get("MEGASCALE_FUSED_CPU")
                                             else ""))
        comp = f"{med['compile']:10.2f}" if "compile" in med else f"{'-':>10s}"
        ratio = mem["fused"] / mem["eager"] if mem["eager"] > 0 else float("nan")
        print(f"{name:32s} {med['eager']:9.2f} {comp} {med['fused']:9.2f} "
              f"{med['eager'] / med['fused']:11.2f} {mem['eager']:9.1f} {mem['fused']:9.1f} {ratio:15.2f}  "
              f"{how}", flush=True)
        del args
        fixed.clear()


# ---------------------------------------------------------------------------------------
# End to end: the Trainer with model.fused_ops off and on, fresh process each (_trainer_probe.py)


def bench_e2e(a) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if a.cpu_impl:
        env["MEGASCALE_FUSED_CPU"] = a.cpu_impl
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"data.path={json.dumps(str(Path(tmp) / 'ds'))}",
                  f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}",
                  "log.progress=false", "log.tensorboard=false", "log.jsonl=false", "log.peak_flops=1e9",
                  "checkpoint.interval=0", "train.eval_interval=0", *a.overrides]
        measure(a.config, 1, [*common, f"train.run_dir={json.dumps(f'{tmp}/prep')}"], env)  # the dataset
        rows = []
        for r in range(a.e2e_rounds):
            off, on = (measure(a.config, a.steps, [*common, f"model.fused_ops={str(f).lower()}",
                                                   f"train.run_dir={json.dumps(f'{tmp}/{f}')}"], env)
                       for f in (False, True))
            rows.append((off, on))
            print(f"round {r + 1}: off {off['tps']:,.0f} tok/s, on {on['tps']:,.0f} tok/s, on/off "
                  f"{on['tps'] / off['tps']:.3f} (best steps: off {off['best']:,.0f}, on {on['best']:,.0f}, "
                  f"on/off {on['best'] / off['best']:.3f}; peak RSS off {off['rss']:.0f} MiB, on "
                  f"{on['rss']:.0f} MiB)", flush=True)
        ratios = [on["tps"] / off["tps"] for off, on in rows]
        best = [on["best"] / off["best"] for off, on in rows]
        print(f"\n{a.config} {' '.join(a.overrides)} ({a.steps} timed steps x {a.e2e_rounds} rounds, "
              "alternating):")
        print(f"  fused_ops off median {statistics.median(x[0]['tps'] for x in rows):,.0f} tok/s, on median "
              f"{statistics.median(x[1]['tps'] for x in rows):,.0f} tok/s; on/off per round median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"from each run's best step: {statistics.median(best):.3f}")
        print(f"  peak RSS median off {statistics.median(x[0]['rss'] for x in rows):.0f} MiB, on "
              f"{statistics.median(x[1]['rss'] for x in rows):.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="per-op timing rounds")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="leave out the torch.compile'd twin (no compile time)")
    ap.add_argument("--cpu-impl", choices=("eager", "compile"), default="",
                    help="force the CPU implementation of every fused op (MEGASCALE_FUSED_CPU)")
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--config", default="configs/bench_gpt_19m.toml")
    ap.add_argument("--e2e-rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed train steps per end-to-end measurement")
    ap.add_argument("overrides", nargs="*", help="config overrides of the end-to-end runs")
    a = ap.parse_args()
    if a.cpu_impl:
        os.environ["MEGASCALE_FUSED_CPU"] = a.cpu_impl
    torch.manual_seed(0)
    if not a.skip_ops:
        bench_ops(a)
        print()
    if not a.skip_e2e:
        bench_e2e(a)


if __name__ == "__main__":
    main()
