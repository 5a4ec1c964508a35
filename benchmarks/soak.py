"""A job that survives the night, measured: a long `megascale launch` run with a random fault every
1-3 minutes, and what each cost.

    python benchmarks/soak.py [--minutes 20] [--gap 60:180] [--nproc 2] [--seed 0] [overrides]

The job (the CPU default model, dp2 on this host, host-memory snapshots every 10 steps, storage
every 100) runs under `megascale launch`; this script plays the night: at random moments it
SIGKILLs a worker (a crash) or SIGSTOPs one (a hang: a frozen host). It reads the driver's stderr
and the run's metrics as they come, and at the end stops the job with SIGTERM (a clean stop) and
prints, per fault: the kind, the seconds to detection (the driver's line) and to the first step
after the restart; and for the run: ETTR, effective training time = the step time of the steps
that count (the run's final metrics, re-done steps once) / wall time.

Goals on this machine: a crash detected in under 5 s, a hang in under 30 s, training again
within 60 s of any fault, ETTR at least 90%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DETECTED = {"kill": "crash:", "stop": "no heartbeat:"}


def worker_pids(run: Path) -> dict[int, int]:
    """rank -> pid of the current workers (from their in-flight records' sidecars)."""
    out = {}
    for p in (run / "trace" / "inflight").glob("rank_*.json"):
        try:
            info = json.loads(p.read_text())
            state = Path(f"/proc/{info['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, KeyError, IndexError):
            continue
        if state not in ("Z", "T", "X"):  # running: not a zombie, not one stopped by an earlier fault
            out[info["rank"]] = info["pid"]
    return out


def train_records(run: Path) -> list[dict]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for x in lines:
        try:
            r = json.loads(x)
        except ValueError:
            continue
        if r.get("kind") == "train":
            out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--gap", default="60:180", help="seconds between faults, MIN:MAX (uniform)")
    ap.add_argument("--first", type=float, default=None, help="seconds to the first fault (default: a gap)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="kill,stop")
    ap.add_argument("--cycle", action="store_true", help="the kinds in turn instead of at random")
    ap.add_argument("--verbose", action="store_true", help="print every line the job writes to stderr")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    lo, hi = (float(v) for v in a.gap.split(":"))
    kinds = a.kinds.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv = [sys.executable, "-m", "megascale", "launch", "--nproc-per-node", str(a.nproc),
                "--max-restarts", "1000", "--config", str(ROOT / "configs" / "cpu_default.toml"),
                "train.steps=1000000", "train.eval_interval=0", "train.log_interval=0", "log.progress=false",
                "log.tensorboard=false", "log.sample_tokens=0", "checkpoint.memory_interval=10",
                "checkpoint.interval=100", "checkpoint.keep=2", f"parallel.dp={a.nproc}",
                "fault.heartbeat_interval_s=1", "fault.heartbeat_timeout_s=4", "fault.selfcheck_min_speed=0",
                f"data.path={json.dumps(str(ROOT / 'data' / 'cache' / 'shakespeare'))}",
                f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}", f"train.run_dir={run}",
                *a.overrides]
        t0 = time.time()
        job = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        lines: list[tuple[float, str]] = []

        def read():
            for line in job.stderr:
                lines.append((time.time(), line.rstrip()))
                if a.verbose or line.startswith("megascale launch:"):
                    print(f"[{time.time() - t0:7.1f} s] {line.rstrip()[:300]}", flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        faults = []
        end = t0 + 60 * a.minutes
        next_at = t0 + (a.first if a.first is not None else rng.uniform(lo, hi))
        try:
            while time.time() < end and job.poll() is None:
                time.sleep(0.2)
                if time.time() < next_at:
                    continue
                pids = worker_pids(run)
                if not pids or not train_records(run):
                    continue  # starting up: a fault needs a running job
                kind = kinds[len(faults) % len(kinds)] if a.cycle else rng.choice(kinds)
                rank = rng.choice(sorted(pids))
                seen = len(lines)
                steps_before = len(train_records(run))
                os.kill(pids[rank], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                faults.append({"kind": kind, "rank": rank, "t": time.time(), "lines_from": seen,
                               "records_before": steps_before})
                print(f"[{time.time() - t0:7.1f} s] fault: {kind} rank {rank} (pid {pids[rank]})", flush=True)
                next_at = time.time() + rng.uniform(lo, hi)
        finally:
            wall = time.time() - t0  # the night ends here: the clean stop after it is not training time
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGTERM)  # a clean stop: the step in flight, a checkpoint
                try:
                    job.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
            reader.join(timeout=5)
        report(faults, lines, run, wall, t0)


def report(faults: list[dict], lines: list[tuple[float, str]], run: Path, wall: float, t0: float) -> None:
    recs = train_records(run)
    steps = {}
    for r in recs:  # a step re-done after a restart counts once: its last record
        steps[r["step"]] = r
    productive = sum(r["step_time"] for r in steps.values())
    for f in faults:
        marker = DETECTED[f["kind"]]
        hit = next((t for t, line in lines[f["lines_from"]:] if marker in line), None)
        f["detect_s"] = None if hit is None else hit - f["t"]
        f["first_step_s"] = first_step_after(run, f["t"])
        d = "not detected" if hit is None else f"detected in {f['detect_s']:.1f} s"
        s = ("no step after it" if f["first_step_s"] is None
             else f"training again after {f['first_step_s']:.1f} s")
        print(f"fault at {f['t'] - t0:7.1f} s: {f['kind']} of rank {f['rank']}: {d}, {s}")
    for kind in sorted({f["kind"] for f in faults}):
        ds = [f["detect_s"] for f in faults if f["kind"] == kind and f["detect_s"] is not None]
        fs = [f["first_step_s"] for f in faults if f["kind"] == kind and f["first_step_s"] is not None]
        n = sum(f["kind"] == kind for f in faults)
        nan = float("nan")
        print(f"{kind}: {n} fault(s), detected {len(ds)}; detection median "
              f"{statistics.median(ds) if ds else nan:.1f} s (max {max(ds, default=nan):.1f}); "
              f"fault to first step median {statistics.median(fs) if fs else nan:.1f} s "
              f"(max {max(fs, default=nan):.1f})")
    print(f"run: {wall:.0f} s wall, {len(steps)} steps that count ({len(recs)} step records), {len(faults)} "
          f"fault(s); ETTR {100 * productive / wall:.1f}% (productive step time {productive:.0f} s / wall)")


def first_step_after(run: Path, t: float) -> float | None:
    """Seconds from t to the first step record written after t (the run's metrics file has the wall time
    of each record only implicitly: the file is polled while the job runs, so use the trace instead)."""
    best = None
    for p in (run / "trace").glob("rank_00000.jsonl"):
        wall_at = None
        for line in p.read_text().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("type") == "header":
                wall_at = (obj["wall_ns"] / 1e9, obj["mono_ns"])  # maps this segment's clock to wall time
            elif isinstance(obj, list) and wall_at is not None and obj[0] == "optimizer":
                end = wall_at[0] + (obj[2] + obj[3] - wall_at[1]) / 1e9
                if end > t and (best is None or end < best):
                    best = end
    return None if best is None else best - t


if __name__ == "__main__":
    main()
