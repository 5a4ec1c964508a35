"""Typed configuration: one dataclass per section, loaded from TOML with dotted overrides.

A run is fully described by a `Config`. It is read from a TOML file (`configs/*.toml`),
then `section.field=value` overrides from the command line are applied, then the whole is
validated. Every user mistake raises `ConfigError`, whose message names the field and the
reason; the CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.errors import UserError


class ConfigError(UserError):
    """A user-facing configuration mistake. The message names the field and the problem."""


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: take it from the tokenizer
    seq_len: int = 256
    n_layers: int = 6
    d_model: int = 384
    n_heads: int = 6
    d_ff: int = 0  # 0: 4*d_model for GeLU, 8/3*d_model rounded up to a multiple of 64 for SwiGLU
    style: str = "gpt"  # "gpt": LayerNorm, GeLU, learned positions; "llama": RMSNorm, SwiGLU, rotary
    # "sequential": h = x + Attn(LN x); y = h + MLP(LN h).  "parallel": y = x + Attn(LN x) + MLP(LN x)
    block: str = "sequential"
    attention: str = "full"  # "full" causal, or "sliding" (each token sees itself and the previous window-1)
    window: int = 0  # sliding-window size in tokens; required when attention = "sliding"
    bias: bool = True  # biases in linear layers and LayerNorm (GPT style); Llama style uses none
    tie_embeddings: bool = True
    dropout: float = 0.0
    recompute: bool = False  # activation recomputation per block: memory for compute
    # fused operators (megascale/ops/): add + norm, bias + GeLU, SwiGLU, rotary, and a head +
    # cross-entropy chunked over tokens that never holds the full logits; the same function
    fused_ops: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # start from other weights instead of the seed's random ones: "hf:DIR" (a Hugging Face model
    # directory as `megascale export` writes it; fine-tuning); "": random initialisation
    init_from: str = ""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.style == "llama":
            return 64 * ((int(8 * self.d_model / 3) + 63) // 64)
        return 4 * self.d_model


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size (ranks adjacent, one machine)
    pp: int = 1  # pipeline parallel size
    # data parallel size; 0: whatever the world leaves, world / (tp * pp), fixed when the job starts
    # (a `megascale launch --nnodes MIN:MAX` job that shrinks when a host is evicted)
    dp: int = 1
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B)
    sequence_parallel: bool = False
    # pipeline schedule: "auto" (1f1b, or interleaved when vpp > 1), "1f1b", "interleaved", "afab"
    schedule: str = "auto"
    dp_bucket_size: int = 40_000_000  # elements per gradient bucket of the distributed optimizer (dp > 1)
    # MegaScale's communication overlap, one off switch per dimension (benchmarks/overlap.py):
    dp_overlap_grad_reduce: bool = True  # reduce-scatter each bucket as its gradients complete in backward
    dp_overlap_param_gather: bool = True  # all-gather each bucket after the step, wait before its first use
    # the last dp_bucket_size elements in this many buckets (1: off): the reduce-scatter left after
    # backward and the first all-gather the forward waits for are a fraction of a bucket (8: the
    # forward's first gathers waited 1.7-2.5 ms a step against 5.4-6.8 at 4, benchmarks/overlap.py)
    dp_tail_buckets: int = 8
    # on gloo, the dp and tp reduce-scatters and all-gathers as direct sends (distributed/direct.py):
    # half the bytes of gloo's reduce-scatter (an all-reduce); its all-gather 1.4x slower on a slow link
    direct_collectives: bool = True
    # on gloo, what carries the point-to-point messages (the direct collectives above, the pipeline's
    # activations and gradients): "sockets", our own TCP transport, a fraction of gloo's CPU and time
    # per message (distributed/sockets.py, benchmarks/transport.py), or "gloo"'s isend/irecv
    transport: str = "sockets"
    # on the socket transport, each connection marked by what it carries (SO_PRIORITY): the pipeline's and
    # tp's interactive, dp's bulk, so a host sends an activation before a parameter bucket's backlog
    transport_priority: bool = True
    pp_overlap: bool = True  # receives posted ahead of the compute that needs them, sends completed lazily
    # 1f1b: forwards every rank but the last runs beyond Megatron's warm-up, so the steady phase does not
    # wait for the round trip of an activation and its gradient (schedule.py); that many more
    # micro-batches of activations held on those ranks. 0: Megatron's 1F1B
    pp_warmup_ahead: int = 0
    tp_overlap: bool = False  # all-gather/reduce-scatter pipelined with the TP GEMMs in chunks (tp > 1)
    # chunks per overlapped TP GEMM (tp_overlap), each split by rank: its own rows first (all-gather) or
    # last (reduce-scatter). 1 hides 1/tp of each GEMM in the fewest messages (best on CPU, with SP); plain
    # TP (no SP) needs 2 or more for its row layers' all-reduce to overlap at all
    tp_overlap_chunks: int = 1
    # how the sequence-parallel GEMMs overlap: "chunked" (ours, any backend), "symm_mem" (PyTorch's fused
    # symmetric-memory ops, CUDA), "auto" (symm_mem where the device has them); parallel/tensor/symm_mem.py
    tp_overlap_impl: str = "auto"
    # with tp_overlap, the fused parallel block's all-gather and reduce-scatter under its MLP's own rows
    # (parallel/tensor/branches.py; gloo's direct sends, no residual dropout). Off: on CPU it cost more
    # than it hid (benchmarks/overlap.py --dims tp --block parallel), so the block keeps them in place
    tp_overlap_branches: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def resolved_schedule(self) -> str:
        if self.schedule != "auto":
            return self.schedule
        return "interleaved" if self.vpp > 1 else "1f1b"


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw" (PyTorch's) or "lamb" (ours)
    lr: float = 1e-3
    min_lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    # after the warm-up: "cosine" or "linear" down to min_lr at train.steps; "wsd" (warm-up, stable,
    # decay) holds lr, then its last decay_fraction of train.steps falls to min_lr as 1 - sqrt(progress);
    # "constant" holds lr
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the share of train.steps that decays (the last ones)
    grad_clip: float = 1.0  # global grad-norm clipping; 0 turns it off


@dataclass
class DataConfig:
    # prefix of the indexed dataset (<path>.bin / <path>.idx; a path ending in .bin or .idx is taken too),
    # in megascale's format or Megatron-LM's (preprocess_data.py's <name>_text_document): the .idx says
    path: str = "data/cache/shakespeare"
    source: str = ""  # text/JSONL file, directory or glob to build `path` from when it does not exist
    tokenizer: str = "byte"  # "byte", "gpt2", or a path to a Hugging Face tokenizer.json
    val_fraction: float = 0.05  # fraction of documents held out for validation
    seed: int = 1234
    preprocess_workers: int = 2
    # [[weight, prefix], ...]: train on several datasets (either format) mixed by weight, in a fixed,
    # resumable order (megascale/data/blend.py); replaces path and source. []: just `path`
    blend: list = field(default_factory=list)
    # one reader per host: its lowest rank reads every local replica's rows once into shared memory and the
    # host's ranks copy theirs out (megascale/data/shared_loader.py); false: every rank reads its own
    shared_loader: bool = True


@dataclass
class TrainConfig:
    steps: int = 1000
    global_batch: int = 32  # sequences per optimizer step (all data-parallel ranks, all micro-batches)
    micro_batch: int = 8  # sequences per forward/backward
    seed: int = 1337
    dtype: str = "fp32"  # "fp32" or "bf16" (autocast; master weights stay fp32)
    device: str = "auto"  # "auto", "cpu" or "cuda"
    eval_interval: int = 100  # steps between validation passes; 0 turns validation off
    eval_batches: int = 10
    log_interval: int = 10
    run_dir: str = "runs/default"
    compile: bool = False  # torch.compile the model


@dataclass
class CheckpointConfig:
    # Two stages (MegaScale): a snapshot of every rank's state into host memory that outlives the
    # process (stage 1, seconds), persisted to storage in the background (stage 2).
    interval: int = 500  # steps between persisted checkpoints; 0: only at the end and on interruption
    memory_interval: int = 0  # steps between host-memory snapshots; 0: only those that are persisted
    path: str = ""  # storage root: a local path or an fsspec URL; "": RUN_DIR/checkpoints
    memory_dir: str = ""  # where snapshots live; "": /dev/shm/megascale (tmpfs), else the temp dir
    memory: bool = True  # stage 1 in host memory; false: persist straight from the live state
    async_persist: bool = True  # stage 2 in a background thread; false: training waits for storage
    writer_process: bool = True  # stage 2 writes from a process of its own; false: from the training process
    # below this many MB of a rank's state (weights + optimizer) a thread writes instead: it costs
    # training ~5 ms per MB per checkpoint (2 CPU cores), a process ~2 s of CPU to start, every rank at
    # once, and ~300 MB for the run (benchmarks/checkpoint_writer.py); 0: always a process
    writer_process_min_mb: float = 16.0
    async_snapshot: bool = True  # stage 1's copy overlaps the next step's forwards and backwards
    # each snapshot copied into a peer host's memory too (multi-host jobs): a host that dies whole
    # restores from its peer's copy instead of from storage (checkpoint/replica.py)
    memory_replicas: bool = True
    broadcast_restore: bool = True  # one reader per data-parallel group broadcasts the weights
    keep: int = 2  # how many complete checkpoints to keep in storage (the newest is never deleted)
    resume: bool = True  # resume from the newest complete state (memory, else storage) if one exists


@dataclass
class LogConfig:
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True  # progress bar; off in CI logs and tests
    sample_tokens: int = 200  # tokens of text sampled at the end of `train` (0: none)
    sample_prompt: str = "ROMEO:"
    peak_flops: float = 0.0  # MFU denominator in FLOP/s per device; 0: probed (CPU) or from the GPU table


@dataclass
class DistributedConfig:
    # where the ranks meet: "tcp" (PyTorch's TCPStore, libuv server), "tcp-legacy" (its single-threaded
    # server of torch < 2.4), or "redis://host:port/db" (password from MEGASCALE_REDIS_PASSWORD)
    store: str = "tcp"
    # "local": each rank creates only its own groups, members synchronise among themselves (MegaScale);
    # "global": every rank creates every group with a barrier over all ranks (the naive way, to compare)
    group_init: str = "local"
    eager_init: bool = True  # GPU: bind the device at init, so NCCL builds communicators now and splits them
    # Three clocks, for three jobs: start-up (store, rendezvous, process groups, and the waits while
    # rank 0 prepares the dataset or a checkpoint is restored) may take long on a healthy job; a
    # collective of training that waits longer than collective_timeout_s fails; a hang is noticed
    # sooner than either, by observe.hang_timeout_s (watchdog) and fault.* (the driver's heartbeats).
    timeout_s: float = 600.0  # start-up: store operations and every collective until training begins
    collective_timeout_s: float = 1800.0  # each collective once training has begun
    job_id: str = ""  # names this job's keys in a shared store; "": the launcher's run id


@dataclass
class ObserveConfig:
    timers: bool = True  # always-on per-op timers into RUN_DIR/trace (megascale timeline, report, stragglers)
    flush_interval_s: float = 1.0  # how often the trace writer thread drains the ring buffer
    buffer_records: int = 65536  # the ring buffer's size; the oldest records go if the writer falls behind
    # each rank's trace file at most this size (MB): past half of it, the file becomes rank_NNNNN.jsonl.1
    # (the one before goes) and a new one starts, so a long run keeps its newest records. 0: unbounded
    trace_max_mb: float = 1024.0
    clock_sync_interval: int = 100  # steps between re-checks of the ranks' clock offsets (0: at start only)
    straggler_window: int = 10  # steps per straggler window (0: no online straggler detection)
    straggler_threshold: float = 0.1  # a rank this much slower than the median of its peers is a straggler
    straggler_windows: int = 2  # ... in this many consecutive windows
    hang_timeout_s: float = 300.0  # no progress in one collective this long: dump stacks + in-flight ops
    hang_action: str = "abort"  # after the dump: "abort" (exit 3, so a launcher can restart) or "dump"
    flight_recorder: int = 2000  # entries of PyTorch's flight recorder per group (0: off)


@dataclass
class FaultConfig:
    # what `megascale launch` (megascale/fault/driver.py) does about faults; a plain run ignores it
    max_restarts: int = 3  # restarts of the worker group (crash, hang, failed self-check) before giving up
    heartbeat_interval_s: float = 2.0  # every rank's beat to the launcher's store
    heartbeat_timeout_s: float = 10.0  # no beat this long: the rank is dead or stopped -> restart
    # how often each host's agent looks at its workers (exits, beats) and asks the rendezvous whether a host
    # waits to join: a fault is seen up to this late, twice (the faulty host, then the others); each look is
    # one request to the rendezvous store per host (torchrun: 0.1 s)
    monitor_interval_s: float = 0.5
    # how often an agent waiting in a rendezvous round reads its state (fault/rendezvous.py). 0: max_nodes /
    # 200 s within [0.1, 1] (at most ~200 reads/s on the store); 1: elastic's own interval
    rendezvous_poll_s: float = 0.0
    # a MIN:MAX job (--nnodes 1:4): once MIN hosts are in a round, how long it waits for more before it
    # starts smaller. The hosts' start skew must fit in it; after an eviction with no spare coming, the
    # survivors wait it out before they train again (elastic's default: 30 s)
    rendezvous_last_call_s: float = 10.0
    # how long a host waits in a rendezvous round for the others (--nnodes MIN of them), and for the
    # rendezvous store to come up; then its agent gives up, saying so (torchrun's join timeout: 600 s)
    rendezvous_timeout_s: float = 120.0
    hang_timeout_s: float = 0.0  # beats but no new step this long -> restart (0: max(60 s, 20 x median step))
    max_nan_rollbacks: int = 3  # non-finite loss: roll back to the last snapshot, skip the batch; this often
    selfcheck: bool = True  # under megascale launch: every host checks itself before each (re)start
    selfcheck_min_speed: float = 0.25  # a matmul slower than this x the host's best recorded fails it
    # a rank flagged as a straggler (observe.straggler_*) has its host evicted, as one failing the
    # self-check is: a replacement or a smaller job goes on without it. Off: stragglers are reported only
    evict_stragglers: bool = False
    # a hang whose diagnosis (fault/hang.py) names ranks of one host only has that host evicted: the restart
    # goes on without it. Off: the job restarts with every host, the stuck one included
    evict_hung_hosts: bool = True
    # workers (of `megascale launch` and `train --nproc`) are forked from a server that imported torch and
    # megascale once (distributed/prefork.py): a start or restart skips the imports (about 4 s of 8 for 4
    # workers on 2 cores). Off: new interpreters, as under torchrun
    prefork_workers: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every field, with secrets redacted: this is what config.toml, metrics and checkpoints hold."""
        out = dataclasses.asdict(self)
        out["distributed"]["store"] = redact_url(out["distributed"]["store"])
        out["checkpoint"]["path"] = redact_url(out["checkpoint"]["path"])
        return out

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
            lines.append("")
        return "\n".join(lines)


def redact_url(url: str) -> str:
    """A URL with its password replaced (redis://:secret@host -> redis://:***@host)."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://[^:/@]*:)[^@/]*@", r"\1***@", url)


# ---------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (optional), apply `section.field=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p}: does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: not valid TOML ({e})") from None
    cfg = from_dict(raw)
    for ov in overrides or []:
        apply_override(cfg, ov)
    validate(cfg)
    return cfg


def from_dict(raw: dict[str, Any]) -> Config:
    cfg = Config()
    for section, values in raw.items():
        if section not in _sections():
            raise ConfigError(f"{section}: unknown config section (known: {', '.join(_sections())})")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a table of fields, got {values!r}")
        for key, value in values.items():
            _set_field(cfg, f"{section}.{key}", value)
    return cfg


def apply_override(cfg: Config, override: str) -> None:
    """Apply one `section.field=value`; the value is parsed as a TOML literal, else taken as a string."""
    if "=" not in override:
        raise ConfigError(f"{override}: an override must look like section.field=value")
    name, text = override.split("=", 1)
    name = name.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: data.tokenizer=gpt2
    _set_field(cfg, name, value)


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def _set_field(cfg: Config, name: str, value: Any) -> None:
    parts = name.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{name}: a field is named section.field")
    section, key = parts
    if section not in _sections():
        raise ConfigError(f"{name}: unknown config section {section!r} (known: {', '.join(_sections())})")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        close = [k for k in fields if k.startswith(key[:3])]
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{name}: unknown field{hint}")
    hint_type = typing.get_type_hints(type(obj))[key]
    setattr(obj, key, _coerce(name, value, hint_type))


def _coerce(name: str, value: Any, hint: Any) -> Any:
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML has nan and inf; no field means anything by them
                raise ConfigError(f"{name}: must be a finite number, got {value!r}")
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif hint is list:  # checked element by element in validate()
        if isinstance(value, list):
            return value
    else:  # pragma: no cover - only the four scalar types are used
        return value
    raise ConfigError(f"{name}: expected {hint.__name__}, got {value!r}")


# ---------------------------------------------------------------------------------------
# Validation: impossible combinations, each with the field and the reason


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(allowed)}, got {value!r}")


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(cfg: Config) -> None:
    m, o, t, p, d = cfg.model, cfg.optim, cfg.train, cfg.parallel, cfg.data
    _choice("model.style", m.style, ("gpt", "llama"))
    _choice("model.block", m.block, ("sequential", "parallel"))
    _choice("model.attention", m.attention, ("full", "sliding"))
    for name in ("seq_len", "n_layers", "d_model", "n_heads"):
        _positive(f"model.{name}", getattr(m, name))
    _positive("model.vocab_size", m.vocab_size, allow_zero=True)
    _positive("model.d_ff", m.d_ff, allow_zero=True)
    _positive("model.norm_eps", m.norm_eps, allow_zero=True)
    _positive("model.init_std", m.init_std)
    _positive("model.rope_theta", m.rope_theta)
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads: {m.n_heads} heads do not divide model.d_model={m.d_model}")
    if m.style == "llama" and m.head_dim % 2:
        raise ConfigError(f"model.n_heads: rotary positions need an even head size, got {m.head_dim}")
    if m.attention == "sliding":
        if m.window <= 0:
            raise ConfigError("model.window: sliding-window attention needs a window > 0")
        if m.window > m.seq_len:
            raise ConfigError(f"model.window: window {m.window} is larger than model.seq_len={m.seq_len}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout: must be in [0, 1), got {m.dropout}")
    if not isinstance(m.fused_ops, bool):
        raise ConfigError(f"model.fused_ops: must be true or false, got {m.fused_ops!r}")

    _choice("optim.name", o.name, ("adamw", "lamb"))
    _choice("optim.schedule", o.schedule, ("cosine", "linear", "wsd", "constant"))
    if not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(f"optim.decay_fraction: must be in (0, 1], got {o.decay_fraction}")
    _positive("optim.lr", o.lr)
    _positive("optim.min_lr", o.min_lr, allow_zero=True)
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr: {o.min_lr} is above optim.lr={o.lr}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            raise ConfigError(f"optim.{name}: must be in [0, 1), got {getattr(o, name)}")
    _positive("optim.eps", o.eps, allow_zero=True)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optim.grad_clip", o.grad_clip, allow_zero=True)

    _choice("train.dtype", t.dtype, ("fp32", "bf16", "fp64"))
    _choice("train.device", t.device, ("auto", "cpu", "cuda"))
    _positive("train.steps", t.steps)
    _positive("train.micro_batch", t.micro_batch)
    _positive("train.global_batch", t.global_batch)
    for name in ("eval_interval", "log_interval"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    _positive("train.eval_batches", t.eval_batches)  # validation off is train.eval_interval = 0
    if not t.run_dir:
        raise ConfigError("train.run_dir: must name a directory (empty would write into the current one)")
    per_step = t.micro_batch * p.dp
    if p.dp and t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch: {t.global_batch} sequences do not split into micro-batches of "
            f"train.micro_batch={t.micro_batch} x parallel.dp={p.dp}"
        )

    for name in ("tp", "pp", "vpp", "dp_bucket_size", "dp_tail_buckets", "tp_overlap_chunks"):
        _positive(f"parallel.{name}", getattr(p, name))
    _positive("parallel.dp", p.dp, allow_zero=True)  # 0: from the world, at start (check_world_size)
    _positive("parallel.pp_warmup_ahead", p.pp_warmup_ahead, allow_zero=True)
    _choice("parallel.schedule", p.schedule, ("auto", "1f1b", "interleaved", "afab"))
    _choice("parallel.transport", p.transport, ("gloo", "sockets"))
    _choice("parallel.tp_overlap_impl", p.tp_overlap_impl, ("auto", "chunked", "symm_mem"))
    if p.tp_overlap_branches and not p.tp_overlap:
        raise ConfigError("parallel.tp_overlap_branches: moves the fused parallel block's collectives under "
                          "the tp overlap, so it needs parallel.tp_overlap = true")
    if p.tp_overlap_branches and m.dropout > 0:
        raise ConfigError(f"parallel.tp_overlap_branches: runs the MLP branch in parts, whose residual "
                          f"dropout masks would not be the fused block's: needs model.dropout = 0, "
                          f"got {m.dropout}")
    validate_layout(cfg)

    _positive("log.peak_flops", cfg.log.peak_flops, allow_zero=True)
    _positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("checkpoint.memory_interval", cfg.checkpoint.memory_interval, allow_zero=True)
    _positive("checkpoint.writer_process_min_mb", cfg.checkpoint.writer_process_min_mb, allow_zero=True)
    if m.init_from and not m.init_from.startswith("hf:"):
        raise ConfigError(f"model.init_from: must be hf:DIR (a Hugging Face model directory), "
                          f"got {m.init_from!r}")

    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in [0, 1), got {d.val_fraction}")
    _positive("data.preprocess_workers", d.preprocess_workers)
    if not d.path:
        raise ConfigError("data.path: must name the dataset prefix (<path>.bin / <path>.idx)")
    _validate_blend(d)
    if not isinstance(d.shared_loader, bool):
        raise ConfigError(f"data.shared_loader: must be true or false, got {d.shared_loader!r}")

    ds = cfg.distributed
    if ds.store not in ("tcp", "tcp-legacy") and not ds.store.startswith("redis://"):
        raise ConfigError(f"distributed.store: must be tcp, tcp-legacy or redis://host:port/db, "
                          f"got {ds.store!r}")
    _choice("distributed.group_init", ds.group_init, ("local", "global"))
    _positive("distributed.timeout_s", ds.timeout_s)
    _positive("distributed.collective_timeout_s", ds.collective_timeout_s)
    if "/" in ds.job_id:
        raise ConfigError(f"distributed.job_id: must not contain '/', got {ds.job_id!r}")

    ob = cfg.observe
    _positive("observe.flush_interval_s", ob.flush_interval_s)
    _positive("observe.buffer_records", ob.buffer_records)
    _positive("observe.trace_max_mb", ob.trace_max_mb, allow_zero=True)
    for name in ("clock_sync_interval", "straggler_window", "flight_recorder"):
        _positive(f"observe.{name}", getattr(ob, name), allow_zero=True)
    _positive("observe.straggler_threshold", ob.straggler_threshold)
    _positive("observe.straggler_windows", ob.straggler_windows)
    _positive("observe.hang_timeout_s", ob.hang_timeout_s)
    _choice("observe.hang_action", ob.hang_action, ("abort", "dump"))

    fc = cfg.fault
    _positive("fault.max_restarts", fc.max_restarts, allow_zero=True)
    _positive("fault.heartbeat_interval_s", fc.heartbeat_interval_s)
    _positive("fault.heartbeat_timeout_s", fc.heartbeat_timeout_s)
    _positive("fault.monitor_interval_s", fc.monitor_interval_s)
    _positive("fault.rendezvous_poll_s", fc.rendezvous_poll_s, allow_zero=True)
    _positive("fault.rendezvous_last_call_s", fc.rendezvous_last_call_s)
    _positive("fault.rendezvous_timeout_s", fc.rendezvous_timeout_s)
    if fc.heartbeat_timeout_s < 2 * fc.heartbeat_interval_s:
        raise ConfigError(f"fault.heartbeat_timeout_s: {fc.heartbeat_timeout_s} s is under two heartbeats "
                          f"(fault.heartbeat_interval_s={fc.heartbeat_interval_s}): one late beat would "
                          "restart the job")
    _positive("fault.hang_timeout_s", fc.hang_timeout_s, allow_zero=True)
    _positive("fault.max_nan_rollbacks", fc.max_nan_rollbacks, allow_zero=True)
    if not 0.0 <= fc.selfcheck_min_speed <= 1.0:
        raise ConfigError(f"fault.selfcheck_min_speed: must be in [0, 1], got {fc.selfcheck_min_speed}")


def _validate_blend(d: DataConfig) -> None:
    """data.blend's shape and weights; that its datasets exist is checked where they are opened
    (megascale/data/ensure.py), as for data.path, so a config still loads where the data is not."""
    if d.blend and d.source:
        raise ConfigError("data.source: builds data.path, which data.blend replaces; set one of them")
    for i, entry in enumerate(d.blend):
        if (not isinstance(entry, list) or len(entry) != 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], (int, float)) or not isinstance(entry[1], str)):
            raise ConfigError(f"data.blend[{i}]: must be [weight, path], got {entry!r}")
        if not 0 < entry[0] < float("inf"):
            raise ConfigError(f"data.blend[{i}]: the weight must be > 0, got {entry[0]}")
        if not entry[1]:
            raise ConfigError(f"data.blend[{i}]: the path is empty")


def validate_layout(cfg: Config) -> None:
    """What a (dp, pp, tp, vpp, sequence_parallel) layout needs of the model and the batch.

    Pure arithmetic, so `megascale train --nproc N` checks it in the launching process before
    any worker starts. The same rules as parallel.tensor.apply.check_tp and
    parallel.pipeline.stage.check_pipeline, which check them again where the model is built.
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.tp > 1:
        if m.n_heads % p.tp:
            raise ConfigError(f"parallel.tp: {p.tp} ranks do not split model.n_heads={m.n_heads} into "
                              "whole heads")
        if m.ffn_dim % p.tp:
            raise ConfigError(f"parallel.tp: {p.tp} ranks do not split the MLP width {m.ffn_dim} "
                              "(model.d_ff)")
        if p.sequence_parallel and m.seq_len % p.tp:
            raise ConfigError(f"parallel.sequence_parallel: model.seq_len={m.seq_len} does not split over "
                              f"parallel.tp={p.tp}")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp: {p.vpp} virtual stages need parallel.pp > 1 (interleaving is "
                          "across pipeline ranks)")
    schedule = p.resolved_schedule
    if p.vpp > 1 and schedule == "1f1b":
        raise ConfigError(f"parallel.schedule: 1f1b runs one chunk per rank; parallel.vpp={p.vpp} needs "
                          "interleaved (or afab)")
    if p.vpp == 1 and schedule == "interleaved":
        raise ConfigError("parallel.schedule: interleaved needs parallel.vpp > 1")
    if p.pp_warmup_ahead and p.pp > 1 and schedule != "1f1b":
        raise ConfigError(f"parallel.pp_warmup_ahead: {p.pp_warmup_ahead} is for the 1f1b schedule, not "
                          f"{schedule} (afab runs every forward first; the interleaved warm-up already runs "
                          "ahead, as Megatron's does)")
    if m.n_layers < p.pp * p.vpp:
        raise ConfigError(f"model.n_layers: {m.n_layers} layers do not fill parallel.pp * parallel.vpp = "
                          f"{p.pp * p.vpp} virtual stages (each needs at least one layer)")
    if p.pp > 1 and p.dp and t.global_batch % (t.micro_batch * p.dp) == 0:
        micro = t.global_batch // (t.micro_batch * p.dp)
        what = (f"{micro} micro-batches per step (train.global_batch={t.global_batch} / (train.micro_batch="
                f"{t.micro_batch} x parallel.dp={p.dp}))")
        if schedule == "1f1b" and micro < p.pp:
            raise ConfigError(f"train.global_batch: {what} are fewer than parallel.pp={p.pp} stages; 1F1B "
                              "needs at least one micro-batch per stage")
        if schedule == "interleaved" and (micro < p.pp or micro % p.pp):
            raise ConfigError(f"train.global_batch: {what} are not a multiple of parallel.pp={p.pp}, as "
                              "the interleaved schedule requires")


def check_world_size(cfg: Config, processes: int, source: str) -> None:
    """The layout's tp * pp * dp must equal the number of processes (`source` names where it comes from).

    `parallel.dp = 0` takes its value here, world / (tp * pp), and the config is validated again with it.
    """
    p = cfg.parallel
    if p.dp == 0:
        if processes % (p.tp * p.pp):
            raise ConfigError(f"parallel.dp = 0 (from the world): {source} = {processes} is not a "
                              f"multiple of parallel.tp * parallel.pp = {p.tp} * {p.pp}")
        p.dp = processes // (p.tp * p.pp)
        validate(cfg)
        return
    if p.world_size == processes:
        return
    hint = ""
    if processes == 1:
        hint = (f"; run it with `megascale train --nproc {p.world_size} ...` or "
                f"`torchrun --nproc-per-node {p.world_size} -m megascale train ...`")
    raise ConfigError(f"parallel.tp * parallel.pp * parallel.dp = {p.tp} * {p.pp} * {p.dp} = {p.world_size} "
                      f"must equal {source} = {processes}{hint}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):  # data.blend
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
