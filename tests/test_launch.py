"""`megascale launch` on one host: faults recovered with no person involved, and exactly.

A dp2 job of 14 steps (float64, host-memory snapshots every 2 steps) runs fault-free once; then
the same job with one fault each: rank 1 killed with SIGKILL at step 7, rank 1 SIGSTOP'd at step
7 (its heartbeats stop), rank 0 skipping a collective (beats go on, the step does not move). Each
time the driver restarts the job, which resumes from host memory and ends with final weights
equal, bit for bit, to the fault-free run's. A user error is not restarted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megascale.checkpoint.model_state import read_model_state
from megascale.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.dropout=0.0",
       "train.global_batch=8", "train.micro_batch=2", "train.steps=14", "train.eval_interval=0",
       "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9",
       "checkpoint.interval=0", "checkpoint.memory_interval=2", "parallel.dp=2", "train.dtype=fp64",
       "fault.heartbeat_interval_s=1", "fault.heartbeat_timeout_s=8", "fault.hang_timeout_s=10",
       "fault.selfcheck_min_speed=0"]  # correctness checks only: this machine is shared, its speed varies


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("corpus")
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets_gut.txt")
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]


def launch(run_dir: Path, data: list[str], fault: str = "", *extra: str):
    """The job through `megascale launch` (2 workers on this host); (its result, seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGASCALE_INJECT", None)
    if fault:
        env["MEGASCALE_INJECT"] = fault
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "megascale", "launch", "--nproc-per-node", "2", "--config",
                        "configs/cpu_default.toml", *JOB, *data, f"train.run_dir={run_dir}", *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    return r, time.time() - t0


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_model_state(run_dir)[1]


def losses(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    r, _ = launch(run, data)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restarting" not in r.stderr
    return run


def _same_as_reference(run: Path, reference: Path) -> None:
    ref, got = final_weights(reference), final_weights(run)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert losses(run) == losses(reference)  # the re-done steps replace the lost ones in the log


@pytest.mark.parametrize("fault, detected", [
    ("kill@step:7:rank=1", r"crash: worker exit codes \{.*1: -9"),
    ("stop@step:7:rank=1", r"no heartbeat: rank 1 \(pid \d+\) sent no heartbeat for [\d.]+ s"),
    ("skip@agree:7:rank=0", r"hang: rank \d \(pid \d+\) beats but has made no new step"),
])
def test_a_fault_is_recovered_exactly(tmp_path, data, reference, fault, detected):
    run = tmp_path / "run"
    r, _ = launch(run, data, fault)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(detected, r.stderr), r.stderr[-3000:]
    assert "restarting the job (restart 1 of 3)" in r.stderr and "restart 2 of" not in r.stderr
    assert "resumed from memory at step 6" in r.stdout, r.stdout[-2000:]
    # where the restart's seconds went: the agent's phases on stderr, the workers' in the startup record
    assert re.search(r"restart: stopped [\d.]+ s, rendezvous [\d.]+ s, workers started [\d.]+ s \(round 1\)",
                     r.stderr), r.stderr[-3000:]
    starts = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"startup"' in x]
    assert [s["step"] for s in starts] == [0, 6]
    assert {"init_process_group", "selfcheck", "build", "restore", "observer", "peak"} <= starts[1].keys()
    _same_as_reference(run, reference)
    # the agent's event log (fault/events.py) says the same, for `megascale report`
    from megascale.fault.events import read_events

    events = read_events(run)
    assert [e["kind"] for e in events] == ["start", detected.split(":")[0], "restart", "end"], events
    seen = events[1]
    assert (seen["restart"], seen["max_restarts"]) == (1, 3), seen
    assert re.search(detected, f"{seen['kind']}: {seen['detail']}"), seen
    # when the fault began, as the agent knows it (ETTR's detection time): the monitor tick before a crash,
    # a silent rank's last beat, a stuck rank's last step, the latter two as long ago as the line says
    assert seen["since"] <= seen["t"], seen
    waited = re.search(r" for ([\d.]+) s", seen["detail"])
    assert not waited or seen["t"] - seen["since"] >= float(waited[1]) - 0.06, seen  # (said to 0.1 s)
    assert "of binary:" not in r.stderr, r.stderr[-3000:]  # elastic's line after ours, which says it
    assert set(events[2]["phases"]) == {"stopped", "rendezvous", "workers started"}
    assert events[-1]["code"] == 0 and events[0]["nproc_per_node"] == 2
    from megascale.observe.ettr import ettr_text

    train = read_metrics(run / "metrics.jsonl", "train")  # each record with its wall clock
    assert all(events[0]["t"] <= r["time"] <= events[-1]["t"] for r in train)
    assert re.fullmatch(r"ETTR [\d.]+% \([\d.]+ s of training steps in [\d.]+ s from the first agent's start "
                        r"to the last one's end\)", ettr_text(events, train))


def test_a_fault_before_the_first_snapshot_restarts_from_scratch_in_the_same_files(tmp_path, data, reference):
    # nothing to resume: the restart trains from step 0 again, but it is the same job, whose files stay
    # where they are (a fresh start of a new job archives an earlier run's: a hang's diagnosis went with them)
    run = tmp_path / "run"
    r, _ = launch(run, data, "kill@step:1:rank=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restarting the job (restart 1 of 3)" in r.stderr and "restart 2 of" not in r.stderr
    assert not (run / "archive").exists()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if '"startup"' in x] == [0, 0]  # both attempts', one file
    _same_as_reference(run, reference)


def test_a_failed_worker_has_a_stuck_one_killed_not_waited_for(tmp_path, data, reference):
    # rank 1 dies while rank 0 is stuck (deaf to the SIGTERM elastic would send, then wait 30 s for)
    run = tmp_path / "run"
    r, _ = launch(run, data, "kill@step:7:rank=1,hang@step:7:rank=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a worker failed: stopping the other 1 with SIGKILL" in r.stderr, r.stderr[-3000:]
    assert re.search(r"crash: worker exit codes \{.*0: -9", r.stderr), r.stderr[-3000:]
    _same_as_reference(run, reference)


def test_new_interpreters_instead_of_forks_recover_the_same(tmp_path, data, reference):
    # fault.prefork_workers = false: every worker a new `python -m megascale train`, as under torchrun
    run = tmp_path / "run"
    r, _ = launch(run, data, "kill@step:7:rank=1", "fault.prefork_workers=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"crash: worker exit codes \{.*1: -9", r.stderr), r.stderr[-3000:]
    assert re.search(r"start-up \(rank 0\): imports [\d.]+ s", r.stdout)
    _same_as_reference(run, reference)


def test_a_user_error_is_not_restarted(tmp_path, data):
    r, _ = launch(tmp_path / "run", data, "", "data.path=/nonexistent/ds", "data.source=")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "restarting" not in r.stderr


def test_launch_checks_its_own_arguments(tmp_path, data):
    r = subprocess.run([sys.executable, "-m", "megascale", "launch", "--nproc-per-node", "3", "--config",
                        "configs/cpu_default.toml", *JOB, *data, f"train.run_dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--nnodes x --nproc-per-node" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "megascale", "launch", "--nproc-per-node", "2", "--config",
                        "configs/cpu_default.toml", *JOB, *data, "checkpoint.resume=false",
                        f"train.run_dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "checkpoint.resume" in r.stderr, r.stderr


def test_nnodes_is_n_or_min_max_and_anything_else_one_line():
    from megascale.errors import UserError
    from megascale.fault.rendezvous import parse_nnodes

    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    for bad, says in [("two", "is not N or MIN:MAX"), ("1:2:3", "is not N or MIN:MAX"), (":2", "is not N"),
                      ("3:", "is not N"), ("3:2", "1 <= MIN <= MAX"), ("0", "1 <= MIN <= MAX")]:
        with pytest.raises(UserError, match=says):
            parse_nnodes(bad)


def test_sigterm_to_a_worker_stops_the_job_with_a_checkpoint_and_no_restart(tmp_path, data):
    """A SIGTERM that reaches a worker and not its agent (another host's agent preempted by its scheduler:
    the ranks agree to stop together): every rank saves and exits 143, and the agent ends the same way.
    Before, it read 143 as a crash and restarted; on a multi-host job it then waited for the stopped host
    until the rendezvous timed out (a traceback, exit 1)."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "megascale", "launch", "--nproc-per-node", "2", "--config",
            "configs/cpu_default.toml", *JOB, *data, f"train.run_dir={run}", "train.steps=4000"]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, metrics = time.time() + 120, run / "metrics.jsonl"
    while time.time() < deadline and (not metrics.exists() or len(read_metrics(metrics, "train")) < 3):
        time.sleep(0.2)
    header = (run / "trace" / "rank_00001.jsonl").read_text().splitlines()[0]
    os.kill(json.loads(header)["pid"], signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped: every worker saved and exited on SIGTERM" in err and "restarting" not in err, err[-3000:]
    step = int(re.search(r"stopped by SIGTERM after step (\d+)", out).group(1))
    assert (run / "checkpoints" / f"step_{step:06d}").is_dir() and step < 4000
    from megascale.fault.events import read_events

    assert [e["kind"] for e in read_events(run)] == ["start", "stopped", "end"]
    assert read_events(run)[-1]["code"] == 143


def test_a_round_that_never_fills_is_one_line(tmp_path, data):
    """`--nnodes 2` with one host started: after fault.rendezvous_timeout_s the agent says what it waited
    for and exits 1 (before: elastic's RendezvousTimeoutError traceback, after a fixed 120 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "megascale", "launch", "--nnodes", "2", "--nproc-per-node", "1",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--config", "configs/cpu_default.toml", *JOB,
                        *data, f"train.run_dir={tmp_path}/run", "fault.rendezvous_timeout_s=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "megascale launch: no rendezvous round formed within fault.rendezvous_timeout_s = 2 s: fewer than 2 "
        f"host(s) joined at 127.0.0.1:{port} (--nnodes 2). Is every host's agent started, with the same "
        "--rdzv-endpoint, --rdzv-id and --nnodes?"), r.stderr[-3000:]


def test_a_host_that_fails_its_self_check_is_not_restarted(tmp_path, data):
    r, _ = launch(tmp_path / "run", data, "fail@selfcheck:2:rank=1")  # rank 1's memory test fails
    assert r.returncode == 4, r.stderr[-3000:]
    assert "self-check failed: memory: injected" in r.stderr, r.stderr[-3000:]
    assert "not restarting on it" in r.stderr and "restarting the job" not in r.stderr
    from megascale.fault.events import read_events

    events = read_events(tmp_path / "run")
    assert [e["kind"] for e in events] == ["start", "selfcheck", "end"] and events[-1]["code"] == 4, events


def test_the_default_hang_timeout_follows_the_step_time():
    """fault.hang_timeout_s = 0 (the default): no new step for max(60 s, 20 x the median step) is a hang;
    60 s before the job has timed a step."""
    from megascale.config import FaultConfig
    from megascale.fault.driver import make_agent_class

    agent = object.__new__(make_agent_class())  # only the timeout's inputs: no workers, no rendezvous
    agent.fault, agent._intervals = FaultConfig(), []
    assert agent._hang_timeout() == 60.0
    agent._intervals = [1.0, 5.0, 6.0]  # seconds a step, as the beats showed
    assert agent._hang_timeout() == 100.0
    agent.fault = FaultConfig(hang_timeout_s=7.0)
    assert agent._hang_timeout() == 7.0
