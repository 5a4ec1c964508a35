"""Smoke test of benchmarks/checkpoint.py --quick: it runs to the end and prints every row with numbers.

The real two-stage checkpoint path runs (snapshot, background persist, restores from memory and
from storage, a dp=2 gloo job with broadcast_restore on and off); timings are never asserted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from _bench import run_benchmark

NUM = r"[-+]?\d+(?:\.\d+)?"

ROWS = ["parameters (M)", "state: weights + AdamW (MB)", "first checkpoint blocked (s)",
        "blocked per checkpoint (s)", "save() call (s)", "before_update wait (s)",
        "sync torch.save + fsync (s)",
        "sync / blocked (goal >= 50x)", "step, no checkpoint (s)", "step after save() (s)",
        "steps during persist (n)", "persist (s)", "persist (MB/s)", "restore from memory (s)",
        "restore from storage cold (s)", "restore from storage warm (s)", "storage / memory restore",
        "restore bytes read (MB)", "restore bytes checksummed (MB)"]


def test_quick_prints_every_row_with_numbers(tmp_path):
    out = run_benchmark("benchmarks/checkpoint.py", "--quick", env=_env(tmp_path))
    assert re.search(r"^memory slots: .+ \(.+\); storage: .+ \(.+\)$", out, re.M), out
    for label in ROWS:
        assert re.search(rf"^\s*{re.escape(label)}\s+{NUM}x?\s*$", out, re.M), f"no row {label!r}:\n{out}"
    # the step during a persist and the slowdown are numbers, or say that the persist was shorter
    assert re.search(rf"^slowdown in persist \(goal <10%\)\s+({NUM}%|persist < step)\s*$", out, re.M), out
    read = {}
    for flag in ("true", "false"):  # the dp=2 rows: five figures in MB, then seconds
        row = re.search(rf"^{flag}((\s+{NUM}){{6}})\s*$", out, re.M)
        assert row, f"dp row {flag!r} missing:\n{out}"
        read[flag] = [float(x) for x in row.group(1).split()[:2]]  # MB read by rank 0, rank 1
    # bytes, not time: with broadcast_restore the second dp replica reads its optimizer shard only (the
    # weights come from replica 0), without it the weights too
    assert read["true"][1] < read["false"][1] and read["true"][0] == read["false"][0], read
    assert re.search(rf"every rank / one reader per dp group: {NUM}x", out), out


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path)  # the benchmark's run directories (it removes them itself)
    return env
