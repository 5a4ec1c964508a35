"""Real processes: time from process start to the first successful collective, naive vs ours.

    python benchmarks/init_processes.py                      # 8, 16, 32 gloo processes
    python benchmarks/init_processes.py --ranks 8 --stores tcp redis --repeats 3

Each case spawns N worker processes on this machine that start a job exactly as `megascale
train` does (`distributed.init`: the store, init_process_group, the mesh's groups, one
all-reduce per group) and report wall-clock timestamps. Meshes: 2 = tp2 (the smoke test),
8 = dp2 pp2 tp2, 16 = dp2 pp2 tp4, 32 = dp4 pp2 tp4.

On this machine importing torch dominates (N processes import it at once on 2 cores), and
ranks that finish importing early wait in init_process_group for the late ones. So the
figure that compares the ways of starting is measured from the moment the *last* rank has
finished importing to the moment the *last* rank has done its first collective ("start-up
after imports"); imports are reported separately. The Redis server is started by the script
on a loopback port.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MESHES = {2: (1, 1, 2), 8: (2, 2, 2), 16: (2, 2, 4), 32: (4, 2, 4)}  # 2: the smoke test's
ROOT = Path(__file__).resolve().parents[1]


def _worker() -> None:
    t_python = time.time()  # interpreter up; the import clock starts here
    import torch

    if os.environ["BENCH_STORE"].startswith("redis://"):
        import megascale.distributed.redis_store  # noqa: F401 - an import, counted as one
    from megascale.config import DistributedConfig, ParallelConfig
    from megascale.distributed.init import (
        create_mesh,
        first_collective,
        init_distributed,
        process_age_s,
        shutdown_distributed,
    )

    t_imported = time.time()
    torch.set_num_threads(1)
    dp, pp, tp = map(int, os.environ["BENCH_MESH"].split("x"))
    cfg = DistributedConfig(store=os.environ["BENCH_STORE"], group_init=os.environ["BENCH_MODE"],
                            timeout_s=300, job_id=os.environ["BENCH_JOB"])
    info = init_distributed(torch.device("cpu"), cfg)
    t_init = time.time()
    mesh = create_mesh(info, ParallelConfig(dp=dp, pp=pp, tp=tp), cfg)
    t_groups = time.time()
    first_collective(info, mesh, torch.device("cpu"))
    t_first = time.time()
    age = process_age_s() or 0.0
    stamps = {"started": time.time() - age, "python": t_python, "imported": t_imported, "init": t_init,
              "groups": t_groups, "first": t_first}
    print(json.dumps({"rank": info.rank, **stamps}), flush=True)
    shutdown_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(n: int, store: str, mode: str, job: str) -> dict:
    dp, pp, tp = MESHES[n]
    env = dict(os.environ, WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", BENCH_MESH=f"{dp}x{pp}x{tp}", BENCH_STORE=store, BENCH_MODE=mode,
               BENCH_JOB=job, PYTHONPATH=str(ROOT))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    spawned = time.time()
    cmd = [sys.executable, __file__, "--worker"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(n)]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"a worker failed ({n} ranks, {store}, {mode}):\n{err[-2000:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    last = {k: max(r[k] for r in rows) for k in ("imported", "init", "groups", "first")}
    return {
        "ranks": n, "mesh": f"dp{dp} pp{pp} tp{tp}", "store": store, "mode": mode,
        "imports_s": statistics.median(r["imported"] - r["started"] for r in rows),
        "last_import_s": last["imported"] - spawned,
        "startup_after_imports_s": last["first"] - last["imported"],
        "init_s": last["init"] - last["imported"],
        "groups_s": last["groups"] - last["init"],
        "first_collective_s": last["first"] - last["groups"],
        "spawn_to_first_collective_s": last["first"] - spawned,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32], choices=sorted(MESHES))
    ap.add_argument("--stores", nargs="+", default=["tcp", "tcp-legacy", "redis"])
    ap.add_argument("--modes", nargs="+", default=["global", "local"])
    ap.add_argument("--repeats", type=int, default=1, help="runs per case; the median is reported")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.worker:
        return _worker()

    from init_scale import RedisServer  # the scale benchmark's loopback redis-server

    redis_server = RedisServer(max_clients=1000) if "redis" in args.stores else None
    redis_url = redis_server.url if redis_server else ""
    results = []
    try:
        print(f"{os.cpu_count()} cores; times in seconds; 'after imports' = last import done -> last rank's "
              f"first collective done; median of {args.repeats}")
        print(f"{'ranks':>5} {'mesh':<14} {'store':<11} {'mode':<7} {'imports':>8} {'after imports':>14} "
              f"{'(init':>7} {'groups':>7} {'first)':>7} {'spawn->first':>13}")
        for n in args.ranks:
            for store in args.stores:
                for mode in args.modes:
                    spec = redis_url if store == "redis" else store
                    runs = [run_case(n, spec, mode, f"bench-{n}-{mode}-{i}-{time.time_ns()}")
                            for i in range(args.repeats)]
                    row = {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v)
                           for k, v in runs[0].items()}
                    row["store"] = store
                    results.append(row)
                    print(f"{n:>5} {row['mesh']:<14} {store:<11} {mode:<7} {row['imports_s']:>8.2f} "
                          f"{row['startup_after_imports_s']:>14.3f} {row['init_s']:>7.3f} "
                          f"{row['groups_s']:>7.3f} {row['first_collective_s']:>7.3f} "
                          f"{row['spawn_to_first_collective_s']:>13.2f}",
                          flush=True)
        print("\nnaive (global) / ours (local), start-up after imports:")
        for n in args.ranks:
            for store in args.stores:
                by = {r["mode"]: r for r in results if r["ranks"] == n and r["store"] == store}
                if {"global", "local"} <= by.keys():
                    naive, ours = (by[m]["startup_after_imports_s"] for m in ("global", "local"))
                    ratio = naive / max(ours, 1e-9)
                    print(f"  {n:>3} ranks, {store:<11}: {ratio:.2f}x")
    finally:
        if redis_server is not None:
            redis_server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
