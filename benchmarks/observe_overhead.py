"""What the always-on timers cost: step time with observe.timers = true vs false.

    python benchmarks/observe_overhead.py [--rounds 5] [--steps 12] [--layouts 1,dp2tp2] [overrides]

Two measurements, because on a shared 2-core machine run-to-run noise (a few %) is larger than
the effect (goal: under 1%):

* end to end: the CPU default model trained for `--steps` steps with the timers on, then off,
  then on, ... (alternating, one fresh job per run, the order swapped every round), for one
  process and for dp2 x tp2 (4 processes); each run's figure is rank 0's median step time after
  two warm-up steps; the result is the median over rounds of on / off;
* per record: the timers' own cost, timed in a tight loop (span, collective record, async
  launch + wait), times the records a step of that layout writes (counted from its trace), over
  the step time: the overhead with the noise taken out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"1": (1, []), "dp2tp2": (4, ["parallel.dp=2", "parallel.tp=2"])}


def run_job(run_dir: Path, nproc: int, layout: list[str], timers: bool, steps: int,
            extra: list[str]) -> float:
    """Rank 0's median step time (s) of one fresh job, warm-up steps excluded."""
    args = [sys.executable, "-m", "megascale", "train", "--config", "configs/cpu_default.toml",
            *(["--nproc", str(nproc)] if nproc > 1 else []), f"train.steps={steps}", "train.eval_interval=0",
            "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9",
            "checkpoint.interval=0", f"observe.timers={str(timers).lower()}", "--no-resume",
            f"train.run_dir={run_dir}", *layout, *extra]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1" if nproc > 1 else "2"}
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the job failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [x["step_time"] for x in recs if x["kind"] == "train"][2:]
    return statistics.median(times)


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
            elif e.op in ("send",) or (e.stream == "dp" and e.op in ("reduce_scatter", "all_gather")):
                kinds["launch"] += 1
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
                            timers.launch("reduce_scatter", "dp", "tp").wait(done)
                    best = min(best, (time.perf_counter() - t0) / n)
                out[kind] = best
        finally:
            timers.install(None)
            rec.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layouts", default="1,dp2tp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    a = ap.parse_args()
    costs = cost_per_record()
    off = costs.pop("off")
    each = ", ".join(f"{k} {1e6 * v:.2f} us" for k, v in costs.items())
    print(f"per record (the recorder's own work): {each}; timers off: {1e9 * off:.0f} ns a call")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.layouts.split(","):
            nproc, layout = LAYOUTS[name]
            ratios, ons, offs = [], [], []
            for r in range(a.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                got = {}
                for on in order:
                    got[on] = run_job(Path(tmp) / f"{name}_{on}", nproc, layout, on, a.steps, a.overrides)
                ons.append(got[True])
                offs.append(got[False])
                ratios.append(got[True] / got[False])
                print(f"{name} round {r + 1}: step on {1e3 * got[True]:.1f} ms, "
                      f"off {1e3 * got[False]:.1f} ms, on/off {ratios[-1]:.4f}", flush=True)
            per_step = records_per_step(Path(tmp) / f"{name}_True")
            est = sum(per_step[k] * costs[k] for k in per_step) / statistics.median(offs)
            med = statistics.median(ratios)
            print(f"{name}: on/off per round median {med:.4f} (overhead {100 * (med - 1):+.2f}%; step on "
                  f"{1e3 * statistics.median(ons):.1f} ms, off {1e3 * statistics.median(offs):.1f} ms); "
                  f"{sum(per_step.values()):.0f} records/step x their cost = {100 * est:.3f}% of a step")


if __name__ == "__main__":
    main()
