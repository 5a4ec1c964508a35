"""Simulated clusters (megascale.fault.netns) for tests: N hosts as network namespaces on a bridge.

A test module imports `sim_cluster_fixture` (and asks for `sim_cluster`) or calls
`make_cluster(request, ...)`:

    from _cluster import make_cluster, sim_cluster_fixture  # noqa: F401 - found by its name

    def test_two_hosts(sim_cluster): ...                        # 2 hosts, links unshaped

    @pytest.mark.parametrize("sim_cluster", [{"hosts": 3, "mbit": 100}], indirect=True)
    def test_slow_links(sim_cluster): ...

Building one needs root (CI runs as root); where namespaces cannot be made the test skips,
with the reason. The cluster is closed by a finalizer, so a failed test leaves nothing behind;
clusters of an earlier run that died unclosed are removed first (never a running one's).
"""

from __future__ import annotations

import time

import pytest
from _bench import run_benchmark

from megascale.fault import netns

# The smallest run of benchmarks/overlap.py or ablation.py that still takes every path
TINY_SIM_RUN = ["--steps", "1", "--warmup", "1", "--layers", "2", "--d-model", "32", "--seq", "16",
                "--batch", "8", "--bucket", "2000", "--mbit", "200", "--set", "parallel.dp_tail_buckets=2"]


def require_netns(shaping: bool = False) -> None:
    """Skip the calling test, saying why, if this process cannot build a SimCluster (with tbf)."""
    ok, why = netns.available(shaping=shaping)
    if not ok:
        pytest.skip(f"no simulated cluster here: {why}")


def run_benchmark_on_sim_cluster(script: str, *args: str, timeout: float = 600,
                                 shaping: bool = True) -> str:
    """A benchmark that builds its own SimCluster (with tbf links unless `shaping` is off), run from the
    repository: skipped where none can be built; it must succeed and leave no namespace behind. Its stdout."""
    require_netns(shaping=shaping)
    before = set(netns.namespaces())
    out = run_benchmark(script, *args, timeout=timeout)
    assert set(netns.namespaces()) <= before  # torn down
    return out


def make_cluster(request: pytest.FixtureRequest, hosts: int = 2, mbit: float | None = None,
                 **kw) -> netns.SimCluster:
    """A SimCluster closed when the test ends, whatever its outcome."""
    require_netns(shaping=mbit is not None)
    netns.cleanup_leftovers()
    cluster = netns.SimCluster(hosts, mbit=mbit, **kw)
    request.addfinalizer(cluster.close)
    return cluster


@pytest.fixture(name="sim_cluster")
def sim_cluster_fixture(request: pytest.FixtureRequest) -> netns.SimCluster:
    """A function-scoped SimCluster; parametrize it indirectly with make_cluster's keywords."""
    return make_cluster(request, **getattr(request, "param", {}))


def alive(pid: int) -> bool:
    """Whether pid runs (or is stopped); a zombie is dead, only not yet reaped by its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after up to timeout seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def wait_stopped(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return stopped(pid)


def own_namespaces(cluster_id: str) -> list[str]:
    """The machine's namespaces that belong to the cluster with this id."""
    return [ns for ns in netns.namespaces() if ns.startswith(cluster_id + "-")]

