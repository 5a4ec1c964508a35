"""A simulated cluster on this machine: N hosts as network namespaces on a bridge (needs root).

    python benchmarks/cluster.py up --hosts 2 [--mbit 1000] [--store tcp|redis]
        build it, print the namespaces and addresses, wait for Ctrl-C / SIGTERM, tear it down
    python benchmarks/cluster.py list               the clusters on this machine and their owners
    python benchmarks/cluster.py down [--prefix P] [--all]
        remove clusters whose owner is gone (a crashed run's); --all: live ones too
    python benchmarks/cluster.py selftest [--mbit 20]
        build a 2-host cluster, check isolation, reachability, a link fault and shaping, tear down

While it is up, run things on a host with `ip netns exec <namespace> <command>`; their traffic
to another host goes to that host's 198.18 address. See megascale/fault/netns.py for the layout.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale.fault import netns  # noqa: E402

_STOP = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _require(shaping: bool) -> None:
    ok, why = netns.available(shaping=shaping)
    if not ok:
        sys.exit(f"cluster: {why}")


def cmd_up(args: argparse.Namespace) -> int:
    _require(args.mbit is not None)
    # Blocked before the cluster exists, so a Ctrl-C while it is built still ends in the teardown below.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
    with netns.SimCluster(args.hosts, mbit=args.mbit, burst_kb=args.burst_kb, name=args.name,
                           mtu=args.mtu) as c:
        print(c.describe())
        if args.store != "none":
            print(f"store: {c.start_store(args.store)}")
        print(f"run on a host:  ip netns exec {c.ns(0)} <command>   (GLOO_SOCKET_IFNAME={netns.IFNAME}; "
              f"MASTER_ADDR={c.addr(0)} or h0)")
        print("Ctrl-C or SIGTERM tears it down.", flush=True)
        sig = signal.sigwait(_STOP)
        print(f"{signal.Signals(sig).name}: tearing down {c.id}", flush=True)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    clusters = netns.list_clusters()
    for c in clusters:
        subnet = f"{netns.SUBNET}.{c['subnet']}.0/24" if c["subnet"] is not None else "?"
        owner = f"owner pid {c['owner_pid']} ({'running' if c['owner_alive'] else 'gone'})" if c["marked"] \
            else "no mark"
        print(f"{c['id']}  {subnet:<17} {owner}  {' '.join(c['namespaces'])}")
    if not clusters:
        print("no clusters")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _require(False)
    done = netns.cleanup_leftovers(prefix=args.prefix, include_live=args.all)
    print(f"removed: {', '.join(done)}" if done else "nothing to remove")
    return 0


def _check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def cmd_selftest(args: argparse.Namespace) -> int:
    _require(True)
    results, port = [], 5000
    with netns.SimCluster(2) as c:
        print(c.describe())
        c.listen(0, port)
        for h, addr, want in ((0, "127.0.0.1", "ok"), (1, c.addr(0), "ok"), (1, "127.0.0.1", "ECONNREFUSED")):
            got = c.probe(h, addr, port)
            results.append(_check(f"h{h} -> {addr}:{port}", got == want, f"{got} (want {want})"))
        c.link_down(1)
        got = c.probe(1, c.addr(0), port)
        results.append(_check("h1 -> h0 with h1's link down", got != "ok", got))
        c.link_up(1)
        got = c.probe(1, c.addr(0), port)
        results.append(_check("h1 -> h0 with the link back up", got == "ok", got))
        nbytes = int(args.mbit * 1e6 / 8)  # one second's worth at the shaped rate
        fast = c.measure_transfer(1, 0, nbytes)
        for h in range(c.hosts):
            c.shape(h, args.mbit)
        slow = c.measure_transfer(1, 0, nbytes)
        rate = nbytes * 8 / slow / 1e6
        detail = f"unshaped {fast:.3f} s, at {args.mbit:g} Mbit/s {slow:.3f} s ({rate:.1f} Mbit/s)"
        ok = 0.5 * args.mbit < rate < 1.2 * args.mbit
        results.append(_check(f"{nbytes / 1e6:.2f} MB h1 -> h0", ok, detail))
        cid = c.id
    left = [ns for ns in netns.namespaces() if ns.startswith(cid + "-")]
    results.append(_check("teardown", not left, f"{left or 'no namespace left'}"))
    return 0 if all(results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a cluster and keep it until Ctrl-C / SIGTERM")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--mbit", type=float, default=None, help="limit every link to this many Mbit/s each way")
    up.add_argument("--burst-kb", type=float, default=None, help="tbf burst (default: 1 ms at the rate)")
    up.add_argument("--mtu", type=int, default=None, help="every link's MTU (default 1500)")
    up.add_argument("--store", choices=["none", "tcp", "redis"], default="none",
                    help="start a TCPStore or redis-server on h0's address")
    up.add_argument("--name", default=None, help="the cluster id (namespace prefix); default ms + 6 hex")
    sub.add_parser("list", help="list the clusters on this machine")
    down = sub.add_parser("down", help="remove leftover clusters")
    down.add_argument("--prefix", default=netns.PREFIX, help="only clusters whose id starts so")
    down.add_argument("--all", action="store_true", help="also clusters whose owner is still running")
    st = sub.add_parser("selftest", help="a quick check of a 2-host cluster")
    st.add_argument("--mbit", type=float, default=20.0)
    args = ap.parse_args()
    return {"up": cmd_up, "list": cmd_list, "down": cmd_down, "selftest": cmd_selftest}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
