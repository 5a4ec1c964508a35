"""A run directory whose disk fills up (metrics, traces, TensorBoard) costs those lines, said once each,
never the run: it trains on and ends like the same run on a roomy disk. Disks are tmpfs mounts of a
given size (root; skipped where mounting is not allowed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megascale.checkpoint.model_state import read_model_state
from megascale.observe.linefile import LineFile
from megascale.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_disk(tmp_path):
    def mount(size: str) -> Path:
        disk = tmp_path / f"disk{size}"
        disk.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(disk)
        return disk

    mounted: list[Path] = []
    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_line_file_loses_lines_while_the_disk_is_full_and_writes_again_after(small_disk):
    disk = small_disk("64k")
    said: list[str] = []
    f = LineFile(disk / "metrics.jsonl", "metrics", said.append)
    record = {"kind": "train", "loss": 1.5, "pad": "x" * 200}
    written = failed = 0
    step = 0
    while failed < 5:  # to the end of the disk, and a few more
        step += 1
        if f.write(json.dumps({**record, "step": step}) + "\n"):
            written += 1
        else:
            failed += 1
    assert written > 100 and len(said) == 1, said
    assert said[0].startswith(f"metrics: cannot write {disk / 'metrics.jsonl'} (No space left on device)")
    room = disk / "metrics.jsonl"
    kept = read_metrics(room)  # whatever the failure cut short is skipped
    assert [r["step"] for r in kept] == list(range(1, len(kept) + 1)) and len(kept) >= written - 1
    os.truncate(room, room.stat().st_size // 2)  # room again (and a line cut in the middle)
    assert f.write(json.dumps({**record, "step": step + 1}) + "\n")
    assert len(said) == 2 and said[1] == f"metrics: writing {room} again (5 writes were lost)", said
    f.close()
    after = read_metrics(room)
    assert after[-1]["step"] == step + 1 and [r["step"] for r in after[:-1]] == list(range(1, len(after)))


def _train(run_dir: Path, ckpt: Path, corpus: Path) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "megascale", "train", "--no-resume", "model.n_layers=2", "model.d_model=32",
            "model.n_heads=2", "model.seq_len=32", "train.steps=120", "train.global_batch=4",
            "train.micro_batch=2", "train.eval_interval=40", "train.eval_batches=2", "train.log_interval=40",
            "log.progress=false", "log.sample_tokens=0", "checkpoint.interval=40", "checkpoint.keep=1",
            "observe.flush_interval_s=0.05",  # the trace written as the run goes, not in one piece
            f"checkpoint.path={ckpt}", f"train.run_dir={run_dir}", f"data.source={json.dumps(str(corpus))}",
            f"data.path={json.dumps(str(corpus.parent / 'cache'))}"]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_run_directory_that_fills_up_costs_its_records_not_the_run(small_disk, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", corpus)
    ref = _train(tmp_path / "ref", tmp_path / "ref_ck", corpus)
    assert ref.returncode == 0, ref.stderr
    disk = small_disk("64k")  # the metrics, trace and TensorBoard of ~45 of the 120 steps (~170 KB in all)
    r = _train(disk / "run", tmp_path / "ck", corpus)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for what in ("metrics", "trace of rank 0"):
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"megascale: {what}: cannot write")]
        assert len(lines) == 1 and "No space left on device" in lines[0], r.stderr
    assert "done: 120 steps" in r.stdout, r.stdout
    steps = [m["step"] for m in read_metrics(disk / "run" / "metrics.jsonl", "train")]
    assert steps and steps[-1] < 120  # the disk filled up mid-run
    want = read_model_state(tmp_path / "ref_ck" / "step_000120")[1]
    got = read_model_state(tmp_path / "ck" / "step_000120")[1]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
