"""Start-up and training collectives have separate timeouts (distributed.timeout_s vs
distributed.collective_timeout_s): rank 0 tokenising for longer than a collective may wait does not
kill a healthy job, and a training collective stuck past its timeout fails the job soon, with the
hang dump written first."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.global_batch=8",
       "train.micro_batch=2", "train.eval_interval=0", "log.progress=false", "log.tensorboard=false",
       "log.sample_tokens=0", "log.peak_flops=1e9", "checkpoint.interval=0",
       "distributed.timeout_s=120", "distributed.collective_timeout_s=6"]


def _job(tmp_path: Path, fault: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    data = [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(tmp_path / 'ds'))}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCALE_INJECT": fault}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "megascale", "train", "--nproc", "2", "--config",
                        "configs/cpu_default.toml", *JOB, *data, f"train.run_dir={tmp_path / 'run'}", *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return r, time.time() - t0


def test_a_slow_dataset_preparation_is_not_a_collective_timeout(tmp_path):
    # rank 0 prepares the dataset 10 s longer than a training collective may wait; rank 1 waits for it
    r, _ = _job(tmp_path, "delay@prepare:10:rank=0", "train.steps=3", "parallel.dp=2")
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("layout", ["parallel.dp=2", "parallel.pp=2"])
def test_a_stuck_training_collective_fails_at_its_timeout_with_a_dump(tmp_path, layout):
    """dp: rank 0 blocks in a collective (the direct param all-gather); pp: in a pipeline receive. Both
    are p2p waits on gloo, which have no timeout of their own: they take the group's."""
    r, seconds = _job(tmp_path, "stop@step:2:rank=1", "train.steps=50", "observe.hang_timeout_s=300", layout)
    assert r.returncode != 0
    assert seconds < 120  # the 6 s collective timeout, not the 300 s hang timeout nor a 30 min default
    dump = tmp_path / "run" / "trace" / "hang" / "rank_00000.json"
    assert dump.exists(), r.stderr[-3000:]
    rec = json.loads(dump.read_text())
    assert "collective failed" in rec["reason"] and rec["record"]["current"] is not None
    # one line says it, naming the op and the dump; no traceback under it (the dump has the stacks)
    assert "megascale: rank 0: collective failed: " in r.stderr and f"stacks and in-flight ops in {dump}" \
        in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)  # as elastic starts one


def _ended(p: subprocess.Popen) -> None:
    """Until p has exited, its exit status left for its reaper (elastic's, in the launcher)."""
    while os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        time.sleep(0.02)


def test_a_failed_workers_stopped_peer_is_killed_not_waited_for():
    """`megascale train --nproc`: when a worker fails, its peers are SIGKILLed at once. Elastic's own
    SIGTERM and 30 s grace is lost on a peer that is stopped or stuck in a collective with the dead (that
    grace was 30 of the stuck-collective test's 44 s). A worker that ended as asked (a user error, a stop
    by SIGTERM after its save) leaves its peers to end by themselves."""
    from megascale.distributed.launch import ORDERLY, kill_the_rest_after_a_failure

    class Workers:  # elastic's process context, as far as the kill reads it
        def __init__(self, *procs):
            self.procs = procs

        def pids(self) -> dict[int, int]:
            return {i: p.pid for i, p in enumerate(self.procs)}

    def failed(code: int) -> bool:
        return code not in ORDERLY

    for code in (2, 143):
        done, peer = _child(f"raise SystemExit({code})"), _child("import time; time.sleep(60)")
        try:
            _ended(done)
            assert kill_the_rest_after_a_failure(Workers(done, peer), failed) == 0
            assert peer.poll() is None
        finally:
            peer.kill()
            peer.wait()
            done.wait()
    crashed, stopped = _child("raise SystemExit(1)"), _child("import time; time.sleep(60)")
    os.kill(stopped.pid, signal.SIGSTOP)
    _ended(crashed)
    assert kill_the_rest_after_a_failure(Workers(crashed, stopped), failed) == 1
    assert stopped.wait(timeout=10) == -signal.SIGKILL
    assert crashed.wait() == 1


def test_a_dead_peer_is_dumped_without_waiting_for_a_diagnosis():
    """A collective that fails because a peer died (gloo: "Connection closed by peer") writes this rank's
    dump and lets the error end the process at once; only a timeout (a hang) waits to take part in the
    diagnosis. Waiting on a dead peer's error cost 16 s of every crash in the cluster soak: the dead never
    dump, and the living count as live until their beats are 5 s old."""
    from types import SimpleNamespace

    from megascale.observe.session import Observer

    calls = []
    me = SimpleNamespace(watchdog=SimpleNamespace(dump=lambda reason, diagnose=True: calls.append(diagnose)
                                                  or "rank_00000.json"))
    said = [Observer.on_error(me, RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                               "[198.18.0.2]:39121")),
            Observer.on_error(me, RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                               "6000ms")),
            Observer.on_error(me, ValueError("not a collective's error"))]
    assert calls == [False, True] and said == [True, True, False]  # (said: no traceback after the line)
