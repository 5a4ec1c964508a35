"""Smoke test of benchmarks/tp_layers.py: every SP layer's pass timed plain, overlapped and as GEMMs alone."""

import re

from _cluster import run_benchmark_on_sim_cluster


def test_tp_layers_benchmark_times_every_layer_and_pass():
    out = run_benchmark_on_sim_cluster("benchmarks/tp_layers.py", "--iters", "3", "--warmup", "1",
                                       "--d-model", "32", "--seq", "16", timeout=300)
    times = r" +([\d.]+) +([\d.]+) +([\d.]+) +(-?[\d.]+%|nan%)$"
    rows = re.findall(r"^(\w+) +(fwd|bwd|all)" + times, out, re.M)
    assert [(name, pas) for name, pas, *_ in rows] == [
        (n, p) for n in ("qkv", "proj", "fc_in", "fc_out") for p in ("fwd", "bwd")] + [("block", "all")], out
    assert all(float(x) > 0 for _, _, *t, _ in rows for x in t), out
