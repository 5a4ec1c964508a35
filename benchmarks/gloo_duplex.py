"""What parallel.direct_collectives buys on gloo over a slow link (megascale/distributed/direct.py),
and why its exchanges post their receives first.

Two hosts (network namespaces, megascale/fault/netns.py) joined by `tc tbf` links (default
1000 Mbit/s each way); every figure is the median over `--repeats` of one exchange between them,
both ranks starting together after a barrier (the swaps: four back to back, per swap):

  swap, receive first     each rank posts irecv() of S bytes, then isend()s S (direct.py's order)
  swap, send first        isend() first, then irecv(): as a blocking pipeline schedule does
  raw TCP                 S bytes each way over one socket, both directions at once: what the link gives
  all-gather, gloo        dist.all_gather_single, S bytes per rank
  all-gather, direct      direct.start_all_gather
  reduce-scatter, gloo    dist.reduce_scatter_single of 2 S bytes (S to each rank)
  reduce-scatter, direct  direct.start_reduce_scatter

and the link's floor, S / rate. gloo's pair sends a message only once the peer has said it is ready
to receive; posted send-first, a rank's "ready" can queue behind its own payload, and the two
directions run one after the other (12 MiB: 2x the floor, receive-first 1.05x).

    sudo .venv/bin/python benchmarks/gloo_duplex.py [--mib 12] [--mbit 1000] [--repeats 5]

Needs root (namespaces, tc); where they cannot be made it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ("swap, receive first", "swap, send first", "raw TCP", "all-gather, gloo", "all-gather, direct",
         "reduce-scatter, gloo", "reduce-scatter, direct")


def timed(repeats: int, fn, burst: int = 1) -> float:
    """Median seconds of fn() over the repeats, each repeat `burst` calls back to back started on
    both ranks after a barrier (seconds per call)."""
    import torch.distributed as dist

    times = []
    fn()  # connections made, buffers touched
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append((time.perf_counter() - t0) / burst)
    return statistics.median(times)


def raw_tcp(rank: int, peer_addr: str, port: int, nbytes: int, repeats: int) -> float:
    """S bytes each way over one TCP connection, a thread receiving while the main one sends."""
    import torch.distributed as dist

    if rank == 0:
        listener = socket.create_server(("0.0.0.0", port))
        dist.barrier()
        sock, _ = listener.accept()
        listener.close()
    else:
        dist.barrier()
        sock = socket.create_connection((peer_addr, port))
    payload, times = bytes(nbytes), []

    def receive():
        view, got = bytearray(1 << 20), 0
        while got < nbytes:
            got += sock.recv_into(view, min(len(view), nbytes - got))

    with sock:
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            th = threading.Thread(target=receive)
            th.start()
            sock.sendall(payload)
            th.join()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from megascale.distributed import direct

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.group.WORLD
    peer, n = 1 - rank, int(a.mib * (1 << 20)) // 4
    send, recv = torch.ones(n), torch.empty(n)
    full, own = torch.empty(2 * n), torch.ones(n)
    grads, shard = torch.ones(2 * n), torch.empty(n)

    def swap(send_first: bool):
        if send_first:
            works = [dist.isend(send, peer, tag=0), dist.irecv(recv, peer, tag=0)]
        else:
            works = [dist.irecv(recv, peer, tag=0), dist.isend(send, peer, tag=0)]
        for w in works:
            w.wait()

    out = {
        "swap, receive first": timed(a.repeats, lambda: swap(False), burst=4),
        "swap, send first": timed(a.repeats, lambda: swap(True), burst=4),
        "raw TCP": raw_tcp(rank, os.environ["MASTER_ADDR"], a.port + 1, 4 * n, a.repeats),
        "all-gather, gloo": timed(a.repeats, lambda: dist.all_gather_single(full, own)),
        "all-gather, direct": timed(a.repeats, lambda: direct.start_all_gather(full, own, world).wait()),
        "reduce-scatter, gloo": timed(a.repeats, lambda: dist.reduce_scatter_single(shard, grads)),
        "reduce-scatter, direct": timed(a.repeats, lambda: direct.start_reduce_scatter(
            shard, grads, world).wait()),
    }
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=12.0, help="S: MiB each rank sends per exchange")
    p.add_argument("--mbit", type=float, default=1000.0, help="each host's link, tc tbf")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=29530)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0

    from megascale.fault import netns

    ok, why = netns.available(shaping=True)
    if not ok:
        print(f"gloo_duplex: skipped, {why}")
        return 0
    nbytes = int(a.mib * (1 << 20))
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", f"--mib={a.mib}",
            f"--repeats={a.repeats}", f"--port={a.port}"]
    with netns.SimCluster(2, mbit=a.mbit) as cluster:
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": cluster.addr(0), "MASTER_PORT": str(a.port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs = [cluster.popen(r, argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [q.communicate(timeout=600)[0] for q in procs]
    for q, text in zip(procs, outs, strict=True):
        if q.returncode:
            raise RuntimeError(f"gloo_duplex: a rank exited {q.returncode}:\n{text[-3000:]}")
    result = json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    floor = nbytes / (a.mbit * 1e6 / 8)
    print(f"2 hosts, {a.mbit:.0f} Mbit/s tbf links; {a.mib:g} MiB each way per exchange; medians of "
          f"{a.repeats}; the link's floor {floor * 1e3:.1f} ms")
    for case in CASES:
        t = result[case]
        print(f"{case:24} {t * 1e3:8.1f} ms  x{t / floor:5.2f} the floor  "
              f"{nbytes / t * 8 / 1e6:6.0f} Mbit/s each way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
