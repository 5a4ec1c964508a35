"""A run directory whose disk fills up (metrics, traces, TensorBoard) costs those lines, said once each,
never the run: it trains on and ends like the same run on a roomy disk. Disks are tmpfs mounts of a
given size (root; skipped where mounting is not allowed)."""

from __future__ import annotations

import errno
import json
import os
import re
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


def _train(run_dir: Path, ckpt: Path, corpus: Path, fault: str = "") -> subprocess.CompletedProcess:
    """120 steps; with a `fault` (MEGASCALE_INJECT) under `megascale launch`, which restarts the job."""
    cmd = ["train", "--no-resume"] if not fault else ["launch", "--nproc-per-node", "1",
                                                      "checkpoint.memory_interval=10"]
    args = [sys.executable, "-m", "megascale", *cmd, "model.n_layers=2", "model.d_model=32",
            "model.n_heads=2", "model.seq_len=32", "train.steps=120", "train.global_batch=4",
            "train.micro_batch=2", "train.eval_interval=40", "train.eval_batches=2", "train.log_interval=40",
            "log.progress=false", "log.sample_tokens=0", "checkpoint.interval=40", "checkpoint.keep=1",
            "observe.flush_interval_s=0.05",  # the trace written as the run goes, not in one piece
            f"checkpoint.path={ckpt}", f"train.run_dir={run_dir}", f"data.source={json.dumps(str(corpus))}",
            f"data.path={json.dumps(str(corpus.parent / 'cache'))}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": fault}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The corpus, and the final weights of the 120-step run on a roomy disk."""
    tmp = tmp_path_factory.mktemp("ref")
    corpus = tmp / "corpus"
    corpus.mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", corpus)
    ref = _train(tmp / "ref", tmp / "ref_ck", corpus)
    assert ref.returncode == 0, ref.stderr
    return corpus, read_model_state(tmp / "ref_ck" / "step_000120")[1], tmp / "ref"


def test_a_run_directory_that_fills_up_costs_its_records_not_the_run(small_disk, tmp_path, reference):
    corpus, want, _ = reference
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
    got = read_model_state(tmp_path / "ck" / "step_000120")[1]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_job_restarts_on_a_run_directory_that_filled_up(small_disk, tmp_path, reference):
    """The disk fills up mid-run (~step 45), then the worker dies at step 90: the restart starts on the full
    disk (its lock's holder line, its in-flight record, its trace all refused) and resumes to the end, with
    the weights of the run that met neither. Before, every restart crashed writing the lock file."""
    corpus, want, _ = reference
    disk = small_disk("64k")
    r = _train(disk / "run", tmp_path / "ck", corpus, fault="kill@step:90")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restarting the job (restart 1 of " in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    # its last snapshot: step 80's, or step 90's when that one committed before the kill (a race, both exact)
    assert re.search(r"resumed from memory at step (80|90) ", r.stdout), r.stdout[-3000:]
    got = read_model_state(tmp_path / "ck" / "step_000120")[1]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _fill(disk: Path) -> None:
    """Take every byte the disk has left."""
    try:
        with open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


def test_a_hang_verdict_on_a_full_disk_keeps_every_host_and_says_why(small_disk):
    """The driver's step after a hang with a clear culprit (host B) whose run directory is full: the
    blocklist, which is how B's own agent learns that it is out, cannot be written, so the restart keeps
    every host and the line says so (before: the OSError left the agent's monitor loop)."""
    from types import SimpleNamespace

    from test_hang_verdict import job, wait_in_world

    from megascale.config import FaultConfig
    from megascale.fault import blocklist
    from megascale.fault.driver import make_agent_class

    run = small_disk("1m") / "run"  # room for the four ranks' in-flight records
    blocklist.add(run, "C", "an earlier eviction")
    wait_in_world(job(run), [0, 1, 2])  # rank 3 (host B) computes for good
    _fill(run.parent)
    group = SimpleNamespace(workers=[SimpleNamespace(world_size=4)],
                            spec=SimpleNamespace(rdzv_handler=SimpleNamespace(get_run_id=lambda: "job")))
    agent = SimpleNamespace(run_dir=str(run), multi_host=True, fault=FaultConfig())
    text = make_agent_class()._judge_hang(agent, group)
    assert text.startswith("diagnosis: rank 3 "), text
    assert text.endswith(f"; host B stays: the run's blocklist ({run / 'blocklist.json'}) cannot be written "
                         "(No space left on device)"), text
    assert list(blocklist.read(run)) == ["C"]  # the list as it was, whole
    assert not [p.name for p in run.rglob("*.tmp*")]  # no part of a failed write holds the disk


def test_a_host_that_fails_its_self_check_on_a_full_disk_still_leaves(small_disk, tmp_path):
    """`megascale launch` with every rank's self-check failing and the run directory's disk full: the host
    leaves the job all the same (exit 4, not restarted); the line says its blocklist entry is missing."""
    from test_launch import JOB

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", corpus)
    run = small_disk("64k") / "run"
    run.mkdir()
    _fill(run.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": "fail@selfcheck:2"}
    r = subprocess.run([sys.executable, "-m", "megascale", "launch", "--nproc-per-node", "2", "--config",
                        "configs/cpu_default.toml", *JOB, f"data.source={json.dumps(str(corpus))}",
                        f"data.path={json.dumps(str(corpus / 'ds'))}", f"train.run_dir={run}",
                        f"checkpoint.path={tmp_path / 'ck'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, r.stderr[-3000:]
    assert "self-check failed: memory: injected" in r.stderr and "not restarting on it" in r.stderr, r.stderr
    assert (f"host {_host()} could not be put on the run's blocklist ({run / 'blocklist.json'}: No space "
            "left on device): it leaves this job, but a relaunch would take it back") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (run / "blocklist.json").exists() and not list(run.glob("blocklist.json.tmp*"))


def _host() -> str:
    from megascale.fault.inject import host_id

    return host_id()


def test_a_report_timeline_or_export_to_a_full_disk_is_one_line_and_leaves_nothing(small_disk, reference):
    disk = small_disk("64k")
    _fill(disk)
    out = disk / "out"
    ckpt = reference[2].parent / "ref_ck" / "step_000120"
    for verb, args, said in (
            ("report", [reference[2], "-o", out], f"cannot write the report to {out} (No space left on "),
            ("timeline", [reference[2], "-o", out], f"cannot write the timeline to {out} (No space left on "),
            ("export", [ckpt, "--format", "hf", "--output", out], f"--output {out}: cannot be written (")):
        r = subprocess.run([sys.executable, "-m", "megascale", verb, *map(str, args)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"megascale {verb}: error: {said}") and r.stderr.count("\n") == 1, r.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no part of it holds the disk


def test_a_dataset_built_onto_a_full_disk_is_one_line_naming_its_output(small_disk, reference):
    """`megascale preprocess` whose output fills the disk mid-way (and `megascale train` building data.path
    from data.source there): one line naming the output setting, exit 2, no part of the dataset left."""
    corpus = reference[0]
    disk = small_disk("64k")  # the sonnets as uint16 tokens are ~200 KB
    ds, run = disk / "ds", reference[2].parent / "r"
    for cmd, said in (
            (["preprocess", "--no-progress", "--input", corpus, "--output", ds],
             "preprocess: error: --output"),
            (["train", "model.n_layers=1", "train.steps=1", f"data.source={json.dumps(str(corpus))}",
              f"data.path={json.dumps(str(ds))}", f"train.run_dir={run}"], "train: error: data.path")):
        r = subprocess.run([sys.executable, "-m", "megascale", *map(str, cmd)], cwd=ROOT, text=True,
                           capture_output=True, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        want = f"megascale {said}: {disk / 'ds.bin'} cannot be written (No space left on device)"
        assert r.stderr.strip().splitlines()[-1] == want, r.stderr[-2000:]
        assert not list(disk.iterdir())


def test_a_restarts_in_flight_record_on_a_full_disk_drops_the_old_layout(small_disk, capsys):
    """A restart's in-flight record on a disk that filled up since: its file is zeroed in place (its blocks
    are there) and mapped; its sidecar with the groups cannot be rewritten, so the earlier start's (another
    layout's, after a shrink) goes rather than be read beside the new words."""
    from megascale.observe.inflight import InFlight, read_record

    d = small_disk("64k") / "inflight"
    InFlight(d, 0, {"world": [0, 1, 2, 3], "dp": [0, 2]}, host="h", coords={"dp": 0})
    assert read_record(d, 0)["groups"] == {"world": [0, 1, 2, 3], "dp": [0, 2]}
    _fill(d.parent)
    again = InFlight(d, 0, {"world": [0, 1]}, host="h", coords={})  # the job shrank to 2 ranks
    assert again.shared and (d / "rank_00000.bin").stat().st_size > 0
    assert read_record(d, 0) is None  # no reader pairs the new words with the old groups
    err = capsys.readouterr().err
    said = f"in-flight record of rank 0: cannot write {d / 'rank_00000.json'} (No space left on device)"
    assert said in err, err
