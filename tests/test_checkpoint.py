"""Two-stage checkpoints through the Trainer: memory then storage, faults, and a safe run directory.

Every fault test compares with an uninterrupted run: the recovered run's final weights must be
the same, bit for bit (one process, same layout: nothing may be lost or replayed differently).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from megascale.checkpoint import list_checkpoints, read_model_state, set_rng_state
from megascale.checkpoint.rng import rng_state
from megascale.checkpoint.storage import COMMIT, Storage
from megascale.config import load_config
from megascale.errors import UserError
from megascale.observe.metrics import read_metrics
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt-corpus")
    for name in ("hamlet_gut.txt", "sonnets_gut.txt"):
        shutil.copy(ROOT / "data" / "shakespeare" / name, d / name)
    return d


def args(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "model.dropout=0.1",
        "train.global_batch=8", "train.micro_batch=4", "train.steps=8", "train.eval_interval=0",
        "optim.warmup_steps=2", "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0",
        "log.peak_flops=1e9", f"data.source={json.dumps(str(corpus))}",
        f"data.path={json.dumps(str(corpus / 'ds'))}", f"train.run_dir={json.dumps(str(run_dir))}",
        f"checkpoint.memory_dir={json.dumps(str(run_dir.parent / 'shm'))}", "checkpoint.interval=3", *extra,
    ]


def trainer(corpus: Path, run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, args(corpus, run_dir, *extra)), quiet=True)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_model_state(run_dir)[1]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cli(corpus: Path, run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`megascale train --config FILE` with the same config as `trainer(...)`."""
    config = run_dir.parent / f"config-{uuid.uuid4().hex[:8]}.toml"
    config.write_text(load_config(None, args(corpus, run_dir, *extra)).to_toml())
    return subprocess.run([sys.executable, "-m", "megascale", "train", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})},
                          timeout=300)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run (8 steps, dropout on) every recovery must reproduce."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    trainer(corpus, run_dir).fit()
    return final_weights(run_dir)


def memory_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir.parent / "shm").rglob("*.json"))


# ------------------------------------------------------------------ stage 1 + stage 2 and restore


def test_restores_from_memory_after_the_writer_is_killed(corpus, tmp_path, reference):
    """kill -9 in stage 2 of step 6 (shards written, no commit marker): the next start restores the
    host-memory snapshot (newer than storage's step 3), and the run ends with the reference weights."""
    run_dir = tmp_path / "run"
    r = cli(corpus, run_dir, "checkpoint.memory_interval=1", env={"MEGASCALE_INJECT": "kill@persist:6"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    storage = Storage(run_dir / "checkpoints")
    assert [s for s, _ in storage.committed()] == [3]
    assert [s for s, _ in storage.partial()] == [6]  # the killed persist: never taken for a checkpoint
    assert memory_files(run_dir)
    r = cli(corpus, run_dir, "checkpoint.memory_interval=1")
    assert r.returncode == 0, r.stderr
    assert "resumed from memory at step" in r.stdout
    step = int(r.stdout.split("resumed from memory at step ")[1].split()[0])
    assert step >= 6
    assert same(final_weights(run_dir), reference)
    assert [s for s, _ in storage.committed()] == [3, 8] and not storage.partial()  # keep=2, leftovers gone
    assert not memory_files(run_dir)  # freed once storage holds the final state


def test_a_killed_writer_process_is_one_line_and_training_goes_on(corpus, tmp_path, reference):
    """kill -9 of the writer process (stage 2 of step 4, persists every 2 steps): that persist fails with
    one line, training goes on, a new writer persists step 6, and the end is persisted; nothing is lost."""
    run_dir = tmp_path / "run"
    r = cli(corpus, run_dir, "checkpoint.interval=2", "checkpoint.writer_process_min_mb=0",
            env={"MEGASCALE_INJECT": "kill@writer:4"})
    assert r.returncode == 0, r.stderr
    fails = [ln for ln in r.stderr.splitlines() if "persisting step" in ln]
    assert len(fails) == 1 and "persisting step 4" in fails[0] and "writer process of rank 0 died" in fails[0]
    assert "step 2 stays the newest checkpoint" in fails[0], r.stderr
    assert [s for s, _ in Storage(run_dir / "checkpoints").committed()] == [6, 8]
    assert same(final_weights(run_dir), reference)


def test_a_final_persist_with_no_writer_running_is_written_by_the_training_process(corpus, tmp_path,
                                                                                     reference):
    """Only the end persisted (checkpoint.interval=0): starting a writer process (a new interpreter
    importing torch) would cost more than the write, and nothing trains beside it, so none is started;
    with persists along the way the one writer started for them writes the end too."""
    big = "checkpoint.writer_process_min_mb=0"  # any state is large enough for a process
    t = trainer(corpus, tmp_path / "end", "checkpoint.interval=0", big)
    t.fit()
    assert t.checkpoints.writer is not None and t.checkpoints.writer.started == 0
    assert [s for s, _ in Storage(tmp_path / "end" / "checkpoints").committed()] == [8]
    assert same(final_weights(tmp_path / "end"), reference)
    t = trainer(corpus, tmp_path / "along", big)
    t.fit()
    assert t.checkpoints.writer.started == 1
    assert [s for s, _ in Storage(tmp_path / "along" / "checkpoints").committed()] == [6, 8]
    assert {r["writer"] for r in read_metrics(tmp_path / "along" / "metrics.jsonl", "persist")} == {"process"}


def test_a_state_below_writer_process_min_mb_is_persisted_from_a_thread(corpus, tmp_path, reference):
    """This model's state is ~0.1 MB: a writer process (seconds of CPU to start, ~300 MB of memory) would
    cost more than the GIL a thread takes from training to write it, so no process is started; the same
    checkpoints, the same weights."""
    t = trainer(corpus, tmp_path / "run")
    t.fit()
    assert t.checkpoints.writer is None
    assert [s for s, _ in Storage(tmp_path / "run" / "checkpoints").committed()] == [6, 8]
    writers = {r["writer"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "persist")}
    assert writers == {"training process"}, writers
    assert same(final_weights(tmp_path / "run"), reference)


def test_restores_from_storage_when_memory_is_gone(corpus, tmp_path, reference):
    """The same kill, and the host lost too (its memory cleared): storage's step 3, the previous complete
    checkpoint, is restored, and the run still ends with the reference weights."""
    run_dir = tmp_path / "run"
    r = cli(corpus, run_dir, env={"MEGASCALE_INJECT": "kill@persist:6"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    shutil.rmtree(run_dir.parent / "shm")
    r = cli(corpus, run_dir)
    assert r.returncode == 0, r.stderr
    assert "resumed from storage at step 3" in r.stdout
    assert same(final_weights(run_dir), reference)


def test_a_flipped_byte_falls_back_to_the_previous_checkpoint(corpus, tmp_path, reference):
    run_dir = tmp_path / "run"
    trainer(corpus, run_dir).fit(max_steps=6)  # checkpoints at 3 and 6 (the end of this call)
    (_, s6), = [c for c in list_checkpoints(run_dir) if c[0] == 6]
    shard = s6 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    r = cli(corpus, run_dir)
    assert r.returncode == 0, r.stderr
    assert f"{shard}: checksum mismatch" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "resumed from storage at step 3" in r.stdout
    assert same(final_weights(run_dir), reference)


def test_metadata_that_is_not_dcp_is_never_unpickled(corpus, tmp_path, reference):
    run_dir = tmp_path / "run"
    trainer(corpus, run_dir).fit(max_steps=6)
    (_, s6), = [c for c in list_checkpoints(run_dir) if c[0] == 6]
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (s6 / ".metadata").write_bytes(pickle.dumps(Evil()))
    record = json.loads((s6 / COMMIT).read_text())  # a consistent commit marker: only the loader can refuse
    digest, n = Storage(run_dir / "checkpoints").sha256(str(s6 / ".metadata"))
    record["files"][".metadata"] = {"sha256": digest, "bytes": n}
    (s6 / COMMIT).write_text(json.dumps(record))
    with pytest.raises(UserError, match="not allowed in checkpoint metadata"):
        trainer(corpus, run_dir)
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_fails_the_persist_and_training_goes_on(corpus, tmp_path, reference):
    """Storage on a tmpfs with room for one checkpoint: the second persist fails with one line naming
    the path and the cause, training finishes, the run fails for want of its final checkpoint, and the
    next start (memory lost) restores the first."""
    probe = tmp_path / "probe"
    trainer(corpus, probe).fit(max_steps=3)
    size = sum(f.stat().st_size for f in (probe / "checkpoints" / "step_000003").iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run_dir = tmp_path / "run"
        r = cli(corpus, run_dir, f"checkpoint.path={json.dumps(str(disk))}")
        assert r.returncode == 2 and "the final state (step 8) did not reach storage" in r.stderr, r.stderr
        fails = [ln for ln in r.stderr.splitlines() if "persisting step" in ln]
        assert fails and all("No space left on device" in ln and str(disk) in ln for ln in fails), r.stderr
        assert "persisting step 6" in fails[0] and "step 3 stays the newest checkpoint" in fails[0]
        assert [s for s, _ in Storage(disk).committed()] == [3]
        assert memory_files(run_dir)  # the final state is not in storage: memory keeps it
        shutil.rmtree(run_dir.parent / "shm")
        r = cli(corpus, run_dir, f"checkpoint.path={json.dumps(str(disk))}", "checkpoint.interval=0")
        assert "resumed from storage at step 3" in r.stdout, (r.stdout, r.stderr)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_final_state_storage_lacks_fails_the_run_and_a_rerun_writes_it(corpus, tmp_path, reference):
    """The end's persist fails (a full disk at step 8): the run exits 2 with one line saying so and where
    the state is kept; the same command again resumes from host memory and writes it, nothing re-trained."""
    run_dir = tmp_path / "run"
    r = cli(corpus, run_dir, env={"MEGASCALE_INJECT": "full@write:8"})
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "the final state (step 8) did not reach storage" in last, last
    assert "No space left on device" in last and "it stays in host memory" in last, last
    assert "run the same command again" in last, last
    storage = Storage(run_dir / "checkpoints")
    assert [s for s, _ in storage.committed()] == [3, 6] and memory_files(run_dir)
    assert not storage.partial()  # the failed persist's files are removed: they would only take room
    r = cli(corpus, run_dir)
    assert r.returncode == 0, r.stderr
    assert "resumed from memory at step 8" in r.stdout, r.stdout
    assert "done: the run is at step 8 of train.steps=8; nothing to train" in r.stdout, r.stdout
    assert [s for s, _ in storage.committed()] == [6, 8] and not memory_files(run_dir)
    assert same(final_weights(run_dir), reference)


def test_a_run_dir_or_storage_that_cannot_be_written_is_refused_at_the_start(corpus, tmp_path):
    """One line naming the field and the path, exit 2, before any step: not a traceback, nor a lost final
    checkpoint hours later."""
    r = cli(corpus, tmp_path / "run", "checkpoint.path=/proc/megascale-nope")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "checkpoint.path /proc/megascale-nope: cannot write there" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    r = cli(corpus, tmp_path / "run", "train.run_dir=/proc/megascale-nope/run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "train.run_dir /proc/megascale-nope/run: cannot be created or written" in r.stderr, r.stderr


@pytest.mark.parametrize("mode", [
    ["checkpoint.async_persist=false", "checkpoint.async_snapshot=false", "checkpoint.writer_process=false"],
    ["checkpoint.memory=false"],
    ["checkpoint.memory_interval=1", "checkpoint.interval=2", "checkpoint.keep=1"],
], ids=["synchronous", "private-memory", "snapshot-every-step"])
def test_every_mode_checkpoints_the_same_state(corpus, tmp_path, reference, mode):
    run_dir = tmp_path / "run"
    first = trainer(corpus, run_dir, *mode)
    first.fit(max_steps=5)
    second = trainer(corpus, run_dir, *mode)
    assert second.step == 5 and second.restored.source == "storage"
    second.fit()
    assert same(final_weights(run_dir), reference)
    keep = 1 if "checkpoint.keep=1" in mode else 2
    assert len(list_checkpoints(run_dir)) == keep


def test_fsspec_storage(corpus, tmp_path, reference):
    url = f"memory://megascale-test-{uuid.uuid4().hex}"
    trainer(corpus, tmp_path / "run", f"checkpoint.path={url}").fit(max_steps=4)
    second = trainer(corpus, tmp_path / "run", f"checkpoint.path={url}")
    assert second.step == 4 and second.restored.where.startswith("memory://")
    second.fit()
    storage = Storage(url)
    assert [s for s, _ in storage.committed()] == [6, 8]
    w = {}
    from megascale.checkpoint.dcp_io import load_chunks, stored_tensors
    from megascale.checkpoint.shards import Chunk
    for fqn, md in stored_tensors(storage, storage.step_dir(8)).items():
        if fqn.startswith("model/"):
            w[fqn[6:]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    load_chunks(storage, storage.step_dir(8), [Chunk(f"model/{k}", tuple(t.shape), (0,) * t.ndim, t, False)
                                                for k, t in w.items()])
    assert all(torch.equal(w[k], reference[k]) for k in w)


def test_dcp_tools_read_the_checkpoint(corpus, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir = tmp_path / "run"
    trainer(corpus, run_dir).fit(max_steps=3)
    (_, ckpt), = list_checkpoints(run_dir)
    dcp_to_torch_save(str(ckpt), str(tmp_path / "whole.pt"))
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert "model/embed.tok.weight" in state and "optim/exp_avg/embed.tok.weight" in state
    assert state["optim/step/embed.tok.weight"].item() == 3


# ------------------------------------------------------------------ the run directory


def test_fresh_start_archives_the_earlier_run(corpus, tmp_path):
    run_dir = tmp_path / "run"
    trainer(corpus, run_dir, "checkpoint.interval=2").fit()  # checkpoints 6, 8 (keep 2)
    t = trainer(corpus, run_dir, "checkpoint.resume=false", "train.steps=3", "checkpoint.interval=1")
    assert t.step == 0
    t.fit()
    archived = list((run_dir / "archive").iterdir())
    assert len(archived) == 1
    old = sorted(p.name for p in (archived[0] / "checkpoints").iterdir())
    assert old == ["step_000006", "step_000008"]
    assert (archived[0] / "metrics.jsonl").exists()
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 3]  # the new run's, not trimmed against 8
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == [1, 2, 3]
    assert trainer(corpus, run_dir, "train.steps=3").step == 3  # a resume finds the new run's


def test_fresh_start_refuses_foreign_storage_with_old_checkpoints(corpus, tmp_path):
    store = tmp_path / "store"
    trainer(corpus, tmp_path / "a", f"checkpoint.path={json.dumps(str(store))}").fit(max_steps=3)
    with pytest.raises(UserError, match="holds checkpoints of an earlier run"):
        trainer(corpus, tmp_path / "b", f"checkpoint.path={json.dumps(str(store))}",
                "checkpoint.resume=false")


def test_a_second_job_on_the_run_directory_is_refused(corpus, tmp_path):
    run_dir = tmp_path / "run"
    first = trainer(corpus, run_dir)
    r = cli(corpus, run_dir)
    assert r.returncode == 2 and "in use by another megascale job" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    first.fit(max_steps=3)  # the first job is untouched
    assert [s for s, _ in list_checkpoints(run_dir)] == [3]
    r = cli(corpus, run_dir, "train.steps=4")  # and once it is done, the directory is free again
    assert r.returncode == 0, r.stderr


def test_resaving_a_committed_step_never_destroys_it(corpus, tmp_path):
    run_dir = tmp_path / "run"
    trainer(corpus, run_dir, "train.steps=3").fit()
    (_, ckpt), = list_checkpoints(run_dir)
    before = (ckpt / COMMIT).read_text()
    t = trainer(corpus, run_dir, "train.steps=3")
    assert t.step == 3
    t.save(final=True)  # the same step again (an interruption right after a periodic save)
    assert (ckpt / COMMIT).read_text() == before and list_checkpoints(run_dir) == [(3, ckpt)]


def test_secrets_are_in_no_file_written(corpus, tmp_path):
    run_dir = tmp_path / "run"
    trainer(corpus, run_dir, "distributed.store=redis://:hunter2@127.0.0.1:6390/0").fit(max_steps=3)
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert b"hunter2" not in f.read_bytes(), f
    assert "redis://:***@127.0.0.1:6390/0" in (run_dir / "config.toml").read_text()


def test_rng_state_from_a_gpu_machine_restores_on_cpu():
    state = rng_state()
    state["cuda"] = [0] * 16  # a GPU's state: nothing to restore it into here, and no crash
    set_rng_state(state)
    assert torch.get_rng_state().tolist() == state["torch"]


def test_a_damaged_memory_snapshot_falls_back_to_storage(corpus, tmp_path, reference):
    run_dir = tmp_path / "run"
    r = cli(corpus, run_dir, "checkpoint.memory_interval=1", env={"MEGASCALE_INJECT": "kill@persist:6"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    for f in (run_dir.parent / "shm").rglob("*.bin"):  # the host's memory damaged: the slots cut short
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    r = cli(corpus, run_dir, "checkpoint.memory_interval=1")
    assert r.returncode == 0, r.stderr
    assert "host-memory snapshot of step" in r.stderr and "cannot be used" in r.stderr, r.stderr
    assert "resumed from storage at step 3" in r.stdout
    assert same(final_weights(run_dir), reference)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_memory_dir_is_one_line_and_training_goes_on(corpus, tmp_path, reference):
    """A /dev/shm too small for the snapshot (Docker's default is 64 MB): one line, snapshots in process
    memory, checkpoints persisted as usual (no SIGBUS in the middle of a copy)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(shm)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run_dir = tmp_path / "run"
        r = cli(corpus, run_dir)
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if "no room for a" in ln]
        assert len(lines) == 1 and "checkpoint.memory_dir" in lines[0], r.stderr
        assert "No space left" in lines[0]
        assert same(final_weights(run_dir), reference)
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)


def test_a_slots_boxes_are_made_once_per_layout_and_hold_each_new_snapshot(tmp_path):
    """The views of a slot's buffer are kept between snapshots of one layout (hundreds of tensors per
    rank: remaking them cost the training thread each time), still receive each new snapshot, and a
    new layout gets new ones."""
    from megascale.checkpoint.shards import Chunk
    from megascale.checkpoint.snapshot import HostSnapshot

    w = torch.arange(4, dtype=torch.float64)
    snaps = HostSnapshot(tmp_path, 0, {"rank": 0}, background=False)

    def chunks(t):
        return [Chunk("model/w", tuple(t.shape), (0,), t, True)]

    for step in (1, 2):  # one into each slot
        w += 1
        snaps.take(step, chunks(w), {})
    boxes = [s.views[2][0].tensor for s in snaps.slots]
    for step in (3, 4):
        w += 1
        snaps.take(step, chunks(w), {})
        assert all(s.views[2][0].tensor is box for s, box in zip(snaps.slots, boxes, strict=True))
    out = torch.zeros(4, dtype=torch.float64)
    snaps.restore(4, chunks(out))
    assert torch.equal(out, w)
    bigger = torch.arange(6, dtype=torch.float64)
    snaps.take(5, chunks(bigger), {})
    out = torch.zeros(6, dtype=torch.float64)
    snaps.restore(5, chunks(out))
    assert torch.equal(out, bigger)
    snaps.close()
