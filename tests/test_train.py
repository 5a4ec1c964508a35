"""The trainer end to end on tiny models: exact resume, clean stop on SIGTERM, bad input."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megascale.checkpoint import list_checkpoints
from megascale.config import load_config
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["hamlet_gut.txt", "macbeth_gut.txt", "sonnets_gut.txt"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS:
        shutil.copy(ROOT / "data" / "shakespeare" / name, d / name)
    return d


def tiny(corpus: Path, run_dir: Path, *extra: str):
    return load_config(None, [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "model.dropout=0.1",
        "train.global_batch=8", "train.micro_batch=4", "train.steps=6", "train.eval_interval=3",
        "train.eval_batches=2", "optim.warmup_steps=2", "log.progress=false", "log.tensorboard=false",
        "log.sample_tokens=0", f"data.source={json.dumps(str(corpus))}",
        f"data.path={json.dumps(str(corpus.parent / 'cache' / 'tiny'))}",
        f"train.run_dir={json.dumps(str(run_dir))}", "checkpoint.interval=0", *extra,
    ])


def weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("optim", ["adamw", "lamb"])
def test_resume_is_bit_exact(corpus, tmp_path, optim):
    full = Trainer(tiny(corpus, tmp_path / "full", f"optim.name={optim}"), quiet=True)
    r_full = full.fit()
    assert r_full["steps"] == 6 and len(r_full["losses"]) == 6

    first = Trainer(tiny(corpus, tmp_path / "split", f"optim.name={optim}"), quiet=True)
    r1 = first.fit(max_steps=4)
    assert r1["steps"] == 4 and [s for s, _ in list_checkpoints(tmp_path / "split")] == [4]
    # Disturb the global RNG: a resume must restore it, not inherit the process's state.
    torch.manual_seed(999)
    second = Trainer(tiny(corpus, tmp_path / "split", f"optim.name={optim}"), quiet=True)
    assert second.step == 4
    r2 = second.fit()
    assert r1["losses"] + r2["losses"] == r_full["losses"]  # exact, not approximately
    assert r2["val_loss"] == r_full["val_loss"]
    wa, wb = weights(full), weights(second)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # The metrics file of the resumed run reads like the uninterrupted one.
    def train_losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]

    assert train_losses("split") == train_losses("full")


def test_one_process_keeps_no_per_op_samples_that_nobody_reads(corpus, tmp_path):
    """The compute spans' durations are kept for the straggler detector, which takes them every
    observe.straggler_window steps in a multi-rank job; one process has none, and they grew by ~260 bytes a
    step for good (1.3 MB per 5000 steps of a 2-layer model, found by tracemalloc)."""
    trainer = Trainer(tiny(corpus, tmp_path / "run"), quiet=True)
    trainer.fit()
    assert trainer.observer.recorder is not None and trainer.observer.recorder.samples is None


def test_no_validation_batch_is_said_once_and_no_nan_is_logged(corpus, tmp_path, capsys):
    """A split with no validation micro-batch (data.val_fraction = 0 here; a one-file .txt corpus, one
    document, the same): one line at the start, and no "val loss nan" line or record every eval_interval."""
    r = Trainer(tiny(corpus, tmp_path / "run", "data.val_fraction=0"), quiet=False).fit()
    out = capsys.readouterr().out
    assert "validation off: the validation split has 0 samples, fewer than one micro-batch (4)" in out, out
    assert "val loss" not in out and math.isnan(r["val_loss"])
    kinds = {json.loads(x)["kind"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()}
    assert "train" in kinds and "val" not in kinds
    r = Trainer(tiny(corpus, tmp_path / "val"), quiet=False).fit()  # the same job with a validation split
    out = capsys.readouterr().out
    assert "validation off" not in out and "step 3: val loss " in out and math.isfinite(r["val_loss"])


def test_loss_decreases_and_generate(corpus, tmp_path):
    cfg = tiny(corpus, tmp_path / "run", "train.steps=30", "optim.lr=3e-3", "model.dropout=0.0",
               "train.eval_interval=30")
    r = Trainer(cfg, quiet=True).fit()
    assert r["losses"][-1] < r["losses"][0] - 1.0
    out = _cli(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "HAMLET:",
                "--max-new-tokens", "20"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("HAMLET:") and len(out.stdout) > len("HAMLET:")


def _cli(args, **kw):
    return subprocess.run([sys.executable, "-m", "megascale", *args], capture_output=True, text=True,
                          cwd=ROOT, **kw)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_saves_and_resumes(corpus, tmp_path, sig):
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C) mid-run: the step in flight finishes, a checkpoint is
    written, exit 143 / 130; the same command then finishes the run with the losses of an uninterrupted
    one."""
    # A constant schedule: the resumed command shortens train.steps, which must not change the lr.
    cfg = tiny(corpus, tmp_path / "sig", "train.steps=400", "optim.schedule=constant")
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    cmd = [sys.executable, "-m", "megascale", "train", "--config", str(tmp_path / "c.toml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "sig" / "metrics.jsonl"
    deadline = time.time() + 120
    # three steps done (not three lines: the start-up, layout and peak records come before any step)
    while time.time() < deadline and (not metrics.exists()
                                      or metrics.read_text().count('"kind": "train"') < 3):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and f"stopped by {sig.name} after step" in out, (out, err)
    saved = list_checkpoints(tmp_path / "sig")
    assert len(saved) == 1 and 3 <= saved[0][0] < 400
    k = saved[0][0]
    r = _cli(["train", "--config", str(tmp_path / "c.toml"), "train.steps=" + str(k + 2)])
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    reference = Trainer(tiny(corpus, tmp_path / "ref", "train.steps=400", "optim.schedule=constant"),
                        quiet=True).fit(max_steps=k + 2)
    got = [json.loads(x)["loss"] for x in metrics.read_text().splitlines() if '"train"' in x]
    assert got == reference["losses"]


def test_a_second_ctrl_c_stops_at_once(corpus, tmp_path):
    """Ctrl-C twice: the user means it: no waiting for the step and the save, exit 130, one line; the
    run directory is left fit for the same command to start again."""
    (tmp_path / "c.toml").write_text(tiny(corpus, tmp_path / "int", "train.steps=400").to_toml())
    cmd = [sys.executable, "-m", "megascale", "train", "--config", str(tmp_path / "c.toml")]
    # every forward takes a second (as a big model's would): both signals land inside a step, whatever
    # this machine's load, and the first alone would have it finish that step and save
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MEGASCALE_INJECT": "delay@forward:1"})
    metrics = tmp_path / "int" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or '"kind": "train"' not in metrics.read_text()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # two signals sent at once are one to the kernel
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "megascale train: interrupted" and "Traceback" not in err, err
    assert "stopped by SIGINT" not in out and not list_checkpoints(tmp_path / "int")  # no step, no save
    r = _cli(["train", "--config", str(tmp_path / "c.toml"), "train.steps=2"])
    assert r.returncode == 0 and "done: 2 steps" in r.stdout, r.stderr


def test_torchrun_runs_the_same_job_as_nproc(corpus, tmp_path):
    """`torchrun --nproc-per-node 2 -m megascale train` and `megascale train --nproc 2` (pp2): the same
    losses, and rank 0 of each prints the same sample, from the model gathered off both stages."""
    samples = []
    for name, launcher in [("nproc", [sys.executable, "-m", "megascale", "train", "--nproc", "2"]),
                           ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc-per-node", "2", "-m", "megascale", "train"])]:
        cfg = tiny(corpus, tmp_path / name, "parallel.pp=2", "train.steps=2", "train.eval_interval=0",
                   "model.dropout=0", "log.sample_tokens=12", "log.sample_prompt=HAMLET:")
        (tmp_path / f"{name}.toml").write_text(cfg.to_toml())
        r = subprocess.run([*launcher, "--config", str(tmp_path / f"{name}.toml")], capture_output=True,
                           text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.count("--- sample (12 tokens from 'HAMLET:') ---\nHAMLET:") == 1, r.stdout
        samples.append(r.stdout.split("--- sample")[1])
    losses = [[json.loads(x)["loss"] for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()
               if '"train"' in x] for n in ("nproc", "torchrun")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert samples[0] == samples[1]


def test_resume_flags(corpus, tmp_path):
    """--resume insists on a checkpoint (one line, exit 2, when there is none); --no-resume starts fresh
    beside one, the earlier run archived."""
    (tmp_path / "c.toml").write_text(tiny(corpus, tmp_path / "run", "train.steps=2").to_toml())
    train = ["train", "--config", str(tmp_path / "c.toml")]
    r = _cli([*train, "--resume"])
    assert r.returncode == 2 and r.stderr.strip() == (
        f"megascale train: error: --resume: no checkpoint in {tmp_path / 'run' / 'checkpoints'}"), r.stderr
    assert _cli(train).returncode == 0  # (resuming itself: the tests above)
    r = _cli([*train, "--no-resume"])
    assert r.returncode == 0 and "fresh start" in r.stdout and "done: 2 steps" in r.stdout, r.stdout
    assert len(list((tmp_path / "run" / "archive").iterdir())) == 1


def test_bad_inputs_are_one_line_exit_2(corpus, tmp_path, capsys):
    """The first through a process of its own (the exit code a shell sees), the rest through the same
    main() in this one (an interpreter's start-up less each)."""
    from megascale.cli import main

    base = ["train", "--config", str(ROOT / "configs" / "cpu_default.toml"), "model.n_layers=1",
            "model.d_model=32", "model.n_heads=2", "train.steps=1"]
    runs = iter(range(100))

    def check(extra, expect, own_process=False):
        run_dir = tmp_path / f"run{next(runs)}"
        if own_process:
            r = _cli([*base, f"train.run_dir={run_dir}", *extra])
            code, out, err = r.returncode, r.stdout, r.stderr
        else:
            capsys.readouterr()
            code = main([*base, f"train.run_dir={run_dir}", *extra])
            out, err = capsys.readouterr()
        assert code == 2, (extra, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], err
        assert not run_dir.exists(), "nothing may be written for bad input"

    check([f"data.path={tmp_path}/nowhere/ds", "data.source="], "does not exist", own_process=True)
    check([f"data.path={tmp_path}/x/ds", f"data.source={tmp_path}/no_such_dir"], "data.source")
    check([f"data.tokenizer={tmp_path}/missing/tokenizer.json"], "tokenizer.json")
    check(["model.n_layrs=2"], "model.n_layrs: unknown field")

    # a corrupt .idx: build a good dataset, then damage its index
    good = tmp_path / "good"
    assert main(["preprocess", "--input", str(corpus), "--output", str(good / "ds"), "--no-progress"]) == 0
    idx = good / "ds.idx"
    idx.write_bytes(b"garbage" + idx.read_bytes()[7:])
    check([f"data.path={good}/ds", "data.source="], "ds.idx")


def test_a_warmup_stable_decay_run_is_extended_on_resume(corpus, tmp_path):
    """optim.schedule = wsd through the Trainer: a run planned for 8 steps, stopped at 5 (before its
    decay) and resumed with train.steps = 12, had the lr of the longer plan at every step: the stable
    phase grew, the decay moved to the new end, down to min_lr."""
    from megascale.optim import lr_at

    wsd = ("optim.schedule=wsd", "optim.decay_fraction=0.25", "optim.warmup_steps=2", "optim.min_lr=1e-5",
           "train.eval_interval=0")
    cfg = tiny(corpus, tmp_path / "run", "train.steps=8", *wsd)
    Trainer(cfg, quiet=True).fit(max_steps=5)
    longer = tiny(corpus, tmp_path / "run", "train.steps=12", *wsd)
    again = Trainer(longer, quiet=True)
    assert again.step == 5
    again.fit()
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
           if json.loads(x)["kind"] == "train"]
    assert lrs == [lr_at(s, longer.optim, 12) for s in range(12)]
    assert lrs[2:9] == [longer.optim.lr] * 7 and lrs[-1] < lrs[-2] < lrs[8]  # stable to step 9, then down


def test_a_resume_on_other_tokens_is_refused_and_on_a_moved_copy_goes_on(corpus, tmp_path):
    """The data position in a checkpoint is a count of samples: a dataset rebuilt with the same sizes and
    other tokens (another tokenizer's ids) went on "exactly" over other text. Now one line naming the
    field, the checkpoint kept; the same tokens at another path resume."""
    from megascale.data.indexed import IndexedDataset
    from megascale.errors import UserError

    first = tmp_path / "first" / "ds"
    cfg = tiny(corpus, tmp_path / "run", "train.steps=2", f"data.path={json.dumps(str(first))}")
    Trainer(cfg, quiet=True).fit()
    moved = tmp_path / "moved"
    shutil.copytree(first.parent, moved)  # the same tokens elsewhere: resumes
    at = f"data.path={json.dumps(str(moved / 'ds'))}"
    again = Trainer(tiny(corpus, tmp_path / "run", "train.steps=3", at), quiet=True)
    assert again.step == 2
    again.close()
    dtype = IndexedDataset(first).tokens.dtype
    tokens = np.fromfile(first.with_suffix(".bin"), dtype=dtype)
    ((tokens + 1) % 256).astype(dtype).tofile(first.with_suffix(".bin"))  # the same sizes, other ids
    with pytest.raises(UserError, match=r"^data.path: holds other data than the checkpoint was taken on: .* "
                       r"\(the same sizes, other tokens\); resuming needs the same tokens .*model.init_from"):
        Trainer(tiny(corpus, tmp_path / "run", "train.steps=3", f"data.path={json.dumps(str(first))}"),
                quiet=True)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]


def test_corrupt_checkpoint_is_a_clear_error(corpus, tmp_path):
    cfg = tiny(corpus, tmp_path / "run", "train.steps=2")
    Trainer(cfg, quiet=True).fit()
    (_, ckpt), = list_checkpoints(tmp_path / "run")
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    r = _cli(["train", "--config", str(tmp_path / "c.toml"), "train.steps=3"])
    assert r.returncode == 2 and "__0_0.distcp: checksum mismatch" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_train_without_config_trains_the_cpu_default(tmp_path):
    """`megascale train` with no --config, from another directory: the CPU default on the bundled data."""
    r = subprocess.run([sys.executable, "-m", "megascale", "train", "train.steps=2", "model.n_layers=1",
                        "model.d_model=32", "model.n_heads=2", "train.eval_interval=0", "log.sample_tokens=0",
                        "log.progress=false", f"train.run_dir={tmp_path / 'run'}",
                        f"data.path={tmp_path / 'ds'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "done: 2 steps" in r.stdout
    config = (tmp_path / "run" / "config.toml").read_text()
    assert "seq_len = 128" in config and "lr = 0.002" in config  # configs/cpu_default.toml's values
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))  # log.tensorboard's default


def test_the_cli_ends_every_thread_of_the_run_before_it_returns(corpus, tmp_path):
    """`megascale train` closes its Trainer: no trace writer, heartbeat, loader or checkpoint thread is left
    running into interpreter exit, where a daemon thread inside a torch call aborts the process (CI saw
    "terminate called without an active exception", SIGABRT, from a finished `--nproc 2` run)."""
    import threading

    from megascale.cli import main

    before = set(threading.enumerate())
    args = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "train.steps=2",
            "train.global_batch=8", "train.micro_batch=4", "train.eval_interval=0", "log.progress=false",
            "log.tensorboard=false", "log.sample_tokens=0", "checkpoint.interval=1",
            f"data.source={json.dumps(str(corpus))}",
            f"data.path={json.dumps(str(corpus.parent / 'cache' / 'tiny'))}",
            f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"]
    assert main(["train", *args]) == 0
    # (tqdm's monitor thread is pure Python, shared by every bar of the process, and harmless)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name != "tqdm_monitor"]
    assert not left, left


def test_compile_trains_as_eager_does(corpus, tmp_path):
    """train.compile = true: the model's forward runs as a torch.compile'd graph and trains as eager does
    (float32; the fused kernels round differently). Dropout off: under compile its masks are inductor's
    draws, not eager's bits."""
    run = ["model.dropout=0", "model.n_layers=1", "train.steps=2", "train.eval_interval=0"]
    eager = Trainer(tiny(corpus, tmp_path / "eager", *run), quiet=True).fit()
    compiled = Trainer(tiny(corpus, tmp_path / "compiled", *run, "train.compile=true"), quiet=True)
    assert all(block._compiled_call_impl is not None for block in compiled.engine.model.blocks)
    losses = compiled.fit()["losses"]
    assert losses == pytest.approx(eager["losses"], rel=1e-5) and losses[0] != losses[1]
    # sampling gets the trained weights in eager blocks (a growing context would recompile them)
    sampler = compiled.full_model()
    assert all(block._compiled_call_impl is None for block in sampler.blocks)
    assert all(torch.equal(v, compiled.model.state_dict()[k]) for k, v in sampler.state_dict().items())
