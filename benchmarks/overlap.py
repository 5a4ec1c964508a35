"""How much communication the overlaps hide, per dimension, on a simulated cluster with slow links.

On loopback gloo communication is CPU work and nothing of an overlap shows, so every rank here
runs on a host of its own (a network namespace, megascale/fault/netns.py) whose link is limited
with `tc tbf` (default 1000 Mbit/s): each collective of the measured dimension crosses a real,
slow wire. For each dimension (dp, pp, tp) and all together, the real Trainer runs four ways,
Domino's method (Wang et al. 2024):

  T_serial   the dimension's overlap flags off: collectives where the computation waits on them
  T_overlap  the flags on
  T_nocomm   flags on, the dimension's collectives replaced by no-ops of the same shapes, the
             pipeline's activations and gradients by one-element messages: the stages still wait for
             each other as the schedule says (its warm-up and cool-down bubble is the schedule's, not
             communication: with free-running stages, pp2 x 8 micro-batches, T_nocomm had none of its
             (p - 1) / m = 1/8 and T_overlap / T_nocomm counted it against the overlaps)
  T_comm     the collectives of one overlapped step replayed alone, back to back, no compute

  H = (T_serial - T_overlap) / (T_serial - T_nocomm)   the fraction of the exposed communication hidden

and, from the always-on timers (observe/breakdown.py), the communication each dimension left
exposed per step, and the compute time (for tp: what splitting the GEMMs into chunks costs); for dp
also what its steps waited for, by kind (the parameter gathers, the gradient reduce-scatters, the
norms' all-reduces). `--set KEY=VALUE` adds a config override to every run (one switch's A/B).
The three variants' Trainers live side by side in every rank and take turns of 1 + `--steps` steps,
`--rounds` times (a turn's first step, the hand-over, is not timed), so the machine's drift falls on
all three alike. Step times are medians of Trainer.train_step's time over the timed steps, exposed
communication the slowest rank's per step, all measured in one run. H comes with a 90% bootstrap
interval over the rounds: on 2 shared cores one step moves by 10% and more, and H is a ratio of two
differences of such medians, so a single figure says little without it.
The pp overlap is parallel.pp_overlap with one 1F1B warm-up forward ahead (parallel.pp_warmup_ahead=1,
`--pp-ahead`): posting receives early cannot shorten the steady phase's round trip (an activation out,
the next stage's forward and backward, its gradient back), running a forward ahead can.
The links' MTU is loopback's size, 65520 (`--mtu 1500` for Ethernet's): a link's packets cost the
machine's CPU (the bridge forwards each, TCP acknowledges every two), CPU a real NIC spends in
hardware and that here comes out of the compute beside an overlap. 150 MB over one 1 Gbit/s link,
three transfers each, cost 0.73 ms of kernel CPU a MB at MTU 65000, 1.07-1.27 at 9000, 1.27-1.33 at
1500; `--dims dp --rounds 5`, four pairs alternated in one sitting: H 76, 85, 68, 78% at 65520, 64, 68,
71, 68% at 1500 (exposed dp 12-16 ms, 14-21 ms).
Where every rank can have a core of its own (the 2-rank dimensions on 2 cores) each is bound to one, as a
real host has its own (`--no-pin`: left to the scheduler, as the 4- and 8-rank runs always are).
`--block parallel` runs the dimensions on the parallel block (tp: its one all-gather and one reduce-scatter
under its MLP's own rows, parallel.tp_overlap_branches, in the overlap variant).
`--tail-buckets 1` and `--gloo-collectives` turn off the dp refinements (parallel.dp_tail_buckets,
parallel.direct_collectives) to see what each buys. Goals of
issue 12: DP H >= 80%, PP exposed p2p under 2% of the step, TP H >= 50% on CPU with compute
slowed under 10%, all together T_overlap / T_nocomm <= 1.10.

    sudo .venv/bin/python benchmarks/overlap.py [--dims dp pp tp all] [--mbit 1000] [--rounds 3] [--ablation]

`--ablation` adds MegaScale's table (its rows cumulative on dp2 x pp2 x tp2, 8 hosts; the rows swept
`--ablation-rounds` times, a job of fresh processes per row and sweep, medians over the sweeps) with the
planner's step time per row twice, on the CPU preset calibrated at the end of the run (`megascale plan
--calibrate` into a file of its own: perf/calibrate.py's kernels and perf/host.py's framework work, as the
machine runs then). Both use the links' tbf rate and veth's latency. "planner" adds what
a message costs the host's CPU (gloo's copies, the kernel's TCP work), fitted here on 2-rank
all-gathers of three sizes, all pairs at once, from the machine's busy time: 8 ranks share 2 cores,
so that CPU competes with the compute, and perf/step.py bounds the step by the sum (`rank_cpu_seconds`).
"nominal" leaves it out, as a GPU cluster's NICs and copy engines do. The table also gives each row's
machine CPU-seconds per step and how busy the cores were, and then each row's step split by cause
(compute, tp, pp, dp, other; the planner's "cpu" column is its CPU bound's excess over its timeline)
as the timers measured it and as the planner has it, and last each row's CPU-seconds per step: the
machine's, the ranks' own (their threads and system calls: nearly all of the machine's, softirq
included), the ranks' again with every dp, pp and tp collective a no-op (`--steps` more steps), and
the planner's (all, and its compute alone). That last table says where the planner's error lies.
`--dims` with no dimension runs the ablation alone.

Needs root (namespaces, tc); where they cannot be made it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# dimension: (layout overrides, world, the flags that turn its overlap on, the mesh groups it owns)
DP_FLAGS = ["dp_overlap_grad_reduce", "dp_overlap_param_gather"]
DIMS = {
    "dp": (["parallel.dp=2"], 2, DP_FLAGS, ("dp",)),
    "pp": (["parallel.pp=2"], 2, ["pp_overlap"], ("pp",)),
    "tp": (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, ["tp_overlap", "tp_overlap_branches"],
           ("tp",)),
    "all": (["parallel.dp=2", "parallel.pp=2"], 4,
            [*DP_FLAGS, "pp_overlap", "tp_overlap", "tp_overlap_branches"],
            ("dp", "pp", "tp")),
}
VARIANTS = ("serial", "overlap", "nocomm")
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


def overrides(a: argparse.Namespace, dim: str, variant: str, run_dir: str) -> list[str]:
    layout, world, flags, _ = DIMS[dim]
    on = variant != "serial"
    # dp alone: one micro-batch per rank, so the whole backward can hide the reduce-scatters (with m
    # micro-batches only the last one's backward runs while gradients are final: --dp-micro to see it)
    micro = a.dp_micro or a.batch // world if dim == "dp" else a.micro
    return [
        f"model.n_layers={a.layers}", f"model.d_model={a.d_model}", "model.n_heads=4",
        f"model.seq_len={a.seq}", "model.dropout=0.0", f"model.block={a.block}",
        f"train.global_batch={a.batch}", f"train.micro_batch={micro}", "train.steps=1000",
        "train.eval_interval=0", "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0",
        "log.peak_flops=1e9", "checkpoint.interval=0", "checkpoint.memory_interval=0",
        f"parallel.dp_bucket_size={a.bucket}", f"parallel.dp_tail_buckets={a.tail_buckets}",
        f"parallel.direct_collectives={str(not a.gloo_collectives).lower()}",
        f"parallel.transport={a.transport}",
        f"parallel.tp_overlap_chunks={a.tp_chunks}",
        f"data.path={json.dumps(str(ROOT / 'data' / 'cache' / 'shakespeare'))}",
        f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}",
        f"train.run_dir={json.dumps(run_dir)}", *layout, *[f"parallel.{f}={str(on).lower()}" for f in flags],
        f"parallel.pp_warmup_ahead={a.pp_ahead if on and 'pp_overlap' in flags else 0}", *a.set,
    ]


def first_config(a: argparse.Namespace):
    """The first measured layout's config (its dataset is every run's): a --set may suit only some
    dimensions (parallel.vpp needs pp > 1), so not a layout the run may not measure at all."""
    from megascale.config import load_config

    return load_config(None, overrides(a, a.dims[0] if a.dims else "all", "serial", "unused"))


# ---------------------------------------------------------------------- no-op and recorded collectives


class _Done:
    """A finished Work: what a no-op collective returns."""

    def wait(self, *_a, **_k) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Collectives:
    """Wraps torch.distributed's collectives, and the socket transport's sends and receives
    (distributed/p2p.py, parallel.transport = "sockets"): on the chosen groups, record each call's
    shapes, or replace it with a no-op (a receive's buffer zeroed, a gather's or reduce-scatter's output
    filled from this rank's own data, a routed all-reduce left as it is: no garbage reaches the loss).
    On the `ordered` groups (the pipeline's) a send or receive becomes a one-element message instead of
    nothing, so that a stage still waits for the one before it."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
             "reduce_scatter_tensor", "broadcast", "isend", "irecv")

    def __init__(self, groups: set):
        import torch.distributed as dist

        from megascale.distributed import direct, p2p

        self.dist, self.p2p, self.groups, self.mode, self.calls = dist, p2p, groups, "pass", []
        self.ordered: set = set()
        self.real = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in self.real.items():
            setattr(dist, name, self._wrap(name, fn))
        # a routed group's messages never reach torch.distributed: caught where they leave p2p.py
        self.real_p2p = {n: getattr(p2p, n) for n in ("isend", "irecv")}
        for name, fn in self.real_p2p.items():
            setattr(p2p, name, self._wrap(name, fn, routed_only=True))
        # A routed all-reduce (Mesh.all_reduce: the vocab-parallel loss's sums, SP's partial gradients)
        # is a no-op as a whole: made of no-op messages, its all-gather would zero the peers' chunks of
        # the sum, and half the tokens' softmax denominators would be 0, their loss and every weight
        # NaN after one step (measured: the no-comm variant then computed on NaN).
        self.real_all_reduce = direct.all_reduce

        def all_reduce(t, group, *args, **kw):
            if self.mode == "nocomm" and group in self.groups:
                return None
            return self.real_all_reduce(t, group, *args, **kw)
        direct.all_reduce = all_reduce

    def _wrap(self, name, fn, routed_only: bool = False):
        def call(*args, **kw):
            group = kw.get("group")
            ours = group in self.groups and (not routed_only or self.p2p.routed(group))
            if self.mode == "pass" or not ours:
                return fn(*args, **kw)
            tensors = [a for a in args if hasattr(a, "shape")]
            if self.mode == "record":
                self.calls.append((name, group, [(t.shape, t.dtype) for t in tensors],
                                   {k: v for k, v in kw.items() if k in ("dst", "src", "tag", "op")}))
                return fn(*args, **kw)
            if name in ("isend", "irecv") and group in self.ordered:
                if name == "irecv":
                    tensors[0].zero_()
                return fn(tensors[0].new_zeros(1), *args[1:], **kw)  # the dependency, not the bytes
            if name == "irecv":
                tensors[0].zero_()
            elif name.startswith(("all_gather", "reduce_scatter")):  # the output as one rank would see it
                _stand_in(name, *tensors[:2])
            return _Done() if kw.get("async_op") or name in ("isend", "irecv") else None
        return call

    def replay(self) -> float:
        """The recorded calls again with fresh tensors: collectives blocking in order, p2p in flight
        together (a blocking receive could wait on a send the peer issues later); seconds."""
        import torch

        self.dist.barrier()
        t0, pending = time.perf_counter(), []
        for name, group, shapes, kw in self.calls:
            tensors = [torch.zeros(s, dtype=d) for s, d in shapes]
            if name in ("isend", "irecv"):
                real = self.real_p2p if self.p2p.routed(group) else self.real
                pending.append(real[name](tensors[0], group=group, **kw))
            else:
                self.real[name](*tensors, group=group, **{k: v for k, v in kw.items() if k == "src"})
        for w in pending:
            w.wait()
        return time.perf_counter() - t0


def _stand_in(name: str, out, inp) -> None:
    """Fill a no-op all-gather's or reduce-scatter's output (made with torch.empty) with this rank's
    own data: every peer's piece a copy of ours, our piece of the sum our own addend. Left unwritten,
    its garbage reaches the weights (NaN, denormals) and the no-comm step computes on it."""
    flat_out, flat_in = out.reshape(-1), inp.reshape(-1)
    if name.startswith("all_gather"):
        flat_out.view(-1, flat_in.numel()).copy_(flat_in.expand(flat_out.numel() // flat_in.numel(), -1))
    else:
        flat_out.copy_(flat_in[: flat_out.numel()])


OWNER = {"dp": "dp", "tp": "tp", "pp": "pp", "emb": "pp"}  # a mesh group's prefix -> its dimension
# (mp_group, the tp x pp grad-norm sum, is one scalar a step: left real)


def dim_groups(engine, dims: tuple[str, ...]) -> set:
    """The process groups of the given dimensions: the mesh's (by attribute name), and under tp the
    TP overlap's own group."""
    groups = {value for name, value in vars(engine.mesh).items()
              if name.endswith("group") and value is not None and OWNER.get(name.split("_")[0]) in dims}
    overlap = getattr(engine.factory, "overlap", None)
    if "tp" in dims and overlap is not None:
        groups.add(overlap.group)
    return groups


def steady_p2p_wait(ranks: dict, steps: list[int]) -> float:
    """The fraction of a step the busiest pipeline rank spent waiting in receives in the steady phase
    (after its first backward began, before its last forward ended): the exposed p2p the overlap is
    for, without the warm-up and cool-down bubble no p2p scheme removes, and without a lighter
    stage's wait for a heavier one (imbalance, not communication). Median over the steps."""
    per_rank = {}
    for r, trace in ranks.items():
        fractions, busy = [], 0
        for step in steps:
            ev = [e for e in trace.events if e.step == step]
            fwd = [e for e in ev if e.op == "forward"]
            bwd = [e for e in ev if e.op == "backward"]
            if not fwd or not bwd:
                continue
            lo, hi = min(e.t0 for e in bwd), max(e.t1 for e in fwd)
            wait = sum(e.blocked for e in ev if e.op == "recv" and lo <= e.t0 and e.t1 <= hi)
            fractions.append(wait / (max(e.t1 for e in ev) - min(e.t0 for e in ev)))
            busy += sum(e.dur - e.blocked for e in fwd + bwd)
        if fractions:
            per_rank[r] = (busy, statistics.median(fractions))
    return max(per_rank.values())[1] if per_rank else float("nan")


def dp_waits(ranks: dict, steps: list[int]) -> dict[str, float]:
    """The dp communication each step waited for, by kind, seconds: "gather" (the parameter all-gathers,
    waited for in the forward), "reduce" (the gradient reduce-scatters, after backward), "norm" (the
    grad norm's and LAMB's all-reduces over dp), each the slowest rank's, median over the steps."""
    kinds = {"all_gather": "gather", "reduce_scatter": "reduce", "all_reduce": "norm"}
    out = {}
    for op, kind in kinds.items():
        per_step = [max(sum(e.blocked for e in t.events if e.step == s and e.op == op and e.group == "dp")
                        for t in ranks.values()) for s in steps]
        out[kind] = statistics.median(per_step) / 1e9 if per_step else float("nan")
    return out


# ---------------------------------------------------------------------- one rank


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
    """The planner's step time for each ablation row, on this machine's CPU preset calibrated now (into
    a file of its own, or the one at `calibration`; `--no-calibrate`: as stored, placeholders if never
    calibrated: the machine's speed drifts by 20% in minutes, a calibration of another hour predicts
    another machine) made into the simulated cluster: the ranks sharing this machine's cores (at the
    speed `sharing`, from
    measure_sharing, says a shared core keeps), every link the tbf rate with veth's latency and, given
    `measured` (measure_link), the host CPU its messages cost as fitted on the cluster (without it a
    message costs no CPU, as on a GPU cluster). One perf.step.Prediction per row, with its breakdown."""
    import dataclasses

    import torch

    from megascale.config import load_config
    from megascale.data.tokenizer import build_tokenizer
    from megascale.perf.calibrate import calibrate
    from megascale.perf.presets import Link, apply_calibration, load_preset
    from megascale.perf.step import Layout, Settings, predict

    cpu = load_preset("cpu", use_calibration=a.no_calibrate)
    if not a.no_calibrate:
        calibration = calibration or Path(tempfile.mkdtemp()) / "cpu.json"
        if not calibration.exists():  # now, on one thread as each rank runs, in CPU time
            torch.set_num_threads(1)
            calibrate(cpu, out=calibration, clock="cpu")
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
    for _, args in [rows[i] for i in a.ablation_rows]:
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
            return start_job(cluster, a, "share", port, ["--row", str(j), "--sweep", str(sweep)],
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


def pin_to_core(a: argparse.Namespace, world: int) -> None:
    """Bind this rank (all its threads) to core `rank` when every rank can have a core of its own, as a
    real host has its own, unless --no-pin. With more ranks than cores the scheduler is left to balance
    them: a fixed share suits a pipeline's shifting load worse.

    Measured on 2 cores, each pair of runs in one sitting: --dims tp (2 ranks) bound, every step ~10%
    shorter and H's 90% interval 16 points wide instead of 67; --dims all (4 ranks) bound two to a core
    (each core one rank of each stage and replica), every step 11-16% longer than unbound."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if a.pin and 0 < world <= len(cores):
        os.sched_setaffinity(0, {cores[int(os.environ.get("RANK", "0"))]})


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


def ablation_worker(a: argparse.Namespace) -> None:
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
    if a.row == a.ablation_rows[0] and a.sweep == 0:  # the layout's tp pairs (adjacent ranks)
        out["link"] = measure_link(a, [[r, r + 1] for r in range(0, 8, 2)])
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps(out), flush=True)
    shutdown_distributed()


def run_ablation(cluster, a: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every row's figures over `--ablation-rounds` sweeps of the rows (a job per row and sweep, so the
    machine's drift falls on every row in several places), and the links as measured."""
    got: list[dict] = [{} for _ in a.ablation_rows]
    link = None
    for sweep in range(a.ablation_rounds):
        for i, g in zip(a.ablation_rows, got, strict=True):
            job = run_dim(cluster, a, "ablation", 29400 + sweep * len(ABLATION) + i,
                          ["--row", str(i), "--sweep", str(sweep)])
            link = job.pop("link", link)
            for k, v in job.items():
                g[k] = g.get(k, 0 if isinstance(v, float) else []) + v
    rows = []
    for (name, _), g in zip([ABLATION[i] for i in a.ablation_rows], got, strict=True):
        n = len(g["step_s"])
        rows.append({"row": name, **{k: statistics.median(g[k]) for k in
                                     ("step_s", "tokens_per_s", "mfu", "nocomm_step_s")},
                     "cpu_s": g["busy"] / n, "busy": g["busy"] / (g["wall"] * (os.cpu_count() or 1)),
                     "ranks_cpu_s": g["ranks_cpu_s"] / n, "nocomm_ranks_cpu_s": g["nocomm_ranks_cpu_s"] / n,
                     "runs": g["runs"]})
    return rows, link


def worker(a: argparse.Namespace) -> None:
    """On every rank (a host of the cluster): the three variants and the replay of one dimension.

    The three variants' Trainers live side by side and take turns, a few steps each, round after
    round, so that the machine's drift (2 shared cores: one step moves by 10% and more, the machine
    by 25% between runs minutes apart) falls on all three alike. A turn's first step is not timed:
    it starts with what the previous variant left in flight on the wire, and with the parameter
    gathers its own last turn launched long done. Its steps after that are the variant's own.
    """
    pin_to_core(a, DIMS[a.worker][1])
    import torch

    from megascale.config import load_config
    from megascale.distributed.init import shutdown_distributed
    from megascale.observe import timers
    from megascale.observe.breakdown import step_breakdown
    from megascale.observe.trace import read_run
    from megascale.train import Trainer

    torch.set_num_threads(1)
    dim, rank = a.worker, int(os.environ["RANK"])
    trainers, groups, ordered, timed = {}, {}, {}, {v: [] for v in VARIANTS}
    for variant in VARIANTS:
        run_dir = str(Path(a.base) / f"{dim}-{variant}")  # shared by the ranks: all are read
        trainers[variant] = Trainer(load_config(None, overrides(a, dim, variant, run_dir)), quiet=True)
        groups[variant] = dim_groups(trainers[variant].engine, DIMS[dim][3])
        ordered[variant] = dim_groups(trainers[variant].engine, ("pp",)) & groups[variant]
    wrapper = Collectives(set())
    times = {v: [] for v in VARIANTS}
    by_round: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}

    def step(variant: str, measured: bool, record: bool = False):
        trainer = trainers[variant]
        timers.install(trainer.observer.recorder)
        wrapper.groups, wrapper.ordered = groups[variant], ordered[variant]
        wrapper.mode = "nocomm" if variant == "nocomm" and measured else "pass"
        if record:
            wrapper.mode, wrapper.calls = "record", []
        stats = trainer.train_step()
        wrapper.mode = "pass"
        if measured:
            timed[variant].append(trainer.step - 1)  # the trace's step number of this step
        return stats.step_time

    for variant in VARIANTS:
        for _ in range(a.warmup):
            step(variant, False)
    for rnd in range(a.rounds):
        for variant in VARIANTS:
            step(variant, False)  # the turn's first step: the hand-over
            by_round[variant].append([step(variant, True, record=variant == "overlap" and rnd == 0 and i == 0)
                                      for i in range(a.steps)])
            times[variant] += by_round[variant][-1]
    rows, out = {}, {}
    for variant, trainer in trainers.items():
        run_dir = str(trainer.run_dir)
        timers.install(trainer.observer.recorder)
        trainer.close()
        traces = read_run(run_dir)
        breakdown = step_breakdown(traces)
        steps = [s for s in breakdown["steps"] if s in set(timed[variant])]
        rows[variant] = [breakdown["max"][s] for s in steps]
        # The step is Trainer.train_step's time (it ends in an all-reduce: the same on every rank), not
        # one rank's wall from its trace, which ends at that rank's last span.
        out[variant] = {k: statistics.median(r[k] for r in rows[variant]) for k in rows[variant][0]}
        out[variant]["step"] = statistics.median(times[variant])
        out[variant]["steady_p2p"] = steady_p2p_wait(traces, steps)
        out[variant]["dp_waits"] = dp_waits(traces, steps)
    out["comm"] = statistics.median(wrapper.replay() for _ in range(3))
    out["rounds"] = by_round  # step times
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    shutdown_distributed()  # gloo's threads joined before exit, as `megascale train` does


# ---------------------------------------------------------------------- the cluster


def run_dim(cluster, a: argparse.Namespace, dim: str, port: int, extra: list[str] = ()) -> dict:
    """Every rank of one dimension's runs (dim "ablation": one ablation row), rank 0's RESULT."""
    return finish_job(a, dim, start_job(cluster, a, dim, port, extra))


def start_job(cluster, a: argparse.Namespace, dim: str, port: int, extra: list[str] = (),
              first_host: int = 0) -> list:
    """Launch one job's ranks, rank r on host first_host + r; its processes."""
    world = {"ablation": 8, "share": 2}.get(dim) or DIMS[dim][1]
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", dim, *a.forward, *extra]
    procs = []
    for r in range(world):
        env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": cluster.addr(first_host), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        procs.append(cluster.popen(first_host + r, argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True))
    return procs


def finish_job(a: argparse.Namespace, dim: str, procs: list) -> dict:
    """Wait for a job's ranks; rank 0's RESULT (RuntimeError with its output if a rank failed)."""
    outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    for p, text in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"overlap {dim}: a rank exited {p.returncode}:\n{text[-3000:]}")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def hidden_fraction(serial: float, over: float, nocomm: float) -> float:
    """H: the share of the exposed communication (serial - nocomm) that the overlap hid."""
    exposed = serial - nocomm
    return (serial - over) / exposed if exposed > 0 else float("nan")


def hidden_interval(rounds: dict[str, list[list[float]]], resamples: int = 1000) -> tuple[float, float]:
    """A 90% bootstrap interval of H over the rounds (nan, nan with one round).

    Rounds are resampled whole, with their steps, so the interval holds the machine's drift between
    rounds as well as each step's noise (2 shared cores move one step by 10% and more); each resample's
    H is taken from the medians of its pooled steps, as the reported H is.
    """
    n = len(rounds["serial"])
    if n < 2:
        return float("nan"), float("nan")
    rng, hs = random.Random(0), []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        med = [statistics.median(t for i in picks for t in rounds[v][i]) for v in VARIANTS]
        hs.append(hidden_fraction(*med))
    hs = sorted(h for h in hs if h == h)
    if not hs:
        return float("nan"), float("nan")
    return hs[int(0.05 * len(hs))], hs[int(0.95 * len(hs)) - 1]


def report(dim: str, r: dict) -> str:
    serial, over, nocomm = (r[v]["step"] for v in VARIANTS)
    hidden = hidden_fraction(serial, over, nocomm)
    streams = ("dp", "pp", "tp") if dim == "all" else (dim,)
    exp = " ".join(f"{s} {r['serial'][f'exposed_{s}'] * 1e3:.0f}->{r['overlap'][f'exposed_{s}'] * 1e3:.0f} ms"
                   for s in streams)
    bubble = ""
    if dim in ("dp", "all"):
        waits = (r[v]["dp_waits"] for v in ("serial", "overlap"))
        bubble = ", dp waits (gathers, reduce-scatters, norms) " + " -> ".join(
            "/".join(f"{w[k] * 1e3:.1f}" for k in ("gather", "reduce", "norm")) for w in waits) + " ms"
    if dim in ("pp", "all"):
        bubble += (f", pp wait {r['overlap']['bubble'] / over:.1%} of the step, in the steady phase "
                  f"{r['serial']['steady_p2p']:.1%}->{r['overlap']['steady_p2p']:.1%}")
    compute = r["overlap"]["compute"] / r["serial"]["compute"] if r["serial"]["compute"] else float("nan")
    low, high = hidden_interval(r["rounds"])
    spread = f" (90% {low:.0%}..{high:.0%})" if low == low else ""
    return (f"{dim:>4}  T_serial {serial:6.3f}  T_overlap {over:6.3f}  T_nocomm {nocomm:6.3f}  "
            f"T_comm {r['comm']:6.3f} s   H {hidden:6.1%}{spread}   "
            f"T_overlap/T_nocomm {over / nocomm:5.2f}   "
            f"exposed {exp}{bubble}; compute x{compute:.2f}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", nargs="*", default=list(DIMS), choices=list(DIMS),
                   help="the dimensions to measure (none: only --ablation)")
    p.add_argument("--mbit", type=float, default=1000.0, help="each host's link, tc tbf")
    p.add_argument("--mtu", type=int, default=65520, help="the links' MTU (see above)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant and turn")
    p.add_argument("--rounds", type=int, default=6, help="rounds of the variants' turns")
    p.add_argument("--ablation-rounds", type=int, default=3, help="sweeps of the ablation's rows")
    p.add_argument("--ablation-rows", type=int, nargs="+", default=list(range(len(ABLATION))),
                   choices=range(len(ABLATION)), metavar="ROW",
                   help="the ablation's rows to run, 0 (baseline) .. 6 (+ LAMB, 4x batch); default all")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=2, help="micro-batch of the pp, tp and all runs")
    p.add_argument("--block", choices=("sequential", "parallel"), default="sequential",
                   help="model.block of the dimensions' runs (the ablation sets its own)")
    p.add_argument("--dp-micro", type=int, default=0, help="micro-batch of the dp run (0: batch / dp)")
    p.add_argument("--bucket", type=int, default=500_000, help="parallel.dp_bucket_size")
    p.add_argument("--tail-buckets", type=int, default=4, help="parallel.dp_tail_buckets (1: off)")
    p.add_argument("--gloo-collectives", action="store_true",
                   help="parallel.direct_collectives=false: gloo's own (its reduce-scatter an all-reduce)")
    p.add_argument("--transport", choices=("gloo", "sockets"), default="sockets",
                   help="parallel.transport: what carries the p2p messages (distributed/sockets.py)")
    p.add_argument("--tp-chunks", type=int, default=1,
                   help="parallel.tp_overlap_chunks (1: own rows only; 2 hid less here, twice the messages)")
    p.add_argument("--pp-ahead", type=int, default=1,
                   help="parallel.pp_warmup_ahead of the pp overlap (0: Megatron's 1F1B warm-up)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, after the variant's flags (e.g. one overlap's "
                        "off switch: --set parallel.dp_tail_buckets=1)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--keep", help="write the runs' directories (traces, metrics) here and keep them")
    p.add_argument("--raw", action="store_true", help="also print each variant's breakdown (seconds)")
    p.add_argument("--ablation", action="store_true",
                   help="also MegaScale's ablation table on dp2 x pp2 x tp2 (8 hosts)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the ranks to the scheduler, even where each could have a core of its own")
    p.add_argument("--no-calibrate", action="store_true",
                   help="the planner column with the CPU preset's calibration as stored (placeholders if "
                        "never calibrated), not a fresh one")
    p.add_argument("--worker", choices=[*DIMS, "ablation", "share"], help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)  # the workers' run directories go under it
    p.add_argument("--row", type=int, default=0, help=argparse.SUPPRESS)  # an ablation job's row
    p.add_argument("--sweep", type=int, default=0, help=argparse.SUPPRESS)  # and its sweep
    return p


def main() -> int:
    a = parser().parse_args()
    if a.worker == "ablation":
        ablation_worker(a)
        return 0
    if a.worker == "share":
        share_worker(a)
        return 0
    if a.worker:
        worker(a)
        return 0
    a.forward = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                 ("steps", "rounds", "ablation_rounds", "warmup", "layers", "d_model", "seq", "batch",
                  "micro", "dp_micro", "bucket", "tail_buckets", "tp_chunks", "transport", "pp_ahead",
                  "block")]
    a.forward += ["--gloo-collectives"] if a.gloo_collectives else []
    a.forward += [] if a.pin else ["--no-pin"]
    a.forward += ["--ablation-rows", *map(str, a.ablation_rows)]
    a.forward += [f"--set={x}" for x in a.set]

    from megascale.data import ensure_dataset
    from megascale.fault import netns

    ok, why = netns.available(shaping=True)
    if not ok:
        print(f"overlap: skipped, {why}")
        return 0
    ensure_dataset(first_config(a).data, progress=False)
    hosts = 8 if a.ablation else max(DIMS[d][1] for d in a.dims)
    print(f"GPT {a.layers} layers, d_model {a.d_model}, seq {a.seq}, global batch {a.batch} in micro-batches "
          f"of {a.micro} (dp alone: {a.dp_micro or a.batch // 2}); one rank per host, links {a.mbit:.0f} "
          f"Mbit/s (tc tbf), MTU {a.mtu}; {a.rounds} rounds of the variants' turns of 1 + {a.steps} steps "
          f"after {a.warmup}, medians of the timed steps", flush=True)
    with netns.SimCluster(hosts, mbit=a.mbit, mtu=a.mtu) as cluster, tempfile.TemporaryDirectory() as tmp:
        base = a.keep or tmp  # --keep: the runs' directories (traces, metrics) stay for a look
        a.forward.append(f"--base={base}")
        for i, dim in enumerate(a.dims):
            result = run_dim(cluster, a, dim, 29500 + i)
            print(report(dim, result), flush=True)
            if a.raw:
                print(json.dumps(result, indent=1))
        if a.ablation:
            print(f"\nablation, dp2 x pp2 x tp2 (sequence parallel), global batch {a.batch} (the last row "
                  f"{4 * a.batch}), MFU against the probed matmul peak of one core per rank; "
                  f"{a.ablation_rounds} sweeps of the rows, {a.steps} steps each after {a.warmup} "
                  f"(+ {a.steps} with no communication)")
            rows, link = run_ablation(cluster, a)
            sharing = measure_sharing(cluster, a)
            # the planner: the CPU preset as calibrated here (`megascale plan --calibrate --cluster cpu`),
            # the cores' speed shared as measured, its links at the tbf rate (nominal) and as fitted on
            # the cluster (measured)
            calibration = Path(tmp) / "cpu.json"  # the first call calibrates the CPU into it
            planned = predicted_steps(a, 8, link, sharing, calibration)
            nominal = [x.step_time for x in predicted_steps(a, 8, sharing=sharing, calibration=calibration)]
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
