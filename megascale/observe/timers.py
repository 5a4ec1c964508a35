"""Always-on per-operation timers: every forward, backward, collective, send/recv, optimizer step,
data wait and checkpoint stage of a rank, into a bounded ring buffer that a background thread
writes to `RUN_DIR/trace/rank_NNNNN.jsonl`.

    from megascale.observe import timers
    with timers.span("forward", "compute", micro=i, chunk=c):
        ...
    with timers.comm("all_reduce", "tp", "tp"):          # op, stream, group kind: timed + in flight
        dist.all_reduce(x, group=mesh.tp_group)
    pending = timers.launch("reduce_scatter", "dp", "dp")  # an async collective, issued now ...
    work = dist.reduce_scatter_tensor(out, inp, group=mesh.dp_group, async_op=True)
    pending.issued()                                     # ... (the issuing thread's part ends here)
    ...
    pending.wait(work)                                   # ... and waited for here (the blocked part)

There is one recorder per process (`install`), so the parallel code needs no extra argument;
until one is installed (and with `observe.timers = false`) every call returns a shared no-op
object: an attribute lookup and a call, nothing else.

Why a ring buffer and a thread: the hot path only appends a tuple to a `deque(maxlen=...)`
(atomic under the GIL, no lock, no allocation beyond the tuple); the flusher thread drains it
every `flush_interval_s` and encodes JSON off the training thread's critical path. If the
writer ever falls behind, the oldest records are dropped (and counted), never the training.

Clocks: CPU spans use CLOCK_MONOTONIC (`time.monotonic_ns`), the same clock for every process
of a host, corrected per rank by the offset to rank 0's clock that `observe.clock` measures.
On a GPU, compute spans are CUDA event pairs read lazily by the flusher once the end event has
completed (`Event.query()`), so the training thread never synchronises for a timer; their host
time comes from an anchor event recorded once at start.

The file is bounded (`max_bytes`, observe.trace_max_mb): once it holds half of that, it is renamed
`rank_NNNNN.jsonl.1` (replacing the previous one) and a new file starts with the header, the notes
and the latest clock line again, so each file reads on its own and a long run keeps its newest
records, never less than half the bound, in at most the bound per rank.

Record layout (one JSON array per line, `FIELDS` order; the header line names them):
    [op, stream, t0_ns, dur_ns, step, micro, chunk, group, seq, peer, blocked_ns, bytes, tag]
`blocked_ns` is the part of the span the rank was waiting (the whole of a synchronous
collective, the wait of an async one, a receive's wait) or working for the op on its own thread
(an async op's "issue" event): what the report calls exposed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from megascale.fault.inject import delays, host_id, skew_ns
from megascale.observe.inflight import InFlight
from megascale.observe.linefile import LineFile

STREAMS = ("compute", "dp", "pp", "tp", "data", "checkpoint")
FIELDS = ("op", "stream", "t0_ns", "dur_ns", "step", "micro", "chunk", "group", "seq", "peer",
          "blocked_ns", "bytes", "tag")
TRACE_VERSION = 1


class _Null:
    """What every call returns when no recorder is on: enter, exit and wait do nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self, work=None):
        if work is not None:
            work.wait()

    def issued(self):
        pass


NULL = _Null()


class _Span:
    """A compute (or data, checkpoint) span. The time it spent blocked in collectives nested inside it
    (a TP all-reduce in a forward) is recorded as its blocked part: compute is the rest."""

    __slots__ = ("rec", "op", "stream", "micro", "chunk", "t0", "delay", "b0")

    def __init__(self, rec: Recorder, op: str, stream: str, micro: int, chunk: int, delay: float):
        self.rec, self.op, self.stream, self.micro, self.chunk = rec, op, stream, micro, chunk
        self.delay = delay

    def __enter__(self):
        self.b0 = self.rec.blocked_total
        self.t0 = time.monotonic_ns()
        if self.delay:  # an injected slow rank (MEGASCALE_INJECT="delay@forward:0.02:rank=3")
            time.sleep(self.delay)
        return self

    def __exit__(self, *exc):
        t1 = time.monotonic_ns()
        rec = self.rec
        nested = rec.blocked_total - self.b0
        rec._buf.append((self.op, self.stream, self.t0, t1 - self.t0, rec.step, self.micro, self.chunk,
                         None, -1, -1, nested, 0, -1))
        rec._added += 1
        if self.stream == "compute" and rec.samples is not None:
            rec.samples.setdefault(self.op, []).append(t1 - self.t0 - nested)
        return False


class _CudaSpan(_Span):
    """A compute span on a GPU: two CUDA events, resolved by the flusher when they completed."""

    __slots__ = ("ev0",)

    def __enter__(self):
        import torch

        self.ev0 = torch.cuda.Event(enable_timing=True)
        self.ev0.record()
        return self

    def __exit__(self, *exc):
        import torch

        ev1 = torch.cuda.Event(enable_timing=True)
        ev1.record()
        self.rec._cuda.append((self.op, self.stream, self.ev0, ev1, self.rec.step, self.micro, self.chunk))
        return False


class _Comm:
    """A synchronous collective or a blocking receive: timed, and in flight while it runs."""

    __slots__ = ("rec", "op", "stream", "group", "peer", "tag", "nbytes", "t0", "seq")

    def __init__(self, rec, op, stream, group, peer, tag, nbytes):
        self.rec, self.op, self.stream, self.group = rec, op, stream, group
        self.peer, self.tag, self.nbytes = peer, tag, nbytes

    def __enter__(self):
        self.t0 = time.monotonic_ns()
        self.seq = self.rec.inflight.begin(self.group, self.op, self.peer, self.tag)
        return self

    def __exit__(self, *exc):
        t1 = time.monotonic_ns()
        rec = self.rec
        rec.blocked_total += t1 - self.t0
        rec.bytes_moved += self.nbytes
        if exc[0] is None:
            rec.inflight.end()
        rec._buf.append((self.op, self.stream, self.t0, t1 - self.t0, rec.step, -1, -1, self.group, self.seq,
                         self.peer, t1 - self.t0, self.nbytes, self.tag))
        rec._added += 1
        return False


class _Pending:
    """An asynchronous op (DP bucket reduce-scatter / all-gather, a pipeline isend): issued at
    construction, its span ends when `wait` returns; only the wait counts as blocked.

    It is recorded under the step whose training thread waited for it, not the one that issued
    it: a parameter all-gather launched after step k's update (dp_overlap_param_gather) and
    waited for in step k+1's forward is step k+1's exposed communication, and step k ends at its
    update (observe/breakdown.py takes an async op's wait, not its issue, as its place in a step)."""

    __slots__ = ("rec", "op", "stream", "group", "peer", "tag", "nbytes", "t0", "seq")

    def __init__(self, rec, op, stream, group, peer, tag, nbytes):
        self.rec, self.op, self.stream, self.group = rec, op, stream, group
        self.peer, self.tag, self.nbytes = peer, tag, nbytes
        self.t0 = time.monotonic_ns()
        self.seq = rec.inflight.issue(group, peer, tag)

    def issued(self) -> None:
        """The op has been started (call it as the start returns): the time since `launch` was the
        issuing thread's own work for it, recorded as an "issue" event blocked throughout, so that a
        step's breakdown counts it as exposed communication rather than compute. On CPU that work is
        the kernel's: writing a message to a peer's socket runs its whole delivery path, ~0.2 ms per
        128 KiB on a 2-core VM, work a NIC does on a real host. Not on a GPU, where a launch only
        queues the op and the device goes on computing."""
        rec = self.rec
        if rec._gpu:
            return
        dur = time.monotonic_ns() - self.t0
        rec.blocked_total += dur
        rec._buf.append(("issue", self.stream, self.t0, dur, rec.step, -1, -1, self.group, -1, self.peer, dur,
                         0, self.tag))
        rec._added += 1

    def wait(self, work=None) -> None:
        rec = self.rec
        tw = time.monotonic_ns()
        if work is not None:
            rec.inflight.begin_wait(self.group, self.op, self.seq, self.peer, self.tag)
            work.wait()
            rec.inflight.end()
        t1 = time.monotonic_ns()
        rec.blocked_total += t1 - tw
        rec.bytes_moved += self.nbytes
        rec._buf.append((self.op, self.stream, self.t0, t1 - self.t0, rec.step, -1, -1, self.group, self.seq,
                         self.peer, t1 - tw, self.nbytes, self.tag))
        rec._added += 1


class Recorder:
    """One rank's timers, its in-flight record and the thread that writes them out."""

    def __init__(self, trace_dir: str | Path, rank: int, world: int, coords: dict[str, int],
                 groups: dict[str, list[int]], *, device_type: str = "cpu", capacity: int = 1 << 16,
                 flush_interval_s: float = 1.0, mesh_shape: dict[str, int] | None = None,
                 max_bytes: int = 0):
        self.trace_dir = Path(trace_dir)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world = rank, world
        self.step = 0
        # compute time (ns, nested waits taken out) of every compute span since the straggler window began;
        # None (not kept) unless a straggler detector takes them each window, else they would grow forever
        self.samples: dict[str, list[int]] | None = None
        self.blocked_total = 0  # ns blocked in comm so far: what spans subtract for nested waits
        self.bytes_moved = 0  # payload bytes of the collectives and sends so far (the heartbeat's)
        self._buf: deque = deque(maxlen=capacity)
        self._cuda: deque = deque()
        self._added = self._written = 0
        self._skew = skew_ns(rank)  # a test's deliberately wrong clock (MEGASCALE_INJECT="skew@clock:...")
        self._delays = delays(rank)
        self._gpu = device_type == "cuda"
        # the host as the job names it (under megascale launch its --local-addr): who is evicted for a hang
        self.inflight = InFlight(self.trace_dir / "inflight", rank, groups, host=host_id(), coords=coords)
        self.path = self.trace_dir / f"rank_{rank:05d}.jsonl"
        # a disk that refuses the trace (full) costs its lines, said once, never the run (linefile.py)
        self._file = LineFile(self.path, f"trace of rank {rank}")
        self._max_bytes = max_bytes  # 0: unbounded
        # the file's size (JSON is ASCII: characters are bytes)
        self._bytes = self.path.stat().st_size if self.path.exists() else 0
        self._carried: list[str] = []  # the lines every file begins with: the header and the notes ...
        self._clock_line = ""  # ... and the latest clock line
        self._lock = threading.Lock()  # the file: the flusher and close() may both write
        # one flush at a time: each takes the records it counted, and the background flusher and the
        # training thread's own flush (fit's end) would otherwise pop the same records (IndexError)
        self._flushing = threading.Lock()
        header = {"type": "header", "version": TRACE_VERSION, "rank": rank, "world": world, "coords": coords,
                  "mesh": mesh_shape or {}, "groups": groups, "host": host_id(),
                  "pid": os.getpid(),
                  "fields": FIELDS, "clock": "monotonic_ns", "device": device_type,
                  "wall_ns": time.time_ns(), "mono_ns": self.now()}
        self._write_line(header, carry="always")
        self._anchor = None
        if self._gpu:
            import torch

            torch.cuda.synchronize()
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record()
            torch.cuda.synchronize()
            self._anchor_ns = time.monotonic_ns()
        self._stop = threading.Event()
        self._interval = flush_interval_s
        self._thread = threading.Thread(target=self._run, name="megascale-timers", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the hot path

    def now(self) -> int:
        """This rank's clock as its records carry it (monotonic, plus any injected skew)."""
        return time.monotonic_ns() + self._skew

    def span(self, op: str, stream: str = "compute", micro: int = -1, chunk: int = -1):
        if self._gpu and stream == "compute":
            return _CudaSpan(self, op, stream, micro, chunk, 0.0)
        return _Span(self, op, stream, micro, chunk, self._delays.get(op, 0.0))

    def comm(self, op: str, stream: str, group: str, peer: int = -1, tag: int = -1, nbytes: int = 0):
        return _Comm(self, op, stream, group, peer, tag, nbytes)

    def launch(self, op: str, stream: str, group: str, peer: int = -1, tag: int = -1, nbytes: int = 0):
        return _Pending(self, op, stream, group, peer, tag, nbytes)

    def record(self, op: str, stream: str, t0_ns: int, t1_ns: int, blocked_ns: int = 0,
               nbytes: int = 0) -> None:
        """A span measured elsewhere (another thread's checkpoint stage), on this monotonic clock."""
        self._buf.append((op, stream, t0_ns, t1_ns - t0_ns, self.step, -1, -1, None, -1, -1, blocked_ns,
                          nbytes, -1))
        self._added += 1

    def set_step(self, step: int) -> None:
        """The optimizer step (0-based) the following records belong to."""
        self.step = step
        self.inflight.set_step(step)

    # ------------------------------------------------------------------ output

    def clock(self, offset_ns: int, err_ns: int) -> None:
        """A measured offset to rank 0's clock (add it to this rank's times), with its error bound."""
        line = {"type": "clock", "mono_ns": self.now(), "offset_ns": int(offset_ns), "err_ns": int(err_ns)}
        self._write_line(line, carry="clock")

    def note(self, **fields: Any) -> None:
        """A free-form line of the trace (e.g. the hosts of every rank)."""
        self._write_line({"type": "note", **fields}, carry="always")

    def _write_line(self, obj: Any, carry: str = "") -> None:
        """One line now; `carry` "always" (header, notes) or "clock" (until the next clock line): it also
        begins every later file."""
        text = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            if carry == "always":
                self._carried.append(text)
            elif carry == "clock":
                self._clock_line = text
            self._emit(text)

    def _emit(self, text: str) -> None:
        """Write and flush `text` (the caller holds the file's lock); start a new file past the bound."""
        if self._file.write(text):
            self._bytes += len(text)
        if self._max_bytes and self._bytes > self._max_bytes // 2:
            self._rotate()

    def _rotate(self) -> None:
        self._file.close()
        try:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))  # the older one goes
        except OSError:  # (the file is gone: start a new one all the same)
            pass
        self._bytes = 0
        text = "".join(self._carried) + self._clock_line
        if self._file.write(text):
            self._bytes = len(text)

    def flush(self) -> None:
        """Write out what is buffered (the flusher does this every interval; close() at the end)."""
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        lines = []
        if self._cuda:
            lines += self._resolve_cuda()
        buf, skew = self._buf, self._skew
        n = len(buf)
        for _ in range(n):
            r = buf.popleft()
            if skew:
                r = (*r[:2], r[2] + skew, *r[3:])
            lines.append(json.dumps(r, separators=(",", ":")))
        self._written += n
        dropped = self._added - self._written - len(buf)
        text = "\n".join(lines) + "\n" if lines else ""
        if dropped > 0:
            text += json.dumps({"type": "dropped", "records": dropped}) + "\n"
            self._written += dropped
        if text:
            with self._lock:
                self._emit(text)

    def _resolve_cuda(self) -> list[str]:
        out = []
        q = self._cuda
        while q and q[0][3].query():  # in order: the first one not yet done stops the walk
            op, stream, ev0, ev1, step, micro, chunk = q.popleft()
            t0 = self._anchor_ns + int(self._anchor.elapsed_time(ev0) * 1e6) + self._skew
            dur = int(ev0.elapsed_time(ev1) * 1e6)
            if self.samples is not None:
                self.samples.setdefault(op, []).append(dur)
            out.append(json.dumps((op, stream, t0, dur, step, micro, chunk, None, -1, -1, 0, 0, -1),
                                  separators=(",", ":")))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a timer must never take training down
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._gpu:
            import torch

            torch.cuda.synchronize()
        self.flush()
        with self._lock:
            self._file.close()
        self.inflight.close()


# ---------------------------------------------------------------------- the process's recorder

_current: Recorder | None = None


def install(recorder: Recorder | None) -> None:
    """Make `recorder` the one every timers.* call uses (None: back to no-ops)."""
    global _current
    _current = recorder


def current() -> Recorder | None:
    return _current


def span(op: str, stream: str = "compute", micro: int = -1, chunk: int = -1):
    r = _current
    return NULL if r is None else r.span(op, stream, micro, chunk)


def comm(op: str, stream: str, group: str, peer: int = -1, tag: int = -1, nbytes: int = 0):
    r = _current
    return NULL if r is None else r.comm(op, stream, group, peer, tag, nbytes)


def launch(op: str, stream: str, group: str, peer: int = -1, tag: int = -1, nbytes: int = 0):
    r = _current
    return NULL if r is None else r.launch(op, stream, group, peer, tag, nbytes)


def now_ns() -> int:
    """The clock spans use (for code that measures a stage itself and hands it to `record`)."""
    return time.monotonic_ns()


def record(op: str, stream: str, t0_ns: int, t1_ns: int, blocked_ns: int = 0, nbytes: int = 0) -> None:
    r = _current
    if r is not None:
        r.record(op, stream, t0_ns, t1_ns, blocked_ns, nbytes)
