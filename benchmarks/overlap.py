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

and H's ceiling on this machine: T_serial - T_nocomm less the messages' CPU in the overlapped compute
and the waits for a late peer, over T_serial - T_nocomm. Where every core computes (2 here), what the
kernel and the transport spend on a message comes out of the compute beside it, and a peer's lateness
is the ranks' skew: no overlap hides either, so an H goal above the ceiling is out of this machine's
reach whatever the code does; the line says which share of the ceiling the overlap reached.

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

    sudo .venv/bin/python benchmarks/overlap.py [--dims dp pp tp all] [--mbit 1000] [--rounds 3]

MegaScale's ablation table, on the same cluster and with the same machinery, is benchmarks/ablation.py.

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

    return load_config(None, overrides(a, a.dims[0], "serial", "unused"))


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


def run_job(cluster, a: argparse.Namespace, script: str, worker: str, world: int, port: int,
            extra: list[str] = ()) -> dict:
    """Every rank of one job (`script --worker worker`, one rank per host), rank 0's RESULT."""
    return finish_job(a, worker, start_job(cluster, a, script, worker, world, port, extra))


def start_job(cluster, a: argparse.Namespace, script: str, worker: str, world: int, port: int,
              extra: list[str] = (), first_host: int = 0) -> list:
    """Launch one job's ranks, `script --worker worker` with the options `a.forward`, rank r on host
    first_host + r; its processes."""
    argv = [sys.executable, str(Path(script).resolve()), "--worker", worker, *a.forward, *extra]
    procs = []
    for r in range(world):
        env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": cluster.addr(first_host), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        procs.append(cluster.popen(first_host + r, argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True))
    return procs


def finish_job(a: argparse.Namespace, worker: str, procs: list) -> dict:
    """Wait for a job's ranks; rank 0's RESULT (RuntimeError with its output if a rank failed)."""
    outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    for p, text in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"{worker}: a rank exited {p.returncode}:\n{text[-3000:]}")
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


def report(dim: str, r: dict, own_cores: bool = True) -> str:
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
            f"exposed {exp}{bubble}; compute x{compute:.2f}; {what_is_left(r, streams, own_cores)}")


def what_is_left(r: dict, streams: tuple[str, ...], own_cores: bool = True) -> str:
    """Where T_overlap - T_nocomm goes, from the timers: the communication still exposed (beyond the
    no-comm variant's own waits: a pipeline's stages wait for each other there too), and the
    compute slowed by the messages themselves (the overlapped compute less the no-comm variant's, which
    runs the same overlapped code with its collectives no-ops): the CPU the kernel and the transport
    spend on a message comes out of the core that computes beside it (a NIC's work on a real host), so
    no overlap can hide it; also as a ratio, the GEMMs slowed by the overlap's messages. What the thread
    that starts a message spends starting it (the kernel's send path) is not in it: that is exposed
    communication (observe/timers.py, `issued`). Of the exposed part, the waits until the collective's
    last member arrived (observe.lateness): the ranks' skew, which a synchronous step pays whatever the
    network (on this VM one rank's backward runs 10-20 ms longer than its peer's in some steps, at
    random). And what the overlap's own code costs: the no-comm compute against the serial one (for tp,
    the GEMMs cut by rank and chunk). Each figure the slowest rank's median, so the two parts need not
    add up to the difference of the steps. H's ceiling (hidden_ceiling) only where each rank has a core
    of its own (`own_cores`): ranks time-slicing a core stretch each other's compute spans by their
    messages' CPU, and those stretches overlap in time, so they do not add up to the step (--dims all
    here: 170 ms of stretch a rank, against 60 ms between T_serial and T_nocomm)."""
    exposed = sum(r["overlap"][f"exposed_{s}"] - r["nocomm"][f"exposed_{s}"] for s in streams)
    late = sum(r["overlap"][f"late_{s}"] - r["nocomm"][f"late_{s}"] for s in streams)
    slowed = r["overlap"]["compute"] - r["nocomm"]["compute"]
    own = r["nocomm"]["compute"] / r["serial"]["compute"] if r["serial"]["compute"] else float("nan")
    slowed_x = r["overlap"]["compute"] / r["nocomm"]["compute"] if r["nocomm"]["compute"] else float("nan")
    serial, over, nocomm = (r[v]["step"] for v in VARIANTS)
    ceiling = hidden_ceiling(serial, nocomm, slowed, late)
    of_it = hidden_fraction(serial, over, nocomm) / ceiling if ceiling > 0 else float("nan")
    limit = (f"H's ceiling on these cores {ceiling:.0%} (H is {of_it:.0%} of it)" if own_cores
             else "H's ceiling not measured (ranks share cores)")
    return (f"T_overlap - T_nocomm {(over - nocomm) * 1e3:.0f} ms, of it "
            f"exposed {exposed * 1e3:.0f} ms ({late * 1e3:.0f} of them waiting for a peer to arrive) and "
            f"the messages' CPU in the compute {slowed * 1e3:.0f} ms (x{slowed_x:.2f} the no-comm "
            f"variant's); "
            f"the overlap's own code x{own:.2f} (no-comm compute against serial); "
            f"{limit}")


def hidden_ceiling(serial: float, nocomm: float, cpu: float, late: float) -> float:
    """The most H an overlap could reach on this machine: the communication's cost (serial - nocomm)
    less what no overlap hides where the ranks' cores are busy: the messages' CPU in the compute (the
    kernel's and the transport's work for a message comes out of the core beside it; a NIC's on a real
    host) and the waits for a late peer (the ranks' skew). Negative parts count as none."""
    cost = serial - nocomm
    if cost <= 0:
        return float("nan")
    return max(0.0, cost - max(0.0, cpu) - max(0.0, late)) / cost


def common_parser(description: str) -> argparse.ArgumentParser:
    """The options this benchmark and benchmarks/ablation.py share: the cluster, the model, the layout's
    settings, how long to measure."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--mbit", type=float, default=1000.0, help="each host's link, tc tbf")
    p.add_argument("--mtu", type=int, default=65520, help="the links' MTU (see overlap.py's doc)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per turn (variant or row)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=2, help="micro-batch of the pp, tp, all and ablation runs")
    p.add_argument("--bucket", type=int, default=500_000, help="parallel.dp_bucket_size")
    p.add_argument("--tail-buckets", type=int, default=8, help="parallel.dp_tail_buckets (1: off)")
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
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the ranks to the scheduler, even where each could have a core of its own")
    p.add_argument("--base", help=argparse.SUPPRESS)  # the workers' run directories go under it
    return p


def forwarded(a: argparse.Namespace, more: tuple[str, ...] = ()) -> list[str]:
    """The options as given, for the workers' command lines: common_parser's and the names in `more`."""
    keys = ("steps", "warmup", "layers", "d_model", "seq", "batch", "micro", "bucket", "tail_buckets",
            "tp_chunks", "transport", "pp_ahead", *more)
    out = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys]
    out += ["--gloo-collectives"] if a.gloo_collectives else []
    out += [] if a.pin else ["--no-pin"]
    return out + [f"--set={x}" for x in a.set]


def parser() -> argparse.ArgumentParser:
    p = common_parser(__doc__.splitlines()[0])
    p.add_argument("--dims", nargs="+", default=list(DIMS), choices=list(DIMS),
                   help="the dimensions to measure")
    p.add_argument("--rounds", type=int, default=6, help="rounds of the variants' turns")
    p.add_argument("--block", choices=("sequential", "parallel"), default="sequential",
                   help="model.block of the runs")
    p.add_argument("--dp-micro", type=int, default=0, help="micro-batch of the dp run (0: batch / dp)")
    p.add_argument("--raw", action="store_true", help="also print each variant's breakdown (seconds)")
    p.add_argument("--worker", choices=list(DIMS), help=argparse.SUPPRESS)
    return p


def main() -> int:
    a = parser().parse_args()
    if a.worker:
        worker(a)
        return 0
    a.forward = forwarded(a, ("rounds", "dp_micro", "block"))

    from megascale.data import ensure_dataset
    from megascale.fault import netns

    ok, why = netns.available(shaping=True)
    if not ok:
        print(f"overlap: skipped, {why}")
        return 0
    ensure_dataset(first_config(a).data, progress=False)
    print(f"GPT {a.layers} layers, d_model {a.d_model}, seq {a.seq}, global batch {a.batch} in micro-batches "
          f"of {a.micro} (dp alone: {a.dp_micro or a.batch // 2}); one rank per host, links {a.mbit:.0f} "
          f"Mbit/s (tc tbf), MTU {a.mtu}; {a.rounds} rounds of the variants' turns of 1 + {a.steps} steps "
          f"after {a.warmup}, medians of the timed steps", flush=True)
    hosts = max(DIMS[d][1] for d in a.dims)
    with netns.SimCluster(hosts, mbit=a.mbit, mtu=a.mtu) as cluster, tempfile.TemporaryDirectory() as tmp:
        a.forward.append(f"--base={a.keep or tmp}")  # --keep: the runs' directories stay for a look
        for i, dim in enumerate(a.dims):
            result = run_job(cluster, a, __file__, dim, DIMS[dim][1], 29500 + i)
            print(report(dim, result, own_cores=a.pin and DIMS[dim][1] <= len(os.sched_getaffinity(0))),
                  flush=True)
            if a.raw:
                print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
