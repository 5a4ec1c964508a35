"""Smoke test of benchmarks/recovery_soak.py: a random fault in a random combination, recovered exactly."""

import random
import re

from _bench import load_benchmark, run_benchmark

from megascale.fault.inject import _parse


def test_one_fault_is_recovered_to_the_fault_free_run():
    out = run_benchmark("benchmarks/recovery_soak.py", "--combos", "1", "--world", "2", "--kinds", "kill")
    line = r"^\[0\] world 2, kill@step:\d:rank=\d, \d+ s, equal after 1 restart, rank \d named$"
    assert re.search(line, out, re.M), out
    assert out.rstrip().endswith("recovery soak: 1 equal, 0 differ, 0 failed, 0 refused"), out


def test_every_drawn_fault_names_a_rank_and_a_step_of_the_job():
    soak = load_benchmark("recovery_soak.py", "recovery_soak")
    rng = random.Random(0)
    seen = set()
    for _ in range(300):
        world = rng.choice(sorted(soak.LAYOUTS))
        fault = soak.draw_fault(rng, world, list(soak.KINDS))
        faults = _parse(fault.spec)
        assert len(faults) == max(1, fault.restarts) and faults[0].rank == fault.rank
        for f in faults:
            assert 0 <= f.rank < world and 0 <= f.value < soak.STEPS, fault
            seen.add((f.action, f.point, f.attempt))
        if fault.kind == "twice":  # the restarted job must reach the second kill's step: no state was
            first, again = faults  # saved after it and before the first kill (seed 17 drew 3 then 2)
            saves = [c for c in range(soak.STEPS)
                     if c % soak.MEMORY_EVERY == 0 or c % soak.STORAGE_EVERY == 0]
            assert not any(again.value < c <= first.value for c in saves), fault
    assert seen == {("kill", "step", None), ("stop", "step", None), ("hang", "step", None),
                    ("skip", "agree", None), ("kill", "persist", None), ("kill", "step", 1),
                    ("kill", "committed", None)}
