"""What parallel.transport = "sockets" buys over gloo's point-to-point messages on CPU
(megascale/distributed/sockets.py): CPU and wall time per exchange, and what an exchange in the
background costs the compute beside it.

Two ranks on this machine (loopback), one thread each for compute. For each message size S and each
transport, medians over `--repeats` bursts of `--burst` exchanges back to back:

  swap        each rank posts a receive of S bytes and sends S (direct.py's order), then waits
  all-gather  direct.start_all_gather of S bytes per rank, as DP and TP/SP run it
  all-reduce  a sum of S bytes: gloo's own all_reduce, or on sockets direct.all_reduce (a direct
              reduce-scatter and all-gather over the transport), as TP without SP, the tp gradient
              syncs, the loss and the grad norm run it
  cpu         the process's CPU-seconds per all-gather (every thread: gloo's or ours)
  stolen      a block of GEMMs timed alone and with `--burst` all-gathers in flight behind it
              (issued before, waited after): how much longer the compute took, per all-gather
              (what an overlap pays on cores the communication shares)
  issue       of which the issuing thread's own CPU per all-gather (time.thread_time around the
              start calls: posting the receive, writing the send, which for a local peer runs the
              kernel's whole delivery path): what an overlap pays on its compute thread itself
  one         one all-gather at a time beside one GEMM (issued, the GEMM, waited; `--burst` times), as
              the tp overlap runs its collectives: how much longer each GEMM + all-gather took than
              the GEMM alone. A burst shares its hand-offs between messages; one at a time pays
              them all (on a 2-core VM a reader thread woken per message cost 70-140 us of it at
              64-256 KiB, before small receives were read by their own wait, distributed/sockets.py)

    .venv/bin/python benchmarks/transport.py [--kib 4 64 256 1024] [--repeats 7] [--burst 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRANSPORTS = ("gloo", "sockets")


def _per_call(burst: int, fn) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of `burst` calls back to back, both ranks starting together."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(burst):
        fn()
    return (time.perf_counter() - t0) / burst, (time.process_time() - c0) / burst


def measure(world: int, a: argparse.Namespace) -> dict:
    """Rank 0's medians {(KiB, transport): {figure: seconds}}. The transports take turns within every
    repeat (the order alternating), so the machine's drift falls on both alike."""
    import torch
    import torch.distributed as dist

    from megascale.distributed import direct, p2p

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    groups = {"gloo": dist.new_group([0, 1]), "sockets": dist.new_group([0, 1])}
    p2p.use_sockets((groups["sockets"],))
    a_mat = torch.randn(a.gemm, a.gemm)

    def gemms():
        for _ in range(8):
            torch.mm(a_mat, a_mat)

    out: dict = {}
    for kib in a.kib:
        n = kib * 1024 // 4
        send, recv = torch.ones(n), torch.empty(n)
        full, own = torch.empty(2 * n), torch.ones(n)
        inboxes = [torch.empty(2 * n) for _ in range(a.burst)]

        def swap(g, send=send, recv=recv):
            works = [p2p.irecv(recv, peer, g), p2p.isend(send, peer, g)]
            for w in works:
                w.wait()

        def gather(g, full=full, own=own):
            direct.start_all_gather(full, own, g).wait()

        def reduce(g, name, buf=send):
            if name == "sockets":
                direct.all_reduce(buf, g)
            else:
                dist.all_reduce(buf, group=g)

        def beside(g, issue: bool, own=own, inboxes=inboxes) -> tuple[float, float]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            ex = [direct.start_all_gather(inboxes[i], own, g, tag=i) for i in range(a.burst)] if issue else []
            issued = (time.thread_time() - c0) / a.burst
            gemms()
            t = time.perf_counter() - t0
            for e in ex:
                e.wait()
            return t, issued

        def one_at_a_time(g, issue: bool, own=own, full=full) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.burst):
                ex = direct.start_all_gather(full, own, g) if issue else None
                torch.mm(a_mat, a_mat)
                if ex is not None:
                    ex.wait()
            return (time.perf_counter() - t0) / a.burst

        got: dict[str, dict[str, list[float]]] = {t: {} for t in TRANSPORTS}
        for g in groups.values():  # connections made, buffers touched
            swap(g), gather(g), beside(g, True)
            reduce(g, "sockets" if g is groups["sockets"] else "gloo")
        for r in range(a.repeats):
            for name in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                g, rec = groups[name], got[name]
                rec.setdefault("swap", []).append(_per_call(a.burst, lambda g=g: swap(g))[0])
                wall, cpu = _per_call(a.burst, lambda g=g: gather(g))
                rec.setdefault("all-gather", []).append(wall)
                rec.setdefault("cpu", []).append(cpu)
                summed, _ = _per_call(a.burst, lambda g=g, n=name: reduce(g, n))
                rec.setdefault("all-reduce", []).append(summed)
                (alone, _), (with_comm, issued) = beside(g, False), beside(g, True)
                rec.setdefault("stolen", []).append((with_comm - alone) / a.burst)
                rec.setdefault("issue", []).append(issued)
                rec.setdefault("one", []).append(one_at_a_time(g, True) - one_at_a_time(g, False))
        for name in TRANSPORTS:
            out[(kib, name)] = {k: statistics.median(v) for k, v in got[name].items()}
    p2p.close()
    return out if rank == 0 else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kib", type=int, nargs="+", default=[4, 64, 256, 1024], help="S: KiB per rank")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--burst", type=int, default=20)
    p.add_argument("--gemm", type=int, default=384, help="the compute block: 8 GEMMs of this square size")
    a = p.parse_args()

    from benchmarks._gloo import run_on_gloo

    got = run_on_gloo(2, measure, a)[0]
    print(f"2 ranks on loopback, one compute thread each; medians of {a.repeats} bursts of {a.burst}")
    print(f"{'KiB':>6} {'transport':9} {'swap us':>9} {'all-gather us':>14} {'cpu us':>8} {'stolen us':>10} "
          f"{'issue us':>9} {'all-reduce us':>14} {'one us':>7}")
    for kib in a.kib:
        for name in TRANSPORTS:
            r = got[(kib, name)]
            print(f"{kib:6d} {name:9} {r['swap'] * 1e6:9.0f} {r['all-gather'] * 1e6:14.0f} "
                  f"{r['cpu'] * 1e6:8.0f} {r['stolen'] * 1e6:10.0f} {r['issue'] * 1e6:9.0f} "
                  f"{r['all-reduce'] * 1e6:14.0f} {r['one'] * 1e6:7.0f}")
        g, s = got[(kib, "gloo")], got[(kib, "sockets")]
        print(f"{kib:6d} {'ratio':9} {g['swap'] / s['swap']:9.2f} {g['all-gather'] / s['all-gather']:14.2f} "
              f"{g['cpu'] / s['cpu']:8.2f} {g['stolen'] / max(s['stolen'], 1e-9):10.2f} "
              f"{g['issue'] / max(s['issue'], 1e-9):9.2f} {g['all-reduce'] / s['all-reduce']:14.2f} "
              f"{g['one'] / max(s['one'], 1e-9):7.2f}  (gloo / sockets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
