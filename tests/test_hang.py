"""Hang diagnosis end to end: a dp2 x pp2 x tp2 job (8 processes) that hangs, two ways.

* rank 5 SIGSTOPs itself at the start of step 3 (a host that froze);
* rank 2 skips the step-3 loss all-reduce (a bug that desynchronises the collectives).

Either way the other ranks' watchdogs see no progress for observe.hang_timeout_s, dump their
in-flight ops and stacks, the lowest live rank writes the diagnosis, and `megascale diagnose`
names the culprit, and no other rank, within hang_timeout_s + 10 s of the hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.observe.inflight import read_record

ROOT = Path(__file__).resolve().parents[1]
HANG_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    import shutil

    d = tmp_path_factory.mktemp("corpus")
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]


def _hang(run_dir: Path, data: list[str], fault: str) -> tuple[float, str, dict, str]:
    """Start the job with `fault`, wait for the watchdogs' diagnosis; returns (seconds from the hang to
    the diagnosis file, `megascale diagnose` text, its --json, the watchdog's verdict). The job is
    killed whatever happens."""
    args = [sys.executable, "-m", "megascale", "train", "--nproc", "8", "--config",
            "configs/cpu_default.toml",
            "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
            "train.global_batch=8", "train.micro_batch=2", "train.steps=50", "train.eval_interval=0",
            "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9",
            "checkpoint.interval=0", "parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
            "parallel.dp_bucket_size=3000", f"observe.hang_timeout_s={HANG_TIMEOUT_S}",
            "observe.hang_action=dump", f"train.run_dir={run_dir}", *data]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": fault}
    job = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    verdict = run_dir / "trace" / "hang" / "diagnosis.txt"
    try:
        deadline = time.time() + 240
        while not verdict.exists():
            assert job.poll() is None, job.stdout.read()[-3000:]
            assert time.time() < deadline, "no diagnosis within 240 s"
            time.sleep(0.5)
        # when the hang began: the newest progress any rank recorded (they all stop within ms of it)
        recs = [read_record(run_dir / "trace" / "inflight", r) for r in range(8)]
        hung_at = max(r["updated_ns"] for r in recs) / 1e9
        detected = verdict.stat().st_mtime - hung_at
        out = subprocess.run([sys.executable, "-m", "megascale", "diagnose", str(run_dir)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        as_json = subprocess.run([sys.executable, "-m", "megascale", "diagnose", str(run_dir), "--json"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
        return detected, out.stdout, json.loads(as_json.stdout), verdict.read_text()
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # the stopped rank too: SIGKILL needs no SIGCONT
        except ProcessLookupError:
            pass  # the job ended by itself (its failure is asserted above)
        job.wait(timeout=30)
        _kill_workers_of(run_dir)


def _kill_workers_of(run_dir: Path) -> None:
    """The workers lead sessions of their own (elastic starts them so), out of the launcher's group: a
    SIGKILLed launcher leaves them, and with hang_action=dump they would sit out the rest of the suite
    on its cores. Every process whose command line names this run directory goes."""
    mark = f"train.run_dir={run_dir}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def test_a_stopped_rank_is_named(tmp_path, data):
    detected, text, js, verdict = _hang(tmp_path / "stop", data, "stop@step:3:rank=5")
    assert js["culprits"] == [5], text
    assert "rank 5" in verdict and "not responding" in text and "stopped" in text, text
    assert "dp1 pp0 tp1" in text
    assert 0 < detected <= HANG_TIMEOUT_S + 10, detected
    # every live rank dumped its stacks and in-flight op
    dumps = sorted((tmp_path / "stop" / "trace" / "hang").glob("rank_*.json"))
    assert len(dumps) == 7 and "rank_00005.json" not in {d.name for d in dumps}
    one = json.loads(dumps[0].read_text())
    assert one["record"]["current"] is not None and one["threads"]


def test_a_rank_that_skips_a_collective_is_named(tmp_path, data):
    detected, text, js, verdict = _hang(tmp_path / "skip", data, "skip@agree:3:rank=2")
    assert js["culprits"] == [2], text
    assert "skipped or never reached world all_reduce" in text, text
    assert 0 < detected <= HANG_TIMEOUT_S + 10, detected


def test_by_default_a_hang_ends_the_job_and_a_rank_besides_0_says_who(tmp_path, data):
    """observe.hang_action's default ("abort"): the live ranks dump, diagnose and exit 3, so a launcher
    restarts the job. Rank 0 is the frozen one here: rank 1 diagnoses, and it is heard on stderr (only
    rank 0's lines reached it before)."""
    run_dir = tmp_path / "abort"
    args = [sys.executable, "-m", "megascale", "train", "--nproc", "2", "model.n_layers=2",
            "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.global_batch=4",
            "train.micro_batch=2", "train.steps=50", "train.eval_interval=0", "log.progress=false",
            "log.tensorboard=false", "log.sample_tokens=0", "checkpoint.interval=0", "parallel.dp=2",
            "observe.hang_timeout_s=5", f"train.run_dir={run_dir}", *data]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": "stop@step:3:rank=0"}
    try:
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        _kill_workers_of(run_dir)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "megascale: rank 1: no progress for" in r.stderr and "\nculprit: 0\n" in r.stderr, r.stderr[-3000:]
    assert 'megascale: rank 1: aborting (observe.hang_action = "abort")' in r.stderr, r.stderr[-3000:]
    assert "culprit: 0" in (run_dir / "trace" / "hang" / "diagnosis.txt").read_text()
