"""MegaScale's ablation (its Table 2) on a simulated cluster, with the planner's step time for each row.

The rows are cumulative on one dp2 x pp2 x tp2 layout (sequence parallel), one rank per host of a
simulated cluster of 8 (network namespaces, `tc tbf` links, as benchmarks/overlap.py, whose Trainer
overrides, no-op collectives and job launching this uses): baseline, + parallel block, + sliding
window, + TP overlap, + PP overlap, + DP overlap, + LAMB with a 4x batch. The rows are swept `--sweeps`
times, a job of fresh processes per row and sweep, medians over the sweeps; each row's tokens/s and MFU.

Beside each row the planner's step time twice, on the CPU preset calibrated before the first sweep and
after each (`megascale plan --calibrate` into files of their own: perf/calibrate.py's kernels and
perf/host.py's framework work, as the machine runs then), per row the median over the calibrations:
three calibrations back to back on this VM predicted the baseline row at 0.94, 0.84 and 0.89 s, and with
one calibration at the end of each run the planner's compute fell by 25% from one run to the next, while
the rows are medians over sweeps that span the whole run. Both use the links' tbf rate and veth's
latency. "planner" adds what a message costs the host's CPU (gloo's copies, the kernel's TCP work),
fitted here on 2-rank all-gathers of three sizes, all pairs at once, from the machine's busy time: 8
ranks share 2 cores, so that CPU competes with the compute, and perf/step.py bounds the step by the sum
(`rank_cpu_seconds`). "nominal" leaves it out, as a GPU cluster's NICs and copy engines do. The table
also gives each row's machine CPU-seconds per step and how busy the cores were, and then each row's step
split by cause (compute, tp, pp, dp, other; the planner's "cpu" column is its CPU bound's excess over
its timeline) as the timers measured it and as the planner has it, and last each row's CPU-seconds per
step: the machine's, the ranks' own (their threads and system calls: nearly all of the machine's,
softirq included), the ranks' again with every dp, pp and tp collective a no-op (`--steps` more steps),
and the planner's (all, and its compute alone). That last table says where the planner's error lies.

    sudo .venv/bin/python benchmarks/ablation.py [--sweeps 3] [--rows 0 3 5] [--mbit 1000]

Needs root (namespaces, tc); where they cannot be made it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlap import (  # noqa: E402  (the benchmarks' folder is no package)
    DIMS,
    DP_FLAGS,
    Collectives,
    common_parser,
    dim_groups,
    finish_job,
    forwarded,
    overrides,
    pin_to_core,
    run_job,
    start_job,
)

OFF = [*(f"parallel.{f}=false" for f in DIMS["all"][2]), "parallel.pp_warmup_ahead=0"]
# MegaScale's ablation (its Table 2), cumulative rows on one dp2 x pp2 x tp2 layout, one rank per host
ABLATION = [
    ("baseline", ["model.block=sequential", "model.attention=full", *OFF]),
    ("+ parallel block", ["model.block=parallel"]),
    ("+ sliding window", ["model.attention=sliding", "model.window={window}"]),
    ("+ TP overlap", ["parallel.tp_overlap=true"]),
    ("+ PP overlap", ["parallel.pp_overlap=true", "parallel.pp_warmup_ahead={pp_ahead}"]),
    ("+ DP overlap", [f"parallel.{f}=true" for f in DP_FLAGS]),
    ("+ LAMB, 4x batch", ["optim.name=lamb", "train.global_batch={batch4}"]),
]
ABLATION_LAYOUT = ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]


def ablation_rows(a: argparse.Namespace, base: str) -> list[tuple[str, list[str]]]:
    """(row, the Trainer's overrides) of each ablation row: every row adds its switch to the last."""
    rows, extra = [], []
    for name, more in ABLATION:
        extra += [o.format(window=a.seq // 4, batch4=4 * a.batch, pp_ahead=a.pp_ahead) for o in more]
        args = [o for o in overrides(a, "all", "overlap", f"{base}/ablation-{len(rows)}")
                if not o.startswith("log.peak_flops")]
        rows.append((name, [*args, *ABLATION_LAYOUT, *extra]))
    return rows


def predicted_steps(a: argparse.Namespace, world: int, measured: dict | None = None,
                    sharing: dict | None = None, calibration: Path | None = None) -> list:
    """The planner's step time for each ablation row, on this machine's CPU preset as calibrated into
    `calibration` (calibrate_cpu; None, with `--no-calibrate`: as stored, placeholders if never
    calibrated) made into the simulated cluster: the ranks sharing this machine's cores (at the speed
    `sharing`, from measure_sharing, says a shared core keeps), every link the tbf rate with veth's
    latency and, given `measured` (measure_link), the host CPU its messages cost as fitted on the
    cluster (without it a message costs no CPU, as on a GPU cluster). One perf.step.Prediction per row,
    with its breakdown."""
    import dataclasses

    from megascale.config import load_config
    from megascale.data.tokenizer import build_tokenizer
    from megascale.perf.presets import Link, apply_calibration, load_preset
    from megascale.perf.step import Layout, Settings, predict

    cpu = load_preset("cpu", use_calibration=calibration is None)
    if calibration is not None:
        cpu = apply_calibration(cpu, calibration)
    link = Link(bandwidth=a.mbit * 1e6 / 8, efficiency=0.95, latency_s=150e-6)  # tbf rate; veth + bridge
    if measured is not None:  # the fit is of a 2-rank all-gather's CPU, both ends: half per rank
        link = dataclasses.replace(link, cpu_s_per_message=max(0.0, measured["cpu_s_per_message"]) / 2,
                                   cpu_s_per_byte=max(0.0, measured["cpu_s_per_byte"]) / 2)
    # shared_compute gives each rank 1/devices_per_node of one calibrated core: the ranks per core here
    per_core = max(1, -(-world // (os.cpu_count() or 1)))
    sim = dataclasses.replace(cpu, name="cpu-simcluster", devices_per_node=per_core, intra=link, inter=link,
                              shared_efficiency=sharing["efficiency"] if sharing else 1.0)
    out = []
    rows = ablation_rows(a, "unused")
    for _, args in [rows[i] for i in a.rows]:
        cfg = load_config(None, args)
        m, p = cfg.model, cfg.parallel
        m.vocab_size = m.vocab_size or build_tokenizer(cfg.data.tokenizer).vocab_size
        settings = Settings("row", parallel_block=m.block == "parallel", tp_overlap=p.tp_overlap,
                            tp_overlap_branches=p.tp_overlap_branches, pp_overlap=p.pp_overlap,
                            dp_overlap=p.dp_overlap_grad_reduce, pp_warmup_ahead=p.pp_warmup_ahead)
        lay = Layout(tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp, micro_batch=cfg.train.micro_batch,
                     sequence_parallel=p.sequence_parallel)
        out.append(predict(m, lay, sim, settings, cfg.train.global_batch, policy="fp32", explain=True))
    return out


def calibrate_cpu(path: Path) -> Path:
    """The CPU preset calibrated now into `path` (`megascale plan --calibrate --cluster cpu`), on one
    thread as each rank runs, in CPU time."""
    import torch

    from megascale.perf.calibrate import calibrate
    from megascale.perf.presets import load_preset

    torch.set_num_threads(1)
    calibrate(load_preset("cpu", use_calibration=False), out=path, clock="cpu")
    return path


def median_prediction(per_calibration: list[list]) -> list:
    """Per row, of its predictions on each calibration, the one with the median step time (the lower
    middle one of an even count)."""
    rows = zip(*per_calibration, strict=True)
    return [sorted(row, key=lambda p: p.step_time)[(len(row) - 1) // 2] for row in rows]


# Message sizes (bytes of the whole tensor) the link is fitted on, around the ablation's tp messages
# (micro-batch x seq x d_model floats: 256 KiB at the defaults); a 2-rank all-gather moves half of each
LINK_SIZES = (1 << 16, 1 << 18, 1 << 20)


def measure_link(a: argparse.Namespace, pairs: list[list[int]], repeats: int = 40) -> dict:
    """The alpha-beta of the cluster's links as collectives see them, every pair at once (as the tp
    pairs of a dp2 x pp2 x tp2 step communicate), and the host CPU they cost: least-squares lines
    through the time of a 2-rank all-gather of S bytes, t(S) = alpha + S / 2 / bandwidth, and through
    the machine's busy CPU-seconds an all-gather of one pair adds to a GEMM before it (both ends; the
    kernel's softirq work for veth and tbf included), at the LINK_SIZES. The all-gather goes as the
    rows' do: direct sends over `--transport` (gloo's own with --gloo-collectives). Every rank calls
    it (groups are made collectively)."""
    import torch
    import torch.distributed as dist

    from megascale.distributed import direct, p2p

    rank = dist.get_rank()
    groups = [dist.new_group(p) for p in pairs]
    group = next(g for g, p in zip(groups, pairs, strict=True) if rank in p)
    if a.transport == "sockets" and not a.gloo_collectives:
        p2p.use_sockets((group,))

    def all_gather(out, mine):
        if a.gloo_collectives:
            dist.all_gather_into_tensor(out, mine, group=group)
        else:
            direct.start_all_gather(out, mine, group).wait()

    # a layer's GEMM at the ablation's shape, run before each all-gather in the CPU's loops
    x, w = torch.randn(a.micro * a.seq, a.d_model), torch.randn(a.d_model, 2 * a.d_model)

    def loop(size: int, gemm: bool = False, gather: bool = True) -> tuple[float, float]:
        """(seconds of one round, the machine's CPU-seconds per round of one pair) of `repeats` rounds
        between two barriers: an all-gather (back to back, as a step's collectives come), after a GEMM
        if `gemm`."""
        out, mine = torch.empty(size // 4), torch.ones(size // 8)
        all_gather(out, mine)  # connections made, buffers touched
        dist.barrier()
        busy0, t0 = machine_busy_s(), time.perf_counter()
        for _ in range(repeats):
            if gemm:
                torch.mm(x, w)
            if gather:
                all_gather(out, mine)
        dist.barrier()
        wall, busy = time.perf_counter() - t0, machine_busy_s() - busy0
        return wall / repeats, busy / repeats / len(pairs)

    # The time line from all-gathers back to back. The CPU line from all-gathers between GEMMs, less
    # the GEMMs alone: what a message adds to a computing rank, as in a step. Back to back the same
    # all-gather cost 1.4-1.6x less CPU than the ranks of the ablation's rows spent per message (their
    # CPU with communication less without): the GEMM after a message runs on caches it evicted, the
    # message's Python on caches the GEMM did.
    # Medians over turns that alternate the loops: a difference of two busy times moves with the machine
    times = [loop(size)[0] for size in LINK_SIZES]
    turns = [[loop(size, gemm=True)[1] - loop(size, gemm=True, gather=False)[1] for size in LINK_SIZES]
             for _ in range(5)]
    cpu = [statistics.median(t[i] for t in turns) for i in range(len(LINK_SIZES))]
    slope, alpha = statistics.linear_regression([s / 2 for s in LINK_SIZES], times)
    cpu_slope, cpu_alpha = statistics.linear_regression([s / 2 for s in LINK_SIZES], cpu)
    return {"latency_s": max(0.0, alpha), "bandwidth": 1 / max(slope, 1e-12), "times": times,
            "cpu_s_per_message": cpu_alpha, "cpu_s_per_byte": cpu_slope, "cpu_s": cpu}


def share_worker(a: argparse.Namespace) -> None:
    """On each rank of a 2-rank job (`--row`: the job's index among those at once, `--sweep`: its turn): a
    tp2 rank's work, the `--dims tp` model with its tp collectives no-ops, on core 2 x job + rank (mod
    the cores); rank 0 prints the ranks' median CPU-seconds per step."""
    import torch

    from megascale.config import load_config
    from megascale.distributed.init import shutdown_distributed
    from megascale.train import Trainer

    cores, rank = sorted(os.sched_getaffinity(0)), int(os.environ["RANK"])
    os.sched_setaffinity(0, {cores[(2 * a.row + rank) % len(cores)]})
    torch.set_num_threads(1)
    run_dir = f"{a.base}/share-{a.sweep}-{a.row}"
    trainer = Trainer(load_config(None, overrides(a, "tp", "serial", run_dir)), quiet=True)
    wrapper = Collectives(dim_groups(trainer.engine, ("tp",)))
    wrapper.mode = "nocomm"
    for _ in range(a.warmup):
        trainer.train_step()
    cpu = []
    for _ in range(2 * a.steps):
        t0 = time.process_time()
        trainer.train_step()
        cpu.append(time.process_time() - t0)
    wrapper.mode = "pass"
    trainer.close()
    t = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
    wrapper.real["all_reduce"](t)
    if rank == 0:
        print("RESULT " + json.dumps({"cpu_s": float(t) / 2}), flush=True)
    shutdown_distributed()


def measure_sharing(cluster, a: argparse.Namespace, ranks: int = 8, rounds: int = 2) -> dict | None:
    """How much of a core's speed its ranks keep when `ranks` of them time-slice the machine's cores,
    as the ablation's do: a tp2 job's CPU-seconds per step alone (a core per rank) against four such
    jobs at once (ranks / cores a core), the same work, alternated `rounds` times, medians. None where
    every rank has a core of its own.

    Measured on 2 cores with a probe of the same work, alternating: 0.56-0.69 CPU-s a step alone,
    0.79-0.84 four jobs at once (x1.2-1.5), while a one-process loop of the same model's steps lost
    under 8% at 4 a core."""
    cores = len(os.sched_getaffinity(0))
    if ranks <= cores:
        return None
    alone, shared = [], []
    for turn in range(rounds):  # alternated: the machine's speed drifts by 20% within minutes
        port = 29380 + turn * (ranks // 2 + 1)

        def job(j: int, sweep: int, port: int) -> list:  # on hosts 2j, 2j + 1; sweep: its run directory
            return start_job(cluster, a, __file__, "share", 2, port, ["--row", str(j), "--sweep", str(sweep)],
                             first_host=2 * j)

        alone.append(finish_job(a, "share", job(0, 2 * turn, port + ranks // 2)))
        jobs = [job(j, 2 * turn + 1, port + j) for j in range(ranks // 2)]
        shared.append(statistics.median(finish_job(a, "share", procs)["cpu_s"] for procs in jobs))
    one, many = statistics.median(x["cpu_s"] for x in alone), statistics.median(shared)
    return {"alone_cpu_s": one, "shared_cpu_s": many, "ranks_per_core": ranks / cores,
            "efficiency": min(1.0, one / many)}


def machine_busy_s() -> float:
    """CPU-seconds this machine has been busy since boot, all cores, kernel work (softirq: the veth and
    tbf traffic) included; /proc/stat is not namespaced, so every simulated host reads the same."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measured_parts(runs: list[tuple[str, list[int]]]) -> dict[str, float]:
    """Where the slowest rank's median step went, over the given (run directory, steps) of a row, from
    its timers, in the planner's terms (the slowest rank: the largest median wall time over them)."""
    from megascale.observe.breakdown import step_breakdown
    from megascale.observe.trace import read_run

    per_rank: dict[int, list[dict]] = {}
    for run_dir, steps in runs:
        for rank, rows in step_breakdown(read_run(run_dir))["ranks"].items():  # {rank: {step: row}}
            per_rank.setdefault(rank, []).extend(rows[s] for s in steps if s in rows)
    medians = [{k: statistics.median(x[k] for x in mine) for k in mine[0]}
               for mine in per_rank.values() if mine]
    row = max(medians, key=lambda m: m["wall"])
    return {"compute": row["compute"], "tp": row["exposed_tp"], "pp": row["exposed_pp"] + row["bubble"],
            "dp": row["exposed_dp"], "other": row["data"] + row["checkpoint"] + row["other"]}


def planned_parts(prediction) -> dict[str, float]:
    b = prediction.breakdown
    return {"compute": b.compute + b.optimizer, "tp": b.tp_exposed, "pp": b.pp_exposed + b.bubble,
            "dp": b.dp_exposed, "other": b.other_exposed, "cpu": b.cpu_contention}


def row_worker(a: argparse.Namespace) -> None:
    """On every rank: one sweep of one ablation row (`--row`, `--sweep`), in processes of its own;
    rank 0 prints its figures (and, in the first job, the links' as measure_link finds them).

    A job of its own per row and sweep, because a process cannot let go of a Trainer's process groups:
    gloo keeps three threads per group until the group is destroyed, each idle group costs ~1.5 ms of
    CPU a second, and destroying locally synchronised groups to make them again fails (torch names the
    new ones as the old, whose rendezvous keys are still in the store: "connectFullMesh failed ...
    Connection refused"). With every row's Trainer in one process the later rows ran among the
    earlier ones' groups: their no-comm CPU rose row after row (1.47 -> 1.84 CPU-s a step with nothing
    in their compute changed), and seven Trainers alive at once cost ~0.57 CPU-s a step.
    The row runs `--warmup` steps, `--steps` timed steps, and as many with every dp, pp and tp
    collective a no-op (the ranks' CPU without communication)."""
    import torch

    from megascale.config import load_config
    from megascale.distributed.init import shutdown_distributed
    from megascale.train import Trainer

    pin_to_core(a, 8)
    torch.set_num_threads(1)
    wrapper = Collectives(set())

    def ranks_sum(seconds: float) -> float:
        """The sum over all ranks of a per-rank figure (world group: never a no-op)."""
        t = torch.tensor([seconds], dtype=torch.float64)
        wrapper.real["all_reduce"](t)
        return float(t)

    _, args = ablation_rows(a, f"{a.base}/sweep{a.sweep}")[a.row]
    trainer = Trainer(load_config(None, args), quiet=True)
    for _ in range(a.warmup):
        trainer.train_step()
    # time.process_time: this process's CPU-seconds, every thread's (gloo's too), user and system
    busy0, t0, own0 = machine_busy_s(), time.monotonic(), time.process_time()
    stats = [trainer.train_step() for _ in range(a.steps)]
    busy, wall, own = machine_busy_s() - busy0, time.monotonic() - t0, time.process_time() - own0
    run = (str(trainer.run_dir), list(range(trainer.step - a.steps, trainer.step)))  # the traces' numbers
    wrapper.groups = dim_groups(trainer.engine, ("dp", "pp", "tp"))
    wrapper.mode, own0 = "nocomm", time.process_time()
    bare = [trainer.train_step() for _ in range(a.steps)]
    wrapper.mode, bare_own = "pass", time.process_time() - own0
    trainer.close()
    out = {"step_s": [x.step_time for x in stats], "tokens_per_s": [x.tokens_per_s for x in stats],
           "mfu": [x.mfu for x in stats], "nocomm_step_s": [x.step_time for x in bare], "busy": busy,
           "wall": wall, "ranks_cpu_s": ranks_sum(own), "nocomm_ranks_cpu_s": ranks_sum(bare_own),
           "runs": [run]}
    if a.row == a.rows[0] and a.sweep == 0:  # the layout's tp pairs (adjacent ranks)
        out["link"] = measure_link(a, [[r, r + 1] for r in range(0, 8, 2)], a.link_repeats)
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps(out), flush=True)
    shutdown_distributed()


def run_ablation(cluster, a: argparse.Namespace, after_sweep=lambda: None) -> tuple[list[dict], dict]:
    """Every row's figures over `--sweeps` sweeps of the rows (a job per row and sweep, so the
    machine's drift falls on every row in several places), and the links as measured; `after_sweep()`
    runs after each sweep."""
    got: list[dict] = [{} for _ in a.rows]
    link = None
    for sweep in range(a.sweeps):
        for i, g in zip(a.rows, got, strict=True):
            job = run_job(cluster, a, __file__, "row", 8, 29400 + sweep * len(ABLATION) + i,
                          ["--row", str(i), "--sweep", str(sweep)])
            link = job.pop("link", link)
            for k, v in job.items():
                g[k] = g.get(k, 0 if isinstance(v, float) else []) + v
        after_sweep()
    rows = []
    for (name, _), g in zip([ABLATION[i] for i in a.rows], got, strict=True):
        n = len(g["step_s"])
        rows.append({"row": name, **{k: statistics.median(g[k]) for k in
                                     ("step_s", "tokens_per_s", "mfu", "nocomm_step_s")},
                     "cpu_s": g["busy"] / n, "busy": g["busy"] / (g["wall"] * (os.cpu_count() or 1)),
                     "ranks_cpu_s": g["ranks_cpu_s"] / n, "nocomm_ranks_cpu_s": g["nocomm_ranks_cpu_s"] / n,
                     "runs": g["runs"]})
    return rows, link


def parser() -> argparse.ArgumentParser:
    p = common_parser(__doc__.splitlines()[0])
    p.add_argument("--sweeps", type=int, default=3, help="sweeps of the rows (medians over them)")
    p.add_argument("--rows", type=int, nargs="+", default=list(range(len(ABLATION))),
                   choices=range(len(ABLATION)), metavar="ROW",
                   help="the rows to run, 0 (baseline) .. 6 (+ LAMB, 4x batch); default all")
    p.add_argument("--share-rounds", type=int, default=2,
                   help="turns of the core-sharing measurement (one alone, four jobs at once, each)")
    p.add_argument("--link-repeats", type=int, default=40,
                   help="all-gathers per point of the links' measurement")
    p.add_argument("--no-calibrate", action="store_true",
                   help="the planner column with the CPU preset's calibration as stored (placeholders if "
                        "never calibrated), not a fresh one")
    p.add_argument("--worker", choices=("row", "share"), help=argparse.SUPPRESS)
    p.add_argument("--row", type=int, default=0, help=argparse.SUPPRESS)  # a job's row (or share job)
    p.add_argument("--sweep", type=int, default=0, help=argparse.SUPPRESS)  # and its sweep
    p.set_defaults(block="sequential", dp_micro=0)  # overrides() reads them; the rows set model.block
    return p


def main() -> int:
    p = parser()
    a = p.parse_args()
    if min(a.sweeps, a.share_rounds, a.link_repeats) < 1:
        p.error("--sweeps, --share-rounds and --link-repeats must be at least 1")
    if a.worker:
        {"row": row_worker, "share": share_worker}[a.worker](a)
        return 0
    a.forward = forwarded(a) + ["--rows", *map(str, a.rows), f"--link-repeats={a.link_repeats}"]

    from megascale.config import load_config
    from megascale.data import ensure_dataset
    from megascale.fault import netns

    ok, why = netns.available(shaping=True)
    if not ok:
        print(f"ablation: skipped, {why}")
        return 0
    ensure_dataset(load_config(None, ablation_rows(a, "unused")[0][1]).data, progress=False)
    print(f"GPT {a.layers} layers, d_model {a.d_model}, seq {a.seq}; dp2 x pp2 x tp2 (sequence parallel), "
          f"one rank per host, links {a.mbit:.0f} Mbit/s (tc tbf), MTU {a.mtu}; global batch {a.batch} "
          f"(the last row {4 * a.batch}) in micro-batches of {a.micro}; MFU against the probed matmul peak "
          f"of one core per rank; {a.sweeps} sweeps of the rows, {a.steps} steps each after {a.warmup} "
          f"(+ {a.steps} with no communication)", flush=True)
    with netns.SimCluster(8, mbit=a.mbit, mtu=a.mtu) as cluster, tempfile.TemporaryDirectory() as tmp:
        a.forward.append(f"--base={a.keep or tmp}")  # --keep: the runs' directories stay for a look
        # the CPU preset calibrated before the first sweep and after each (a calibration is a moment
        # of a drifting machine; the rows' medians span the run)
        calibrations: list[Path] = []

        def calibrate_now() -> None:
            if not a.no_calibrate:
                calibrations.append(calibrate_cpu(Path(tmp) / f"cpu-{len(calibrations)}.json"))

        calibrate_now()
        rows, link = run_ablation(cluster, a, after_sweep=calibrate_now)
        sharing = measure_sharing(cluster, a, rounds=a.share_rounds)
        # the planner on each calibration, the cores' speed shared as measured, its links at the tbf
        # rate (nominal) and as fitted on the cluster (measured); per row the median over calibrations
        each = [predicted_steps(a, 8, link, sharing, c) for c in calibrations or [None]]
        planned = median_prediction(each)
        nominal = [x.step_time for x in median_prediction(
            [predicted_steps(a, 8, sharing=sharing, calibration=c) for c in calibrations or [None]])]
        if len(each) > 1:
            print(f"the planner: per row the median over {len(each)} calibrations of this CPU (before the "
                  f"first sweep and after each); the first row on each: "
                  f"{', '.join(f'{p[0].step_time:.3f}' for p in each)} s")
        if sharing:
            print(f"a core time-sliced by {sharing['ranks_per_core']:.0f} ranks keeps "
                  f"{sharing['efficiency']:.2f} of its speed (a tp2 rank's no-comm step "
                  f"{sharing['alone_cpu_s']:.3f} CPU-s on a core of its own, "
                  f"{sharing['shared_cpu_s']:.3f} among them)")
        print(f"links as measured (2-rank all-gathers, 4 pairs at once): "
              f"{link['latency_s'] * 1e6:.0f} us per message, {link['bandwidth'] * 8 / 1e6:.0f} Mbit/s "
              f"(the tbf rate {a.mbit:.0f}); the machine's CPU per all-gather "
              f"{link['cpu_s_per_message'] * 1e6:.0f} us + {link['cpu_s_per_byte'] * 1e9:.2f} ns/byte "
              f"({', '.join(f'{c * 1e3:.2f}' for c in link['cpu_s'])} ms at {LINK_SIZES} bytes)")
        print(f"{'':18} {'step s':>7} {'tokens/s':>9} {'vs base':>7} {'MFU':>6} {'planner s':>9} "
              f"{'error':>7} {'nominal':>8} {'error':>7} {'CPU s':>6} {'busy':>5}")
        for r, want, nom in zip(rows, planned, nominal, strict=True):
            want = want.step_time
            print(f"{r['row']:18} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} "
                  f"{r['tokens_per_s'] / rows[0]['tokens_per_s']:7.2f} {r['mfu']:6.2%} {want:9.3f} "
                  f"{want / r['step_s'] - 1:+7.1%} {nom:8.3f} {nom / r['step_s'] - 1:+7.1%} "
                  f"{r['cpu_s']:6.2f} {r['busy']:5.0%}", flush=True)
        # where the planner's error lies: each row's step split by cause, the timers' against its own
        parts = ("compute", "tp", "pp", "dp", "other")
        print("\nwhere the step goes, s (slowest rank, from the timers / the planner; pp = exposed p2p "
              f"+ bubble)\n{'':18} " + " ".join(f"{k:>13}" for k in parts) + f" {'planner cpu':>11}")
        for r, plan in zip(rows, planned, strict=True):
            got, want = measured_parts(r["runs"]), planned_parts(plan)
            cells = " ".join(f"{got[k]:.3f}/{want[k]:.3f}".rjust(13) for k in parts)
            print(f"{r['row']:18} {cells} {want['cpu']:11.3f}", flush=True)
        # where the machine's CPU goes: the ranks' own (their threads, their system calls), the rest
        # (the kernel's softirq work for veth and tbf), and what the ranks spend without communication
        print(f"\nCPU-s per step      {'machine':>7} {'ranks':>6} {'no comm':>7} {'planner':>7} "
              f"{'compute':>7} {'step no comm':>12}")
        for r, plan in zip(rows, planned, strict=True):
            cpu = {k: 8 * v for k, v in (plan.cpu_seconds or {}).items()}  # all 8 ranks
            print(f"{r['row']:18} {r['cpu_s']:7.2f} {r['ranks_cpu_s']:6.2f} "
                  f"{r['nocomm_ranks_cpu_s']:7.2f} {sum(cpu.values()):7.2f} {cpu.get('compute', 0):7.2f} "
                  f"{r['nocomm_step_s']:12.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
