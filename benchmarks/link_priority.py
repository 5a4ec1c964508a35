"""What marking a connection's priority buys on a busy simulated link: a small message's round trip
while a bulk flow fills the same link, unmarked and marked (parallel.transport_priority).

On a 2-host SimCluster (megascale/fault/netns.py: tbf links, pfifo_fast's priority bands under
them) host 1 sends a bulk flow to host 0 on one connection and, on another, `--kib` KiB messages
that host 0 answers with one byte, one at a time (an activation and the pipeline waiting for it);
the bulk connection is a dp bucket on the wire. Three ways: no bulk flow (the link idle), the bulk
flow with both connections unmarked (one FIFO: the message waits behind the flow's backlog), and
the message's connection marked interactive, the flow's bulk (SO_PRIORITY 6 and 2, as
distributed/p2p.py prioritise marks the pipeline's and tp's peers and the dp peers). Medians and
90th percentiles over `--messages` round trips, each way in one run.

    sudo .venv/bin/python benchmarks/link_priority.py [--mbit 1000] [--kib 128] [--messages 40]

Needs root (namespaces, tc); where they cannot be made it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# host 0: accepts the bulk connection (drained) and the message connection (each message answered)
SERVER = r"""
import socket, sys, threading
addr, size = sys.argv[1], int(sys.argv[2])
bulk_srv, msg_srv = socket.create_server((addr, 5001)), socket.create_server((addr, 5002))
print("ready", flush=True)
def drain():
    bulk, _ = bulk_srv.accept()
    buf = bytearray(1 << 20)
    while bulk.recv_into(buf):
        pass
threading.Thread(target=drain, daemon=True).start()
conn, _ = msg_srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(size))
while True:
    got = 0
    while got < size:
        n = conn.recv_into(buf[got:])
        if not n:
            sys.exit(0)
        got += n
    conn.sendall(b"x")
"""

# host 1: the bulk flow (unless its priority is "none") and the timed messages; prints the round trips
CLIENT = r"""
import json, socket, sys, threading, time
addr, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
msg_prio, bulk_prio = sys.argv[4], sys.argv[5]
if bulk_prio != "none":
    bulk = socket.create_connection((addr, 5001))
    bulk.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, int(bulk_prio))
    def flood():
        data = bytes(4 << 20)
        try:
            while True:
                bulk.sendall(data)
        except OSError:
            pass
    threading.Thread(target=flood, daemon=True).start()
    time.sleep(0.3)  # the flow's backlog built up
conn = socket.create_connection((addr, 5002))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, int(msg_prio))
msg, rtts = bytes(size), []
for _ in range(count):
    t0 = time.perf_counter()
    conn.sendall(msg)
    conn.recv(1)
    rtts.append(time.perf_counter() - t0)
    time.sleep(0.01)
print("RTT " + json.dumps(rtts), flush=True)
"""

WAYS = (("link idle", "0", "none"), ("unmarked", "0", "0"), ("marked", "6", "2"))


def round_trips(cluster, size: int, count: int, msg_prio: str, bulk_prio: str) -> list[float]:
    server = cluster.popen(0, [sys.executable, "-c", SERVER, cluster.addr(0), str(size)],
                           stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("link_priority: the server on host 0 did not start")
        out = cluster.run(1, [sys.executable, "-c", CLIENT, cluster.addr(0), str(size), str(count), msg_prio,
                              bulk_prio], timeout=120, check=True).stdout
    finally:
        server.kill()
        server.wait(timeout=30)
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RTT "))[4:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbit", type=float, default=1000.0, help="each host's link, tc tbf")
    p.add_argument("--kib", type=int, default=128, help="the timed message (the default: an activation "
                   "of the overlap benchmark's pipeline, 2 x 128 tokens x 256 floats)")
    p.add_argument("--messages", type=int, default=40)
    a = p.parse_args()

    from megascale.fault import netns

    ok, why = netns.available(shaping=True)
    if not ok:
        print(f"link_priority: skipped, {why}")
        return 0
    print(f"a {a.kib} KiB message and its 1-byte answer, {a.messages} times, on a {a.mbit:g} Mbit/s link "
          f"(tc tbf, MTU 65520) beside a bulk flow; round trip in ms")
    with netns.SimCluster(2, mbit=a.mbit, mtu=65520) as cluster:
        for name, msg_prio, bulk_prio in WAYS:
            t0 = time.perf_counter()
            rtts = sorted(round_trips(cluster, a.kib * 1024, a.messages, msg_prio, bulk_prio))
            print(f"{name:10} median {statistics.median(rtts) * 1e3:7.2f}  p90 "
                  f"{rtts[int(0.9 * (len(rtts) - 1))] * 1e3:7.2f}   ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
