"""Random feature combinations, each layout against one process: a parity soak.

The Trainer parity suite (tests/test_trainer_parallel.py) runs a dozen chosen layouts; the flags
multiply past what any list covers. This draws combinations at random (model style, block,
attention, fused ops, recompute, optimizer, dtype; tp/pp/dp, virtual stages, sequence parallel,
each overlap, the transport, the shared loader), trains each through `megascale train` for a few
steps as one process and as the layout, and compares their training and validation losses
(relative: float64 1e-10, float32 1e-4, bf16 autocast 5e-3). Dropout is drawn for dp and pp layouts
only: under tp the split regions draw their masks per rank (Megatron's rule), so a tp layout is not
one process there.

Session 36's first run of it found the parallel block failing its first step in bf16 under tp.
Each combination prints the overrides that reproduce it; the exit status is 1 if any differed or
failed (a layout the config refuses is counted, not failed).

    .venv/bin/python benchmarks/parity_soak.py --combos 40 --seed 1     # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale.observe.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = {"fp64": 1e-10, "fp32": 1e-4, "bf16": 5e-3}
LAYOUTS = {2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],  # (tp, pp, dp)
           4: [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)],
           8: [(2, 2, 2), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 1, 4), (1, 2, 4)]}  # not drawn unless asked
# 4 layers of d_model 64, 4 heads, 64 tokens; 8 micro-batches of 2 a step (2 per rank at dp 4)
SMALL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=64", "model.dropout=0.0",
         "train.global_batch=16", "train.micro_batch=2", "train.eval_batches=2", "checkpoint.interval=0",
         "log.sample_tokens=0", "log.progress=false", "log.tensorboard=false"]


def flag(rng: random.Random) -> str:
    return rng.choice(["true", "false"])


def draw(rng: random.Random, world: int) -> tuple[str, list[str], list[str]]:
    """(dtype, the model's and optimizer's overrides, the layout's) of one random combination."""
    style, block = rng.choice(["gpt", "llama"]), rng.choice(["sequential", "parallel"])
    dtype = rng.choice(list(TOL))
    model = [f"model.style={style}", f"model.block={block}", f"model.fused_ops={flag(rng)}",
             f"model.recompute={flag(rng)}", f"optim.name={rng.choice(['adamw', 'lamb'])}",
             f"train.dtype={dtype}"]
    if style == "llama":
        model += ["model.bias=false", f"model.tie_embeddings={flag(rng)}"]
    if rng.random() < 0.4:
        model += ["model.attention=sliding", f"model.window={rng.choice([8, 24, 40])}"]
    tp, pp, dp = rng.choice(LAYOUTS[world])
    transport = rng.choice(["sockets", "sockets", "gloo"])
    layout = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
              f"parallel.transport={transport}", f"data.shared_loader={flag(rng)}"]
    if pp > 1:
        layout += [f"parallel.vpp={rng.choice([1, 2]) if pp == 2 else 1}", f"parallel.pp_overlap={flag(rng)}"]
    if dp > 1:
        layout += [f"parallel.dp_bucket_size={rng.choice([3000, 40_000_000])}",
                   f"parallel.dp_overlap_grad_reduce={flag(rng)}",
                   f"parallel.dp_overlap_param_gather={flag(rng)}"]
    if tp == 1 and rng.random() < 0.3:  # masks seeded by (seed, step, micro-batch, site): one process's
        model.append("model.dropout=0.1")
    if tp > 1:
        sp = rng.random() < 0.5
        layout.append(f"parallel.sequence_parallel={str(sp).lower()}")
        if rng.random() < 0.6:
            layout += ["parallel.tp_overlap=true", f"parallel.tp_overlap_chunks={rng.choice([1, 2, 3])}"]
            if sp and block == "parallel" and rng.random() < 0.5:  # the fused block's own schedule
                layout.append("parallel.tp_overlap_branches=true")
    return dtype, model, layout


def last_error(stderr: str) -> str:
    """A failed run's own error line (the exception's, not the launcher's summary after it)."""
    lines = stderr.splitlines()
    return ([ln for ln in lines if re.search(r"\w(Error|Exception): ", ln)] or
            [ln for ln in lines if "error: " in ln] or lines or ["(no output)"])[-1].strip()[:300]


class Tally:
    """A soak's verdicts: each draw's line as it comes (the overrides that reproduce it), then the summary
    and the exit status (1 if any draw differed or failed; a refused layout is counted, not failed)."""

    def __init__(self, name: str):
        self.name, self.counts = name, {"equal": 0, "differ": 0, "failed": 0, "refused": 0}

    def add(self, head: str, kind: str, verdict: str, model: list[str], layout: list[str]) -> None:
        self.counts[kind] += 1
        print(f"{head}, {verdict}\n    {' '.join(model)}\n    {' '.join(layout)}", flush=True)

    def end(self) -> int:
        print(f"{self.name}: " + ", ".join(f"{n} {k}" for k, n in self.counts.items()))
        return 1 if self.counts["differ"] or self.counts["failed"] else 0


def train(overrides: list[str], nproc: int, run_dir: Path, timeout: float) -> tuple[list[float] | None, str]:
    """The training and validation losses of `megascale train` (None and its last error line if it
    failed; "refused: ..." for a config the CLI rejects, exit 2)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "megascale", "train", "--config", "configs/cpu_default.toml", *overrides,
           f"train.run_dir={run_dir}"]
    if nproc > 1:
        cmd[4:4] = ["--nproc", str(nproc)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"no end after {timeout:.0f} s"
    if r.returncode != 0:
        return None, ("refused: " if r.returncode == 2 else f"exit {r.returncode}: ") + last_error(r.stderr)
    return [x["loss"] for x in read_metrics(run_dir / "metrics.jsonl") if x["kind"] in ("train", "val")], ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--combos", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="which combinations (the same seed draws the same)")
    ap.add_argument("--world", type=int, nargs="+", choices=sorted(LAYOUTS), default=[2, 4],
                    help="ranks of the layouts drawn (8 time-slices 2 cores 4 ways: slower)")
    ap.add_argument("--steps", type=int, default=4, help="training steps (validation at half and at the end)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    base = [*SMALL, f"train.steps={args.steps}", f"train.eval_interval={max(1, args.steps // 2)}"]
    out = args.keep or Path(tempfile.mkdtemp(prefix="parity_soak_"))
    tally = Tally("parity soak")
    print(f"{args.combos} combinations (seed {args.seed}), {args.steps} steps each, worlds {args.world}; "
          f"common overrides: {' '.join(base)}", flush=True)
    try:
        for i in range(args.combos):
            world = rng.choice(args.world)
            dtype, model, layout = draw(rng, world)
            t0 = time.perf_counter()
            want, err1 = train([*base, *model], 1, out / f"{i}-one", args.timeout)
            got, err = train([*base, *model, *layout], world, out / f"{i}-layout", args.timeout)
            if want is None or got is None:
                kind = "refused" if want is not None and err.startswith("refused") else "failed"
                verdict = f"{kind}: {'one process ' + err1 if want is None else err}"
            elif len(got) != len(want):
                kind, verdict = "differ", f"differ: {len(got)} losses, one process {len(want)}"
            else:
                rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
                kind = "equal" if rel < TOL[dtype] else "differ"
                verdict = f"{kind}: loss rel {rel:.1e} (tolerance {TOL[dtype]:.0e})"
            tally.add(f"[{i}] world {world}, {time.perf_counter() - t0:.0f} s", kind, verdict, model, layout)
    finally:
        if args.keep is None:
            shutil.rmtree(out, ignore_errors=True)
    return tally.end()


if __name__ == "__main__":
    sys.exit(main())
