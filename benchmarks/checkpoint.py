"""What the two-stage checkpoint buys: training blocked per checkpoint against a synchronous torch.save.

    .venv/bin/python benchmarks/checkpoint.py                  # the 19M bench model and a ~1.2 GB state
    .venv/bin/python benchmarks/checkpoint.py --big-params 340  # a larger state (M parameters x 12 bytes)
    .venv/bin/python benchmarks/checkpoint.py --quick           # the smoke-test size (well under a minute)

For each model, one process running the real `Trainer.train_step` on the bundled Shakespeare,
fp32, AdamW (weights + two moments = 12 bytes per parameter), measured in the same run:

  * blocked per checkpoint: the wall time of `trainer.save()` (stage 1 starts the copy into the
    /dev/shm slots, stage 2 is queued to a background thread) plus what the next step's
    `before_update` waits for that copy to finish; against `torch.save({"model": ..., "optim":
    ...})` + fsync of the same state to the same storage directory, which blocks training for
    all of its duration. Measured after two snapshots have allocated (first-touched) both
    slots; the first checkpoint's cost, slot allocation included, is its own row;
  * the step: the median step with no checkpoint activity, the step that follows a
    `save()` (it overlaps stage 1's copy, and the persist when that is shorter than a step),
    and the steps that ran entirely while stage 2 persisted (2 cores: the persist thread and the
    training threads share them). When the persist is shorter than a step no step runs entirely
    during it, and the table says so;
  * persist: seconds and MB/s (this rank's DCP files, written, fsynced and checksummed, while
    training goes on);
  * restore: a new Trainer on the same run directory, from the host-memory snapshot, then (slots
    deleted) from storage, with the checkpoint's pages dropped from the page cache first
    (posix_fadvise DONTNEED: a cold read) and again warm; `RestoreInfo.seconds`, bytes read and
    bytes checksummed;
  * dp = 2 (a 2-process gloo job, one thread per rank): restore from storage with one reader of
    the weights per data-parallel group that broadcasts them (`checkpoint.broadcast_restore=true`)
    against every rank reading them (false): bytes each rank reads, in total, and the seconds.

Medians over the repetitions; the machine is noisy (and shared), so read the ratios, which are
measured in alternation in the same run. Data, run directories and the memory slots live in
temporary directories (the slots in one under /dev/shm, where stage 1 keeps them in a real run),
removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gloo import run_on_gloo  # noqa: E402

from megascale.config import load_config  # noqa: E402
from megascale.data import ensure_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_CONFIG = ROOT / "configs" / "bench_gpt_19m.toml"
MB = 1e6


@dataclass
class Size:
    name: str
    model: list[str]  # model/train overrides on top of configs/bench_gpt_19m.toml
    reps: int


def tiny_size(reps: int) -> Size:
    return Size("tiny", ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=32",
                         "train.global_batch=4", "train.micro_batch=4"], reps)


def big_size(params_m: float, d_model: int, seq: int, batch: int, reps: int) -> Size:
    """A GPT of `params_m` million parameters (about 12 d^2 per layer) at width d_model."""
    layers = max(1, round((params_m * 1e6 - (256 + seq) * d_model) / (12 * d_model * d_model)))
    heads = max(1, d_model // 128)
    return Size(f"big ({params_m:g}M)", [f"model.n_layers={layers}", f"model.d_model={d_model}",
                                          f"model.n_heads={heads}", f"model.seq_len={seq}",
                                          f"train.global_batch={batch}", f"train.micro_batch={batch}"], reps)


def overrides(tmp: Path, memory_dir: Path, run: str, extra: list[str]) -> list[str]:
    return [
        *extra, "model.dropout=0.0", "train.dtype=fp32", "train.steps=100000", "train.eval_interval=0",
        "log.progress=false", "log.tensorboard=false", "log.jsonl=false", "log.sample_tokens=0",
        "log.peak_flops=1e12", "checkpoint.interval=0", "checkpoint.keep=2",
        f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}",
        f"data.path={json.dumps(str(tmp / 'ds'))}",
        f"train.run_dir={json.dumps(str(tmp / run))}",
        f"checkpoint.memory_dir={json.dumps(str(memory_dir))}",
    ]


def close(trainer) -> None:
    """A Trainer that never ran `fit`: its loader thread, stage 2 and the run directory's lock."""
    trainer.close()


def drop_page_cache(directory: str) -> None:
    """Evict a directory's (fsynced, clean) file pages from the page cache: the next read is cold."""
    for dirpath, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sync_save(trainer, path: Path) -> tuple[float, int]:
    """The synchronous baseline: torch.save of the model's and optimizer's state dicts + fsync."""
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save({"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return seconds, size


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- one process


def measure_training(cfg, reps: int, max_during: int) -> dict:
    from megascale.checkpoint.manager import state_mb
    from megascale.train import Trainer

    trainer = Trainer(cfg, resume=False, quiet=True)
    ck = trainer.checkpoints
    out: dict = {"params": trainer._num_params, "base": [], "after": [], "during": [], "blocked": [],
                 "save": [], "wait": [], "sync": [], "persist": [], "persist_bytes": [], "sync_bytes": 0,
                 "short_persists": 0}
    try:
        trainer.train_step()  # the optimizer state exists after the first step
        out["state_bytes"] = state_mb(trainer.engine) * 1e6
        for i in range(2):  # two snapshots: each allocates and first-touches one of the two slots
            t0 = time.perf_counter()
            trainer.save(persist=False)
            save_s, lb = time.perf_counter() - t0, ck.last_blocked_s
            trainer.train_step()
            if i == 0:
                out["first_blocked"] = save_s + ck.last_blocked_s - lb
        for _ in range(reps):
            for _ in range(2):  # nothing in flight
                out["base"].append(trainer.train_step().step_time)
            t0 = time.perf_counter()
            trainer.save(persist=True)
            save_s, lb = time.perf_counter() - t0, ck.last_blocked_s
            s = trainer.train_step()  # its update waits for stage 1's copy
            wait_s = ck.last_blocked_s - lb
            out["save"].append(save_s)
            out["wait"].append(wait_s)
            out["blocked"].append(save_s + wait_s)
            out["after"].append(s.step_time)
            events = ck.events()
            if events:  # the whole persist fitted in the step after save()
                out["short_persists"] += 1
            n = 0
            while not events and n < max_during:
                s = trainer.train_step()
                events = ck.events()
                if not events:  # still persisting when this step ended: it ran entirely during stage 2
                    out["during"].append(s.step_time)
                n += 1
            ck.wait()
            events += ck.events()
            ev = events[0]
            if not ev["ok"]:
                raise RuntimeError(f"persist failed: {ev['error']}")
            out["persist"].append(ev["persist_s"])
            out["persist_bytes"].append(ev["bytes"])
            sync_s, out["sync_bytes"] = sync_save(trainer, trainer.run_dir / "sync_torch_save.pt")
            out["sync"].append(sync_s)
        out["storage_dir"] = ck.storage.root
    finally:
        close(trainer)
        del trainer, ck
        gc.collect()
    return out


def measure_restore(cfg, reps: int, storage_dir: str) -> dict:
    """New Trainers on the run directory: from the host-memory snapshot, then from storage (cold, warm)."""
    from megascale.train import Trainer

    out: dict = {"memory": [], "cold": [], "warm": [], "bytes_read": 0, "bytes_verified": 0}

    def restore(kind: str, clear: bool = False):
        trainer = Trainer(cfg, quiet=True)
        try:
            info = trainer.restored
            want = "memory" if kind == "memory" else "storage"
            if info is None or info.source != want:
                raise RuntimeError(f"expected a restore from {want}, got {info and info.source}")
            out[kind].append(info.seconds)
            if want == "storage":
                out["bytes_read"], out["bytes_verified"] = info.bytes_read, info.bytes_verified
            if clear:  # the slots gone: the next Trainer restores from storage
                trainer.checkpoints.snapshots.clear()
        finally:
            close(trainer)
            del trainer
            gc.collect()

    for r in range(reps):
        restore("memory", clear=r == reps - 1)
    for _ in range(reps):
        drop_page_cache(storage_dir)
        restore("cold")
        restore("warm")
    return out


def run_size(size: Size, tmp: Path, shm: Path, max_during: int, log) -> dict:
    run = size.name.split()[0]
    cfg = load_config(BENCH_CONFIG, overrides(tmp, shm / run, run, size.model))
    log(f"{size.name}: {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, seq {cfg.model.seq_len}, "
        f"batch {cfg.train.global_batch}: training and checkpointing ({size.reps} repetitions)")
    res = measure_training(cfg, size.reps, max_during)
    log(f"{size.name}: restoring")
    res |= measure_restore(cfg, size.reps, res["storage_dir"])
    shutil.rmtree(tmp / run, ignore_errors=True)
    shutil.rmtree(shm / run, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- dp = 2


def dp_restore(world: int, args: dict) -> list[tuple[bool, int, int, float]]:
    """On every rank of a dp=2 job: save once, then restore from storage with broadcast on and off,
    alternating; [(broadcast, bytes read, bytes checksummed, seconds)] of this rank."""
    import torch.distributed as dist

    from megascale.train import Trainer

    def cfg(*extra: str):
        return load_config(BENCH_CONFIG, [*args["overrides"], "parallel.dp=2", "checkpoint.memory=false",
                                          *extra])

    trainer = Trainer(cfg(), resume=False, quiet=True)
    trainer.train_step()
    trainer.save(final=True)
    storage = trainer.checkpoints.storage.root
    close(trainer)
    del trainer
    rows = []
    for _ in range(args["reps"]):
        for broadcast in (True, False):
            if dist.get_rank() == 0:
                drop_page_cache(storage)
            dist.barrier()
            trainer = Trainer(cfg(f"checkpoint.broadcast_restore={str(broadcast).lower()}"), quiet=True)
            info = trainer.restored
            if info is None or info.source != "storage":
                raise RuntimeError(f"dp restore: expected storage, got {info and info.source}")
            rows.append((broadcast, info.bytes_read, info.bytes_verified, info.seconds))
            close(trainer)
            del trainer
            gc.collect()
    return rows


def run_dp(size: Size, tmp: Path, shm: Path, reps: int, log) -> dict:
    run = "dp2"
    batch = load_config(BENCH_CONFIG, overrides(tmp, shm, run, size.model)).train.global_batch
    model = [*size.model, f"train.micro_batch={max(1, batch // 2)}"]  # one micro-batch per dp rank
    log(f"dp=2 restore ({size.name} model, 2 gloo processes, {reps} repetitions)")
    per_rank = run_on_gloo(2, dp_restore, {"overrides": overrides(tmp, shm / run, run, model), "reps": reps})
    shutil.rmtree(tmp / run, ignore_errors=True)
    shutil.rmtree(shm / run, ignore_errors=True)
    out = {}
    for broadcast in (True, False):
        rows = {r: [x for x in per_rank[r] if x[0] == broadcast] for r in per_rank}
        out[broadcast] = {
            "read": [rows[r][0][1] for r in sorted(rows)],  # the same every repetition
            "verified": [rows[r][0][2] for r in sorted(rows)],
            "seconds": med([max(rows[r][i][3] for r in rows) for i in range(len(rows[0]))]),  # slowest rank
        }
    return out


# ----------------------------------------------------------------------------- output


def fs_of(path: Path) -> str:
    """'tmpfs', 'ext4 on /dev/vda', ... for the mount that holds `path`."""
    path, best = Path(os.path.realpath(path)), ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, kind = line.split()[:3]
            if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) > len(best[0]):
                best = (mnt, kind, dev)
    except OSError:
        return "?"
    return best[1] if best[1] == "tmpfs" else f"{best[1]} on {best[2]}"


def host_line(tmp: Path, shm: Path) -> str:
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal"))) / 1e6
    except (OSError, StopIteration):
        mem = float("nan")
    return (f"host: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads), {mem:.0f} GB RAM\nmemory slots: {shm} ({fs_of(shm)}); storage: {tmp} ({fs_of(tmp)})")


def table(results: dict[str, dict]) -> list[str]:
    names = list(results)
    w = max(16, *(len(n) + 2 for n in names))
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fmt: str, fn) -> None:
        cells = []
        for n in names:
            try:
                v = fn(results[n])
            except (ZeroDivisionError, KeyError, IndexError):
                v = None
            cells.append("-" if v is None else v if isinstance(v, str) else fmt.format(v))
        rows.append((label, cells))

    def slowdown(r: dict) -> float | str:
        if not r["during"]:
            return "persist < step"
        return 100 * (med(r["during"]) / med(r["base"]) - 1)

    row("parameters (M)", "{:.1f}", lambda r: r["params"] / 1e6)
    row("state: weights + AdamW (MB)", "{:.1f}", lambda r: r["state_bytes"] / MB)
    row("first checkpoint blocked (s)", "{:.4f}", lambda r: r["first_blocked"])
    row("blocked per checkpoint (s)", "{:.4f}", lambda r: med(r["blocked"]))
    row("  save() call (s)", "{:.4f}", lambda r: med(r["save"]))
    row("  before_update wait (s)", "{:.4f}", lambda r: med(r["wait"]))
    row("sync torch.save + fsync (s)", "{:.3f}", lambda r: med(r["sync"]))
    row("sync / blocked (goal >= 50x)", "{:.1f}x", lambda r: med(r["sync"]) / med(r["blocked"]))
    row("step, no checkpoint (s)", "{:.3f}", lambda r: med(r["base"]))
    row("step after save() (s)", "{:.3f}", lambda r: med(r["after"]))
    row("  vs no checkpoint", "{:+.1f}%", lambda r: 100 * (med(r["after"]) / med(r["base"]) - 1))
    row("steps during persist (n)", "{:d}", lambda r: len(r["during"]))
    row("step during persist (s)", "{:.3f}", lambda r: med(r["during"]) if r["during"] else "-")
    row("slowdown in persist (goal <10%)", "{:+.1f}%", slowdown)
    row("persist (s)", "{:.3f}", lambda r: med(r["persist"]))
    row("persist (MB/s)", "{:.0f}",
        lambda r: med([b / s / MB for b, s in zip(r["persist_bytes"], r["persist"], strict=True)]))
    row("restore from memory (s)", "{:.3f}", lambda r: med(r["memory"]))
    row("restore from storage cold (s)", "{:.3f}", lambda r: med(r["cold"]))
    row("restore from storage warm (s)", "{:.3f}", lambda r: med(r["warm"]))
    row("storage / memory restore", "{:.1f}x", lambda r: med(r["cold"]) / med(r["memory"]))
    row("restore bytes read (MB)", "{:.1f}", lambda r: r["bytes_read"] / MB)
    row("restore bytes checksummed (MB)", "{:.1f}", lambda r: r["bytes_verified"] / MB)
    label_w = max(len(label) for label, _ in rows) + 2
    out = [f"{'':{label_w}}" + "".join(f"{n:>{w}}" for n in names)]
    out += [f"{label:{label_w}}" + "".join(f"{c:>{w}}" for c in cells) for label, cells in rows]
    return out


def dp_table(dp: dict) -> list[str]:
    out = [f"{'broadcast_restore':<19}{'rank 0 read MB':>15}{'rank 1 read MB':>15}{'total read MB':>14}"
           f"{'checksummed MB':>15}{'read + checksummed':>19}{'restore s':>11}"]
    for broadcast in (True, False):
        d = dp[broadcast]
        out.append(f"{str(broadcast).lower():<19}{d['read'][0] / MB:>15.2f}{d['read'][1] / MB:>15.2f}"
                   f"{sum(d['read']) / MB:>14.2f}{sum(d['verified']) / MB:>15.2f}"
                   f"{(sum(d['read']) + sum(d['verified'])) / MB:>19.2f}{d['seconds']:>11.3f}")
    on, off = sum(dp[True]["read"]), sum(dp[False]["read"])
    on_all, off_all = on + sum(dp[True]["verified"]), off + sum(dp[False]["verified"])
    out.append(f"bytes read, every rank / one reader per dp group: {off / on:.2f}x ({off_all / on_all:.2f}x "
               f"with the checksum pass); restore time false / true: "
               f"{dp[False]['seconds'] / dp[True]['seconds']:.2f}x")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smoke-test size: a tiny model, 2 repetitions")
    ap.add_argument("--big-params", type=float, default=100.0,
                    help="millions of parameters of the large model (12 bytes each in state); 0: skip it")
    ap.add_argument("--big-d-model", type=int, default=1024)
    ap.add_argument("--big-seq", type=int, default=64)
    ap.add_argument("--big-batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="checkpoints (and restores) per model")
    ap.add_argument("--dp-reps", type=int, default=2)
    ap.add_argument("--no-dp", action="store_true", help="skip the dp=2 restore comparison")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for training (0: the default; 1 on 2 cores leaves one to stage 2)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.quick:
        sizes, dp_size, dp_reps, max_during = [tiny_size(2)], tiny_size(1), 1, 30
    else:
        sizes = [Size("19M", [], args.reps)]
        if args.big_params > 0:
            sizes.append(big_size(args.big_params, args.big_d_model, args.big_seq, args.big_batch, args.reps))
        dp_size, dp_reps, max_during = Size("19M", [], args.reps), args.dp_reps, 30

    tmp = Path(tempfile.mkdtemp(prefix="megascale-ckpt-bench-"))
    shm_root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    shm = Path(tempfile.mkdtemp(prefix="megascale-ckpt-bench-", dir=shm_root))
    log = lambda msg: print(f"  ... {msg}", file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    try:
        print(host_line(tmp, shm), flush=True)
        ensure_dataset(load_config(BENCH_CONFIG, overrides(tmp, shm, "unused", [])).data, progress=False)
        results = {s.name: run_size(s, tmp, shm, max_during, log) for s in sizes}
        print(f"\none process, fp32, AdamW; medians of {sizes[0].reps} checkpoints per model")
        for line in table(results):
            print(line)
        if not args.no_dp:
            dp = run_dp(dp_size, tmp, shm, dp_reps, log)
            print(f"\ndp=2 restore from storage, {dp_size.name} model (ZeRO-2: each rank holds half the "
                  f"optimizer state), cold page cache, median of {dp_reps}")
            for line in dp_table(dp):
                print(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
