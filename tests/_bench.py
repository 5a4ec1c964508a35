"""Running a benchmark script for its smoke test (tests/test_bench_*.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, timeout: float = 300,
                  env: dict[str, str] | None = None) -> str:
    """`script` (a path from the repository root) run with this Python (in `env`, or this process's
    environment); it must succeed. Its stdout."""
    r = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    return r.stdout


def load_benchmark(script: str, name: str):
    """benchmarks/`script` imported as module `name` (a script, not a package member), for the tests of
    its functions; registered in sys.modules, as dataclasses and pickling look a module up there."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
