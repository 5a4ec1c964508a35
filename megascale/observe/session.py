"""What the Trainer runs of observability, in one object: timers, clock alignment, stragglers, hangs.

    obs = Observer(cfg, run_dir, mesh, device, log)   # collective when world > 1 (hosts, clocks)
    obs.begin_step(step)                              # records of this optimizer step carry `step`
    obs.end_step(step, logger)                        # collective every N steps: clocks, straggler window
    obs.close()

With more than one rank a watchdog thread heartbeats into the in-flight record and, when one op
has run for `observe.hang_timeout_s`, writes the rank's stacks and in-flight state and (the lowest
live rank) the diagnosis of who everyone waits for (observe/watchdog.py, observe/diagnose.py).

With `observe.timers = false` nothing is installed: every timers.* call in the parallel code is
a no-op, and there are no traces, no straggler windows and no in-flight records (so no hang
diagnosis either); the benchmark `benchmarks/observe_overhead.py` compares the two.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megascale.config import Config
from megascale.fault.heartbeat import HeartbeatWriter
from megascale.fault.inject import host_id
from megascale.fault.rendezvous import serves_store
from megascale.observe import timers
from megascale.observe.clock import measure_offsets
from megascale.observe.stragglers import COMPUTE_OPS, StragglerDetector
from megascale.observe.watchdog import Watchdog
from megascale.parallel.mesh import Mesh, group_ranks, mesh_group_kinds


def rank_groups(mesh: Mesh) -> dict[str, list[int]]:
    """The members (global ranks) of every group this rank is in, by kind; "world" first. A rank is in no
    group of some kinds (the tied-embedding group "emb" holds only the first and last pipeline stages)."""
    out = {"world": list(range(mesh.world_size))}
    for kind in mesh_group_kinds(mesh.dp, mesh.pp, mesh.tp):
        mine = next((g for g in group_ranks(mesh.dp, mesh.pp, mesh.tp, kind) if mesh.rank in g), None)
        if mine is not None:
            out[kind] = mine
    return out


class Observer:
    def __init__(self, cfg: Config, run_dir: str | Path, mesh: Mesh, device: torch.device, log=None):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.ob = cfg.observe
        self.log = log or (lambda msg: print(f"megascale: {msg}", file=sys.stderr, flush=True))
        self.multi = mesh.world_size > 1
        self.recorder: timers.Recorder | None = None
        self.watchdog = None
        self.heartbeat: HeartbeatWriter | None = None
        self.clock_error_ns = 0
        self._window_start = None
        if not self.ob.timers:
            return
        coords = {"dp": mesh.dp_rank, "pp": mesh.pp_rank, "tp": mesh.tp_rank}
        shape = {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}
        self.recorder = timers.Recorder(Path(run_dir) / "trace", mesh.rank, mesh.world_size, coords,
                                        rank_groups(mesh), device_type=device.type,
                                        capacity=self.ob.buffer_records,
                                        flush_interval_s=self.ob.flush_interval_s, mesh_shape=shape,
                                        max_bytes=int(self.ob.trace_max_mb * 2**20))
        timers.install(self.recorder)
        self.hosts = [host_id()]  # under megascale launch its --local-addr (simulated hosts share a name)
        self.coords = [(0, 0, 0)]
        # the hosts whose agent serves the rendezvous store: they cannot leave without ending the job
        self.store_hosts = {host_id()} if serves_store() else set()
        if self.multi:
            every: list = [None] * mesh.world_size
            dist.all_gather_object(every, (host_id(), (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank),
                                           serves_store()))
            self.hosts = [h for h, _, _ in every]
            self.coords = [tuple(c) for _, c, _ in every]
            self.store_hosts = {h for h, _, serves in every if serves}
            self.recorder.note(hosts=self.hosts)
            self.sync_clocks()
            if self.ob.straggler_window:
                self.recorder.samples = {}  # kept for _straggler_window, which takes them each window
        self.stragglers = StragglerDetector(self.coords, self.hosts, self.ob.straggler_threshold,
                                            self.ob.straggler_windows)
        self._hang_dir = Path(run_dir) / "trace" / "hang"

    def start_heartbeat(self, interval_s: float) -> HeartbeatWriter:
        """The beat to the launcher's store (a no-op without a launcher); the Trainer updates it."""
        rec = self.recorder
        self.heartbeat = HeartbeatWriter(self.mesh.rank, interval_s,
                                         bytes_moved=(lambda: rec.bytes_moved) if rec is not None else None)
        return self.heartbeat

    # ------------------------------------------------------------------ the watchdog (fit() holds it)

    def watch(self) -> None:
        """Start the watchdog: heartbeats, and a dump when one op runs for observe.hang_timeout_s. Only
        with more than one rank: a hang needs two."""
        if self.recorder is None or not self.multi or self.watchdog is not None:
            return
        # its lines go to stderr from every rank (not through self.log, rank 0's alone): when rank 0 is
        # the one stopped, another rank diagnoses the hang and must be heard
        self.watchdog = Watchdog(self.recorder.inflight, self._hang_dir, self.mesh.rank,
                                 self.ob.hang_timeout_s, self.ob.hang_action,
                                 on_hang=lambda _path: self.recorder.flush()).start()

    def unwatch(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    # ------------------------------------------------------------------ clocks

    def sync_clocks(self) -> None:
        """Measure this rank's offset to rank 0's clock (collective) and put it in the trace."""
        offset, err = measure_offsets(self.recorder.now)
        self.recorder.clock(offset, err)
        self.clock_error_ns = err

    # ------------------------------------------------------------------ the step

    def begin_step(self, step: int) -> None:
        if self.recorder is not None:
            self.recorder.set_step(step)
            if self._window_start is None:
                self._window_start = step

    def end_step(self, step: int, logger) -> list[dict]:
        """After optimizer step `step` (1-based count done): the periodic collectives. Returns the
        straggler records found, the same on every rank (fault.evict_stragglers acts on them)."""
        if self.recorder is None or not self.multi:
            return []
        ob, found = self.ob, []
        if ob.clock_sync_interval and step % ob.clock_sync_interval == 0:
            self.sync_clocks()
        if ob.straggler_window and step % ob.straggler_window == 0:
            found = self._straggler_window(step, logger)
        return found

    def _straggler_window(self, step: int, logger) -> list[dict]:
        # the median duration of each op in the window: one preempted instance (a noisy neighbour) does
        # not move it, a rank that is slow every time does
        samples, self.recorder.samples = self.recorder.samples, {}
        mine = torch.tensor([float(np.median(samples[op])) / 1e9 if samples.get(op) else 0.0
                             for op in COMPUTE_OPS], dtype=torch.float64)
        first = (self._window_start or 0) + 1
        self._window_start = step
        dev = mine.to(self.device)
        parts = [torch.empty_like(dev) for _ in range(self.mesh.world_size)]
        with timers.comm("all_gather", "dp", "world"):
            dist.all_gather(parts, dev)
        seconds = np.stack([p.cpu().numpy() for p in parts])
        ranks_recs, found = self.stragglers.update(step, first, seconds)  # every rank: the same verdict
        if self.mesh.rank != 0:
            return found
        for rec in ranks_recs:
            logger.log("ranks", rec)
        for rec in found:
            logger.log("straggler", rec)
            self.log(f"straggler: rank {rec['rank']} (host {rec['host']}, dp{rec['dp']} pp{rec['pp']} "
                     f"tp{rec['tp']}) is {100 * rec['slower_by']:.0f}% slower in {rec['op']} than the "
                     f"median of its peers ({1e3 * rec['seconds']:.1f} ms vs {1e3 * rec['median_s']:.1f} ms "
                     f"per op, steps {first}-{step}), {rec['windows']} windows in a row")
        return found

    def on_error(self, exc: BaseException) -> bool:
        """A collective that timed out (or a peer that died) raises here: write this rank's hang dump
        (in-flight op, stacks, flight recorder) before the error ends the process. Whether it was said,
        in one line naming the op and the dump."""
        if self.watchdog is None or not isinstance(exc, (dist.DistError, RuntimeError)):
            return False
        text = str(exc).lower()
        reason = f"collective failed: {str(exc).splitlines()[0][:300]}"
        if any(w in text for w in ("timed out", "timeout")):
            # a hang: take part in the diagnosis of who everyone waits for
            return self.watchdog.dump(reason) is not None
        if any(w in text for w in ("connection", "closed", "reset", "abort")):
            # a peer died: the error names it already. Write the dump but do not wait for the others'
            # (the dead never write theirs, and the live ones count as live until their beats are 5 s
            # old): the sooner this process exits, the sooner its agent restarts the job
            return self.watchdog.dump(reason, diagnose=False) is not None
        return False

    def layout_record(self) -> dict:
        m = self.mesh
        return {"dp": m.dp, "pp": m.pp, "tp": m.tp, "world": m.world_size,
                "hosts": getattr(self, "hosts", []), "coords": [list(c) for c in getattr(self, "coords", [])],
                "clock_error_us": self.clock_error_ns / 1e3}

    def close(self) -> None:
        self.unwatch()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.recorder is not None:
            timers.install(None)
            self.recorder.close()
            self.recorder = None
