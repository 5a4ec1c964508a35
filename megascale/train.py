"""The Trainer: builds everything from one config and runs the training loop.

    cfg = load_config("configs/cpu_default.toml", ["train.steps=200"])
    result = Trainer(cfg).fit()

One optimizer step = `global_batch` sequences, run as `global_batch / micro_batch`
forward/backward passes whose gradients accumulate. The loop logs loss, tokens/s and MFU,
evaluates on the held-out split, checkpoints, and stops cleanly on Ctrl-C or SIGTERM (the
step in flight finishes, a checkpoint is written, and `fit` returns). A run directory that
already holds a checkpoint is resumed from it, and the resumed run is bit-for-bit the
uninterrupted one: same losses, same data order, same random numbers.

Everything that can be wrong with the user's input (config, data, tokenizer, checkpoint) is
checked before the run directory is written to.

One path for every world size: a single process is a mesh of one. torchrun or `megascale
train --nproc N` start N processes that each build a Trainer for the same config; the process
group and the (dp, pp, tp) mesh are set up here, the rank's model, optimizer and step come from
`parallel.engine.ParallelEngine` (which calls no collective for a world of one), and this loop
is the same: the loss it reports is the job's (the dp mean; under pp the last stage's), tokens/s
counts the whole job, MFU divides by world_size devices, and only global rank 0 prints, logs and
writes config.toml and metrics. Every rank agrees on user errors and on stopping (a signal on
any rank stops all after the same step).

Checkpoints (checkpoint/manager.py): every rank snapshots its own shard of the state into host
memory and persists it in the background (DCP); a start restores the newest complete state,
from any layout's checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megascale.checkpoint import CheckpointManager, RestoreInfo, rng_state, set_rng_state
from megascale.checkpoint.manager import storage_root
from megascale.checkpoint.rundir import RunDirLock, archive_previous_run
from megascale.checkpoint.storage import CheckpointError, Storage
from megascale.config import Config, ConfigError, check_world_size
from megascale.data import build_tokenizer, ensure_dataset, open_splits
from megascale.data.atomic import write_text_atomic
from megascale.data.fingerprint import datasets_of
from megascale.data.shared_loader import build_loader
from megascale.distributed.init import (
    agree_on_user_errors,
    create_mesh,
    first_collective,
    init_distributed,
    set_collective_timeout,
)
from megascale.distributed.same_config import check_same_config, check_same_data, check_shared_run_dir
from megascale.errors import CollectiveFailed, HostCheckError, PeerHostEvicted, UserError
from megascale.fault import blocklist
from megascale.fault.inject import attempt, delays, fires_once, host_id, inject
from megascale.fault.selfcheck import host_selfcheck, under_launcher
from megascale.model import GPT
from megascale.observe import timers
from megascale.observe.metrics import MetricsLogger
from megascale.observe.session import Observer
from megascale.observe.stragglers import costliest
from megascale.observe.watchdog import enable_flight_recorder
from megascale.optim import lr_at, set_lr
from megascale.parallel.engine import ParallelEngine, layout_of
from megascale.parallel.mesh import Mesh, tp_across_hosts
from megascale.perf.flops import flops_per_token, published_flops_per_token
from megascale.perf.hardware import PeakInfo, peak_info, record_matmul_rate

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time: float
    tokens_per_s: float
    mfu: float  # exact FLOPs (causal attention: (s+1)/2 keys per query) over the peak
    mfu_published: float  # the PaLM/Megatron convention (6N + 12*L*d*s per token, full s), for comparisons


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda was asked for but no GPU is available")
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: Config, *, resume: bool | None = None, quiet: bool = False):
        self.cfg = cfg
        t, m = cfg.train, cfg.model
        self.device = resolve_device(t.device)
        if cfg.observe.flight_recorder:  # PyTorch's own record of each group's collectives (hang dumps)
            enable_flight_recorder(cfg.observe.flight_recorder)
        # torchrun / --nproc: join the process group (nothing happens for a single process)
        self.dist = init_distributed(self.device, cfg.distributed)
        self.world_size, self.is_main = self.dist.world_size, self.dist.is_main
        self.quiet = quiet or not self.is_main
        if self.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        check_world_size(cfg, self.world_size, "the number of processes (WORLD_SIZE)")
        hosts = check_same_config(cfg, self.dist.rank, self.world_size)  # hosts launched one by one differ
        self.run_dir = Path(t.run_dir)
        self._lock = RunDirLock(self.run_dir) if self.is_main else None

        # --- inputs first: nothing is written to the run directory until they are known good.
        # Every rank checks them; a user error on any rank stops all, with one message.
        prefix = None
        with agree_on_user_errors(self.dist):
            self.tokenizer = build_tokenizer(cfg.data.tokenizer)
            if m.vocab_size == 0:
                m.vocab_size = self.tokenizer.vocab_size
            elif m.vocab_size < self.tokenizer.vocab_size:
                raise ConfigError(
                    f"model.vocab_size: {m.vocab_size} is smaller than the tokenizer's vocabulary "
                    f"({self.tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer!r})"
                )
            if self.is_main:  # rank 0 tokenises a missing dataset; the others wait, then open it
                time.sleep(delays(self.dist.rank).get("prepare", 0.0))  # tests: a slow tokenisation
                prefix = ensure_dataset(cfg.data, progress=cfg.log.progress and not self.quiet)
        with agree_on_user_errors(self.dist):
            if prefix is None:
                prefix = ensure_dataset(cfg.data, progress=False)
            self.train_samples, self.val_samples = open_splits(prefix, cfg.data, m.seq_len)
            if len(self.train_samples) < t.global_batch:
                where = "data.blend: the blend" if cfg.data.blend else f"data.path: {prefix}"
                raise UserError(
                    f"{where} has {len(self.train_samples)} training samples of "
                    f"{m.seq_len + 1} tokens, fewer than one global batch ({t.global_batch})"
                )
        check_same_data(datasets_of(self.train_samples), self.dist.rank, hosts)  # hosts' copies drift
        with agree_on_user_errors(self.dist):
            if self._lock is not None:  # one job per run directory, from here to the end of fit
                self._lock.acquire()
                # storage no checkpoint can be written to: refused now, not at the first save hours in
                Storage(storage_root(cfg, self.run_dir)).check_writable()
            init = self._initial_weights()
        check_shared_run_dir(self.run_dir, self.dist.rank, hosts)  # its blocklist, diagnosis, checkpoints

        # --- build: the same seed gives the same initial weights in every run and layout
        torch.manual_seed(t.seed)
        self.model_dtype = torch.float64 if t.dtype == "fp64" else torch.float32
        if self.world_size > 1:
            self.mesh = create_mesh(self.dist, cfg.parallel, cfg.distributed)
            first_collective(self.dist, self.mesh, self.device)
            if (spanning := tp_across_hosts(hosts, self.mesh.dp, self.mesh.pp, self.mesh.tp)) is not None:
                self._warn(spanning)  # it runs, only slowly: said once, at the start
            if cfg.fault.selfcheck and under_launcher():
                with self._phase("selfcheck"):
                    self._selfcheck()
        else:
            self.mesh = Mesh(1, 1, 1, 0)
        with self._phase("build"):
            self.engine = ParallelEngine(cfg, self.mesh, self.device, self.model_dtype, init)
            del init
            self.model, self.optimizer = self.engine.model, self.engine.optimizer
            self.n_micro = self.engine.n_micro  # micro-batches per step on each dp rank
            with torch.device("meta"):  # the one-process count (a tied matrix once), no memory, no collective
                self._num_params = GPT(m).num_params()
            # this dp rank's rows; data.shared_loader: one reader per host (collective)
            self.loader = build_loader(cfg, self.train_samples, self.mesh, self.device)
        self.step = 0

        # --- the newest complete state (host memory, else storage), from any layout
        with self._phase("restore"):
            self.checkpoints = CheckpointManager(cfg, self.run_dir, self.mesh, self.dist.rank,
                                                 self.world_size, layout_of(cfg), self._warn)
            self.restored: RestoreInfo | None = None
            self._restarted_fresh = False  # a launcher's restart that found no state: from step 0 again
            with agree_on_user_errors(self.dist):
                self._resume(resume)
        # after the resume: a fresh start has archived an earlier run's traces by now
        with self._phase("observer"):
            self.observer = Observer(cfg, self.run_dir, self.mesh, self.device, self._warn)
        self.heartbeat = self.observer.start_heartbeat(cfg.fault.heartbeat_interval_s)  # under a launcher
        if self.world_size > 1:  # start-up is over: collectives of training get their own timeout
            set_collective_timeout(self.mesh, cfg.distributed.collective_timeout_s)

        self.tokens_per_step = t.global_batch * m.seq_len  # the whole job's, every layout
        self.flops_per_token = flops_per_token(m, training=True)
        self.flops_per_token_published = published_flops_per_token(m)
        with self._phase("peak"):
            self.peak_info = self._peak_flops()  # per device; MFU divides by world_size of them
        self.peak = self.peak_info.flops
        self._stop_signal: int | None = None
        self._stop_agreed: int | None = None  # the signal every rank stops for
        self.rollbacks = 0  # non-finite losses rolled back so far (fault.max_nan_rollbacks)

    def _peak_flops(self) -> PeakInfo:
        cfg, t = self.cfg, self.cfg.train
        if cfg.log.peak_flops or self.world_size == 1 or self.device.type != "cpu":
            return peak_info(self.device.type if self.device.type == "cpu" else _gpu_name(), t.dtype,
                             override=cfg.log.peak_flops or None)
        box = [peak_info("cpu", t.dtype) if self.is_main else None]  # one CPU probe, not one per rank
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ set-up helpers

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time one phase of a distributed start-up into the start-up breakdown (the `startup` record):
        after a fault, where the seconds to the first step go."""
        t0 = time.perf_counter()
        yield
        if self.world_size > 1:
            self.dist.timings[name] = time.perf_counter() - t0

    def _selfcheck(self) -> None:
        """The host self-check of a launched job; a host that fails goes on the run's blocklist (its first
        rank writes it) before its ranks exit 4 and its agent leaves the job."""
        try:
            host_selfcheck(self.device, self.cfg.fault.selfcheck_min_speed, self._warn)
        except HostCheckError as e:
            if self.dist.local_rank == 0:
                self._blocklist(host_id(), str(e))
            raise

    def _blocklist(self, host: str, why: str) -> None:
        """This host on the run's blocklist before its ranks leave the job (exit 4). Its leaving does not
        depend on the file: a full disk costs only the record that keeps it out of a relaunch."""
        try:
            blocklist.add(self.run_dir, host, why, os.environ.get("TORCHELASTIC_RUN_ID", ""))
        except OSError as e:
            print(f"megascale: {blocklist.unwritten(self.run_dir, host, e)}", file=sys.stderr, flush=True)

    def _evict_straggler(self, rec: dict) -> None:
        """fault.evict_stragglers: every rank has the same verdict; the straggler's host leaves (exit 4, on
        the blocklist), the others restart without it (exit 5), as after a failed self-check."""
        why = (f"straggler: rank {rec['rank']} {100 * rec['slower_by']:.0f}% slower in {rec['op']} than the "
               f"median of its peers for {rec['windows']} windows (fault.evict_stragglers)")
        if rec["host"] in self.observer.store_hosts:
            # its agent serves the rendezvous store: its leaving would end the job, a slow host only slows it
            self._warn(f"host {rec['host']} is not evicted ({why}): its agent serves the rendezvous store "
                       "(--rdzv-endpoint), so the job would end with it. A store outside the job "
                       "(megascale rdzv-store) lets any host be evicted")
            return
        if rec["host"] == host_id():
            if self.dist.local_rank == 0:
                self._blocklist(rec["host"], why)
            raise HostCheckError(f"host {rec['host']} is evicted: {why}")
        raise PeerHostEvicted(f"host {rec['host']} is evicted ({why}); this host ({host_id()}) restarts "
                              "without it")

    def _initial_weights(self) -> dict[str, torch.Tensor] | None:
        """model.init_from's weights (one-process state dict), or None for the seed's random ones."""
        src = self.cfg.model.init_from
        if not src:
            return None
        from megascale.checkpoint.hf import load_hf_state

        return load_hf_state(src.removeprefix("hf:"), self.cfg.model)

    def _resume(self, resume: bool | None) -> None:
        """Restore the newest complete state, or start fresh (archiving an earlier run's files)."""
        want = self.cfg.checkpoint.resume if resume is None else resume
        info = self.checkpoints.restore(self.engine) if want else None
        if info is None:
            if resume is True:
                raise UserError(f"--resume: no checkpoint in {self.checkpoints.storage.display}")
            self.checkpoints.fresh_start()
            if attempt() > 0:  # a restart before the job's first snapshot: the run directory's files are
                self._restarted_fresh = True  # this job's own (the driver's hang diagnosis among them)
                return
            if self.is_main:
                moved = archive_previous_run(self.run_dir, self.checkpoints.storage,
                                             self.checkpoints.default_storage)
                if moved is not None and not self.quiet:
                    print(f"fresh start: the earlier run's checkpoints and metrics are in {moved}")
            return
        if info.extra.get("loader") is not None:
            self.loader.load_state_dict(info.extra["loader"])
        if info.extra.get("rng") is not None:  # the same layout: each rank's own generators
            set_rng_state(info.extra["rng"])
        self.step = info.step
        self.restored = info

    def save(self, persist: bool = True, final: bool = False) -> str:
        """Checkpoint the current step (collective: every rank calls it): stage 1 into host memory now,
        stage 2 to storage in the background; `final` waits for storage. Returns the storage path."""
        extra = {"rng": rng_state(), "loader": self.loader.state_dict()}
        self.checkpoints.save(self.step, self.engine, extra, persist, last=final)
        path = self.checkpoints.storage.url(self.checkpoints.storage.step_dir(self.step))
        if final and not self.checkpoints.finish(self.step):  # the run's end: no later save will cover it
            kept = (f"it stays in host memory ({self.checkpoints.memory_dir}): run the same command again "
                    "to write it" if self.cfg.checkpoint.memory else "checkpoint.memory is off: it is lost")
            raise CheckpointError(f"checkpoint: the final state (step {self.step}) did not reach storage "
                                  f"{path} ({self.checkpoints.persist_error}); {kept}")
        return path

    def close(self) -> None:
        """Release the run directory, the checkpoint threads and the trace writer (fit() releases the
        lock too)."""
        self.observer.close()
        self.checkpoints.close()
        self.loader.close()
        if self._lock is not None:
            self._lock.release()

    def full_model(self) -> GPT | None:
        """The trained model as one GPT (for sampling): the model itself on one process; in a parallel
        run gathered from the ranks (collective) and returned on rank 0 only. Under train.compile a copy
        with eager blocks: the compiled ones would compile again for new lengths of a growing context."""
        if self.world_size == 1 and not self.cfg.train.compile:
            return self.model
        full = self.model.state_dict() if self.world_size == 1 else self.engine.full_model_state()
        if not self.is_main:
            return None
        model = GPT(self.cfg.model).to(dtype=self.model_dtype)
        model.load_state_dict(full)
        return model

    def _autocast(self):
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the loop

    def train_step(self) -> StepStats:
        """One optimizer step: forwards and backwards of the micro-batches, clip, update; ends with the
        one all-reduce that gives every rank the job's loss and the agreed stop flag (none for one
        process)."""
        t0 = time.perf_counter()
        cfg, engine = self.cfg, self.engine
        inject("step", self.step)  # tests: MEGASCALE_INJECT="stop@step:3:rank=5" (a host that hangs)
        self.observer.begin_step(self.step)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        set_lr(self.optimizer, lr)
        with timers.span("next_batch", "data"):
            x, y = self.loader.next_batch()  # this dp rank's rows of the global batch
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.model.train()
        local_loss = engine.forward_backward(x, y, self._autocast, self.step)
        if fires_once("nan", self.step):  # tests: MEGASCALE_INJECT="nan@step:7" (a loss spike to NaN)
            local_loss = local_loss * float("nan")
        with timers.span("clip"):
            grad_norm = engine.clip_grads(cfg.optim.grad_clip)  # global: the same on every rank
        # the job's loss and stop flag: launched before the update, whose parameter all-gathers would
        # hold its few bytes behind megabytes on the wire; .item() at the end, a sync
        agreement = engine.start_agree(local_loss, self._stop_signal, self.step + 1)
        with timers.span("blocked", "checkpoint"):
            self.checkpoints.before_update()  # a snapshot's copy must be complete before the weights change
        if torch.isfinite(grad_norm):
            engine.step()
        else:  # a non-finite gradient would poison the weights: skip the update, keep going, say so
            self._log_print(f"step {self.step + 1}: non-finite gradient norm, update skipped")
        engine.zero_grad()
        self.step += 1
        loss_value, self._stop_agreed = engine.finish_agree(agreement)
        dt = time.perf_counter() - t0
        tps = self.tokens_per_step / dt
        if (self.world_size == 1 and tps * self.flops_per_token > self.peak and self.device.type == "cpu"
                and not cfg.log.peak_flops):
            # Faster than the peak: the probe ran on a busy machine. What this step did is a lower bound
            # on what the CPU can do; it becomes the cached best (no re-probe on the hot path).
            self.peak = record_matmul_rate(cfg.train.dtype, tps * self.flops_per_token)
        devices = self.peak * self.world_size
        return StepStats(self.step, loss_value, lr, float(grad_norm), dt, tps,
                         tps * self.flops_per_token / devices, tps * self.flops_per_token_published / devices)

    def _val_batches(self) -> int:
        """Validation micro-batches an evaluation takes: 0 when the split holds less than one."""
        return min(self.cfg.train.eval_batches, len(self.val_samples) // self.cfg.train.micro_batch)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first `eval_batches` validation micro-batches (a fixed set); NaN if none."""
        batches = self._val_batches()
        if batches == 0:
            return float("nan")
        return self.engine.evaluate(self.val_samples, batches, self._autocast)  # split over dp

    def fit(self, max_steps: int | None = None) -> dict[str, Any]:
        """Train to `train.steps` (or for at most `max_steps` more steps in this call), then save."""
        cfg, t = self.cfg, self.cfg.train
        end = t.steps if max_steps is None else min(t.steps, self.step + max_steps)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._lock is not None and self._lock._fh is None:  # a second fit() of this Trainer
            self._lock.acquire()
        if self.is_main:  # one writer per run directory: global rank 0
            try:
                write_text_atomic(self.run_dir / "config.toml", cfg.to_toml())
            except OSError as e:  # a restart on a full disk: the run matters more than this copy
                self._warn(f"cannot write {self.run_dir / 'config.toml'} ({e.strerror or e}); "
                           "training goes on")
            logger = MetricsLogger(self.run_dir, cfg.log.jsonl, cfg.log.tensorboard,
                                   resume_step=self.step if self.step > 0 or self._restarted_fresh else None,
                                   warn=self._warn)
        else:
            logger = _NoLogger()
        start_step = self.step
        if self.dist.timings:  # rank 0's start-up breakdown, in seconds
            logger.log("startup", {"step": start_step, **self.dist.timings})
        logger.log("layout", {"step": start_step, **self.observer.layout_record()})
        logger.log("peak", {"step": start_step, "peak_flops": self.peak, "source": self.peak_info.source,
                            "detail": self.peak_info.detail, "devices": self.world_size,
                            "flops_per_token": self.flops_per_token,
                            "flops_per_token_published": self.flops_per_token_published})
        timers.install(self.observer.recorder)  # this Trainer's, if a process runs several
        self.observer.watch()
        self._banner(start_step)
        old_handlers = self._install_signal_handlers()
        bar = self._progress_bar(start_step)
        # every step's time (the run's median) and loss (fit's result), 8 bytes each, not a Python float's
        # 32: a week-long run is millions of steps
        times, losses, last_val = array("d"), array("d"), float("nan")
        evaluates = bool(t.eval_interval and self._val_batches())  # off, said at the start, if no batch
        t_start = time.perf_counter()
        saved_at = None  # the step of a checkpoint whose blocked time the next step completes
        try:
            while self.step < end:
                s = self.train_step()
                if not math.isfinite(s.loss):  # the job's loss: every rank sees the same and acts alike
                    self._roll_back(s, logger, bar)
                    continue
                if saved_at is not None:  # save() + the wait for its copy before this step's update
                    logger.log("checkpoint", {"step": saved_at, "blocked_s": self.checkpoints.last_blocked_s,
                                              "snapshots_skipped": self.checkpoints.skipped})
                    saved_at = None
                times.append(s.step_time)
                losses.append(s.loss)
                rec = {"step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
                       "step_time": s.step_time, "tokens_per_s": s.tokens_per_s, "mfu": s.mfu,
                       "mfu_published": s.mfu_published, "tokens": s.step * self.tokens_per_step}
                if self.engine.pipelined:
                    rec["bubble"] = self.engine.bubble  # rank 0's idle fraction in the pipeline
                logger.log("train", rec)
                self._show(bar, s)
                if evaluates and (s.step % t.eval_interval == 0 or s.step == t.steps):
                    t_eval = time.perf_counter()
                    last_val = self.evaluate()
                    logger.log("val", {"step": s.step, "loss": last_val, "ppl": _ppl(last_val),
                                       "seconds": time.perf_counter() - t_eval})
                    self._log_print(f"step {s.step}: val loss {last_val:.4f}, ppl {_ppl(last_val):.2f}", bar)
                c = cfg.checkpoint
                if s.step < end and (c.interval and s.step % c.interval == 0
                                     or c.memory_interval and s.step % c.memory_interval == 0):
                    with timers.span("snapshot", "checkpoint"):
                        self.save(persist=bool(c.interval and s.step % c.interval == 0))
                    saved_at = s.step
                for ev in self.checkpoints.events():
                    logger.log("persist", ev)
                slow = self.observer.end_step(s.step, logger)
                # only a host among others: a job on one host has nowhere to go without it (and a
                # shrunk job's two tp peers flag each other on a noisy machine)
                if slow and cfg.fault.evict_stragglers and under_launcher() \
                        and len(set(self.observer.hosts)) > 1:
                    # on a shared machine a healthy rank is flagged now and then too: the one that
                    # costs the step most goes
                    self._evict_straggler(costliest(slow))
                self.heartbeat.update(step=s.step, loss=s.loss, tokens_per_s=s.tokens_per_s,
                                      status="training")
                if self._stopping() is not None:
                    break
            interrupted = self._stopping() is not None
            # resumed from a host-memory snapshot of the last step that storage lacks (its final persist
            # failed): write it now
            unsaved = self.restored is not None and self.step not in self.checkpoints.committed
            if self.step > start_step or interrupted or unsaved:
                # no more steps: the driver's frozen-step check is for training (the final save, the
                # wait for storage may take longer than a step; the observe watchdog still guards it)
                self.heartbeat.update(status="saving")
                path = self.save(final=True)
                for ev in self.checkpoints.events():
                    logger.log("persist", ev)
                if interrupted:
                    self._log_print(f"stopped by {signal.Signals(self._stopping()).name} after step "
                                    f"{self.step}; checkpoint {path}; run the same command to resume", bar)
        except Exception as e:
            self.heartbeat.update(status="failed", last_log=f"{type(e).__name__}: {str(e)[:200]}")
            if self.observer.on_error(e):  # a collective that failed: said, with who waited for what
                raise CollectiveFailed(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
            raise
        finally:
            if bar is not None:
                bar.close()
            logger.close()
            self.loader.close()
            self._restore_signal_handlers(old_handlers)
            self.checkpoints.wait()
            self.observer.unwatch()
            if self.observer.recorder is not None:
                self.observer.recorder.flush()  # the trace is complete when fit returns
            if self._lock is not None:
                self._lock.release()
        seconds = time.perf_counter() - t_start
        med = float(np.median(times)) if times else float("nan")
        peak = self.peak * self.world_size
        result = {
            "steps": self.step, "steps_run": self.step - start_step, "seconds": seconds,
            "tokens": self.step * self.tokens_per_step,
            "train_loss": losses[-1] if losses else float("nan"),
            "val_loss": last_val, "losses": losses.tolist(),
            "median_step_time": med,
            "tokens_per_s": self.tokens_per_step / med if times else float("nan"),
            "mfu": self.tokens_per_step / med * self.flops_per_token / peak if times else float("nan"),
            "mfu_published": (self.tokens_per_step / med * self.flops_per_token_published / peak if times
                              else float("nan")),
            "interrupted": self._stopping() is not None,
            "stop_signal": self._stopping(),
        }
        self.heartbeat.update(step=self.step, status="stopped" if result["interrupted"] else "done")
        return result

    def _roll_back(self, s: StepStats, logger, bar) -> None:
        """A non-finite loss: back to the newest snapshot, past the batches since (the offending window
        among them: PaLM's remedy for loss spikes), at most fault.max_nan_rollbacks times. Collective."""
        self.rollbacks += 1
        limit = self.cfg.fault.max_nan_rollbacks
        if self.rollbacks > limit:
            raise UserError(f"train: the loss was not finite at step {s.step} after {limit} rollback(s) "
                            "(fault.max_nan_rollbacks): the run diverges; lower optim.lr or check the data")
        self.checkpoints.wait()
        info = self.checkpoints.restore(self.engine)
        if info is None:
            self._log_print(f"step {s.step}: loss {s.loss}; no snapshot to roll back to, going on", bar)
            return
        if info.extra.get("loader") is not None:
            self.loader.load_state_dict(info.extra["loader"])
        skipped = s.step - info.step  # the batches of steps info.step + 1 .. s.step, the bad one last
        for _ in range(skipped):
            self.loader.next_batch()
        self.step = info.step
        if info.extra.get("rng") is not None:
            set_rng_state(info.extra["rng"])
        logger.log("rollback", {"step": s.step, "loss": str(s.loss), "restored_step": info.step,
                                "source": info.source, "skipped_batches": skipped,
                                "rollback": self.rollbacks})
        self._log_print(f"step {s.step}: loss {s.loss}: rolled back to step {info.step} ({info.source}) and "
                        f"skipped {skipped} batch(es); rollback {self.rollbacks} of {limit}", bar)

    def _stopping(self) -> int | None:
        """The signal to stop for: this process's own, or in a parallel run the one all ranks agreed on
        at the end of the last step (so that every rank stops after the same step)."""
        return self._stop_agreed

    # ------------------------------------------------------------------ output

    def _banner(self, start_step: int) -> None:
        if self.quiet:
            return
        m, t, p = self.cfg.model, self.cfg.train, self.cfg.parallel
        n = self._num_params
        r = self.restored
        where = "fresh start"
        if r:
            peers = f", {r.from_peers} rank(s) from peer hosts" if r.from_peers else ""
            where = (f"resumed from {r.source} at step {start_step} ({r.where}, {r.seconds:.2f} s"
                     f"{'' if r.same_layout else ', resharded from another layout'}{peers})")
        if self.device.type == "cpu" and t.dtype == "bf16" and not _cpu_has_bf16():
            print(f"warning: train.dtype=bf16 on a CPU without AVX512-BF16/AMX (capability "
                  f"{torch.backends.cpu.get_cpu_capability()}): bf16 matmuls are emulated and far slower "
                  "than fp32 here")
        print(f"megascale: {n / 1e6:.2f}M parameters ({m.style} style, {m.block} block, {m.attention} "
              f"attention), {m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, seq {m.seq_len}")
        print(f"  data: {len(self.train_samples)} train / {len(self.val_samples)} val samples; "
              f"batch {t.global_batch} = {self.n_micro} x {t.micro_batch}; {t.dtype} on {self.device}; "
              f"peak {self.peak / 1e9:.0f} GFLOP/s ({self.peak_info.source}); {where}")
        if t.eval_interval and not self._val_batches():
            print(f"  validation off: the validation split has {len(self.val_samples)} samples, fewer than "
                  f"one micro-batch ({t.micro_batch}); data.val_fraction = {self.cfg.data.val_fraction} "
                  "holds out whole documents (a .txt file is one): more documents, or a larger fraction, "
                  "give it some")
        print(f"  unigram baseline: {unigram_entropy(self.train_samples, m.vocab_size):.3f} nats/token "
              f"(a model that learned nothing but token frequencies)")
        if self.world_size > 1:
            pipe = (f", {p.resolved_schedule} schedule" + (f" x {p.vpp} chunks" if p.vpp > 1 else "")
                    if p.pp > 1 else "")
            dopt = ", distributed optimizer" if p.dp > 1 else ""
            sp = " + sequence parallel" if p.sequence_parallel and p.tp > 1 else ""
            print(f"  parallel: dp {p.dp} x pp {p.pp} x tp {p.tp}{sp} = {self.world_size} processes "
                  f"({self.dist.backend}){pipe}{dopt}; "
                  f"{self.n_micro} micro-batches of {t.micro_batch} per dp rank per step")
            print(f"  start-up (rank 0): {self.dist.startup_line()} "
                  f"({self.cfg.distributed.group_init} group init)")

    def _progress_bar(self, start_step: int):
        if self.quiet or not self.cfg.log.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _show(self, bar, s: StepStats) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {s.loss:.4f} | {s.tokens_per_s:,.0f} tok/s | MFU {100 * s.mfu:.1f}%")
        elif not self.quiet and self.cfg.train.log_interval and s.step % self.cfg.train.log_interval == 0:
            eta = (self.cfg.train.steps - s.step) * s.step_time
            print(f"step {s.step}/{self.cfg.train.steps} | loss {s.loss:.4f} | lr {s.lr:.2e} | "
                  f"{s.tokens_per_s:,.0f} tok/s | MFU {100 * s.mfu:.1f}% | ETA {eta:.0f}s", flush=True)

    def _warn(self, msg: str) -> None:
        """A problem worth a line even in a quiet run (rank 0 says it, on stderr)."""
        if self.is_main:
            print(f"megascale: {msg}", file=sys.stderr, flush=True)

    def _log_print(self, msg: str, bar=None) -> None:
        self.heartbeat.log(msg)
        if self.quiet:
            return
        if bar is not None:
            bar.write(msg)
        else:
            print(msg, flush=True)

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self):
        def handler(signum, frame):
            if self._stop_signal is not None:  # a second Ctrl-C: the user means it
                raise KeyboardInterrupt
            self._stop_signal = signum

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return old

    @staticmethod
    def _restore_signal_handlers(old) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)


class _NoLogger:
    """The metrics sink of ranks other than 0."""

    def log(self, kind: str, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def unigram_entropy(samples, vocab_size: int, max_samples: int = 2000) -> float:
    """Entropy (nats) of the token distribution: the loss of a model that knows only frequencies."""
    n = min(len(samples), max_samples)
    stride = max(1, len(samples) // n)
    tokens = samples.batch(range(0, stride * n, stride)).numpy().ravel()
    counts = np.bincount(tokens, minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


def _cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN needs AVX512-BF16 or AMX for speed)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe()) if probe is not None else True


def _gpu_name() -> str:
    return torch.cuda.get_device_name()
