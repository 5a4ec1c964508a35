"""One data loader per host (data.shared_loader) vs one per rank: what loading costs a tp4 host.

    python benchmarks/shared_loader.py [--rounds 3] [--steps 8] [--warmup 2] [--tp 4] [overrides]

Four tensor-parallel ranks on this host (gloo), one replica: without the flag each of them reads,
packs and copies the same rows; with it the host's leader reads them once into shared memory and
the four copy theirs out. The config makes loading a visible cost on a CPU: many short rows per step
(2048 x 33 tokens: PackedSamples gathers row by row, ~15 us each here) and a tiny model. Within one
job of 4 processes, every round builds a fresh Trainer with the flag on and one with it off (the
order swapped every round), runs warm-up steps, then `--steps` measured ones, and reads:

* loader CPU s/step: the CPU time of the thread that reads (BatchLoader's prefetch thread, or the
  leader's producer: read + pack + write + checksum), of each rank's reader thread (the copy out of
  the ring, the checksum, any polling) and of the caller inside next_batch, from `loader.stats`
  (`time.thread_time`);
* bytes read/step: token bytes read from the dataset's memory map (rows x (seq_len + 1) x its dtype);
* wait: the `next_batch` timer (megascale/observe/timers, op "next_batch", stream "data") of every
  measured step; per rank its median, per host the median over steps of the slowest rank's wait;
* step time (rank 0's median) and the process CPU of all ranks per step, for context.

Per host figures sum the ranks. The summary is the median over rounds of each figure, on and off,
and on/off; nothing is asserted on time (a shared 2-core machine is noisy).
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

# loading made visible: many short rows, a model that computes little per token
WORKLOAD = ["model.n_layers=1", "model.d_model=32", "model.n_heads=4", "model.seq_len=32",
            "train.global_batch=2048", "train.micro_batch=1024"]


def measure(world: int, args: dict) -> list[dict]:
    """On every rank: per round, flag on and off (alternating order), this rank's figures."""
    import torch.distributed as dist

    from megascale.config import load_config
    from megascale.observe.trace import read_rank, trace_dir
    from megascale.train import Trainer

    rank = dist.get_rank() if world > 1 else 0
    out = []
    for r in range(args["rounds"]):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            run = Path(args["tmp"]) / f"r{r}-{'on' if on else 'off'}"
            cfg = load_config(args["config"], [*args["overrides"], f"train.run_dir={json.dumps(str(run))}",
                                               f"data.shared_loader={'true' if on else 'false'}"])
            trainer = Trainer(cfg, quiet=True)
            for _ in range(args["warmup"]):
                trainer.train_step()
            st0, p0 = dict(trainer.loader.stats), time.process_time()
            steps = [trainer.train_step().step_time for _ in range(args["steps"])]
            p1, st1 = time.process_time(), dict(trainer.loader.stats)
            mode = getattr(trainer.loader, "mode", "own")
            trainer.close()  # flushes the trace
            waits = {e.step: e.dur / 1e9 for e in read_rank(trace_dir(run) / f"rank_{rank:05d}.jsonl").events
                     if e.op == "next_batch" and e.step >= args["warmup"]}
            n = args["steps"]
            out.append({"round": r, "on": on, "mode": mode, "step_s": statistics.median(steps),
                        "loader_cpu_s": sum(st1[k] - st0[k] for k in st1 if k.endswith("_cpu_s")) / n,
                        "bytes": (st1["bytes_read"] - st0["bytes_read"]) / n,
                        "process_cpu_s": (p1 - p0) / n, "waits": waits})
    return out


def _row(ranks: dict[int, list[dict]], i: int) -> dict:
    """Per-host figures of measurement i (the same index on every rank)."""
    per = [ranks[r][i] for r in sorted(ranks)]
    steps = sorted(set.intersection(*(set(p["waits"]) for p in per)))
    slowest = [max(p["waits"][s] for p in per) for s in steps]
    return {"on": per[0]["on"], "round": per[0]["round"], "modes": [p["mode"] for p in per],
            "step_s": per[0]["step_s"],
            "loader_cpu_s": sum(p["loader_cpu_s"] for p in per),
            "loader_cpu_s_ranks": [p["loader_cpu_s"] for p in per],
            "bytes": sum(p["bytes"] for p in per), "bytes_ranks": [p["bytes"] for p in per],
            "wait_s": statistics.median(slowest) if slowest else float("nan"),
            "wait_s_ranks": [statistics.median(p["waits"].values()) if p["waits"] else float("nan")
                             for p in per],
            "process_cpu_s": sum(p["process_cpu_s"] for p in per)}


def _ms(xs) -> str:
    return "/".join(f"{1e3 * x:.2f}" for x in xs)


def _kb(xs) -> str:
    return "/".join(f"{x / 1e3:.0f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks (processes) on this host")
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu_default.toml"))
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (after the workload's)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        common = ["train.steps=100000", "train.eval_interval=0", "log.progress=false",
                  "log.tensorboard=false", "log.jsonl=false", "log.sample_tokens=0", "log.peak_flops=1e9",
                  "checkpoint.interval=0", "checkpoint.resume=false", f"parallel.tp={a.tp}",
                  f"data.path={json.dumps(str(ROOT / 'data' / 'cache' / 'shakespeare'))}",
                  f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}", *WORKLOAD, *a.overrides]
        args = {"config": a.config, "overrides": common, "rounds": a.rounds, "steps": a.steps,
                "warmup": a.warmup, "tmp": tmp}
        ranks = run_on_gloo(a.tp, measure, args)
    rows = [_row(ranks, i) for i in range(len(ranks[0]))]
    for x in rows:
        print(f"round {x['round'] + 1} {'on ' if x['on'] else 'off'} ({','.join(x['modes'])}): "
              f"loader CPU {1e3 * x['loader_cpu_s']:.2f} ms/step per host "
              f"(ranks {_ms(x['loader_cpu_s_ranks'])}), "
              f"read {x['bytes'] / 1e3:.0f} kB/step per host (ranks {_kb(x['bytes_ranks'])}), "
              f"wait {1e3 * x['wait_s']:.2f} ms (slowest rank; ranks {_ms(x['wait_s_ranks'])}), "
              f"step {1e3 * x['step_s']:.0f} ms, process CPU {x['process_cpu_s']:.3f} s/step", flush=True)
    print(f"\ntp{a.tp} on one host, {a.steps} steps x {a.rounds} rounds, alternating; medians over rounds:")
    for key, label, unit, scale in (("loader_cpu_s", "loader CPU per host", "ms/step", 1e3),
                                    ("bytes", "bytes read per host", "kB/step", 1e-3),
                                    ("wait_s", "wait for data (slowest rank)", "ms/step", 1e3),
                                    ("step_s", "step time (rank 0)", "ms", 1e3),
                                    ("process_cpu_s", "process CPU of all ranks", "s/step", 1.0)):
        on = statistics.median(x[key] for x in rows if x["on"])
        off = statistics.median(x[key] for x in rows if not x["on"])
        ratio = f"{on / off:.3f}" if off else "n/a"
        print(f"  {label}: on {on * scale:.3f} {unit}, off {off * scale:.3f} {unit}, on/off {ratio}")
    for key, label, unit, scale in (("loader_cpu_s_ranks", "loader CPU per rank", "ms/step", 1e3),
                                    ("bytes_ranks", "bytes read per rank", "kB/step", 1e-3),
                                    ("wait_s_ranks", "wait per rank", "ms/step", 1e3)):
        for on in (True, False):
            per = [statistics.median(x[key][r] for x in rows if x["on"] == on) for r in range(a.tp)]
            figures = ", ".join(f"{v * scale:.3f}" for v in per)
            print(f"  {label} {'on ' if on else 'off'}: {figures} {unit}")


if __name__ == "__main__":
    main()
