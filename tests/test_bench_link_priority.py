"""Smoke test of benchmarks/link_priority.py: it runs for seconds and prints its three rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_link_priority_benchmark_runs_on_a_simulated_cluster():
    from _cluster import require_netns

    from megascale.fault import netns

    require_netns(shaping=True)
    before = set(netns.namespaces())
    r = subprocess.run([sys.executable, "benchmarks/link_priority.py", "--messages", "5", "--kib", "64"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    for way in ("link idle", "unmarked", "marked"):
        assert re.search(rf"^{way} +median +[\d.]+  p90 +[\d.]+", r.stdout, re.M), r.stdout
    assert set(netns.namespaces()) <= before  # torn down
