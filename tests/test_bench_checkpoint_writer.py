"""Smoke test of benchmarks/checkpoint_writer.py --quick: both writers run and print their row with numbers.

The real stage 2 runs from a thread and from a writer process (started, its memory read) for the
smallest state; timings are never asserted.
"""

from __future__ import annotations

import re

from _bench import run_benchmark

NUM = r"[-+]?\d+\.\d+"


def test_quick_prints_a_row_per_writer_with_numbers():
    out = run_benchmark("benchmarks/checkpoint_writer.py", "--quick")
    assert re.search(rf"^\s*{NUM}MB\s+thread\s+{NUM}s\s+{NUM}s\s+{NUM}s\s+-$", out, re.M), out
    assert re.search(rf"^\s*{NUM}MB\s+process\s+{NUM}s\s+{NUM}s\s+{NUM}s\s+\d+ MB$", out, re.M), out
