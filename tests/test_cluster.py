"""The simulated cluster (megascale.fault.netns): hosts as network namespaces on a bridge.

Every byte these tests send goes to loopback or to an address the cluster assigned inside its
own namespaces (198.18.S.x); every cluster is closed by a finalizer or a `with`, and every wait
is bounded. They need root; elsewhere they skip, saying why.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cluster import (  # noqa: F401 - the fixture is found by its name, sim_cluster
    alive,
    make_cluster,
    own_namespaces,
    require_netns,
    sim_cluster_fixture,
    wait_dead,
    wait_stopped,
)

from megascale.fault import netns

PY = sys.executable
PORT = 5000
SLEEP = [PY, "-c", "import time; time.sleep(60)"]
# Starts a grandchild in a session of its own, prints its pid and exits: only the namespace finds it then.
ESCAPE = [PY, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
          "time.sleep(60)'], start_new_session=True); print(p.pid, flush=True)"]

ECHO_CLIENT = r"""
import os, socket, sys
payload = os.urandom(100_000)
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as c:
    c.sendall(payload)
    c.shutdown(socket.SHUT_WR)
    back = b""
    while chunk := c.recv(1 << 16):
        back += chunk
print("echoed" if back == payload else f"got {len(back)} bytes back, not the same", len(payload))
"""

GLOO_RANK = r"""
import datetime, os, torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["N"])
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
x = torch.full((n,), float(rank + 1))
dist.all_reduce(x)
print(rank, x.min().item(), x.max().item(), flush=True)
dist.destroy_process_group()
"""

STORE_CLIENT = r"""
import datetime, sys
import torch.distributed as dist
host, port = sys.argv[1].removeprefix("tcp://").split(":")
s = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=20))
s.set("from-h1", "hello")
print(s.get("from-h1").decode())
"""

REDIS_CLIENT = r"""
import sys, redis
r = redis.Redis.from_url(sys.argv[1], socket_timeout=10, socket_connect_timeout=10)
r.set("from-h1", "hello")
print(r.get("from-h1").decode())
"""


def _root_network() -> tuple[str, str]:
    """The machine's own interfaces and routes: a cluster must leave them as they are."""
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, timeout=10).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=10).stdout
    return links, routes


def _first_line(p: subprocess.Popen, timeout: float = 20.0) -> str:
    line = netns.read_line(p, timeout).strip()
    assert line, f"no output from {p.args} in {timeout}s"
    return line


def test_hosts_talk_over_the_bridge_and_have_their_own_loopback(request):
    require_netns()
    before = _root_network()
    c = make_cluster(request, hosts=2)
    assert _root_network() == before  # nothing was added to the machine's own namespace
    bench = ipaddress.ip_network("198.18.0.0/15")
    assert all(ipaddress.ip_address(c.addr(h)) in bench for h in range(2)) and c.addr(0) != c.addr(1)
    # Host 1 has lo and one link, and a route to the cluster's /24 only: no way off the island.
    addrs = json.loads(c.run(1, ["ip", "-j", "addr"], timeout=10, check=True).stdout)
    assert {(a["ifname"], i["local"]) for a in addrs for i in a.get("addr_info", [])} == \
        {("lo", "127.0.0.1"), (netns.IFNAME, c.addr(1))}
    routes = json.loads(c.run(1, ["ip", "-j", "route"], timeout=10, check=True).stdout)
    assert [r["dst"] for r in routes] == [f"{netns.SUBNET}.{c.subnet}.0/24"]
    # Nothing is sent on the links that a process did not send (no IPv6 discovery, no IGMP).
    assert all(c.link_stats(h)["tx_packets"] == c.link_stats(h)["rx_packets"] == 0 for h in range(2))

    c.listen(0, PORT)  # on 0.0.0.0: host 0's 198.18 address and its loopback
    out = c.run(1, [PY, "-c", ECHO_CLIENT, c.addr(0), str(PORT)], timeout=30, check=True).stdout
    assert out.split() == ["echoed", "100000"]
    assert c.probe(0, "127.0.0.1", PORT) == "ok"
    assert c.probe(1, "127.0.0.1", PORT) == "ECONNREFUSED"  # host 1's loopback is its own
    assert c.link_stats(1)["tx_bytes"] > 100_000


NBYTES = 2_500_000  # 1 s at 20 Mbit/s


def test_tbf_limits_the_bandwidth_of_each_link_both_ways(request):
    require_netns(shaping=True)
    fast = make_cluster(request, hosts=2).measure_transfer(1, 0, NBYTES)
    shaped = make_cluster(request, hosts=2, mbit=20)
    up = shaped.measure_transfer(1, 0, NBYTES)  # host 1's veth shapes it
    down = shaped.measure_transfer(0, 1, NBYTES)  # and here host 1's switch port
    print(f"{NBYTES / 1e6} MB: unshaped {fast:.3f} s, at 20 Mbit/s h1->h0 {up:.3f} s, h0->h1 {down:.3f} s")
    assert up > 0.5 and down > 0.5
    assert up > 3 * fast and down > 3 * fast
    # what waits for the rate waits by priority (pfifo_fast's bands under tbf), on both ends of the link
    for ns, dev in ((shaped.ns(1), netns.IFNAME), (shaped.switch, "port1")):
        qdiscs = json.loads(subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], check=True,
                                           capture_output=True, text=True).stdout)
        kinds = {(q["kind"], q.get("parent", "root")) for q in qdiscs}
        assert {("tbf", "root"), ("pfifo_fast", "1:1")} <= kinds, qdiscs


# Host 1 sends one UDP datagram of N bytes to host 0 with "don't fragment" set: it leaves whole or
# not at all (EMSGSIZE: larger than the link's MTU); host 0 says whether it arrived, and its size.
DATAGRAM = r"""
import socket, sys
kind, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if kind == "recv":
    s.bind((addr, 5001)); s.settimeout(20); print("ready", flush=True)
    print(len(s.recv(1 << 16)), flush=True)
else:
    s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO: never fragment
    try:
        s.sendto(bytes(n), (addr, 5001)); print("sent")
    except OSError as e:
        print("EMSGSIZE" if e.errno == 90 else e)
"""


@pytest.mark.parametrize("mtu", [None, 9000], ids=["default", "jumbo"])
def test_mtu_sets_every_link_of_the_path(request, mtu):
    """mtu= reaches both ends of every veth: an 8000-byte datagram crosses the bridge unfragmented
    with 9000 and is refused with the default 1500."""
    c = make_cluster(request, hosts=2, mbit=1000, mtu=mtu)
    for h in range(2):
        link = json.loads(c.run(h, ["ip", "-j", "link", "show", netns.IFNAME], timeout=10, check=True).stdout)
        assert link[0]["mtu"] == (mtu or 1500)
    recv = c.popen(0, [PY, "-c", DATAGRAM, "recv", c.addr(0), "0"], stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "ready"
    sent = c.run(1, [PY, "-c", DATAGRAM, "send", c.addr(0), "8000"], timeout=30, check=True).stdout.strip()
    if mtu:
        assert sent == "sent"
        assert recv.stdout.readline().strip() == "8000"
    else:
        assert sent == "EMSGSIZE"
        recv.kill()
    recv.wait(timeout=30)
    with pytest.raises(ValueError, match="mtu must be"):
        netns.SimCluster(2, mtu=70000)
    if mtu:
        with pytest.raises(ValueError, match="below one packet"):
            c.shape(0, 1000, burst_kb=4)  # a bucket in which tbf would drop every 9000-byte packet


@pytest.mark.parametrize("ifname", [True, False], ids=["GLOO_SOCKET_IFNAME", "hostname"])
def test_gloo_all_reduce_across_two_hosts(sim_cluster, ifname):
    """2 hosts x 2 ranks. Without GLOO_SOCKET_IFNAME gloo binds what the hostname resolves to:
    the cluster's hosts file makes that the host's own 198.18 address, as on a real machine."""
    c, n, world = sim_cluster, 1 << 18, 4
    sent = c.link_stats(1)["tx_bytes"]
    env = {"WORLD_SIZE": str(world), "N": str(n), "INIT": f"tcp://{c.addr(0)}:29500",
           "GLOO_SOCKET_IFNAME": netns.IFNAME if ifname else None, "OMP_NUM_THREADS": "1"}
    procs = [c.popen(rank // 2, [PY, "-c", GLOO_RANK], env={**env, "RANK": str(rank)},
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        results.append(out.split())
    total = float(sum(range(1, world + 1)))
    assert results == [[str(r), str(total), str(total)] for r in range(world)]
    # Host 1's ranks sent their share to host 0 over the veth (n floats of 4 bytes each).
    assert c.link_stats(1)["tx_bytes"] - sent > n * 4 // 2


def test_link_down_cuts_a_host_off_and_link_up_restores_it(sim_cluster):
    c = sim_cluster
    c.listen(0, PORT)
    assert c.probe(1, c.addr(0), PORT) == "ok"
    c.link_down(1)
    t = time.monotonic()
    assert c.probe(1, c.addr(0), PORT, timeout=2.0) in ("ENETUNREACH", "EHOSTUNREACH", "ETIMEDOUT")
    assert time.monotonic() - t < 20  # bounded by the probe's timeout (plus starting python)
    c.link_up(1)
    assert c.probe(1, c.addr(0), PORT) == "ok"


def _start_victims(c: netns.SimCluster) -> list[int]:
    """A sleeper and a SIGSTOP'd process on host 0, a sleeper and an escaped grandchild on host 1."""
    sleeper0, stopped0, sleeper1 = c.popen(0, SLEEP), c.popen(0, SLEEP), c.popen(1, SLEEP)
    stopped0.send_signal(signal.SIGSTOP)
    assert wait_stopped(stopped0.pid)
    escaper = c.popen(1, ESCAPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(_first_line(escaper))
    escaper.wait(timeout=20)
    assert alive(grandchild) and grandchild in c.pids(1)
    return [sleeper0.pid, stopped0.pid, sleeper1.pid, grandchild]


def test_close_after_an_exception_removes_everything(request):
    require_netns()
    with pytest.raises(RuntimeError, match="the test failed"):
        with netns.SimCluster(2) as c:
            request.addfinalizer(c.close)  # if an assert below fails first
            pids = _start_victims(c)
            names = own_namespaces(c.id)
            assert len(names) == 3
            raise RuntimeError("the test failed")
    assert own_namespaces(c.id) == []
    assert wait_dead(pids) == []
    assert not any((netns.NETNS_ETC / ns).exists() for ns in names)
    assert not netns.workdir(c.id).exists()
    c.close()  # again: a no-op
    with pytest.raises(RuntimeError, match="closed"):
        c.popen(0, SLEEP)


# Builds a cluster with a sleeper in it, prints the cluster id, the sleeper and the watchdog, and waits.
CRASHING_OWNER = r"""
import sys, time
from megascale.fault import netns
c = netns.SimCluster(2)
p = c.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
print(c.id, p.pid, c._watchdog.pid, flush=True)
time.sleep(60)
"""


def _crashing_owner(request) -> tuple[subprocess.Popen, str, int, int]:
    owner = subprocess.Popen([PY, "-c", CRASHING_OWNER], stdout=subprocess.PIPE, text=True)
    request.addfinalizer(lambda: (owner.kill(), owner.wait()))
    line = _first_line(owner, timeout=30).split()
    cid = line[0]
    request.addfinalizer(lambda: netns.cleanup_leftovers(prefix=cid, include_live=True))
    return owner, cid, int(line[1]), int(line[2])


def _wait_gone(cid: str, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := own_namespaces(cid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_killed_owner_is_cleaned_up_by_its_watchdog(request):
    require_netns()
    owner, cid, sleeper, _ = _crashing_owner(request)
    assert len(own_namespaces(cid)) == 3
    owner.kill()  # no atexit, no finalizer: as after pytest-timeout's os._exit
    owner.wait(timeout=10)
    assert _wait_gone(cid) == []
    assert wait_dead([sleeper]) == []


def test_cleanup_leftovers_removes_a_dead_owners_cluster_only(request, sim_cluster):
    owner, cid, sleeper, watchdog = _crashing_owner(request)
    subprocess.run(["kill", "-KILL", str(watchdog)], timeout=10)  # no watchdog either: a hard crash
    assert wait_dead([watchdog]) == []
    assert netns.cleanup_leftovers(prefix=cid) == []  # its owner still runs: not a leftover
    owner.kill()
    owner.wait(timeout=10)
    assert len(own_namespaces(cid)) == 3 and alive(sleeper)
    assert cid in netns.cleanup_leftovers()
    assert own_namespaces(cid) == [] and wait_dead([sleeper]) == []
    assert len(own_namespaces(sim_cluster.id)) == 3  # the running one is left alone


def test_kill_host_kills_everything_in_that_namespace_only(sim_cluster):
    c = sim_cluster
    pids = _start_victims(c)
    on_h0 = [p for p in pids if p not in c.pids(1)]
    assert len(on_h0) == 2
    c.kill_host(1)
    assert wait_dead([p for p in pids if p not in on_h0]) == [] and c.pids(1) == []
    assert all(alive(p) for p in on_h0)
    c.kill_host(0, signal.SIGSTOP)  # a hung host
    assert all(wait_stopped(p) for p in on_h0)
    c.kill_host(0)
    assert wait_dead(on_h0) == [] and c.pids(0) == []


def test_a_tcpstore_on_host_0_serves_host_1(sim_cluster):
    c = sim_cluster
    url = c.start_store("tcp")
    assert url == f"tcp://{c.addr(0)}:29400"
    out = c.run(1, [PY, "-c", STORE_CLIENT, url], timeout=60, check=True).stdout
    assert out.strip() == "hello"


def test_a_redis_on_host_0_serves_host_1(sim_cluster):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    c = sim_cluster
    url = c.start_store("redis")
    assert url == f"redis://{c.addr(0)}:6379/0"
    out = c.run(1, [PY, "-c", REDIS_CLIENT, url], timeout=60, check=True).stdout
    assert out.strip() == "hello"
    assert Path(netns.workdir(c.id)).is_dir()  # its --dir: removed with the cluster
