"""Where stage 2 should write from: a thread of the training process, or a writer process of its own.

    .venv/bin/python benchmarks/checkpoint_writer.py            # states of ~1, ~40 and ~230 MB a rank
    .venv/bin/python benchmarks/checkpoint_writer.py --quick    # the smoke-test size (seconds)

A thread costs training the GIL while DCP's torch.save copies and checksums the state: a price per
checkpoint that grows with the state. A process costs nothing per checkpoint but a new interpreter
that imports torch (seconds of CPU, every rank of a host at once, and its memory for the whole run).
`checkpoint.writer_process_min_mb` picks between them by the rank's state; this measures both on
the real Trainer (one process, fp32, AdamW: 12 bytes a parameter), in the same run, for each state:

  * extra training seconds per checkpoint: the steps from `save()` until the persist is done, less
    as many median steps with nothing in flight (what the checkpoint cost the steps beside it);
  * for the process, the first checkpoint apart: its writer starts then;
  * the writer process's resident memory, and `persist_s` of each.

On a machine whose cores are all training (this CPU, or a test's jobs) the new interpreter's
import competes with the steps; on a GPU host with idle cores it does not, and only the thread's
GIL price is left. Medians over `--reps`; the machine is noisy, so read the columns side by side.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # model overrides: about 1, 40 and 230 MB of weights + AdamW moments
    "1 MB": ["model.n_layers=2", "model.d_model=64", "model.n_heads=2"],
    "40 MB": ["model.n_layers=4", "model.d_model=256", "model.n_heads=4"],
    "230 MB": ["model.n_layers=6", "model.d_model=512", "model.n_heads=8"],
}


def config(tmp: Path, model: list[str], process: bool):
    return load_config(ROOT / "configs" / "bench_gpt_19m.toml", [
        *model, "model.seq_len=64", "train.global_batch=4", "train.micro_batch=4", "model.dropout=0.0",
        "train.dtype=fp32", "train.steps=100000", "train.eval_interval=0", "log.progress=false",
        "log.tensorboard=false", "log.jsonl=false", "log.sample_tokens=0", "log.peak_flops=1e12",
        "checkpoint.interval=0", "checkpoint.keep=1", f"checkpoint.writer_process={str(process).lower()}",
        "checkpoint.writer_process_min_mb=0",
        f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}",
        f"data.path={json.dumps(str(tmp / 'ds'))}", f"train.run_dir={json.dumps(str(tmp / 'run'))}",
        f"checkpoint.memory_dir={json.dumps(str(tmp / 'shm'))}"])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(cfg, reps: int) -> dict:
    from megascale.checkpoint.manager import state_mb
    from megascale.train import Trainer

    trainer = Trainer(cfg, resume=False, quiet=True)
    ck = trainer.checkpoints
    out: dict = {"extra": [], "persist": [], "rss": float("nan")}
    try:
        trainer.train_step()
        out["state_mb"] = state_mb(trainer.engine)  # what the manager weighs against the threshold
        for _ in range(2):  # both memory slots allocated and first-touched: their cost is not the writer's
            trainer.save(persist=False)
            trainer.train_step()
        quiet = [trainer.train_step().step_time for _ in range(4)]  # steps with nothing in flight
        during = []
        for _ in range(reps + 1):  # the first: a process starts its writer
            trainer.save(persist=True)
            times, events = [], []
            while not events and len(times) < 200:
                times.append(trainer.train_step().step_time)
                events = ck.events()
            ck.wait()
            events += ck.events()
            during.append(times)
            out["persist"].append(events[0]["persist_s"])
            if ck.writer is not None and ck.writer.running():
                out["rss"] = rss_mb(ck.writer._proc.pid)
            quiet += [trainer.train_step().step_time for _ in range(4)]
        base = statistics.median(quiet)  # interleaved with the checkpoints: the machine's drift is in both
        out["extra"] = [sum(times) - base * len(times) for times in during]
    finally:
        trainer.close()
        del trainer, ck
        gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 1 MB state, 1 repetition")
    ap.add_argument("--reps", type=int, default=4, help="checkpoints after the first, per state and writer")
    args = ap.parse_args()
    sizes = {"1 MB": SIZES["1 MB"]} if args.quick else SIZES
    reps = 1 if args.quick else args.reps
    print(f"{'state':>8} {'writer':>8} {'first ckpt':>11} {'later ckpts':>12} {'persist_s':>10} "
          f"{'writer RSS':>11}")
    with tempfile.TemporaryDirectory(prefix="megascale-writer-bench-") as tmp:
        for model in sizes.values():
            for process in (False, True):
                r = measure(config(Path(tmp), model, process), reps)
                rss = f"{r['rss']:.0f} MB" if process else "-"
                print(f"{r['state_mb']:6.1f}MB {'process' if process else 'thread':>8} "
                      f"{r['extra'][0]:+10.3f}s {statistics.median(r['extra'][1:]):+11.3f}s "
                      f"{statistics.median(r['persist']):9.3f}s {rss:>11}", flush=True)
    print("(extra training seconds per checkpoint against undisturbed steps; 'later' is the median of "
          f"{reps} after the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
