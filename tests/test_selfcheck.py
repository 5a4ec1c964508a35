"""Host self-checks (fault/selfcheck.py): each check passes on a sound machine and catches the fault it
is for (a wrong product, a slow matmul, a flipped or aliased byte, an injected failure), the
collective ones on 2 and 3 gloo processes, and the report line a person reads in the log."""

from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch
from _dist import one_thread_fixture, pools_fixture  # noqa: F401 - the fixtures are found by their names

from megascale.fault import selfcheck as sc
from megascale.perf import hardware


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own rate cache (never the user's) and no injected faults."""
    monkeypatch.setenv("MEGASCALE_CACHE", str(tmp_path))
    monkeypatch.delenv("MEGASCALE_INJECT", raising=False)
    return tmp_path


# ------------------------------------------------------------------------------------------ matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_exact_operands_product_is_known(dtype):
    a, b, want = sc._exact_operands(96, dtype, seed=3)
    assert torch.equal(torch.mm(a.double(), b.double()), want.double())  # exact in fp64
    assert torch.equal(torch.mm(a, b).double(), want.double())  # and in the dtype itself
    assert a.dtype == b.dtype == dtype and want.abs().max() > 8  # not a trivial product


def test_matmul_passes_then_catches_a_corrupted_result(monkeypatch):
    r = sc.check_matmul("cpu", n=128)
    assert r.ok and r.name == "matmul" and r.value > 0 and "GFLOP/s" in r.detail

    def off_by_a_bit(a, b):
        c = torch.mm(a, b)
        c[3, 5] += 0.32
        return c

    monkeypatch.setattr(sc, "_product", off_by_a_bit)
    r = sc.check_matmul("cpu", n=128)
    assert not r.ok
    assert r.detail == "result off by 3.2e-01 (expected exact) at [3, 5], 1 of 16384 entries wrong"


def test_matmul_catches_a_nan(monkeypatch):
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: mm(a, b).index_fill_(0, torch.tensor([7]), np.nan))
    r = sc.check_matmul("cpu", n=64)
    assert not r.ok and r.detail.startswith("result off by nan (expected exact) at [7, ")


def test_matmul_speed_without_a_reference_passes_and_records_one():
    key = hardware._cpu_key(torch, "fp32")
    assert key not in hardware._read_cache()
    r = sc.check_matmul("cpu", n=128)
    assert r.ok and r.detail.endswith("(no reference yet)")
    assert hardware._read_cache()[key] == pytest.approx(r.value)  # the next check has a reference
    r = sc.check_matmul("cpu", n=128, min_fraction=0.0)
    assert r.ok and "(expected >= 0 GFLOP/s)" in r.detail


def test_matmul_far_below_the_expected_speed_fails():
    hardware.record_matmul_rate("fp32", 1e15)  # a "best ever" no CPU here reaches
    r = sc.check_matmul("cpu", n=128)
    assert not r.ok
    assert r.detail.startswith("too slow: ") and "expected >= 500 TFLOP/s (0.5 x the best recorded, 1e+03" \
        in r.detail
    assert hardware._read_cache()[hardware._cpu_key(torch, "fp32")] == 1e15  # a slow run lowers nothing


def test_a_wrong_product_records_no_rate(monkeypatch):
    monkeypatch.setattr(sc, "_product", lambda a, b: torch.mm(a, b) + 1)
    assert not sc.check_matmul("cpu", n=64).ok
    assert hardware._read_cache() == {}


# ------------------------------------------------------------------------------------------ memory


def test_memory_passes():
    r = sc.check_memory(8)
    assert r.ok and r.name == "memory" and r.detail.startswith("8 MiB ok (") and r.detail.endswith(" GB/s)")
    assert r.value > 0


def test_memory_catches_a_flipped_byte(monkeypatch):
    def flip(words):
        w = words.copy()
        w.view(np.uint8)[12345] ^= 0x10
        return w

    monkeypatch.setattr(sc, "_read_back", flip)
    r = sc.check_memory(4)
    assert not r.ok
    assert r.detail == "pattern 0x0000 wrong at byte offset 12345: wrote 0x00, read 0x10"


def test_memory_catches_a_stuck_bit_and_an_aliased_word(monkeypatch):
    def stuck_low(words):  # bit 7 of byte 99 always reads 0: only the patterns with it set see it
        w = words.copy()
        w.view(np.uint8)[99] &= 0x7F
        return w

    monkeypatch.setattr(sc, "_read_back", stuck_low)
    assert sc.check_memory(1).detail == "pattern 0xffff wrong at byte offset 99: wrote 0xff, read 0x7f"

    def aliased(words):  # word 1000 reads word 0's cell: every constant pattern reads back right
        w = words.copy()
        w[1000] = w[0]
        return w

    monkeypatch.setattr(sc, "_read_back", aliased)
    r = sc.check_memory(1)
    assert not r.ok and r.detail.startswith("pattern address wrong at byte offset 8000: ")


def test_torch_words_the_gpu_path_verifies_and_catches(monkeypatch):
    buf = sc._TorchWords(1 << 16, torch.device("cpu"))
    for pattern in (*sc._PATTERNS, sc._ADDRESS):
        buf.write(pattern)
        assert buf.first_bad(pattern) is None
    buf.write(0xFFFFFFFFFFFFFFFF)
    buf.words.view(torch.uint8)[21] = 0xFE
    word, wrote, read = buf.first_bad(0xFFFFFFFFFFFFFFFF)
    assert sc._byte_diff(word, wrote, read) == "byte offset 21: wrote 0xff, read 0xfe"


# ------------------------------------------------------------------------------------------ injection


def test_inject_names_one_check_of_one_rank(monkeypatch):
    monkeypatch.setenv("MEGASCALE_INJECT", "kill@persist:4,fail@selfcheck:1:rank=3")
    assert sc.inject_failure("matmul", rank=3)
    assert not sc.inject_failure("matmul", rank=2) and not sc.inject_failure("memory", rank=3)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # broken hardware stays broken after a restart
    assert sc.inject_failure("matmul", rank=3)
    monkeypatch.setenv("MEGASCALE_INJECT", "fail@selfcheck:9")
    with pytest.raises(ValueError, match="no such check.*1=matmul, 2=memory, 3=allreduce, 4=p2p"):
        sc.inject_failure("matmul")


def test_injected_failure_fails_exactly_that_check(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MEGASCALE_INJECT", "fail@selfcheck:2")
    report = sc.run_selfcheck("cpu", min_fraction=0)
    assert [(r.name, r.ok, r.detail) for r in report.failed] == [("memory", False, "injected")]
    assert report.results[0].ok and not report.ok
    monkeypatch.setenv("MEGASCALE_INJECT", "fail@selfcheck:2:rank=1")  # another rank's fault
    assert sc.run_selfcheck("cpu", min_fraction=0).ok


def test_a_check_that_raises_is_a_failure():
    def boom():
        raise RuntimeError("Connection closed by peer [10.0.0.7]:29500\nmore text")

    r = sc._guard("p2p", boom)
    assert not r.ok and r.detail == "RuntimeError: Connection closed by peer [10.0.0.7]:29500"


# ------------------------------------------------------------------------------------------ report


def test_report_lines_read_well():
    passed = sc.SelfCheckReport("gpu-17", 3, [
        sc.CheckResult("matmul", True, 0.03, "12.3 GFLOP/s (expected >= 5.1 GFLOP/s)", 12.3e9),
        sc.CheckResult("memory", True, 0.1, "256 MiB ok (4.1 GB/s)", 4.1e9),
        sc.CheckResult("allreduce", True, 0.01, "ok (4 ranks, 2 GB/s bus)", 2e9),
        sc.CheckResult("p2p", True, 0.01, "1.2 GB/s to rank 7", 1.2e9),
    ])
    assert passed.ok and passed.failed == []
    assert passed.line() == (
        "host gpu-17 rank 3: self-check passed: matmul 12.3 GFLOP/s (expected >= 5.1 GFLOP/s), "
        "memory 256 MiB ok (4.1 GB/s), host all-reduce ok (4 ranks, 2 GB/s bus), p2p 1.2 GB/s to rank 7")
    failed = sc.SelfCheckReport("gpu-17", 3, [
        sc.CheckResult("matmul", False, 0.03, "result off by 3.2e-01 (expected exact) at [3, 5]"),
        sc.CheckResult("memory", True, 0.1, "256 MiB ok (4.1 GB/s)"),
        sc.CheckResult("p2p", False, 0.01, "injected"),
    ])
    assert [r.name for r in failed.failed] == ["matmul", "p2p"]
    assert failed.line() == ("host gpu-17 rank 3: self-check failed: matmul: result off by 3.2e-01 (expected "
                             "exact) at [3, 5]; p2p: injected")
    d = json.loads(json.dumps(failed.to_dict()))
    assert d["ok"] is False and d["results"][2] == {"name": "p2p", "ok": False, "seconds": 0.01,
                                                    "detail": "injected", "value": None}
    assert sc.SelfCheckReport.from_dict(d) == failed


def test_quick_selfcheck_is_quick():
    report = sc.run_selfcheck("cpu", min_fraction=0)
    assert report.ok, report.line()
    assert [r.name for r in report.results] == ["matmul", "memory"]
    assert sum(r.seconds for r in report.results) < 3.0  # well under a second when the machine is idle


def test_hosts_main_single_process(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert sc.hosts_main(["--hosts", "--device", "cpu", "--min-fraction", "0"]) == 0
    assert ": self-check passed: matmul " in capsys.readouterr().out
    monkeypatch.setenv("MEGASCALE_INJECT", "fail@selfcheck:1")
    assert sc.hosts_main(["--device", "cpu", "--json", "--min-fraction", "0"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and d["results"][0]["detail"] == "injected"


# ------------------------------------------------------------------------------------------ collectives


@contextlib.contextmanager
def _env(**values):
    """Set env vars in a pool worker (spawned before the test's monkeypatch) for one call."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k in [k for k, v in values.items() if v is None]:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _collectives(rank: int, cache: str) -> list[sc.CheckResult]:
    import torch.distributed as dist

    world = dist.get_world_size()
    with _env(MEGASCALE_CACHE=cache, MEGASCALE_INJECT=None):
        return [sc.check_host_allreduce(None, list(range(world)), mbytes=1),
                sc.check_p2p((rank + 1) % world, (rank - 1) % world, None, mbytes=1),
                sc.check_host_alltoall(None, mbytes=1)]


def test_hosts_main_two_hosts_ring_between_them(pools, cache):
    (code, out), _ = pools(2).run(_hosts_main, str(cache), "1", "fail@selfcheck:3:rank=0")
    lines = out.splitlines()
    assert code == 1 and lines[0].endswith(" rank 0: self-check failed: host all-reduce: injected")
    assert "host all-reduce ok (1 rank, " in lines[1] and " GB/s to rank 0" in lines[1]


@pytest.mark.parametrize("world", [2, 3])
def test_host_allreduce_p2p_and_alltoall(pools, cache, world):
    for rank, (ar, p2p, a2a) in enumerate(pools(world).run(_collectives, str(cache))):
        assert ar.ok and ar.detail.startswith(f"ok ({world} ranks, ") and ar.detail.endswith(" GB/s bus)")
        assert p2p.ok and p2p.detail.endswith(f" GB/s to rank {(rank + 1) % world}") and p2p.value > 0
        assert a2a.ok and a2a.detail.startswith(f"ok ({world} ranks, ")


def _hosts_main(rank: int, cache: str, local: str, inject: str | None) -> tuple[int, str]:
    out = io.StringIO()
    with _env(MEGASCALE_CACHE=cache, MEGASCALE_INJECT=inject, LOCAL_WORLD_SIZE=local):
        with contextlib.redirect_stdout(out):
            code = sc.hosts_main(["--device", "cpu", "--min-fraction", "0"])
    return code, out.getvalue()


def test_hosts_main_three_ranks_one_host(pools, cache):
    (code0, out0), *rest = pools(3).run(_hosts_main, str(cache), "3", None)
    assert code0 == 0 and all(code == 0 and out == "" for code, out in rest)  # rank 0 prints for all
    lines = out0.splitlines()
    assert len(lines) == 3 and all(f" rank {r}: self-check passed: " in lines[r] for r in range(3))
    assert "host all-reduce ok (3 ranks, " in lines[0] and f" GB/s to rank {1}" in lines[0]


def test_hosts_main_injected_rank_fails_alone(pools, cache):
    results = pools(3).run(_hosts_main, str(cache), "3", "fail@selfcheck:4:rank=1")
    assert [code for code, _ in results] == [1, 1, 1]  # every rank agrees the job is not fit
    lines = results[0][1].splitlines()
    assert lines[1].endswith(" rank 1: self-check failed: p2p: injected")
    assert ": self-check passed: " in lines[0] and ": self-check passed: " in lines[2]


def test_megascale_diagnose_hosts_runs_the_self_check(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "MEGASCALE_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "megascale", "diagnose", "--hosts", "--min-fraction", "0"],
                       cwd=root, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "self-check passed: matmul" in r.stdout
    env["MEGASCALE_INJECT"] = "fail@selfcheck:2"
    r = subprocess.run([sys.executable, "-m", "megascale", "diagnose", "--hosts"], cwd=root,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "memory: injected" in r.stdout, (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "megascale", "diagnose"], cwd=root, capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--hosts" in r.stderr


def test_the_speed_expected_of_a_rank_is_its_share_of_the_cores(monkeypatch):
    import os

    import torch

    from megascale.fault import selfcheck

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert selfcheck.cpu_share() == 0.25  # 8 ranks of 1 thread on 2 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert selfcheck.cpu_share() == 1.0


def test_ranks_sharing_a_cpu_host_split_its_memory_test():
    # 4 ranks of one CPU host each test a quarter of the buffer: the host's whole size, one rank's cost
    full = sc.run_selfcheck("cpu", min_fraction=0)
    shared = sc.run_selfcheck("cpu", min_fraction=0, memory_share=4)
    size = sc.QUICK["cpu"].memory_mb
    got = [r.detail.split(" ok")[0] for r in (full.results[1], shared.results[1])]
    assert got == [f"{size} MiB", f"{size // 4} MiB"]
    assert sc._memory_mb(size, torch.device("cuda"), 4) == size  # a GPU's memory is its own
