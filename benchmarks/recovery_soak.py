"""Random faults in random feature combinations, each recovered run against the fault-free one.

tests/test_launch.py recovers three faults in one dp2 float64 job; the soak benchmarks (soak.py,
cluster.py) time recoveries of the default model. This draws what neither covers: a combination of
model and layout flags (parity_soak.draw: tp/pp/dp, virtual stages, sequence parallel, each overlap,
the transport, the shared loader, LAMB, bf16, recompute, ...) and a fault in it (a rank killed, frozen,
stuck, skipping a collective, killed while its storage checkpoint is written, or killed once more
while the job recovers from the first fault), runs the job under `megascale launch` without and with
the fault, and requires the driver to restart it and the restarted job to resume from host memory
exactly: the same loss at every step and the same final weights, bit for bit.

One more kind, reshard: a rank of a plain `megascale train --nproc` job is killed once its step-3 or
step-6 checkpoint is committed (no driver: the job ends), and the same command on another layout, of 2
or 4 ranks, resumes it from storage (the host-memory snapshot is the old layout's); its losses must
be the fault-free run's within the parity soak's tolerance of the dtype (another layout adds in another
order).

Each draw prints the fault and the overrides that reproduce it; the exit status is 1 if any recovered
run differed or failed (a layout the config refuses is counted, not failed).

    .venv/bin/python benchmarks/recovery_soak.py --combos 20 --seed 1     # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from parity_soak import LAYOUTS, SMALL, TOL, Tally, draw, flag, last_error  # noqa: E402

from megascale.checkpoint.model_state import read_model_state  # noqa: E402
from megascale.observe.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
MEMORY_EVERY, STORAGE_EVERY = 2, 3  # steps between host-memory snapshots, and storage checkpoints
# (what a kill in stage 2 hits); faults are seen in 1-2 s (exit), 5 s (no beat) or 12 s (beats, no step:
# above a step of an 8-rank layout on 2 cores)
JOB = [f"train.steps={STEPS}", "train.eval_interval=4", f"checkpoint.memory_interval={MEMORY_EVERY}",
       f"checkpoint.interval={STORAGE_EVERY}",
       "fault.heartbeat_interval_s=1", "fault.heartbeat_timeout_s=5", "fault.hang_timeout_s=12",
       "fault.selfcheck_min_speed=0"]  # correctness only: this machine's speed varies
KINDS = ("kill", "stop", "hang", "skip", "persist", "twice", "reshard")


class Fault(NamedTuple):
    kind: str  # of KINDS
    spec: str  # MEGASCALE_INJECT
    restarts: int  # the restarts it must cost (reshard: none, the job ends)
    rank: int  # the rank it strikes (the first, for "twice")


def draw_fault(rng: random.Random, world: int, kinds: list[str]) -> Fault:
    """One random fault of `kinds` on a rank of a `world`-rank job."""
    kind, rank = rng.choice(kinds), rng.randrange(world)
    step = rng.randrange(1, STEPS)  # 0-based: step 0 has no snapshot before it, step STEPS never comes
    if kind == "persist":  # stage 2 of a storage checkpoint (3, 6), after the shards, before the marker
        return Fault(kind, f"kill@persist:{rng.choice([3, 6])}:rank={rank}", 1, rank)
    if kind == "skip":  # leaves its peers in the step's loss all-reduce: the job hangs
        return Fault(kind, f"skip@agree:{step}:rank={rank}", 1, rank)
    if kind == "reshard":  # once a storage checkpoint is committed (a kill at a step could come before its
        return Fault(kind, f"kill@committed:{rng.choice([3, 6])}:rank={rank}", 0, rank)  # background persist)
    if kind == "twice":  # a second rank dies while the restarted job redoes the steps the first lost:
        # from the newest state saved before the first kill (either kind of save), never an earlier step
        resumed = max(c for c in range(step + 1) if c % MEMORY_EVERY == 0 or c % STORAGE_EVERY == 0)
        again = rng.randrange(resumed, STEPS)
        return Fault(kind, f"kill@step:{step}:rank={rank},kill@step:{again}:rank={rng.randrange(world)}"
                           ":attempt=1", 2, rank)
    return Fault(kind, f"{kind}@step:{step}:rank={rank}", 1, rank)


def names_the_rank(fault: Fault, stderr: str, run_dir: Path) -> bool:
    """Whether the driver's detection named the rank the fault struck: the crashed rank's exit code, the
    rank with no heartbeat, or the culprit of the hang's diagnosis."""
    if fault.kind in ("hang", "skip"):
        diagnosis = run_dir / "trace" / "hang" / "driver_diagnosis.txt"
        culprits = re.findall(r"^culprit: (.*)$", diagnosis.read_text(), re.M) if diagnosis.exists() else []
        return bool(culprits) and str(fault.rank) in re.split(r"[,\s]+", culprits[0])
    if fault.kind == "stop":
        return f"no heartbeat: rank {fault.rank} " in stderr
    return re.search(rf"crash: worker exit codes \{{[^}}]*\b{fault.rank}: -9", stderr) is not None


def resume_layout(rng: random.Random, world: int, model: list[str]) -> list[str]:
    """Another layout of `world` ranks for a crashed job to resume on: tp/pp/dp, virtual stages, SP
    (tp = 1 under dropout: tp's split regions draw other masks than one process)."""
    dropout = "model.dropout=0.1" in model
    tp, pp, dp = rng.choice([t for t in LAYOUTS[world] if t[0] == 1 or not dropout])
    out = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"]
    if pp == 2:
        out.append(f"parallel.vpp={rng.choice([1, 2])}")
    if tp > 1:
        out.append(f"parallel.sequence_parallel={flag(rng)}")
    return out


def launch(overrides: list[str], world: int, run_dir: Path, fault: str, timeout: float,
           verb: str = "launch", fresh: bool = True):
    """`megascale launch` (or `megascale train --nproc`: verb "train") of the job on `world` local
    workers, in a fresh run directory unless not `fresh`: (exit code, None on a timeout; stdout; stderr)."""
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGASCALE_INJECT", None)
    if fault:
        env["MEGASCALE_INJECT"] = fault
    cmd = [sys.executable, "-m", "megascale", verb, "--nproc-per-node" if verb == "launch" else "--nproc",
           str(world), "--config", "configs/cpu_default.toml", *overrides, f"train.run_dir={run_dir}"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, e.stdout or "", e.stderr or ""
    return r.returncode, r.stdout, r.stderr


def outcome(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A finished run's training losses, one per step (a redone step's record replaces the lost one's),
    and its final weights."""
    return ([x["loss"] for x in read_metrics(run_dir / "metrics.jsonl") if x["kind"] == "train"],
            read_model_state(run_dir)[1])


def compare(want, got) -> str:
    """'' if the recovered run is the fault-free one, bit for bit; else what differs."""
    (want_losses, want_w), (got_losses, got_w) = want, got
    if len(got_losses) != len(want_losses):
        return f"{len(got_losses)} losses, the fault-free run {len(want_losses)}"
    for step, (a, b) in enumerate(zip(got_losses, want_losses, strict=True)):
        if a != b:
            return f"loss of step {step + 1}: {a!r}, the fault-free run {b!r}"
    for name, w in want_w.items():
        if name not in got_w or not torch.equal(got_w[name], w):
            return f"final weight {name}"
    return ""


def recovered(job: list[str], world: int, fault: Fault, run_dir: Path, reference: Path,
              timeout: float) -> tuple[str, str]:
    """The job with `fault` under `megascale launch`, against the fault-free run: (kind, verdict)."""
    code, _, err = launch(job, world, run_dir, fault.spec, timeout)
    done = len(re.findall(r"restarting the job \(restart \d+ of", err))
    if code != 0:
        return "failed", f"exit {code}: {last_error(err)}"
    if done != fault.restarts:
        return "failed", f"{done} restarts, the fault needs {fault.restarts}"
    if not names_the_rank(fault, err, run_dir):
        return "failed", f"recovered, but the detection did not name rank {fault.rank}"
    diff = compare(outcome(reference), outcome(run_dir))
    if diff:
        return "differ", f"differ: {diff}"
    return "equal", f"equal after {done} restart{'s' * (done > 1)}, rank {fault.rank} named"


def resharded(model: list[str], layout: list[str], world: int, layout2: list[str], world2: int, dtype: str,
              fault: Fault, run_dir: Path, reference: Path, timeout: float) -> tuple[str, str]:
    """The job killed on its layout (no driver), then resumed on `layout2` by the same command: (kind,
    verdict)."""
    code, _, err = launch([*model, *layout], world, run_dir, fault.spec, timeout, verb="train")
    if code in (0, None):
        return "failed", f"the killed job {'ended well' if code == 0 else 'hung'}: {last_error(err)}"
    code, out, err = launch([*model, *layout2], world2, run_dir, "", timeout, verb="train", fresh=False)
    if code != 0:
        return ("refused" if code == 2 else "failed"), f"the resumed job: exit {code}: {last_error(err)}"
    # from storage; from host memory only where the new layout has the old one's shape
    resumed = re.search(r"resumed from (memory|storage) at step (\d+)", out)
    if resumed is None:
        return "failed", "the job on the new layout did not resume"
    want, got = outcome(reference)[0], outcome(run_dir)[0]
    if len(got) != len(want):
        return "differ", f"differ: {len(got)} losses, the fault-free run {len(want)}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    if rel >= TOL[dtype]:
        return "differ", f"differ: loss rel {rel:.1e} (tolerance {TOL[dtype]:.0e})"
    return "equal", (f"equal, {resumed[0]} on {world2} ranks ({' '.join(layout2)}): loss rel {rel:.1e} "
                     f"(tolerance {TOL[dtype]:.0e})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--combos", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="which draws (the same seed draws the same)")
    ap.add_argument("--world", type=int, nargs="+", choices=sorted(LAYOUTS), default=[2, 4])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"faults drawn from (of {','.join(KINDS)})")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a job may take")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: each of {','.join(KINDS)}")
    rng = random.Random(args.seed)
    base = [*SMALL, *JOB]
    out = args.keep or Path(tempfile.mkdtemp(prefix="recovery_soak_"))
    tally = Tally("recovery soak")
    print(f"{args.combos} faults (seed {args.seed}) in {STEPS}-step jobs under megascale launch, worlds "
          f"{args.world}; common overrides: {' '.join(base)}", flush=True)
    try:
        for i in range(args.combos):
            world = rng.choice(args.world)
            dtype, model, layout = draw(rng, world)
            fault = draw_fault(rng, world, kinds)
            t0 = time.perf_counter()
            job = [*base, *model, *layout]
            reference = out / f"{i}-fault-free"
            code, _, err = launch(job, world, reference, "", args.timeout)
            if code == 2:
                kind, verdict = "refused", f"refused: {last_error(err)}"
            elif code != 0:
                kind, verdict = "failed", f"fault-free run: exit {code}: {last_error(err)}"
            elif fault.kind == "reshard":
                world2 = rng.choice(args.world)
                layout2 = resume_layout(rng, world2, model)
                kind, verdict = resharded([*base, *model], layout, world, layout2, world2, dtype, fault,
                                          out / f"{i}-fault", reference, args.timeout)
            else:
                kind, verdict = recovered(job, world, fault, out / f"{i}-fault", reference, args.timeout)
            tally.add(f"[{i}] world {world}, {fault.spec}, {time.perf_counter() - t0:.0f} s", kind, verdict,
                      model, layout)
    finally:
        if args.keep is None:
            shutil.rmtree(out, ignore_errors=True)
    return tally.end()


if __name__ == "__main__":
    sys.exit(main())
