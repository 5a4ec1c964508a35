"""What a step costs beyond its kernels timed alone, measured in the real Trainer.

The kernel model (perf/gemm.py) times GEMMs and memory-bound kernels, each alone, with a small
dispatch `overhead_s`. A training step also runs Python: the modules, autograd's graph (built in the
forward, walked in the backward), the tensor-parallel functions around each collective, the schedule,
the loss, the optimizer's loops over its tensors, the timers, the data loader. On a GPU that work runs
ahead of the kernels and hides while they are longer; on a CPU the same core runs it between them,
so it adds. And a layer's kernels run slower in place than alone (between others, in autograd's fresh
buffers; CPU flash attention's backward is ~2.7x its forward, not the 2x of its GEMMs).

`measure` runs the real Trainer at tp 1 and at tp 2 with sequence parallelism. At a shape so small
that its kernels take almost nothing (TINY: d_model 64, seq 16), at 1 and 3 layers and 2 and 16
micro-batches a step, four step times fit

    host(step) = S + L * P + M * (B + L * H)        L layers, M micro-batches

S the step's fixed work (loader, timers, optimizer set-up), P each layer's share of the optimizer,
clipping and zeroing (its tensors), B a micro-batch's work around the layers (embedding, head, loss,
schedule), H a layer's per micro-batch. tp 2's H and B less tp 1's are what the tensor-parallel path
adds: per collective call in a layer (`host_tp_call_s`, the calls as perf/compute.py counts them) and
per micro-batch around the layers (the vocab-parallel loss: `host_tp_microbatch_s`). At a typical
small layer (WIDE: d_model 256, 4 heads of 64, seq 128), 1 and 3 layers, what a layer costs beyond
its kernel model and H is the in-place factor, at tp 1 and at tp 2 (SP's layout copies included). It
scales the layer's kernels but its projections' GEMMs, which run within 3% of their calibrated time in
a layer: attention (its CPU backward is ~2.7x its forward, not 2x) and the memory-bound kernels.
A reference timed between the turns (a WIDE layer's GEMMs alone) scales every time to the speed the
kernel model was calibrated at, so the machine's drift in between drops out. On a GPU the factors stay
1: a WIDE step there is launch-bound, and its excess over the kernels is host work, already counted.

Measured on this 2-core VM (three runs): H 0.17-0.19 ms, B 0.19-0.26 ms, S 0.82-1.14 ms, P 0.06-0.47
ms, 0.03-0.07 ms per tp call, 0.17-0.46 ms per micro-batch for the vocab-parallel loss, in-place
factors 1.38-1.56 (tp 1) and 2.04-2.38 (tp 2) on the kernels they scale. The block timed alone in a
loop (session 20's way) saw only about half of that host work and none of the per-step, tp-path or
in-place costs: the planner's compute was 5-20% under what the ranks of benchmarks/ablation.py spent
with their collectives no-ops.

The tp 2 runs are one process in a world of two whose collectives return at once and move nothing
(torch.distributed's "fake" backend, from its test utilities; where it is missing, the tp terms are
0 and the factor is tp 1's). Each tp runs in a subprocess of its own: the caller's process group, if
any, is untouched. torch is imported inside: the planner itself must not need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megascale.config import ModelConfig
from megascale.perf import compute, memory
from megascale.perf.gemm import DeviceModel
from megascale.perf.step import OPTIMIZER_BYTES_PER_PARAM

TINY = {"d_model": 64, "n_heads": 4, "seq_len": 16, "dropout": 0.0, "vocab_size": 256}  # byte tokenizer
# A typical small layer (heads of 64, as most models have), where the kernels are most of its time
WIDE = {**TINY, "d_model": 256, "n_heads": 4, "seq_len": 128}
MICRO_BATCH = 2
GRID = ((1, 2), (1, 16), (3, 2), (3, 16))  # (layers, micro-batches a step) at TINY
WIDE_GRID = ((1, 4), (3, 4))  # at WIDE
# A layer's host work split between forward and backward as the bare block's times split it (~1 : 2):
# the Trainer's steps give only the sum
FORWARD_SHARE = 1 / 3
TERMS = ("host_layer_fwd_s", "host_layer_bwd_s", "host_microbatch_s", "host_tp_call_s",
         "host_tp_microbatch_s", "host_step_s", "host_layer_step_s")
FACTORS = ("in_place_factor", "in_place_factor_tp")


def measure(device: str, dtype: str, dev: DeviceModel, clock: str = "wall", rounds: int = 3,
            steps: int = 6) -> tuple[dict[str, float], dict]:
    """(the curve's host terms and in-place factors, the step times they were fitted on): the framework's
    seconds, and the layer's kernels' slow-down in place, that `dev` (the calibrated kernel model) does
    not account for. The times: {tp: {"d_model,layers,micro-batches": seconds, "ref": reference_gemms'
    seconds, "speed": the machine's speed then against the model's}}. `clock`: "wall", or "cpu" (the
    process's CPU time, every thread's: the Trainer's own threads are host work too)."""
    # the kernels alone: a curve that already carries these terms would take them off twice
    bare = dict.fromkeys(TERMS, 0.0) | dict.fromkeys(FACTORS, 1.0)
    dev = dataclasses.replace(dev, curve=dataclasses.replace(dev.curve, **bare))
    times = {tp: _run(tp, device, dtype, clock, rounds, steps) for tp in (1, 2)}
    fits = {tp: fit(dev, tp, got) for tp, got in times.items() if got}
    one, two = fits[1], fits.get(2)
    calls = 2 * compute.tp_calls_per_layer(2, parallel_block=False)
    out = {"host_layer_fwd_s": FORWARD_SHARE * one["H"], "host_layer_bwd_s": (1 - FORWARD_SHARE) * one["H"],
           "host_microbatch_s": one["B"], "host_step_s": one["S"], "host_layer_step_s": one["P"],
           "host_tp_call_s": max(0.0, two["H"] - one["H"]) / calls if two else 0.0,
           "host_tp_microbatch_s": max(0.0, two["B"] - one["B"]) if two else 0.0,
           "in_place_factor": one["f"], "in_place_factor_tp": two["f"] if two else one["f"]}
    if dev.host_async:  # a GPU: WIDE's step is launch-bound, its excess is host work, not slower kernels
        out |= dict.fromkeys(FACTORS, 1.0)
    report = {tp: {"speed": fits[tp]["speed"], **{_key(k): t for k, t in got.items()}}
              for tp, got in times.items() if got}
    return out, report


def fit(dev: DeviceModel, tp: int, times: dict) -> dict[str, float]:
    """S, P, B, H (module docstring), the in-place factor f and the machine's speed from the step times
    at GRID (TINY) and WIDE_GRID, keyed (d_model, layers, micro-batches), and reference_gemms' ("ref").
    A step's host seconds are its time less the kernel model's. At TINY they are the framework's alone
    and give S, P, B, H exactly; at WIDE a layer takes longer than its kernels and H, and f - 1 is that
    excess over the kernel model's layer. Each is floored (differences of noisy medians can dip below)."""
    # every time at the calibrated machine's speed (reference_gemms)
    speed = sum(dev.gemm(*g) for g in reference_gemms(tp)) / times["ref"]
    times = {k: t * speed for k, t in times.items() if k != "ref"}
    h = {(L, M): times[TINY["d_model"], L, M] - kernels(dev, tp, L, M, TINY) for L, M in GRID}
    (l0, m0), (_, m1), (l1, _) = GRID[0], GRID[1], GRID[2]
    dl, dm = l1 - l0, m1 - m0
    H = max(0.0, (h[l1, m1] - h[l0, m1] - h[l1, m0] + h[l0, m0]) / (dl * dm))
    B = max(0.0, (h[l0, m1] - h[l0, m0]) / dm - l0 * H)
    P = max(0.0, (h[l1, m0] - h[l0, m0]) / dl - m0 * H)
    S = max(0.0, h[l0, m0] - l0 * P - m0 * (B + l0 * H))
    # WIDE: each layer more, at the same micro-batches, costs P + M (H + (f - 1) x its kernels) more
    (wl0, wm), (wl1, _) = WIDE_GRID
    wide = {L: times[WIDE["d_model"], L, wm] - kernels(dev, tp, L, wm, WIDE) for L in (wl0, wl1)}
    excess = ((wide[wl1] - wide[wl0]) / (wl1 - wl0) - P) / wm - H  # per layer and micro-batch
    layer = compute.layer_cost(ModelConfig(**WIDE, n_layers=1), dev, MICRO_BATCH, tp, tp > 1, None,
                               False, False, False)
    f = max(1.0, 1.0 + excess / layer.in_place_base)
    return {"S": S, "P": P, "B": B, "H": H, "f": f, "speed": speed}


def _key(k) -> str:
    return k if isinstance(k, str) else ",".join(map(str, k))


def reference_gemms(tp: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of a WIDE layer's GEMMs on one rank of a tp group, forward and backward: timed alone in
    every turn of the measurement, they say how fast the machine ran then against the calibrated
    model, so the machine's drift between the GEMM calibration and this one drops out (on a shared
    VM it moved the in-place factor from 1.08 to 1.51 between two runs a minute apart)."""
    cfg = ModelConfig(**WIDE, n_layers=1)
    groups = compute.layer_gemms(cfg, MICRO_BATCH * cfg.seq_len, MICRO_BATCH, tp, False)
    fwd = [(int(g.m), int(g.n), int(g.k)) for i, group in enumerate(groups) if i != 1 for g in group]
    return [*fwd, *((m, k, n) for m, n, k in fwd), *((k, n, m) for m, n, k in fwd)]


def kernels(dev: DeviceModel, tp: int, layers: int, micro_batches: int, shape: dict) -> float:
    """The kernel model's seconds of one step on one rank of a tp group at `shape` (TINY, WIDE): forward
    and backward of every layer and of the embedding and head, per micro-batch, and the optimizer."""
    cfg = ModelConfig(**shape, n_layers=layers)
    layer = compute.layer_cost(cfg, dev, MICRO_BATCH, tp, tp > 1, None, False, False, False)
    per_mb = layers * (layer.fwd + layer.bwd) + sum(compute.head_cost(cfg, dev, MICRO_BATCH, tp))
    per_mb += sum(compute.embedding_cost(cfg, dev, MICRO_BATCH))
    params = memory.stage_params(cfg, tp, 1, 0)
    return micro_batches * per_mb + dev.elementwise(OPTIMIZER_BYTES_PER_PARAM * params, 8)


def _run(tp: int, device: str, dtype: str, clock: str, rounds: int, steps: int) -> dict[tuple, float]:
    """The median step time of each point (d_model, layers, micro-batches) at this tp, from a subprocess
    (empty where tp > 1 and this torch has no fake backend)."""
    import torch

    env = {k: v for k, v in os.environ.items() if k != "MEGASCALE_INJECT"}  # no test's faults in here
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(tp)}
    cmd = [sys.executable, "-m", "megascale.perf.host", "--tp", str(tp), "--device", device, "--dtype", dtype,
           "--clock", clock, "--threads", str(torch.get_num_threads()), "--rounds", str(rounds),
           "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stdout.splitlines() if x.startswith("HOST ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measuring the framework's host work at tp {tp} failed "
                           f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(lines[-1][5:])
    return {k if k == "ref" else tuple(map(int, k.split(","))): v for k, v in got.items()}


def _fake_world(tp: int) -> bool:
    """Join a world of `tp` processes, this one rank 0, whose collectives return at once and move
    nothing (torch's "fake" backend). False where this torch has none."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return False
    new_group = dist.new_group
    # the checkpoint manager asks for a gloo group by name; in a fake world every group is fake
    dist.new_group = lambda *a, **k: new_group(*a, **{x: y for x, y in k.items() if x != "backend"})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    return True


def _trainer_args(tp: int, shape: dict, layers: int, micro_batches: int, device: str, dtype: str,
                  tmp: str) -> list[str]:
    run = f"{tmp}/run-{shape['d_model']}-{layers}-{micro_batches}"
    return [
        *(f"model.{k}={v}" for k, v in shape.items() if k != "vocab_size"), f"model.n_layers={layers}",
        f"train.micro_batch={MICRO_BATCH}", f"train.global_batch={MICRO_BATCH * micro_batches}",
        f"train.device={device.split(':')[0]}",
        f"train.dtype={dtype if dtype in ('bf16', 'fp64') else 'fp32'}",
        "train.steps=100000", "train.eval_interval=0", "log.progress=false", "log.tensorboard=false",
        "log.sample_tokens=0", "checkpoint.interval=0", "checkpoint.memory_interval=0",
        f"parallel.tp={tp}", f"parallel.sequence_parallel={str(tp > 1).lower()}",
        "parallel.transport=gloo", "data.shared_loader=false", "data.tokenizer=byte",
        f"data.source={json.dumps(f'{tmp}/text.txt')}", f"data.path={json.dumps(f'{tmp}/tokens')}",
        f"train.run_dir={json.dumps(run)}",
    ]


def main(argv: list[str] | None = None) -> int:
    """In the subprocess: the Trainers of GRID's and WIDE_GRID's points side by side, and the reference
    GEMMs, the medians of their steps printed as HOST {json}."""
    p = argparse.ArgumentParser()
    for name, kind in (("tp", int), ("device", str), ("dtype", str), ("clock", str), ("threads", int),
                       ("rounds", int), ("steps", int)):
        p.add_argument(f"--{name}", type=kind, required=True)
    a = p.parse_args(argv)
    import warnings

    import torch

    from megascale.config import load_config
    from megascale.perf.hardware import _torch_dtype
    from megascale.train import Trainer

    warnings.filterwarnings("ignore")  # the fake backend's "set timeout is only supported for ..."
    torch.set_num_threads(a.threads)
    if a.tp > 1 and not _fake_world(a.tp):
        print("HOST {}", flush=True)
        return 0
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    dt = _torch_dtype(torch, a.dtype)
    pairs = [(torch.randn(m, k, device=a.device, dtype=dt), torch.randn(k, n, device=a.device, dtype=dt))
             for m, n, k in reference_gemms(a.tp)]

    def reference() -> None:
        for x, y in pairs:
            torch.mm(x, y)
        sync()

    with tempfile.TemporaryDirectory() as tmp:
        _write_corpus(Path(tmp, "text.txt"))
        points = [(shape, L, M) for shape, grid in ((TINY, GRID), (WIDE, WIDE_GRID)) for L, M in grid]
        trainers = {(shape["d_model"], L, M): Trainer(
            load_config(None, _trainer_args(a.tp, shape, L, M, a.device, a.dtype, tmp)), quiet=True)
            for shape, L, M in points}
        tick = time.process_time if a.clock == "cpu" else time.perf_counter
        times = _take_turns(trainers, reference, tick, a.rounds, a.steps)
    print("HOST " + json.dumps({_key(k): statistics.median(t) for k, t in times.items()}), flush=True)
    return 0


def _write_corpus(path: Path) -> None:
    """Random words to train on (only their number matters): ~150 KB, more than the runs read."""
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 8))) for _ in range(500)]
    path.write_text("\n".join(" ".join(rng.choices(words, k=60)) for _ in range(400)))


def _take_turns(trainers: dict, reference, tick, rounds: int, steps: int) -> dict[object, list[float]]:
    """Each Trainer (and the reference) runs `steps` timed steps a turn, all in turn, `rounds` times after
    a turn of warm-up, so the machine's drift falls on all alike; the Trainers are closed after."""
    from megascale.observe import timers

    times: dict[object, list[float]] = {k: [] for k in (*trainers, "ref")}
    runs = {"ref": reference, **{k: t.train_step for k, t in trainers.items()}}
    for turn in range(rounds + 1):
        for key, run in runs.items():
            if key != "ref":  # its own timers, as it would run alone
                timers.install(trainers[key].observer.recorder)
            for _ in range(steps):
                t0 = tick()
                run()
                if turn:
                    times[key].append(tick() - t0)
    for trainer in trainers.values():
        timers.install(trainer.observer.recorder)
        trainer.close()
    return times


if __name__ == "__main__":
    sys.exit(main())
