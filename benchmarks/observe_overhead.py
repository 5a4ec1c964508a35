"""What the always-on timers cost: step time with observe.timers = true vs false.

    python benchmarks/observe_overhead.py [--rounds 8] [--block 4] [--layouts 1,dp2tp2] [overrides]

Two measurements, because on a shared 2-core machine run-to-run noise (a few %) is larger than
the effect (goal: under 1%):

* end to end, alternating: one job per layout (the CPU default model, one process and dp2 x tp2
  on 4 gloo processes) trains blocks of `--block` steps with the timers on, then off, then on,
  ... (the order swapped every round, after warm-up steps), switching the process's recorder in
  and out between blocks on every rank at the same step; a block's figure is rank 0's median
  step time, the result the median over rounds of on / off. One process, one memory layout,
  one set of threads: what differs between the blocks is the timers alone;
* per record: the timers' own cost, timed in a tight loop (span, collective record, async
  launch + issued + wait: two records), times the records a step of that layout writes (counted
  from its trace), over
  the step time: the overhead with the noise taken out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _gloo import run_on_gloo  # noqa: E402

LAYOUTS = {"1": (1, []), "dp2tp2": (4, ["parallel.dp=2", "parallel.tp=2"])}


def alternate(world: int, args: dict) -> dict:
    """On every rank: the Trainer, warm-up, then blocks on/off; rank 0's median step time per block."""
    from megascale.config import load_config
    from megascale.observe import timers
    from megascale.train import Trainer

    if world == 1:
        import torch

        torch.set_num_threads(args["threads"])
    trainer = Trainer(load_config(args["config"], args["overrides"]), quiet=True)
    recorder = trainer.observer.recorder
    for _ in range(args["warmup"]):
        trainer.train_step()
    ratios, on_s, off_s = [], [], []
    for r in range(args["rounds"]):
        got = {}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            timers.install(recorder if on else None)
            got[on] = statistics.median(trainer.train_step().step_time for _ in range(args["block"]))
        ratios.append(got[True] / got[False])
        on_s.append(got[True])
        off_s.append(got[False])
    timers.install(recorder)
    trainer.close()
    return {"ratios": ratios, "on": on_s, "off": off_s, "trace": str(recorder.trace_dir.parent)}


def records_per_step(run_dir: Path) -> dict[str, float]:
    """Records of each kind one rank writes per step (the busiest rank), from a timers-on run's trace."""
    from megascale.observe.trace import read_run

    ranks = read_run(run_dir)
    best: dict[str, float] = {}
    for t in ranks.values():
        steps = max(1, len({e.step for e in t.events}))
        kinds = {"span": 0, "comm": 0, "launch": 0}
        for e in t.events:
            if e.stream in ("compute", "data", "checkpoint"):
                kinds["span"] += 1
            elif e.op == "issue":  # every launched op writes one, then its own span at the wait
                kinds["launch"] += 1
                kinds["comm"] -= 1
            else:
                kinds["comm"] += 1
        total = sum(kinds.values()) / steps
        if total > sum(best.values()):
            best = {k: v / steps for k, v in kinds.items()}
    return best


class _Done:
    def wait(self):
        pass


def cost_per_record(n: int = 20000) -> dict[str, float]:
    """Seconds per record of each kind, the recorder's own work (no collective behind it)."""
    from megascale.observe import timers

    with tempfile.TemporaryDirectory() as tmp:
        rec = timers.Recorder(Path(tmp) / "trace", 0, 2, {"dp": 0, "pp": 0, "tp": 0},
                              {"world": [0, 1], "tp": [0, 1]}, flush_interval_s=0.2)
        timers.install(rec)
        done = _Done()
        out = {}
        try:
            for kind in ("span", "comm", "launch", "off"):
                if kind == "off":
                    timers.install(None)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        if kind in ("span", "off"):
                            with timers.span("forward"):
                                pass
                        elif kind == "comm":
                            with timers.comm("all_reduce", "tp", "tp"):
                                pass
                        else:
                            pending = timers.launch("reduce_scatter", "dp", "tp")
                            pending.issued()
                            pending.wait(done)
                    best = min(best, (time.perf_counter() - t0) / n)
                out[kind] = best
        finally:
            timers.install(None)
            rec.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=4, help="steps per block (timers on, or off)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu_default.toml"))
    ap.add_argument("--layouts", default="1,dp2tp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    a = ap.parse_args()
    costs = cost_per_record()
    off = costs.pop("off")
    each = ", ".join(f"{k} {1e6 * v:.2f} us" for k, v in costs.items())
    print(f"per record (the recorder's own work): {each}; timers off: {1e9 * off:.0f} ns a call")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.layouts.split(","):
            world, layout = LAYOUTS[name]
            run = Path(tmp) / name
            common = ["train.steps=100000", "train.eval_interval=0", "log.progress=false",
                      "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9",
                      "checkpoint.interval=0", "checkpoint.resume=false",
                      f"train.run_dir={json.dumps(str(run))}",
                      f"data.path={json.dumps(str(ROOT / 'data' / 'cache' / 'shakespeare'))}",
                      f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}"]
            args = {"config": a.config, "overrides": [*common, *layout, *a.overrides], "rounds": a.rounds,
                    "block": a.block, "warmup": a.warmup, "threads": 2}
            res = run_on_gloo(world, alternate, args)[0]
            for r, (x, y, q) in enumerate(zip(res["on"], res["off"], res["ratios"], strict=True)):
                print(f"{name} round {r + 1}: step on {1e3 * x:.1f} ms, off {1e3 * y:.1f} ms, on/off {q:.4f}")
            med = statistics.median(res["ratios"])
            per_step = records_per_step(run)
            est = sum(per_step[k] * costs[k] for k in per_step) / statistics.median(res["off"])
            on_ms, off_ms = 1e3 * statistics.median(res["on"]), 1e3 * statistics.median(res["off"])
            print(f"{name}: on/off per round median {med:.4f} (overhead {100 * (med - 1):+.2f}%; step on "
                  f"{on_ms:.1f} ms, off {off_ms:.1f} ms); {sum(per_step.values()):.0f} records/step x their "
                  f"cost = {100 * est:.3f}% of a step",
                  flush=True)


if __name__ == "__main__":
    main()
