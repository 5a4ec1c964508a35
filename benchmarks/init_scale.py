"""Start-up store traffic of a 256 to 12,288-rank job, replayed against real stores (issue 5).

MegaScale (NSDI'24) measured Megatron-LM spending 1,047 s on process-group initialisation at
2,048 GPUs: TCPStore serves one request at a time, and every `new_group` ended in a barrier
over all ranks, O(N^2) store operations. Processes cannot reach 12,288 ranks on one machine;
their store traffic can. `megascale.distributed.traffic` generates, per rank, the store
operations of the real code path (checked key for key against real gloo processes in
tests/test_group_init.py), and this script performs them:

- the store server runs in its own process: a Python process holding a TCPStore master
  (libuv or the legacy backend) that only sleeps, or a redis-server started here on a
  loopback port (RedisStore clients);
- this process opens one client connection per simulated rank (fewer, shared round-robin,
  only where the store refuses more; the output says so) and a pool of threads performs the
  operations of each step round by round: every rank's round i, each operation on its rank's
  own connection, then round i + 1. `set_if_last` sets its key only if the rank's previous
  `add` returned the count, as torch's barrier does. The operations performed are counted and
  must equal the generator's.

Modes: "global" (naive: every rank creates every group, a world barrier after each) and
"local" (ours: only members synchronise). Naive is O(N^2): 179M operations at 12,288 ranks
(4,864 groups), so it replays init, the first `--max-steps` group steps and the steps after
the groups (NCCL's lazy id exchange), and extrapolates the other group steps from the median
time per operation of the measured ones, counting their operations from the generator. With
NCCL (the default backend) every group step is the same world barrier, 3N + 1 operations, so
that is the median step time. "local" is always replayed in full. The time to open the N
connections is reported apart from the step times.

Bound: the server's CPU seconds (from /proc) and this process's (all client threads) are taken
per case. The servers serve from one thread, so a server near one busy core is store-bound; this
process is Python, held to about one core by the GIL, so near one core it is client-bound. (On two
cores more client threads mostly add GIL contention, but they keep more requests in flight for a
server to batch, which the legacy TCPStore needs; 32 is the default.) Where the client is the
bottleneck, "store s" (the server's CPU per operation times all operations) is what the store
itself would need.

    .venv/bin/python benchmarks/init_scale.py [--ranks 256,2048,12288 | --mesh dp32xpp8xtp8]
        [--stores tcp-libuv,tcp-legacy,redis] [--modes global,local] [--backend nccl|gloo|nccl-split]
        [--threads 32] [--max-steps 5] [--json PATH]

Note on reverse DNS: torch's c10d sockets look up the peer's host name (getnameinfo) on every
connect and accept, and give up on it for the process only after a lookup *fails*. Where the
resolver drops some queries (this sandbox's drops about one in 25) each drop costs the resolver's
5 s timeout and then a retry that succeeds, so c10d never gives up: 12,288 TCPStore connections
would take some 40 minutes. Unless RES_OPTIONS is already set this script sets it to
"timeout:1 attempts:1", so the first dropped query fails after 1 s and c10d stops asking (its
"hostname ... cannot be retrieved" warning). A cluster whose reverse DNS is slow pays this too.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import itertools
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megascale.distributed.redis_store import RedisStore  # noqa: E402
from megascale.distributed.traffic import BACKENDS, MODES, Step, startup_traffic, unique_groups  # noqa: E402
from megascale.parallel.mesh import mesh_group_kinds  # noqa: E402

STORES = ("tcp-libuv", "tcp-legacy", "redis")
DEFAULT_RANKS = (256, 2048, 12288)
DEFAULT_TP, DEFAULT_PP = 8, 8  # the paper's 175B runs: tp 8, pp 8, dp = N / 64
VALUE = b"v" * 128  # what a `set` writes: the size of an NCCL unique id (gloo's addresses are smaller)
STORE_TIMEOUT = datetime.timedelta(seconds=300)


# ---- plans: which steps are replayed, which extrapolated -------------------------------------------------


@dataclass
class Plan:
    """One (world, mode)'s start-up: the steps replayed in order, and the group steps that are not."""

    world: int
    mode: str
    backend: str
    replay: list[Step]
    group_steps: int  # "global": the step after init for each group (the O(N^2) part); "local": 0
    skipped_ops: list[int] = field(default_factory=list)  # the generator's count, per group step not replayed

    @property
    def steps(self) -> int:
        return len(self.replay) + len(self.skipped_ops)

    @property
    def replay_ops(self) -> int:
        return sum(s.num_ops for s in self.replay)

    @property
    def ops(self) -> int:
        return self.replay_ops + sum(self.skipped_ops)

    @property
    def extrapolated(self) -> bool:
        return bool(self.skipped_ops)

    @property
    def group_step_ops(self) -> list[int]:
        """Operations of every group step, replayed or not, from the generator."""
        measured = [s.num_ops for s in self.replay[1:1 + self.group_steps - len(self.skipped_ops)]]
        return measured + self.skipped_ops


def make_plan(world: int, kinds: Sequence[Sequence[Sequence[int]]], mode: str, backend: str,
              max_steps: int) -> Plan:
    """Every step of `startup_traffic`; in "global" mode only init, the first `max_steps` group steps and
    the steps after the groups are kept for replay, the other group steps only as operation counts."""
    if max_steps < 1:
        raise ValueError("max_steps must be at least 1: the group steps not replayed are extrapolated")
    n_groups = sum(len(g) for g in unique_groups(world, kinds, mode)) if mode == "global" else 0
    replay, skipped = [], []
    for i, step in enumerate(startup_traffic(world, kinds, mode, backend)):
        if 1 + max_steps <= i <= n_groups:  # steps 1..n_groups are the groups' ("global")
            skipped.append(step.num_ops)
        else:
            replay.append(step)
    return Plan(world, mode, backend, replay, n_groups, skipped)


# ---- store servers, each in a process of its own --------------------------------------------------------

# The TCPStore master: bound on loopback, prints its port, then holds the store until its stdin closes
# (the benchmark ends, or dies: then the pipe closes too).
_TCP_SERVER = """
import datetime, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=300), wait_for_workers=False,
                      use_libuv=sys.argv[1] == "1")
print(store.port, flush=True)
sys.stdin.read()
"""


def _child_setup() -> None:
    """In a server child before exec: all the file descriptors allowed, and SIGTERM when we die."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def machine_busy_seconds() -> float:
    """CPU seconds all the machine's cores have been busy, from /proc/stat (to see other load)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait; guest time is already in user
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """A store server process and how to open a client of it."""

    name: str
    proc: subprocess.Popen
    version: str
    max_clients: int | None = None  # what the server says it accepts, where it says

    def client(self) -> dist.Store:
        raise NotImplementedError

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class TCPServer(Server):
    def __init__(self, libuv: bool):
        self.name = "tcp-libuv" if libuv else "tcp-legacy"
        self.libuv = libuv
        self.version = f"torch {torch.__version__} TCPStore ({'libuv' if libuv else 'legacy'} backend)"
        self.proc = subprocess.Popen([sys.executable, "-c", _TCP_SERVER, "1" if libuv else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_child_setup)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the TCPStore server did not start (said {line!r})")
        self.port = int(line)

    def client(self) -> dist.Store:
        return dist.TCPStore("127.0.0.1", self.port, None, False, STORE_TIMEOUT, wait_for_workers=False,
                             use_libuv=self.libuv)


class RedisServer(Server):
    def __init__(self, max_clients: int):
        self.name = "redis"
        self.dir = tempfile.TemporaryDirectory(prefix="init-scale-redis-")
        exe = "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else "redis-server"
        for _ in range(3):  # another process may take the free port before the server binds it
            self.port = _free_port()
            args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--maxclients", str(max_clients), "--dir", self.dir.name, "--daemonize", "no",
                    "--loglevel", "warning"]
            try:
                self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
            except FileNotFoundError:
                raise RuntimeError("redis-server is not installed (apt-get install redis-server)") from None
            if self._ready(timeout_s=10.0):
                break
            self.stop()
        else:
            raise RuntimeError("redis-server did not start")
        with self._admin() as r:
            info = r.info("server")
            # redis lowers maxclients itself when its file-descriptor limit is too low
            self.max_clients = int(r.config_get("maxclients")["maxclients"])
        self.version = f"redis-server {info['redis_version']}, redis-py {redis.__version__} (RedisStore)"
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def _ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with self._admin() as r:
                    if r.ping():
                        return True
            except redis.RedisError:
                time.sleep(0.05)
        return False

    def client(self) -> dist.Store:
        return RedisStore(self.url, "init-scale/", timeout=STORE_TIMEOUT)

    def stop(self) -> None:
        super().stop()
        self.dir.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: str, world: int) -> Server:
    if store == "redis":
        return RedisServer(max_clients=world + 64)  # + the admin connection and some slack
    return TCPServer(libuv=store == "tcp-libuv")


def close_client(client: dist.Store) -> None:
    if isinstance(client, RedisStore):
        client.close()


def connect(server: Server, world: int) -> tuple[list[dist.Store], float, str | None]:
    """(clients, seconds, why fewer): one connection per rank, or as many as the store accepts."""
    clients: list[dist.Store] = []
    refused = None
    t0 = time.perf_counter()
    try:
        for _ in range(world):
            clients.append(server.client())
    except Exception as e:  # noqa: BLE001 - any refusal: report it and go on with fewer connections
        refused = f"connection {len(clients) + 1} refused: {' '.join(str(e).split())[:160]}"
        if not clients:
            raise
    return clients, time.perf_counter() - t0, refused


# ---- the replay ----------------------------------------------------------------------------------------


class Replayer:
    """Performs steps' operations on the clients: rank r uses clients[r % len(clients)] (one each
    unless the store refused), with a lock per connection only where connections are shared."""

    def __init__(self, clients: list[dist.Store], world: int, pool: ThreadPoolExecutor, threads: int,
                 server_cpu: Callable[[], float]):
        self.clients = clients
        self.server_cpu = server_cpu  # the server process's CPU seconds so far
        self.shared = len(clients) < world
        self.locks = [threading.Lock() for _ in clients]
        self.last_add = [0] * world
        self.pool = pool
        self.threads = threads

    def _perform(self, work: list[tuple[int, list]], prefix: str) -> tuple[int, Counter]:
        n = 0
        sets: Counter = Counter()  # set_if_last keys actually set
        nc = len(self.clients)
        for rank, ops in work:
            store = self.clients[rank % nc]
            lock = self.locks[rank % nc] if self.shared else None
            for op in ops:
                if lock:
                    lock.acquire()
                try:
                    key = prefix + op.key
                    if op.op == "add":
                        self.last_add[rank] = store.add(key, op.amount)
                    elif op.op == "set":
                        store.set(key, VALUE)
                    elif op.op == "get":
                        store.get(key)
                    elif op.op == "wait":
                        store.wait([key])
                    elif op.op == "set_if_last":  # torch's barrier: the rank that counted everyone sets it
                        if self.last_add[rank] != op.count:
                            continue
                        store.set(key, b"1")
                        sets[op.key] += 1
                    else:
                        raise ValueError(f"unknown store operation {op.op!r}")
                finally:
                    if lock:
                        lock.release()
                n += 1
        return n, sets

    def run(self, step: Step, prefix: str) -> tuple[float, int, tuple[float, float, float]]:
        """(seconds, operations performed, (server, client, whole machine) CPU seconds) of one step;
        checks the operations against the generator's."""
        by_rank = list(step.rounds.items())  # merged per rank here, untimed
        n_rounds = max((len(rr) for _, rr in by_rank), default=0)
        rounds = []
        for i in range(n_rounds):  # each round's work, spread over the threads
            items = [(rank, rr[i]) for rank, rr in by_rank if i < len(rr) and rr[i]]
            rounds.append([items[t::self.threads] for t in range(min(self.threads, len(items)))])
        del by_rank
        performed = 0
        sets: Counter = Counter()
        cpu0 = self.server_cpu(), time.process_time(), machine_busy_seconds()
        t0 = time.perf_counter()
        for chunks in rounds:
            for n, s in self.pool.map(self._perform, chunks, itertools.repeat(prefix)):
                performed += n
                sets.update(s)
        seconds = time.perf_counter() - t0
        cpu = tuple(b - a for a, b in zip(cpu0, (self.server_cpu(), time.process_time(),
                                                 machine_busy_seconds()), strict=True))
        wanted = step.rounds.num_ops()[1]
        if set(sets) != wanted:
            raise AssertionError(f"{step.name}: no rank set {sorted(wanted - set(sets))[:3]}")
        performed -= sum(sets.values()) - len(sets)  # several ranks may set a barrier's key; count one
        if performed != step.num_ops:
            raise AssertionError(f"{step.name}: performed {performed} operations, the generator has "
                                 f"{step.num_ops}")
        return seconds, performed, cpu


def replay_case(plan: Plan, server: Server, replayer: Replayer, prefix: str) -> dict:
    """One (N, store, mode): replay the plan and extrapolate what it skips."""
    times, performed, cpu_server, cpu_client, cpu_machine = [], 0, 0.0, 0.0, 0.0
    group_rates = []  # seconds per operation of each replayed "global" group step
    for i, step in enumerate(plan.replay):
        seconds, n, (server_s, client_s, machine_s) = replayer.run(step, prefix)
        times.append(seconds)
        performed += n
        cpu_server += server_s
        cpu_client += client_s
        cpu_machine += machine_s
        if plan.mode == "global" and 1 <= i <= plan.group_steps - len(plan.skipped_ops):
            group_rates.append(seconds / n)
    if performed != plan.replay_ops:
        raise AssertionError(f"performed {performed} operations, the plan has {plan.replay_ops}")
    measured = sum(times)
    per_op = statistics.median(group_rates) if group_rates else 0.0
    extrapolated = per_op * sum(plan.skipped_ops)
    return {
        "ranks": plan.world, "store": server.name, "mode": plan.mode, "backend": plan.backend,
        "steps": plan.steps, "ops": plan.ops, "wall_s": measured + extrapolated,
        "replayed_steps": len(plan.replay), "replayed_ops": performed, "measured_s": measured,
        "ops_per_s": performed / measured if measured else 0.0,
        "extrapolated": plan.extrapolated, "extrapolated_steps": len(plan.skipped_ops),
        "extrapolated_s": extrapolated, "group_steps": plan.group_steps,
        "measured_group_steps": len(group_rates),
        "group_step_s_median": statistics.median(times[1:1 + len(group_rates)]) if group_rates else None,
        "server_cpu_s": cpu_server, "client_cpu_s": cpu_client,
        "server_util": cpu_server / measured if measured else 0.0,
        # the time a one-thread server needs for all the operations at the CPU cost per operation measured
        # here: where the client is the bottleneck, a floor the store could reach with faster clients
        "store_cpu_s": cpu_server / performed * plan.ops if performed else 0.0,
        "client_util": cpu_client / measured if measured else 0.0,
        # CPU the rest of the machine used meanwhile (other processes, the kernel's softirqs): where it is
        # high the figures are slowed by contention
        "other_util": max(0.0, cpu_machine - cpu_server - cpu_client) / measured if measured else 0.0,
    }  # fmt: skip


def bound(row: dict) -> str:
    """Which side limits the replay. The store servers serve from one thread and the client process is
    Python (one core for its GIL-held work): "both" when both are near a core (the machine's two cores
    are busy), else the busier side when it is past 60%, else "latency" (round trips and the
    round-by-round synchronisation)."""
    server, client = row["server_util"], row["client_util"]
    if server >= 0.8 and client >= 0.8:
        return "both"
    if max(server, client) >= 0.6:
        return "store" if server >= client else "client"
    return "latency"


# ---- the whole benchmark ------------------------------------------------------------------------------


def _quiet_reverse_dns() -> None:
    """See the module docstring: let c10d's first failed reverse lookup fail fast, so it stops asking."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def run_cases(meshes: Sequence[tuple[int, int, int]], stores: Sequence[str] = STORES,
              modes: Sequence[str] = ("global", "local"), backend: str = "nccl", threads: int = 32,
              max_steps: int = 5, log: Callable[[str], None] = print) -> list[dict]:
    """One row per (mesh, store, mode), meshes as (dp, pp, tp). Servers stop on return or error."""
    _quiet_reverse_dns()
    raise_fd_limit()
    rows = []
    for dp, pp, tp in meshes:
        world = dp * pp * tp
        kinds = list(mesh_group_kinds(dp, pp, tp).values())
        t0 = time.perf_counter()
        plans = {mode: make_plan(world, kinds, mode, backend, max_steps) for mode in modes}
        log(f"N={world} (dp{dp} pp{pp} tp{tp}): traffic generated in {time.perf_counter() - t0:.1f} s")
        for plan in plans.values():
            log("  " + describe_plan(plan))
        for store in stores:
            server = start_server(store, world)
            clients: list[dist.Store] = []
            try:
                clients, connect_s, refused = connect(server, world)
                log(f"  {store}: {len(clients)} connections in {connect_s:.2f} s"
                    + (f" (store refused more: {refused}; ranks share them round-robin)" if refused else ""))
                with ThreadPoolExecutor(threads, thread_name_prefix="rank-ops") as pool:
                    replayer = Replayer(clients, world, pool, threads, server.cpu_seconds)
                    for mode, plan in plans.items():
                        row = replay_case(plan, server, replayer, prefix=f"{mode}/")
                        row.update(mesh=f"dp{dp}xpp{pp}xtp{tp}", connections=len(clients),
                                   connect_s=connect_s, refused=refused, threads=threads,
                                   server_max_clients=server.max_clients, store_version=server.version)
                        row["bound"] = bound(row)
                        rows.append(row)
                        est = " (extrapolated)" if row["extrapolated"] else ""
                        log(f"    {mode}: {row['wall_s']:.2f} s{est}, {row['ops_per_s']:,.0f} ops/s")
            finally:
                for c in clients:
                    close_client(c)
                clients.clear()
                server.stop()
    return rows


def describe_plan(plan: Plan) -> str:
    what = f"{plan.mode}: {plan.steps} steps, {plan.ops:,} store ops"
    if not plan.extrapolated:
        return what + ", replayed in full"
    sizes = sorted(set(plan.group_step_ops))
    same = (f"all {plan.group_steps} group steps have {sizes[0]:,} ops (the world barrier, 3N+1), "
            "per the generator") if len(sizes) == 1 else (
        f"group steps differ, {sizes[0]:,} to {sizes[-1]:,} ops (the gloo bootstrap of each group)")
    measured = plan.group_steps - len(plan.skipped_ops)
    return (f"{what}; {same}; replays init + {measured} group steps + the {len(plan.replay) - 1 - measured} "
            f"after them ({plan.replay_ops:,} ops), extrapolates {len(plan.skipped_ops)}")


def environment(threads: int, backend: str) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [f"machine: {cores} cores ({model}), {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}, torch {torch.__version__}, redis-py {redis.__version__}",
            f"clients: this process, {threads} threads; RLIMIT_NOFILE {nofile};"
            f" backend {backend}; RES_OPTIONS={os.environ.get('RES_OPTIONS')!r}"]


def table(rows: list[dict]) -> list[str]:
    cols = [("ranks", 6), ("store", -11), ("mode", -7), ("steps", 6), ("replayed", 10), ("store ops", 13),
            ("wall s", 10), ("ops/s", 9), ("conns", 7), ("conn s", 8), ("srv CPU", 8), ("cli CPU", 8),
            ("oth CPU", 8), ("store s", 9), ("bound", -7)]
    hdr = " ".join(f"{name:>{w}}" if w > 0 else f"{name:<{-w}}" for name, w in cols)
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        replayed = f"{r['measured_group_steps']}/{r['group_steps']}*" if r["extrapolated"] else "all"
        cells = [r["ranks"], r["store"], r["mode"], r["steps"], replayed, f"{r['ops']:,}",
                 f"{r['wall_s']:.2f}", f"{r['ops_per_s']:,.0f}", r["connections"], f"{r['connect_s']:.2f}",
                 f"{r['server_util']:.0%}", f"{r['client_util']:.0%}", f"{r['other_util']:.0%}",
                 f"{r['store_cpu_s']:.2f}", r["bound"]]
        out.append(" ".join(f"{c!s:>{w}}" if w > 0 else f"{c!s:<{-w}}"
                            for c, (_, w) in zip(cells, cols, strict=True)))
    out += [
        "replayed n/m*: init, n of the m group steps and the steps after the groups measured; the other",
        "  group steps extrapolated from the median time per op of the n measured (wall s, ops include them)",
        "ops/s: of the measured steps. conn s: opening the connections, not in wall s.",
        "srv/cli/oth CPU: CPU seconds per wall second of the measured steps, of the server process, of this",
        "  process (all client threads) and of everything else on the machine; 100% = one core. Where oth",
        "  CPU is high, other work competed for the two cores and slowed the figures.",
        "store s: the server's CPU seconds per op times all ops, what a one-thread server needs at that",
        "  cost: the floor where the client is the bottleneck.",
        "bound: both (server and this process near one core each), else the busier side past 60% (store,",
        "  client), else latency",
        "",
    ]
    by = {(r["ranks"], r["store"], r["mode"]): r for r in rows}
    for (n, store, mode), r in by.items():
        ours = by.get((n, store, "local"))
        if mode == "global" and ours:
            est = " (naive extrapolated)" if r["extrapolated"] else ""
            out.append(f"N={n:<6} {store:<11} naive/ours: {r['wall_s'] / ours['wall_s']:8.1f}x time, "
                       f"{r['ops'] / ours['ops']:8.1f}x store ops{est}")
    return out


def parse_meshes(ranks: str | None, meshes: str | None) -> list[tuple[int, int, int]]:
    if meshes:
        out = []
        for m in meshes.split(","):
            parts = m.lower().replace("dp", "").replace("pp", "").replace("tp", "").split("x")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise SystemExit(f"--mesh: expected dpXppXtp such as dp32xpp8xtp8, got {m!r}")
            out.append(tuple(int(p) for p in parts))
        return out
    out = []
    for x in (ranks or ",".join(map(str, DEFAULT_RANKS))).split(","):
        if not x.strip().isdigit() or int(x) == 0 or int(x) % (DEFAULT_TP * DEFAULT_PP):
            raise SystemExit(f"--ranks: {x!r} is not a positive multiple of tp * pp = "
                             f"{DEFAULT_TP * DEFAULT_PP}")
        out.append((int(x) // (DEFAULT_TP * DEFAULT_PP), DEFAULT_PP, DEFAULT_TP))
    return out


def _choices(value: str, allowed: Iterable[str], flag: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: {','.join(bad) or 'nothing'} not among {','.join(allowed)}")
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", help=f"comma list of N (tp{DEFAULT_TP} pp{DEFAULT_PP} dp N/64); "
                                    f"default {','.join(map(str, DEFAULT_RANKS))}")
    ap.add_argument("--mesh", help="comma list of meshes dpXppXtp, e.g. dp32xpp8xtp8 (instead of --ranks)")
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--modes", default="global,local")
    ap.add_argument("--backend", default="nccl", choices=BACKENDS)
    ap.add_argument("--threads", type=int, default=32, help="client threads performing the operations")
    ap.add_argument("--max-steps", type=int, default=5, help="naive group steps replayed per case (>= 1)")
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args()
    if args.max_steps < 1 or args.threads < 1:
        raise SystemExit("--max-steps and --threads must be at least 1")
    meshes = parse_meshes(args.ranks, args.mesh)
    stores = _choices(args.stores, STORES, "--stores")
    modes = _choices(args.modes, MODES, "--modes")
    # Ctrl-C and SIGTERM end the run through the finally blocks that stop the servers
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    _quiet_reverse_dns()
    raise_fd_limit()
    t0 = time.perf_counter()
    for line in environment(args.threads, args.backend):
        print(line)
    try:
        rows = run_cases(meshes, stores, modes, args.backend, args.threads, args.max_steps,
                         log=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    if rows:
        print(f"store versions: {'; '.join(sorted({r['store_version'] for r in rows}))}")
    print()
    print("\n".join(table(rows)))
    print(f"\ntotal run time {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(args.threads, args.backend),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
