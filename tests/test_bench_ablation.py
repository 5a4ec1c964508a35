"""Smoke test of benchmarks/ablation.py: MegaScale's ablation table on a simulated cluster, with the
planner's step time, the step split by cause and the CPU-seconds of each row."""

import os
import re


def test_ablation_benchmark_runs_on_a_simulated_cluster():
    from _cluster import TINY_SIM_RUN, run_benchmark_on_sim_cluster

    out = run_benchmark_on_sim_cluster("benchmarks/ablation.py", *TINY_SIM_RUN, "--sweeps", "1",
                                       "--rows", "6", "--no-calibrate", "--share-rounds", "1",
                                       "--link-repeats", "4")  # a job per row: the last, every flag on
    assert re.search(r"^links as measured .*: \d+ us per message, \d+ Mbit/s", out, re.M), out
    if len(os.sched_getaffinity(0)) < 8:  # 8 ranks time-slice the cores: how much speed a core keeps
        shared = r"^a core time-sliced by \d+ ranks keeps [\d.]+ of its speed"
        assert re.search(shared, out, re.M), out
    # measured, then the planner with the links' CPU cost and without, each with its error
    measured_and_planned = (r" +[\d.]+ +\d+ +[\d.]+ +[\d.]+% +[\d.]+ +[+-][\d.]+% +[\d.]+ +[+-][\d.]+%"
                            r" +[\d.]+ +\d+%$")  # ..., then the machine's CPU-seconds per step and busy
    rows = re.findall(r"^(baseline|\+ [\w ,]+?)" + measured_and_planned, out, re.M)
    assert rows == ["+ LAMB, 4x batch"], out
    # each row's step by cause, measured / planned
    split = r" +[\d.]+/[\d.]+" * 5 + r" +-?[\d.]+$"
    rows = re.findall(r"^(baseline|\+ [\w ,]+?)" + split, out, re.M)
    assert rows == ["+ LAMB, 4x batch"], out
    # each row's CPU-seconds: the machine's, the ranks', the ranks' with no communication, the planner's
    # (all, compute), and the step with no communication
    rows = re.findall(r"^(baseline|\+ [\w ,]+?)" + r" +[\d.]+" * 6 + "$", out, re.M)
    assert rows == ["+ LAMB, 4x batch"], out


def test_each_rows_planner_is_the_median_over_the_calibrations():
    """ablation.py calibrates the CPU before the first sweep and after each: per row, the prediction
    with the median step time (the lower middle one of an even count)."""
    from types import SimpleNamespace

    from _bench import load_benchmark

    ablation = load_benchmark("ablation.py", "ablation_bench")  # (it finds overlap.py itself)

    def on(*steps):  # one calibration's predictions, a row each
        return [SimpleNamespace(step_time=s) for s in steps]

    runs = [on(1.0, 5.0), on(3.0, 4.0), on(2.0, 6.0)]
    assert [p.step_time for p in ablation.median_prediction(runs)] == [2.0, 5.0]
    assert [p.step_time for p in ablation.median_prediction(runs[:2])] == [1.0, 4.0]
    assert ablation.median_prediction(runs[:1]) == runs[0]
