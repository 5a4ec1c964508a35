"""Smoke test of benchmarks/overlap.py: every dimension's four step times on a simulated cluster; and
its no-op collectives, hidden fraction, core binding."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import load_benchmark

from megascale.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_overlap_benchmark_runs_on_a_simulated_cluster():
    from _cluster import TINY_SIM_RUN, run_benchmark_on_sim_cluster

    out = run_benchmark_on_sim_cluster("benchmarks/overlap.py", *TINY_SIM_RUN, "--rounds", "1")
    for dim in ("dp", "pp", "tp", "all"):
        times = r"  ".join(rf"{t} +[\d.]+" for t in ("T_serial", "T_overlap", "T_nocomm", "T_comm"))
        assert re.search(rf"^ *{dim}  {times} s +H ", out, re.M), out
    assert "exposed dp" in out and "pp wait" in out
    waits = r"dp waits \(gathers, reduce-scatters, norms\) [\d./]+ -> \d+\.\d/\d+\.\d/\d+\.\d ms"
    assert len(re.findall(waits, out)) == 2, out  # dp's and all's
    left = (r"T_overlap - T_nocomm -?\d+ ms, of it exposed -?\d+ ms \(-?\d+ of them waiting for a peer to "
            r"arrive\) and the messages' CPU in the compute -?\d+ ms \(x[\d.]+ the no-comm variant's\); "
            r"the overlap's own code x[\d.]+ "
            r"\(no-comm compute against serial\); H's ceiling (on these cores (\d+|nan)% \(H is -?(\d+|nan)% "
            r"of it\)|not measured \(ranks share cores\))")
    assert len(re.findall(left, out)) == 4, out  # every dimension's
    if len(os.sched_getaffinity(0)) < 4:  # all's 4 ranks share the cores
        assert re.search(r"^ +all .*H's ceiling not measured", out, re.M), out


def _overlap_module():
    return load_benchmark("overlap.py", "overlap_bench")


def test_hidden_fraction_and_its_interval_over_rounds():
    ov = _overlap_module()
    assert ov.hidden_fraction(1.0, 0.8, 0.6) == pytest.approx(0.5)
    assert ov.hidden_fraction(1.0, 0.8, 1.0) != ov.hidden_fraction(1.0, 0.8, 1.0)  # nothing exposed: nan
    # steady rounds: the interval is the figure itself
    steady = {"serial": [[1.0, 1.0]] * 3, "overlap": [[0.8, 0.8]] * 3, "nocomm": [[0.6, 0.6]] * 3}
    assert ov.hidden_interval(steady) == pytest.approx((0.5, 0.5))
    # one round whose overlap ran faster widens it upwards, and it still holds the pooled figure
    noisy = {"serial": [[1.0], [1.0], [1.0]], "overlap": [[0.8], [0.8], [0.65]],
             "nocomm": [[0.6], [0.6], [0.6]]}
    low, high = ov.hidden_interval(noisy)
    assert low == pytest.approx(0.5) and high == pytest.approx(0.875)
    assert all(x != x for x in ov.hidden_interval({k: v[:1] for k, v in steady.items()}))  # one round


def test_the_ceiling_leaves_out_the_messages_cpu_and_the_late_peers():
    ov = _overlap_module()
    # communication cost 0.4 s a step; 0.1 of it the messages' CPU, 0.05 a late peer: 0.25 hideable
    assert ov.hidden_ceiling(1.0, 0.6, 0.1, 0.05) == pytest.approx(0.625)
    assert ov.hidden_ceiling(1.0, 0.6, -0.02, -0.01) == pytest.approx(1.0)  # noise below zero: none
    assert ov.hidden_ceiling(1.0, 0.6, 0.5, 0.0) == 0.0  # more than the cost: nothing hideable
    assert ov.hidden_ceiling(1.0, 1.0, 0.1, 0.0) != ov.hidden_ceiling(1.0, 1.0, 0.1, 0.0)  # no cost: nan


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_setting_for_some_layouts_only_is_checked_on_the_first_measured_one():
    """`--dims all --set parallel.vpp=2`: the dataset's config is the all layout's (pp 2), not dp's, on
    which interleaving is an error before any run."""
    ov = _overlap_module()
    a = ov.parser().parse_args(["--dims", "all", "--pp-ahead", "0", "--set", "parallel.vpp=2"])
    cfg = ov.first_config(a)
    assert (cfg.parallel.pp, cfg.parallel.vpp) == (2, 2)
    with pytest.raises(ConfigError, match="parallel.vpp"):
        ov.first_config(ov.parser().parse_args(["--dims", "dp", "all", "--set", "parallel.vpp=2"]))


def test_each_rank_is_bound_to_its_own_core_unless_told_not_to():
    """Rank r runs on core r (a simulated host's own core) where every rank can have one; with more
    ranks than cores, or --no-pin, the scheduler is left to place them."""
    cores = sorted(os.sched_getaffinity(0))
    code = ("import argparse, os, sys; sys.path.insert(0, 'benchmarks'); import overlap; "
            "overlap.pin_to_core(argparse.Namespace(pin=sys.argv[1] == 'pin'), int(sys.argv[2])); "
            "print(sorted(os.sched_getaffinity(0)))")

    def affinity(rank: int, pin: str, world: int) -> str:
        env = {**os.environ, "RANK": str(rank)}
        return subprocess.run([sys.executable, "-c", code, pin, str(world)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    for rank in range(len(cores)):
        assert affinity(rank, "pin", len(cores)) == str([cores[rank]])
    assert affinity(0, "free", len(cores)) == str(cores)
    assert affinity(0, "pin", len(cores) + 1) == str(cores)


def test_no_comm_collectives_leave_this_ranks_own_data_not_garbage(monkeypatch):
    """The no-comm variant computes on what its no-op collectives leave: a gather's output filled with
    copies of this rank's piece, a reduce-scatter's with its own addend, a routed all-reduce's tensor
    untouched (made of no-op messages it zeroed the peers' chunks: the loss went NaN)."""
    import torch
    import torch.distributed as dist

    from megascale.distributed import direct, p2p

    for module, names in ((dist, ov_names()), (p2p, ("isend", "irecv")), (direct, ("all_reduce",))):
        for name in names:  # Collectives patches these modules: put them back after the test
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    ov = _overlap_module()
    mine = torch.arange(6.0).view(2, 3)
    gathered = torch.full((4, 3), float("nan"))
    ov._stand_in("all_gather_single", gathered, mine)
    assert torch.equal(gathered, torch.cat([mine, mine]))
    scattered = torch.full((1, 3), float("nan"))
    ov._stand_in("reduce_scatter_single", scattered, mine)
    assert torch.equal(scattered, mine[:1])
    group = object()
    wrapper = ov.Collectives({group})
    wrapper.mode = "nocomm"
    t = torch.ones(5)
    assert direct.all_reduce(t, group) is None and torch.equal(t, torch.ones(5))
    out = torch.full((4, 3), float("nan"))
    assert dist.all_gather_single(out, mine, group=group) is None
    assert torch.equal(out, torch.cat([mine, mine]))


def ov_names() -> tuple[str, ...]:
    return ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
            "reduce_scatter_tensor", "broadcast", "isend", "irecv")


def test_no_comm_pipeline_messages_keep_the_stages_waiting_on_each_other(monkeypatch):
    """On the pipeline's groups the no-comm variant sends and receives one-element messages instead of
    nothing: the schedule's dependencies (and its bubble) stay, only the bytes go."""
    import torch

    from megascale.distributed import direct, p2p

    sent = []
    for module, names in ((p2p, ("isend", "irecv")), (direct, ("all_reduce",))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(p2p, "routed", lambda group: True)
    for name in ("isend", "irecv"):
        def fake(t, *_a, _name=name, **_k):
            sent.append((_name, t.numel()))
            return "work"
        monkeypatch.setattr(p2p, name, fake)
    ov = _overlap_module()
    pipe, data = object(), object()
    wrapper = ov.Collectives({pipe, data})
    wrapper.ordered = {pipe}
    wrapper.mode = "nocomm"
    activation = torch.full((2, 8), float("nan"))
    assert p2p.irecv(activation, src=1, group=pipe, tag=0) == "work"  # waited for, as the real one
    assert p2p.isend(torch.ones(2, 8), dst=1, group=pipe, tag=0) == "work"
    assert sent == [("irecv", 1), ("isend", 1)] and torch.equal(activation, torch.zeros(2, 8))
    p2p.isend(torch.ones(3), dst=1, group=data, tag=0).wait()  # any other group's: nothing at all
    assert len(sent) == 2
