"""The real Trainer on (dp, pp, tp, vpp, sequence-parallel) layouts equals the single-process Trainer.

Each layout trains a tiny model (4 layers, d_model 32, seq 16, byte tokenizer over three
Shakespeare files) for 10 steps with warm-up, cosine lr, weight decay, active grad-norm
clipping and two validation passes, through `Trainer(cfg).fit()` on every rank of a gloo
worker pool, and is compared with `Trainer(cfg).fit()` on this process for the same config
without the parallel.* fields: per-step losses (the job's dp mean, as rank 0 logs it),
per-step grad norms (from rank 0's metrics.jsonl, which must hold each step once), the
validation loss, and in float64 the final weights gathered back into one GPT.

Tolerances, as in the parity tests of the pieces (test_tp_parity / test_pp_parity /
test_dp_parity): float64 is the strict check (reduction-order noise ~1e-15, amplified a
little by Adam/LAMB over 10 steps; 1e-12 relative on losses and norms); float32 losses within
1e-5 relative (dp, tp and the pipeline's tied-embedding sum add ~1e-7 rounding per step).

Models mix the variants across layouts (GPT/Llama style, sequential/parallel block,
sliding-window attention, AdamW/LAMB); all tie the embedding and the head, so every
pipeline layout runs the tied-gradient all-reduce, and dp2 x pp2 x tp2 composes it with the
distributed optimizer (the tied matrix counted once in the clipping norm).
"""

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
import torch
from _dist import one_thread_fixture, pools_fixture  # noqa: F401 - the fixtures are found by their names

from megascale.checkpoint import list_checkpoints, read_model_state
from megascale.config import load_config
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["hamlet_gut.txt", "macbeth_gut.txt", "sonnets_gut.txt"]
STEPS = 10
TOL = {"bf16": 5e-3, "fp32": 1e-5, "fp64": 1e-12}  # bf16: GEMMs cut by tp round differently

MODELS = {
    "gpt": [],
    "gpt-parallel": ["model.block=parallel"],
    "gpt-sliding": ["model.attention=sliding", "model.window=5"],
    "llama-parallel": ["model.style=llama", "model.bias=false", "model.block=parallel"],
    "llama-sliding": ["model.style=llama", "model.bias=false", "model.attention=sliding", "model.window=5"],
}

# name: (world, parallel overrides, model, optimizer, dtype, also stop after 4 steps and resume);
# "-gloo": the point-to-point messages over gloo's isend/irecv, not our transport (distributed/sockets.py)
LAYOUTS = {
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], "gpt", "adamw", "fp32", False),
    # autocast: the parallel block's row layers add their partial sums, rank 0's with the bias, in bf16;
    # the stages pass activations autocast made
    "pp2-tp2-sp-bf16": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
                        "gpt-parallel", "adamw", "bf16", False),
    "tp2-sp-overlap": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true",
                           "parallel.tp_overlap_chunks=2"], "gpt", "adamw", "fp64", False),
    # the fused parallel block's all-gather and reduce-scatter under its MLP's own rows (branches.py)
    "tp2-sp-overlap-branches": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                    "parallel.tp_overlap=true", "parallel.tp_overlap_branches=true"],
                                "gpt-parallel", "adamw", "fp64", False),
    # one warm-up forward ahead of Megatron's 1F1B (parallel.pp_warmup_ahead): the same gradients
    "pp2-1f1b-ahead1": (2, ["parallel.pp=2", "parallel.pp_warmup_ahead=1"], "llama-parallel", "lamb", "fp64",
                        False),
    "pp2-vpp2-interleaved": (2, ["parallel.pp=2", "parallel.vpp=2"], "gpt-sliding", "adamw", "fp32", False),
    "pp2-vpp2-overlap-off-gloo": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_overlap=false",
                                      "parallel.transport=gloo"], "gpt", "adamw", "fp64", False),
    "dp2": (2, ["parallel.dp=2", "parallel.dp_bucket_size=3000"], "gpt-parallel", "lamb", "fp32", False),
    "dp2-pp2": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.dp_bucket_size=3000"], "gpt-parallel",
                "adamw", "fp32", False),
    "dp2-tp2-sp-gloo": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                            "parallel.dp_bucket_size=3000", "parallel.transport=gloo"], "llama-sliding",
                        "adamw", "fp64", True),
    # train.compile: each block a compiled graph (inductor's float64 kernels), against the eager one process;
    # under tp the block's collectives are custom operators inside its graph (tensor/comm.py)
    "dp2-pp2-compile": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.dp_bucket_size=3000",
                            "train.compile=true"], "llama-parallel", "adamw", "fp64", True),
    "tp2-sp-compile": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.compile=true"],
                       "gpt-parallel", "adamw", "fp64", False),
    "dp2-pp2-tp2-sp": (8, ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
                           "parallel.sequence_parallel=true", "parallel.dp_bucket_size=3000"],
                       "gpt", "lamb", "fp64", True),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """The data overrides: three plays, tokenised once here (the workers find the dataset built)."""
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS:
        shutil.copy(ROOT / "data" / "shakespeare" / name, d / name)
    return [f"data.source={json.dumps(str(d))}", f"data.path={json.dumps(str(d / 'ds'))}"]  # its own


def overrides(data: list[str], run_dir: Path, model: str, optim: str, dtype: str, *extra: str) -> list[str]:
    return [
        "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.dropout=0.0",
        *MODELS[model], f"optim.name={optim}", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=3",
        "optim.grad_clip=0.5", f"train.dtype={dtype}", "train.global_batch=8", "train.micro_batch=2",
        f"train.steps={STEPS}", "train.eval_interval=5", "train.eval_batches=4", "log.progress=false",
        "log.tensorboard=false", "log.sample_tokens=0", "log.peak_flops=1e9", "checkpoint.interval=0",
        *data, f"train.run_dir={json.dumps(str(run_dir))}", *extra,
    ]


def run_on_rank(rank: int, args: list[str], split_at: int | None = None):
    """On every rank: Trainer(cfg).fit(); with split_at, stop there and resume in a fresh Trainer. Without
    split_at, also the graph breaks torch.compile met (none where nothing compiles)."""
    from torch._dynamo.utils import counters

    if split_at is None:
        counters.clear()  # (a pool's worker has run earlier layouts)
        trainer = Trainer(load_config(None, args), quiet=True)
        result = trainer.fit()
        breaks = sum(counters["graph_break"].values())
        full = trainer.engine.full_model_state()  # collective: the one-process state dict
        model = trainer.full_model()  # collective: the one GPT (to sample from), on rank 0 only
        assert (model is not None) == (rank == 0)
        return result["losses"], result["val_loss"], full if rank == 0 else None, breaks
    first = Trainer(load_config(None, args), quiet=True).fit(max_steps=split_at)
    torch.manual_seed(999)  # a resume must restore the RNG, not inherit the process's state
    second = Trainer(load_config(None, args), quiet=True)
    assert second.step == split_at
    rest = second.fit()
    return first["losses"] + rest["losses"], rest["val_loss"], None


def metrics(run_dir: Path, kind: str, field: str) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r[field] for r in map(json.loads, lines) if r["kind"] == kind]


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


REPORT: dict[str, str] = {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_layout_matches_one_process(pools, data, tmp_path, name):
    world, parallel, model, optim, dtype, resume = LAYOUTS[name]
    serial = Trainer(load_config(None, overrides(data, tmp_path / "serial", model, optim, dtype)), quiet=True)
    want = serial.fit()
    want_weights = serial.model.state_dict()
    args = overrides(data, tmp_path / "par", model, optim, dtype, *parallel)
    pool = pools(world)
    results = pool.run(run_on_rank, args)
    losses, val, weights, _ = results[0]

    assert all(r[0] == losses and r[1] == val for r in results)  # every rank reports the job's numbers
    # each compiled block is one graph: no collective, timer or transport call inside cuts it (under tp the
    # block's collectives are custom operators, parallel/tensor/comm.py)
    assert [r[3] for r in results] == [0] * world, [r[3] for r in results]
    assert metrics(tmp_path / "par", "train", "loss") == losses  # rank 0 alone logs, each step once
    loss_rel = rel(losses, want["losses"])
    norm_rel = rel(metrics(tmp_path / "par", "train", "grad_norm"),
                   metrics(tmp_path / "serial", "train", "grad_norm"))
    val_rel = rel(metrics(tmp_path / "par", "val", "loss"), metrics(tmp_path / "serial", "val", "loss"))
    assert weights.keys() == want_weights.keys()
    weight_max = max((weights[k] - v).abs().max().item() for k, v in want_weights.items())
    REPORT[name] = (f"{name:22s} {dtype}: loss rel {loss_rel:.1e}, grad-norm rel {norm_rel:.1e}, val rel "
                    f"{val_rel:.1e}, weight max abs {weight_max:.1e}")
    print("\n" + REPORT[name], f"(losses {want['losses'][0]:.3f} -> {want['losses'][-1]:.3f})")
    assert want["losses"][-1] < want["losses"][0]  # it trains (LAMB at this lr slowly, AdamW fast)
    assert metrics(tmp_path / "serial", "train", "grad_norm")[0] > 0.5  # clipping is active
    assert loss_rel < TOL[dtype] and val_rel < TOL[dtype]
    if dtype == "fp64":  # float32 norms and weights carry TP's amplified rounding (test_dp_parity)
        assert norm_rel < TOL[dtype] and weight_max < 1e-10
    # the checkpoint: one DCP file per rank (each its own shard), read back as the one-process model
    (step, ckpt), = list_checkpoints(tmp_path / "par")
    _, saved = read_model_state(ckpt)
    # (the pipeline's two copies of a tied matrix may differ by rounding: LAMB's norms of each are
    # summed over differently cut dp shards; the checkpoint holds the embedding's)
    differ = [k for k in weights if not torch.equal(saved[k], weights[k])
              and not (k == "head.weight" and torch.allclose(saved[k], weights[k], rtol=0, atol=1e-12))]
    assert step == STEPS and not differ, differ
    ranks = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert ranks == [f"__{r}_0.distcp" for r in range(world)]

    if resume:  # 4 steps, a checkpoint, a fresh Trainer on every rank resumes: bit-for-bit the same run
        split = pool.run(run_on_rank, overrides(data, tmp_path / "split", model, optim, dtype, *parallel), 4)
        assert split[0][0] == losses and split[0][1] == val  # exact
        assert metrics(tmp_path / "split", "train", "loss") == losses


def _start_on_hosts(rank: int, args: list[str], per_host: int) -> str:
    """A Trainer built on this rank as if its host held `per_host` ranks (hosts h0, h1, ...); what rank 0
    said on stderr."""
    import contextlib
    import io
    import os

    os.environ["MEGASCALE_HOST_ID"] = f"h{rank // per_host}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            Trainer(load_config(None, args), quiet=True).close()
    finally:
        del os.environ["MEGASCALE_HOST_ID"]
    return said.getvalue()


def test_tensor_parallel_groups_that_span_hosts_are_said_at_the_start(pools, data, tmp_path):
    """tp's collectives, several in every layer, belong inside a machine: a layout whose tp groups span
    hosts (tp 4 on hosts of 2 ranks) runs, many times slower, and rank 0 says why at the start."""
    from megascale.data import ensure_dataset

    run = overrides(data, tmp_path / "run", "gpt", "adamw", "fp32")
    ensure_dataset(load_config(None, run).data, progress=False)  # tokenised here, not in a worker
    pool = pools(4)
    said = pool.run(_start_on_hosts, [*run, "parallel.tp=4"], 2)
    assert ("megascale: parallel.tp = 4: 1 of 1 tensor-parallel groups span hosts (ranks 0-3 on h0 (2), "
            "h1 (2)): every layer's tp collectives cross the network instead of staying inside a machine. "
            "Keep parallel.tp a divisor of the ranks per host (2 here)\n") in said[0], said[0]
    assert not any(said[1:]), said  # (layouts that keep tp inside a host say nothing: tests/test_mesh.py)


# ------------------------------------------------------------------------------------------- CLI


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megascale", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, **kw)


@pytest.mark.parametrize("extra, expect", [
    (["--nproc", "3", "parallel.tp=3"], "parallel.tp: 3 ranks do not split model.n_heads=4"),
    (["--nproc", "2", "parallel.tp=2", "parallel.dp=2"], "must equal --nproc = 2"),
    (["parallel.dp=2"], "--nproc 2"),
    (["--nproc", "2", "parallel.pp=2", "parallel.vpp=2"], "model.n_layers: 2 layers do not fill"),
])
def test_layout_errors_exit_2_before_any_worker(tmp_path, extra, expect):
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    r = _cli(["train", "--config", "configs/cpu_default.toml", "model.n_layers=2", "model.n_heads=4",
              "model.d_model=32", f"train.run_dir={run_dir}", *extra])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], r.stderr
    assert not run_dir.exists()
    assert time.perf_counter() - t0 < 30  # checked in the launching process: no worker started


def test_user_error_on_every_rank_prints_once(tmp_path):
    r = _cli(["train", "--nproc", "2", "--config", "configs/cpu_default.toml", "parallel.dp=2",
              f"data.path={tmp_path}/nowhere/ds", "data.source=", f"train.run_dir={tmp_path}/run"])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_sigterm_stops_every_rank_at_one_step_and_resumes(data, tmp_path):
    """`megascale train --nproc 2` (dp2, float64; the workers forked from the prefork server), SIGTERM to
    the launcher: the agent forwards it (through the workers' stand-ins), the ranks agree on a step,
    save and exit 143; the same command resumes and finishes; the losses are the single-process
    Trainer's."""
    args = overrides(data, tmp_path / "sig", "gpt", "adamw", "fp64", "parallel.dp=2", "train.steps=400",
                     "optim.schedule=constant", "train.eval_interval=0")
    cmd = [sys.executable, "-m", "megascale", "train", "--nproc", "2", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = tmp_path / "sig" / "metrics.jsonl"
    deadline = time.time() + 180
    # three steps done (not three lines: the start-up, layout and peak records come before any step)
    while time.time() < deadline and (not log.exists() or log.read_text().count('"kind": "train"') < 3):
        time.sleep(0.2)
    # the workers are forks of the prefork server (fault.prefork_workers), not new interpreters
    traces = sorted((tmp_path / "sig" / "trace").glob("rank_*.jsonl"))
    assert len(traces) == 2, traces
    for trace in traces:
        pid = json.loads(trace.read_text().splitlines()[0])["pid"]
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        assert "prefork import serve" in Path(f"/proc/{parent}/cmdline").read_text(), trace
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    (k, ckpt), = list_checkpoints(tmp_path / "sig")
    assert 3 <= k < 400 and len(list(ckpt.glob("*.distcp"))) == 2
    r = _cli(["train", "--nproc", "2", *args, f"train.steps={k + 2}"])  # the last override wins
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and r.stdout.count("done:") == 1  # rank 0 alone prints
    ref_args = overrides(data, tmp_path / "ref", "gpt", "adamw", "fp64", "train.steps=400",
                         "optim.schedule=constant", "train.eval_interval=0")
    reference = Trainer(load_config(None, ref_args), quiet=True).fit(max_steps=k + 2)
    assert rel(metrics(tmp_path / "sig", "train", "loss"), reference["losses"]) < TOL["fp64"]
