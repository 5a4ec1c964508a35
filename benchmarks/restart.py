"""What a restart costs, with workers forked from the prefork server and with new interpreters.

    python benchmarks/restart.py [--nproc 4] [--kills 3] [--rounds 2] [overrides]

One host, `megascale launch` (the soak's job: the CPU default model, dp over every rank, host-memory
snapshots every 10 steps). Each round runs the job once with `fault.prefork_workers=true` and once
with `=false`, in turn; in each run a random worker is SIGKILLed `--kills` times, each time once the
job trains again. Per mode it prints the medians over all kills: seconds from the kill to the
driver's line about it (detection) and to the first step after the restart, and the part of that
which is the restart itself (from detection to the first step: stopping, the rendezvous, the worker
start-up with its imports, the self-check, the restore).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import DETECTED, Night, first_step_after, train_records, worker_pids  # noqa: E402

MODES = {"prefork": "fault.prefork_workers=true", "new interpreters": "fault.prefork_workers=false"}


def one_run(a: argparse.Namespace, mode: str, rng: random.Random) -> list[dict]:
    """The job once in `mode`, with a.kills kills; per kill its detection and first-step times."""
    night_args = argparse.Namespace(nproc=a.nproc, hosts=0, verbose=a.verbose,
                                    overrides=[*a.overrides, MODES[mode]])
    kills = []
    with tempfile.TemporaryDirectory() as tmp, Night(night_args, Path(tmp)) as night:
        try:
            deadline = time.time() + a.timeout
            while len(kills) < a.kills and time.time() < deadline and night.running():
                time.sleep(0.2)
                pids, recs = worker_pids(night.run), train_records(night.run)
                # a new kill once every worker is up and the job has stepped a.settle times since the last
                if len(pids) < a.nproc or len(recs) < (kills[-1]["records"] if kills else 0) + a.settle:
                    continue
                rank = rng.choice(sorted(pids))
                kills.append({"t": time.time(), "lines_from": len(night.lines), "records": len(recs)})
                os.kill(pids[rank], signal.SIGKILL)
            last = kills[-1]["records"] if kills else 0
            while time.time() < deadline and kills and len(train_records(night.run)) < last + 3:
                time.sleep(0.2)  # the last kill's restart, to its first steps
        finally:
            night.stop()
        for k in kills:
            hit = next((t for t, line in night.lines[k["lines_from"]:] if any(m in line for m in DETECTED)),
                       None)
            after = None if hit is None else first_step_after(night.run, hit)
            k["detect_s"] = None if hit is None else hit - k["t"]
            k["restart_s"] = after
            k["first_step_s"] = None if after is None else after + k["detect_s"]
    return kills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4, help="workers on this host")
    ap.add_argument("--kills", type=int, default=3, help="kills per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode, the modes in turn")
    ap.add_argument("--settle", type=int, default=10, help="steps between a restart and the next kill")
    ap.add_argument("--timeout", type=float, default=600, help="seconds at most per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in (MODES if r % 2 == 0 else reversed(MODES)):  # alternate which goes first
            kills = one_run(a, mode, rng)
            got[mode] += kills
            print(f"round {r + 1}, {mode}: " + ", ".join(
                f"{k['first_step_s']:.1f} s" if k["first_step_s"] is not None else "no step" for k in kills),
                flush=True)
    print(f"\n{a.nproc} workers on this host ({os.cpu_count()} cores); medians over {a.rounds} run(s) x "
          f"{a.kills} kill(s) per mode")
    print(f"{'mode':<18} {'kills':>5} {'detection s':>12} {'restart s':>10} {'kill to first step s':>21}")
    for mode, kills in got.items():
        def med(key, kills=kills):
            xs = [k[key] for k in kills if k[key] is not None]
            return f"{statistics.median(xs):.2f}" if xs else "-"
        print(f"{mode:<18} {len(kills):>5} {med('detect_s'):>12} {med('restart_s'):>10} "
              f"{med('first_step_s'):>21}")


if __name__ == "__main__":
    main()
