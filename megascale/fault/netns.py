"""A simulated cluster on one machine: N "hosts" as Linux network namespaces on a bridge.

    with SimCluster(hosts=2, mbit=1000) as c:
        store = c.start_store("tcp")                        # tcp://198.18.S.1:29400, reachable from all
        p = c.popen(1, [sys.executable, "worker.py"], env={"MASTER_ADDR": c.addr(0)})
        c.link_down(1); ...; c.link_up(1)                   # fault injection
        c.kill_host(1)                                      # every process of host 1

Layout. One "switch" namespace holds a Linux bridge; every host namespace has lo and one veth
(`simnet0`, address 198.18.S.(h+1)/24) whose peer (`port<h>`) sits on that bridge. The bridge
lives in its own namespace, not in the machine's, so nothing is ever added to the machine's own
network namespace: its interfaces, routes and firewall stay untouched (a bridge or veth there
would be seen by NetworkManager, docker's iptables rules, br_netfilter...). The veths are created
inside the switch namespace with their host end placed straight into the host namespace, so they
never appear in the machine's namespace even for a moment.

Addresses. 198.18.0.0/15 is reserved for benchmarking (RFC 2544) and routed on no real network.
Each cluster takes one /24, 198.18.S.0/24, with S random among those no live cluster uses. Two
clusters are separate L2 islands anyway (no route between them), so a race on S is harmless.
A host namespace has no default route: an address other than loopback and its cluster's /24 is
unreachable (ENETUNREACH, no packet leaves). IPv6 is off in the namespaces and the bridge does
no multicast snooping, so the links carry no neighbour discovery, MLD or IGMP: an idle cluster
sends nothing, a busy one only what its processes send (and the ARP for their peers).
Processes inside a host reach only THAT namespace's 127.0.0.1; a server meant for all hosts
(TCPStore, Redis) must listen on a host's 198.18 address: `start_store` does that.

Names. Each host namespace gets a hosts file (`ip netns exec` bind-mounts /etc/netns/<ns>/hosts
over /etc/hosts): h0..hN-1 resolve to the island's addresses and the machine's hostname (shared:
namespaces do not change it) to the host's own. Gloo without GLOO_SOCKET_IFNAME binds what the
hostname resolves to; with the machine's /etc/hosts that is a loopback address, which the other
hosts cannot reach (each has its own loopback): init fails, "connection refused". With ours
it binds the host's 198.18 address, as on a real machine. An nsswitch.conf beside it answers
host lookups from that file only, so no DNS query is attempted (TCPStore reverse-resolves each
client; towards the machine's DNS server that would fail at once anyway, for want of a route).

MTU. 1500 unless `mtu=` says otherwise (both ends of every veth). The bytes a link carries cost
the machine's CPU per packet too (the bridge's forwarding, TCP's ACKs, every two segments), CPU that a
real NIC spends in hardware: `mtu=65520` (loopback's size) sends the same bytes in ~40x fewer packets.

Links. `mbit=` limits each host's link each way with tbf (on its veth, out, and on its switch
port, in). What waits for the rate waits in pfifo_fast's three bands by the packets' priority, a
socket's SO_PRIORITY (6 before 0 before 2), not in one FIFO: a NIC serves its queues side by side,
and in one FIFO a small message sent while megabytes are queued waits behind all of them (a 64 KiB
message behind a bulk flow at 200 Mbit/s: 12 ms in one FIFO, 1.7 ms marked ahead of it, the bulk
flow marked behind). The socket transport marks its connections (distributed/p2p.py prioritise).

Processes. `popen` runs `ip netns exec <ns> argv` in a session of its own and returns once the
process is inside the namespace (before that it would escape `kill_host`).

Teardown. `close()` SIGKILLs every process in the cluster's namespaces (stopped ones too; found
by their /proc/<pid>/ns/net, so children that left their session are found as well), deletes the
namespaces (which deletes the veths and the bridge) and their files. It is idempotent and runs
at exit. If the owner dies without running it (SIGKILL, os._exit after a pytest timeout), a
watchdog process, which waits on a pipe from the owner, sees the pipe close and does it.
`cleanup_leftovers()` removes whatever a crashed run still left.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUBNET = "198.18"  # + ".S.h": the benchmarking range, on no real network
IFNAME = "simnet0"  # a host's interface: a name the machine itself has not, so a slip fails loudly
BRIDGE = "br0"
ALIAS = "megascale-simcluster"  # the bridge's ifalias: marks a switch namespace as ours, names its owner
PREFIX = "ms"
_ID_RE = re.compile(r"^[a-z][a-z0-9]{1,11}$")
_DEFAULT_ID_RE = re.compile(r"^ms[0-9a-f]{6}$")  # what SimCluster names a cluster when not told
_NS_RE = re.compile(r"^([a-z][a-z0-9]{1,11})-(sw|h\d+)$")
_TBF_LATENCY_MS = 100  # how long a packet may queue in tbf: sets its queue length
_MAX_HOSTS = 250  # .1 .. .250 of the /24
_MTU, _MIN_MTU, _MAX_MTU = 1500, 1280, 65535  # Ethernet's default; IPv4 needs far less; veth's limit
_KILL_ROUNDS = 20  # kill passes: a process that forks as it dies is caught on a later pass
_GONE_S = 10.0  # how long to wait for killed processes to disappear
_YOUNG_S = 30.0  # a switch namespace without its mark this young may be one being built now
NETNS_ETC = Path("/etc/netns")


# -- running ip and tc ---------------------------------------------------------------------------

def _cmd(argv: list[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip() or p.returncode}")
    return p


def _ip(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip [-n ns] args`: every command names its namespace, none acts on the machine's own."""
    return _cmd(["ip", *(["-n", ns] if ns else []), *args], check=check)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cmd(["tc", "-n", ns, *args], check=check)


def _no_ipv6(ns: str) -> None:
    """Turn IPv6 off in a namespace, so its links carry no neighbour discovery or MLD, only our traffic.

    A shell in the namespace writes the sysctls (/proc/sys/net is per namespace); `sysctl` itself
    is missing from slim images.
    """
    conf = "/proc/sys/net/ipv6/conf"
    script = f"[ -d {conf} ] || exit 0; for c in default all; do echo 1 > {conf}/$c/disable_ipv6; done"
    _cmd(["ip", "netns", "exec", ns, "sh", "-c", script])


def namespaces() -> list[str]:
    """The machine's named network namespaces (`ip netns list`)."""
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _new_id() -> str:
    return PREFIX + secrets.token_hex(3)


# -- can we? -------------------------------------------------------------------------------------

_available: dict[bool, tuple[bool, str]] = {}


def available(shaping: bool = False) -> tuple[bool, str]:
    """(True, "") if this process can build a SimCluster (and shape it with tbf), else (False, why)."""
    if shaping not in _available:
        _available[shaping] = _probe(shaping)
    return _available[shaping]


def _probe(shaping: bool) -> tuple[bool, str]:
    if sys.platform != "linux":
        return False, "network namespaces are Linux only"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    for tool in ["ip"] + (["tc"] if shaping else []):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    ns = f"{_new_id()}-sw"  # our pattern, so a probe killed half-way is cleaned up like a cluster
    try:
        _cmd(["ip", "netns", "add", ns])
        _ip(ns, "link", "add", BRIDGE, "type", "bridge")
        _ip(ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        if shaping:
            _tc(ns, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit", "burst", "32kb",
                "latency", "50ms")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot build a network namespace with a bridge and veths here: {e}"
    finally:
        _cmd(["ip", "netns", "del", ns], check=False)
    return True, ""


# -- finding and killing the processes of a namespace ---------------------------------------------

def _ns_key(ns: str) -> tuple[int, int] | None:
    """(device, inode) of a named namespace: what /proc/<pid>/ns/net of its processes stat to."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in(keys: set[tuple[int, int]]) -> list[int]:
    """Processes whose network namespace is one of `keys` (what `ip netns pids` does, for many at once)."""
    me, out = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:  # gone, or a zombie (it has left its namespace already)
            continue
        if (st.st_dev, st.st_ino) in keys:
            out.append(int(entry.name))
    return out


def _signal_if_in(pid: int, keys: set[tuple[int, int]], sig: int) -> bool:
    """Signal pid if it is still in one of `keys`: through a pidfd, so a reused pid is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
        if (st.st_dev, st.st_ino) not in keys:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _signal_all(keys: set[tuple[int, int]], sig: int) -> int:
    return sum(_signal_if_in(pid, keys, sig) for pid in _pids_in(keys))


def _kill_all(keys: set[tuple[int, int]], wait_s: float = _GONE_S) -> list[int]:
    """SIGKILL every process in `keys` (SIGKILL ends stopped ones too) until none is left; the survivors."""
    deadline = time.monotonic() + wait_s
    for _ in range(_KILL_ROUNDS):
        if not _signal_all(keys, signal.SIGKILL) and not _pids_in(keys):
            return []
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    while time.monotonic() < deadline and _pids_in(keys):  # killed, exiting: give the kernel time
        time.sleep(0.05)
    return _pids_in(keys)


# -- whose is a namespace? -----------------------------------------------------------------------

def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with the pid, names one process for ever."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _mark(meta: dict[str, str]) -> str:
    return " ".join([ALIAS, *(f"{k}={v}" for k, v in meta.items())])


def _read_mark(sw_ns: str) -> dict[str, str] | None:
    """The mark on a switch namespace's bridge ({"pid":..., "start":..., "subnet":...}); None if not ours."""
    p = _ip(sw_ns, "-j", "link", "show", BRIDGE, check=False)
    try:
        alias = json.loads(p.stdout)[0].get("ifalias", "") if p.returncode == 0 else ""
    except (ValueError, IndexError, AttributeError):
        alias = ""
    if not alias.startswith(ALIAS + " "):
        return None
    return dict(kv.split("=", 1) for kv in alias.split()[1:] if "=" in kv)


def _owner_alive(meta: dict[str, str]) -> bool:
    try:
        return _start_time(int(meta["pid"])) == int(meta["start"])
    except (KeyError, ValueError):
        return False


def _clusters() -> dict[str, list[str]]:
    """{cluster id: its namespaces} for every namespace named like ours."""
    out: dict[str, list[str]] = {}
    for ns in namespaces():
        m = _NS_RE.match(ns)
        if m:
            out.setdefault(m.group(1), []).append(ns)
    return out


def list_clusters() -> list[dict]:
    """Every cluster named like ours: id, namespaces, subnet byte, owner pid and whether it still runs."""
    out = []
    for cid, names in sorted(_clusters().items()):
        meta = _read_mark(f"{cid}-sw") if f"{cid}-sw" in names else None
        out.append({"id": cid, "namespaces": sorted(names), "marked": meta is not None,
                    "subnet": int(meta["subnet"]) if meta and meta.get("subnet", "").isdigit() else None,
                    "owner_pid": int(meta["pid"]) if meta and meta.get("pid", "").isdigit() else None,
                    "owner_alive": bool(meta) and _owner_alive(meta)})
    return out


def _used_subnets() -> set[int]:
    return {c["subnet"] for c in list_clusters() if c["subnet"] is not None}


def _is_leftover(cid: str, names: list[str], include_live: bool) -> bool:
    """Whether `cid`'s namespaces are a SimCluster's nobody will tear down (include_live: any of ours)."""
    sw = f"{cid}-sw"
    if sw not in names:  # hosts without their switch: a teardown cut short (the switch goes last)
        return bool(_DEFAULT_ID_RE.match(cid))
    meta = _read_mark(sw)
    if meta is None:  # unmarked: ours only if named like ours and not being built right now
        try:
            young = time.time() - os.stat(f"/run/netns/{sw}").st_mtime < _YOUNG_S
        except OSError:
            young = False
        return bool(_DEFAULT_ID_RE.match(cid)) and not young
    return include_live or not _owner_alive(meta)


# -- teardown ------------------------------------------------------------------------------------

def workdir(cid: str) -> Path:
    """Where a cluster keeps its logs and store files."""
    return Path(tempfile.gettempdir()) / f"megascale-{cid}"


def teardown(cid: str) -> list[str]:
    """Kill everything in cluster `cid`'s namespaces and delete them and their files; what is left."""
    names = _clusters().get(cid, [])
    keys = {k for k in map(_ns_key, names) if k}
    survivors = _kill_all(keys)
    for ns in sorted(names, key=lambda n: n.endswith("-sw")):  # hosts first: a switch means "ours"
        _cmd(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only if no one else has files there
    except OSError:
        pass
    shutil.rmtree(workdir(cid), ignore_errors=True)
    left = [ns for ns in namespaces() if ns in names]
    return left + [f"pid {p}" for p in survivors]


def cleanup_leftovers(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Tear down the clusters named `prefix...` whose owner is gone (include_live: all); their ids.

    Only namespaces named exactly like ours (`<id>-sw`, `<id>-h<n>`) are considered, and a cluster
    whose switch lacks our mark is left alone unless it has a default name (`ms` + 6 hex digits).
    """
    done = []
    for cid, names in _clusters().items():
        if cid.startswith(prefix) and _is_leftover(cid, names, include_live):
            left = teardown(cid)
            if left:
                raise RuntimeError(f"cluster {cid}: could not remove {', '.join(left)}")
            done.append(cid)
    return done


def _watch(cid: str) -> None:
    """The watchdog: block until the owner's pipe closes (close() or the owner's death), then tear down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the owner; we follow it
    try:
        sys.stdin.buffer.read()
    finally:
        teardown(cid)


# -- the cluster ---------------------------------------------------------------------------------

class SimCluster:
    """N hosts (network namespaces) on one bridge, optionally with tbf-shaped links; see the module doc."""

    def __init__(self, hosts: int, mbit: float | None = None, burst_kb: float | None = None,
                 name: str | None = None, mtu: int | None = None):
        if not 1 <= hosts <= _MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{_MAX_HOSTS}, got {hosts}")
        if name is not None and not _ID_RE.match(name):
            raise ValueError(f"name must match {_ID_RE.pattern} (it prefixes namespace names), got {name!r}")
        if mtu is not None and not _MIN_MTU <= mtu <= _MAX_MTU:
            raise ValueError(f"mtu must be {_MIN_MTU}..{_MAX_MTU}, got {mtu}")
        self.hosts, self.mbit, self.mtu = hosts, mbit, mtu or _MTU
        self.id = name or _new_id()
        if any(ns.startswith(self.id + "-") for ns in namespaces()):
            raise RuntimeError(f"namespaces named {self.id}-* exist already (`ip netns list`)")
        self.subnet = self._pick_subnet()
        self.procs: list[tuple[int, subprocess.Popen]] = []  # every process started, with its host
        self.stores: dict[str, subprocess.Popen] = {}  # url -> the store server start_store started
        self._lock = threading.RLock()  # close() may be re-entered from a signal handler: reentrant
        self._closed = False
        self._watchdog: subprocess.Popen | None = None
        atexit.register(self.close)
        try:
            self._build(burst_kb)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _pick_subnet() -> int:
        free = sorted(set(range(256)) - _used_subnets())
        if not free:
            raise RuntimeError("all 256 subnets 198.18.0-255.0/24 are taken by live clusters")
        return random.choice(free)

    # -- naming

    def ns(self, h: int) -> str:
        """Host h's namespace name."""
        self._check_host(h)
        return f"{self.id}-h{h}"

    @property
    def switch(self) -> str:
        return f"{self.id}-sw"

    def addr(self, h: int) -> str:
        """Host h's address: 198.18.S.(h+1)."""
        self._check_host(h)
        return f"{SUBNET}.{self.subnet}.{h + 1}"

    def ifname(self, h: int) -> str:
        """Host h's interface (GLOO_SOCKET_IFNAME); the same name in every host, as on real machines."""
        self._check_host(h)
        return IFNAME

    def _check_host(self, h: int) -> None:
        if not 0 <= h < self.hosts:
            raise IndexError(f"host {h} of a {self.hosts}-host cluster")

    def describe(self) -> str:
        rows = [f"cluster {self.id}: {self.hosts} hosts on {SUBNET}.{self.subnet}.0/24, switch namespace "
                f"{self.switch}" + (f", links shaped to {self.mbit:g} Mbit/s each way" if self.mbit else "")]
        rows += [f"  h{h}  {self.ns(h):<16} {self.addr(h):<16} dev {IFNAME}" for h in range(self.hosts)]
        return "\n".join(rows)

    # -- building

    def _build(self, burst_kb: float | None) -> None:
        self._make_switch()
        self._start_watchdog()
        for h in range(self.hosts):
            self._make_host(h)
        if self.mbit:
            for h in range(self.hosts):
                self.shape(h, self.mbit, burst_kb)

    def _make_switch(self) -> None:
        sw = self.switch
        _cmd(["ip", "netns", "add", sw])
        # Without snooping the bridge joins no multicast group itself, so it sends no IGMP reports.
        _ip(sw, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0")
        me = os.getpid()
        meta = {"pid": me, "start": _start_time(me), "subnet": self.subnet, "hosts": self.hosts}
        _ip(sw, "link", "set", BRIDGE, "alias", _mark(meta))
        _no_ipv6(sw)
        _ip(sw, "link", "set", BRIDGE, "up")

    def _start_watchdog(self) -> None:
        # Its own session: the terminal's Ctrl-C and a killpg of the owner's group do not reach it.
        self._watchdog = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--watch", self.id],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          start_new_session=True)

    def _make_host(self, h: int) -> None:
        ns, sw, port = self.ns(h), self.switch, f"port{h}"
        _cmd(["ip", "netns", "add", ns])
        self._write_etc(h)
        _no_ipv6(ns)  # before the veth exists: it takes the namespace's default
        _ip(ns, "link", "set", "lo", "up")
        # The MTU on both ends (a veth's peer does not inherit it); the bridge forwards by its ports' MTU.
        mtu = ["mtu", str(self.mtu)]
        _ip(sw, "link", "add", port, *mtu, "type", "veth", "peer", "name", IFNAME, "netns", ns, *mtu)
        _ip(sw, "link", "set", port, "master", BRIDGE)
        _ip(sw, "link", "set", port, "up")
        _ip(ns, "addr", "add", f"{self.addr(h)}/24", "dev", IFNAME)
        _ip(ns, "link", "set", IFNAME, "up")

    def _write_etc(self, h: int) -> None:
        """/etc/netns/<ns>/{hosts,nsswitch.conf}: the island's names, looked up in that file only."""
        d = NETNS_ETC / self.ns(h)
        for _ in range(3):  # another cluster's teardown may remove an empty /etc/netns meanwhile
            try:
                d.mkdir(parents=True, exist_ok=True)
                lines = ["127.0.0.1 localhost", f"{self.addr(h)} {socket.gethostname()}"]
                lines += [f"{self.addr(i)} h{i} {self.ns(i)}" for i in range(self.hosts)]
                (d / "hosts").write_text("\n".join(lines) + "\n")
                nss = Path("/etc/nsswitch.conf")
                if nss.exists():
                    text = re.sub(r"(?m)^hosts:.*$", "hosts: files", nss.read_text())
                    (d / "nsswitch.conf").write_text(text)
                return
            except FileNotFoundError:
                continue
            except OSError:
                return  # a read-only /etc: the island still works, names just resolve as on the machine

    # -- links

    def shape(self, h: int, mbit: float, burst_kb: float | None = None) -> None:
        """Limit host h's link to `mbit` Mbit/s each way: tbf on its veth (out) and the switch port (in)."""
        # 1 ms at the rate, at least 128 KiB: a whole 64 KiB GSO packet must fit in the bucket, or tbf
        # segments every GSO packet into MTU-size ones in software. With 32 KiB that cost a 12 MB
        # all-reduce at 500 Mbit/s 140 ms of system CPU per rank (a core's half, taken from the
        # computation an overlap runs beside it); with 128 KiB, 5 ms.
        if burst_kb is None:
            burst_kb = max(128.0, mbit * 1e6 / 8 / 1000 / 1024)
        if burst_kb * 1024 < self.mtu:  # tbf drops a packet its bucket cannot hold
            raise ValueError(f"burst_kb {burst_kb:g} is below one packet of the MTU, {self.mtu} bytes")
        args = ["root", "handle", "1:", "tbf", "rate", f"{mbit:g}mbit", "burst", f"{burst_kb:g}kb",
                "latency", f"{_TBF_LATENCY_MS}ms"]
        for ns, dev in ((self.ns(h), IFNAME), (self.switch, f"port{h}")):
            _tc(ns, "qdisc", "replace", "dev", dev, *args)
            # what waits for the rate waits by priority, not in one FIFO (the module doc's "Links")
            _tc(ns, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "pfifo_fast")

    def unshape(self, h: int) -> None:
        """Remove host h's bandwidth limit."""
        _tc(self.ns(h), "qdisc", "del", "dev", IFNAME, "root", check=False)
        _tc(self.switch, "qdisc", "del", "dev", f"port{h}", "root", check=False)

    def link_down(self, h: int) -> None:
        """Take host h's interface down inside its namespace: its route goes, connects fail at once."""
        _ip(self.ns(h), "link", "set", IFNAME, "down")

    def link_up(self, h: int) -> None:
        """Bring it back; the kernel restores the /24 route from the address."""
        _ip(self.ns(h), "link", "set", IFNAME, "up")

    def link_stats(self, h: int) -> dict[str, int]:
        """Bytes and packets host h's interface has sent and received."""
        base = f"/sys/class/net/{IFNAME}/statistics"
        names = ["rx_bytes", "tx_bytes", "rx_packets", "tx_packets"]
        p = _cmd(["ip", "netns", "exec", self.ns(h), "cat", *(f"{base}/{n}" for n in names)])
        return dict(zip(names, map(int, p.stdout.split()), strict=True))

    # -- processes

    def popen(self, h: int, argv: list[str], env: dict[str, str | None] | None = None,
              **kw) -> subprocess.Popen:
        """Start argv in host h (`ip netns exec`), in its own session so it can be killed as a group.

        env is laid over this process's environment (PATH, the venv... carry over); a None value
        removes that variable.
        """
        if self._closed:
            raise RuntimeError(f"cluster {self.id} is closed")
        kw["start_new_session"] = True
        full_env = None
        if env is not None:
            full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(h), *argv], env=full_env, **kw)
        self.procs.append((h, p))  # `ip netns exec` execs argv: p.pid is argv's own pid
        self._wait_entered(h, p)
        return p

    def _wait_entered(self, h: int, p: subprocess.Popen, timeout: float = 10.0) -> None:
        """Return once p is in host h's namespace, so that kill_host and pids() see it from now on.

        Until `ip netns exec` has called setns, p sits in the machine's namespace, where a
        signal for "every process of host h" would miss it.
        """
        key, deadline = _ns_key(self.ns(h)), time.monotonic() + timeout
        while p.poll() is None:
            try:
                st = os.stat(f"/proc/{p.pid}/ns/net")
                if (st.st_dev, st.st_ino) == key:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                _killpg(p)
                raise RuntimeError(f"{_argv_str(p)} did not enter {self.ns(h)} in {timeout}s")
            time.sleep(0.001)

    def run(self, h: int, argv: list[str], timeout: float, env: dict[str, str | None] | None = None,
            input: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run argv in host h to completion (output captured as text); killed, and raised, past timeout."""
        p = self.popen(h, argv, env=env, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p)
            p.communicate()
            raise
        done = subprocess.CompletedProcess(argv, p.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def pids(self, h: int) -> list[int]:
        """Every process in host h's namespace."""
        key = _ns_key(self.ns(h))
        return _pids_in({key}) if key else []

    def kill_host(self, h: int, sig: int = signal.SIGKILL) -> int:
        """Signal every process in host h's namespace (SIGSTOP: a hung host); with SIGKILL wait until gone.

        Returns how many processes were signalled.
        """
        key = _ns_key(self.ns(h))
        if key is None:
            return 0
        n = _signal_all({key}, sig)
        if sig == signal.SIGKILL:
            n += len(_kill_all({key}))  # stragglers forked meanwhile
            self._reap(host=h)
        return n

    def _reap(self, host: int | None = None, timeout: float = 5.0) -> None:
        """wait() for our own children (killed already) so they leave no zombies."""
        for h, p in self.procs:
            if host is None or h == host:
                try:
                    p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass

    # -- stores

    def start_store(self, kind: str = "tcp", host: int = 0, port: int | None = None,
                    timeout: float = 60.0) -> str:
        """Start a TCPStore ("tcp") or redis-server ("redis") on host's 198.18 address; its URL.

        Listening on that address (not 127.0.0.1, which is only the host's own) makes it
        reachable from every host. Returns once it accepts connections.
        """
        addr, wd = self.addr(host), workdir(self.id)
        wd.mkdir(parents=True, exist_ok=True)
        if kind == "tcp":
            port = port or 29400
            argv = [sys.executable, "-c", _TCPSTORE_SERVER, addr, str(port)]
            url, ready = f"tcp://{addr}:{port}", "ready"
        elif kind == "redis":
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("redis-server is not installed")
            port = port or 6379
            argv = [exe, "--bind", addr, "--port", str(port), "--save", "", "--appendonly", "no",
                    "--protected-mode", "no", "--dir", str(wd), "--daemonize", "no"]
            url, ready = f"redis://{addr}:{port}/0", "Ready to accept connections"
        else:
            raise ValueError(f"store kind must be tcp or redis, got {kind!r}")
        log = wd / f"store-{kind}-h{host}-{port}-{time.time_ns()}.log"  # a restarted store: a new log
        with open(log, "wb") as f:
            p = self.popen(host, argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        _wait_for_text(p, log, ready, timeout)
        self.stores[url] = p
        return url

    def stop_store(self, url: str) -> None:
        """Kill the store start_store returned `url` for (SIGKILL: a crash, its keys are gone)."""
        p = self.stores.pop(url)
        _killpg(p)
        p.wait(timeout=10)

    # -- probing and measuring

    def listen(self, h: int, port: int, bind: str = "0.0.0.0", timeout: float = 60.0) -> subprocess.Popen:
        """An echo server in host h on bind:port (0.0.0.0: its 198.18 address and its own 127.0.0.1).

        It echoes each connection until EOF, and exits after 100 connections or `timeout` s without one.
        Returns once it listens.
        """
        p = self.popen(h, [sys.executable, "-c", _ECHO, bind, str(port), str(timeout)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if read_line(p, timeout).strip() != "ready":
            _killpg(p)
            raise RuntimeError(f"the echo server on host {h} did not start")
        return p

    def probe(self, h: int, addr: str, port: int, timeout: float = 2.0) -> str:
        """Try a TCP connect from host h: "ok", or the errno name (ECONNREFUSED, ENETUNREACH, ETIMEDOUT)."""
        argv = [sys.executable, "-c", _PROBE, addr, str(port), str(timeout)]
        return self.run(h, argv, timeout=timeout + 30, check=True).stdout.strip()


    def measure_transfer(self, src: int, dst: int, nbytes: int, port: int = 5001,
                         timeout: float = 60.0) -> float:
        """Seconds to send nbytes over TCP from host src to host dst (until dst has read them all)."""
        sink = self.popen(dst, [sys.executable, "-c", _SINK, self.addr(dst), str(port), str(nbytes),
                                str(timeout)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        try:
            if read_line(sink, timeout).strip() != "ready":
                raise RuntimeError(f"the receiver on host {dst} did not start")
            out = self.run(src, [sys.executable, "-c", _SEND, self.addr(dst), str(port), str(nbytes),
                                 str(timeout)], timeout=timeout + 5, check=True).stdout.split()
        finally:
            _killpg(sink)
            sink.wait(timeout=5)
        if int(out[1]) != nbytes:
            raise RuntimeError(f"host {dst} received {out[1]} of {nbytes} bytes")
        return float(out[0])

    # -- teardown

    def close(self) -> None:
        """Kill every process of the cluster, delete its namespaces. Idempotent; fine in atexit, handlers."""
        with self._lock:
            if self._closed:
                return
            for _, p in self.procs:  # whole sessions first: the bulk, cheaply
                _killpg(p)
            left = teardown(self.id)
            self._reap()
            if self._watchdog is not None:  # it tears down again (finds nothing) and exits
                self._watchdog.stdin.close()
                try:
                    self._watchdog.wait(timeout=_GONE_S)
                except subprocess.TimeoutExpired:
                    self._watchdog.kill()
                    self._watchdog.wait()
            if left:
                raise RuntimeError(f"cluster {self.id}: could not remove {', '.join(left)}")
            self._closed = True
            atexit.unregister(self.close)

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SimCluster({self.id}, hosts={self.hosts}, subnet={SUBNET}.{self.subnet}.0/24)"


def _killpg(p: subprocess.Popen) -> None:
    """SIGKILL p's session, only while p is unreaped (so its id cannot have been reused)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass


def _argv_str(p: subprocess.Popen) -> str:
    return " ".join(map(str, p.args))[:200]


def read_line(p: subprocess.Popen, timeout: float) -> str:
    """One line of p's stdout (a pipe), or "" if none comes within timeout or p ends first."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if ready else ""


def _wait_for_text(p: subprocess.Popen, log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if p.poll() is not None:
            break
        time.sleep(0.05)
    _killpg(p)
    raise RuntimeError(f"{' '.join(map(str, p.args[4:6]))}: not ready in {timeout}s "
                       f"(exit {p.poll()}); its log: {log.read_text(errors='replace')[-2000:]}")


# Scripts run inside the hosts (sys.executable -c). Every wait in them has a timeout.
_TCPSTORE_SERVER = r"""
import datetime, signal, sys
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("ready", flush=True)
signal.pause()  # serves until the cluster kills it
"""

_ECHO = r"""
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(float(sys.argv[3]))
print("ready", flush=True)
for _ in range(100):
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        break
    with conn:
        conn.settimeout(float(sys.argv[3]))
        while chunk := conn.recv(1 << 16):
            conn.sendall(chunk)
"""

_PROBE = r"""
import errno, socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except TimeoutError:
    print("ETIMEDOUT")
except OSError as e:
    print(errno.errorcode.get(e.errno, str(e)))
"""

_SINK = r"""
import socket, sys
host, port, n, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
srv = socket.create_server((host, port))
srv.settimeout(t)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(t)
got = 0
while got < n and (chunk := conn.recv(1 << 16)):
    got += len(chunk)
conn.sendall(got.to_bytes(8, "big"))
"""

_SEND = r"""
import socket, sys, time
host, port, n, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
payload = bytes(n)
start = time.monotonic()
with socket.create_connection((host, port), timeout=t) as c:
    c.sendall(payload)
    ack = b""
    while len(ack) < 8 and (chunk := c.recv(8 - len(ack))):
        ack += chunk
print(time.monotonic() - start, int.from_bytes(ack, "big"))
"""


if __name__ == "__main__" and sys.argv[1:2] == ["--watch"]:
    _watch(sys.argv[2])
