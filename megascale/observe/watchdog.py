"""Per-rank hang watchdog: heartbeat, dump on no progress, diagnose, abort.

    enable_flight_recorder(cfg.observe.flight_recorder)        # before init_process_group
    ...
    wd = Watchdog(recorder.inflight, run_dir / "trace" / "hang", rank, cfg.observe.hang_timeout_s,
                  cfg.observe.hang_action).start()
    ...
    except <collective timeout> as e:
        wd.dump(f"collective timed out: {e}")
        raise
    ...
    wd.stop()                                                  # before recorder.close()

A daemon thread, once a second:
  * writes the rank's heartbeat into its in-flight record, which is how `diagnose` tells a live
    rank from a stopped, dead or GIL-hung one;
  * reads the record's words (the training thread writes them) and, once the rank has been in one
    op for more than `hang_timeout_s`, once per such op, writes `hang_dir/rank_NNNNN.json` (the
    record, every Python thread's stack, PyTorch's flight recorder) and one line to stderr;
  * then the lowest live rank that is in flight waits a few seconds for the others' dumps,
    runs the diagnosis and writes `hang_dir/diagnosis.txt`; the others wait for that file, so a
    launcher that kills the job when the first rank exits does not kill the diagnosis;
  * with action "abort" the process then exits with code 3 (os._exit: the training thread is
    stuck in C++ and would never see an exception), with "dump" it goes on waiting.

Python stacks from a side thread work while the training thread is blocked in a C++ collective
because gloo and NCCL waits release the GIL. A rank stuck *holding* the GIL runs no watchdog:
its heartbeat goes stale, and the other ranks' diagnosis names it as not responding.

SIGUSR1: faulthandler writes every thread's stack to `hang_dir/stacks_rank_NNNNN.txt` from the
signal handler itself (C level, so also while the main thread is blocked); the thread notices
the file grew and writes the full JSON dump as well.

Nothing here may raise into training: every step is caught and logged.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from megascale.data.atomic import write_text_atomic
from megascale.fault.inject import host_id
from megascale.observe.inflight import (
    CUR_GROUP,
    CUR_OP,
    CUR_PEER,
    CUR_SEQ,
    CUR_T0,
    IDLE,
    STATE_W,
    STEP_W,
    UPDATED_W,
    InFlight,
    read_all,
    read_record,
)

EXIT_HANG = 3
FR_ENTRIES_KEPT = 256  # the tail of the flight recorder's ring that goes into a dump


def enable_flight_recorder(entries: int) -> bool:
    """Turn PyTorch's flight recorder on (TORCH_FR_BUFFER_SIZE) unless the user set it; call before
    init_process_group, which reads it. Returns whether it is on."""
    if entries > 0 and "TORCH_FR_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(int(entries))
    return _fr_size() > 0


def _fr_size() -> int:
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0"))
    except ValueError:
        return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Watchdog:
    def __init__(self, inflight: InFlight, hang_dir: str | Path, rank: int, hang_timeout_s: float,
                 action: str = "abort", on_hang: Callable[[Path], None] | None = None,
                 log: Callable[[str], None] | None = None, *, interval_s: float = 1.0,
                 collect_s: float = 5.0, stale_s: float = 5.0):
        if action not in ("abort", "dump"):
            raise ValueError(f"hang_action must be 'abort' or 'dump', got {action!r}")
        self.inflight, self.rank = inflight, rank
        self.hang_dir = Path(hang_dir)
        self.run_dir = self.hang_dir.parent.parent  # RUN_DIR/trace/hang
        self.timeout_s, self.action, self.on_hang = float(hang_timeout_s), action, on_hang
        self.log = log or _stderr
        self.interval_s, self.collect_s, self.stale_s = interval_s, collect_s, stale_s
        self.path = self.hang_dir / f"rank_{rank:05d}.json"
        self.stacks_path = self.hang_dir / f"stacks_rank_{rank:05d}.txt"
        self._stop = threading.Event()
        self._lock = threading.Lock()  # dump() from the training thread vs. the watchdog thread
        self._handled: tuple | None = None  # the op last dumped for: once per op
        self._thread: threading.Thread | None = None
        self._stacks_file = None
        self._stacks_size = 0
        self.dumps = 0  # how many hang files this rank wrote (tests, logs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Watchdog:
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        self._register_sigusr1()
        self._thread = threading.Thread(target=self._run, name="megascale-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._thread = None
        if self._stacks_file is not None:
            try:
                faulthandler.unregister(signal.SIGUSR1)
            except (ValueError, RuntimeError, OSError):
                pass
            self._stacks_file.close()
            self._stacks_file = None

    def _register_sigusr1(self) -> None:
        try:
            self._stacks_file = open(self.stacks_path, "a")  # noqa: SIM115 - faulthandler writes it until stop()
            self._stacks_size = os.fstat(self._stacks_file.fileno()).st_size
            faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True)
        except (OSError, ValueError, RuntimeError, AttributeError) as e:  # no SIGUSR1 (Windows), bad fd
            self.log(f"megascale: rank {self.rank}: SIGUSR1 stack dumps unavailable: {e}")

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the watchdog must never take training down
                self._safe_log(f"megascale: rank {self.rank}: watchdog error: {type(e).__name__}: {e}")

    def _tick(self) -> None:
        self._beat()
        if self._stacks_grew():
            self.dump("SIGUSR1", diagnose=False)
        op = self._op_in_flight()
        if op is None:
            return
        key, since_ns = op
        stuck_s = (time.time_ns() - since_ns) / 1e9
        if stuck_s <= self.timeout_s or key == self._handled:
            return
        self._handle(f"no progress for {stuck_s:.0f} s", key)

    def _beat(self) -> None:
        try:
            self.inflight.heartbeat()
        except (AttributeError, ValueError, OSError):  # the record was closed under us (shutdown)
            pass

    def _stacks_grew(self) -> bool:
        """faulthandler wrote to the stacks file: a SIGUSR1 came in."""
        if self._stacks_file is None:
            return False
        size = os.fstat(self._stacks_file.fileno()).st_size
        grew, self._stacks_size = size > self._stacks_size, size
        return grew

    def _op_in_flight(self) -> tuple[tuple, int] | None:
        """(identity of the op in flight, since when) from the record's words, None when idle."""
        try:
            w = self.inflight.words
            state = int(w[STATE_W])
            if state == IDLE:
                return None
            key = (state, *(int(w[i]) for i in (CUR_GROUP, CUR_OP, CUR_SEQ, CUR_PEER, CUR_T0)))
            since = max(int(w[CUR_T0]), int(w[UPDATED_W]))
            # The training thread writes the words without a lock: a changed state means the op moved on.
            if int(w[STATE_W]) != state:
                return None
        except (AttributeError, ValueError, IndexError):
            return None
        return key, since

    # ------------------------------------------------------------------ on a hang

    def _handle(self, reason: str, key: tuple | None) -> None:
        with self._lock:
            if key is not None and key == self._handled:
                return
            self._handled = key
        try:
            with self._lock:
                path = self._write_dump(reason)
            self._announce(reason, path)
            self._callback(path)
            self._diagnose_or_wait()
        except Exception as e:  # noqa: BLE001 - still abort below: the rank is hung either way
            self._safe_log(f"megascale: rank {self.rank}: hang handling failed: {type(e).__name__}: {e}")
        if self.action == "abort" and not self._stop.is_set():  # stop() means training ended after all
            self._safe_log(f"megascale: rank {self.rank}: aborting (observe.hang_action = \"abort\")")
            sys.stderr.flush()
            os._exit(EXIT_HANG)

    def dump(self, reason: str, diagnose: bool = True) -> Path | None:
        """Write this rank's hang file now (e.g. a collective raised a timeout); with `diagnose`, also take
        part in the diagnosis like a hang the thread found (and the thread will not handle this op again).
        Never raises; never exits."""
        try:
            op = self._op_in_flight()
            with self._lock:
                if op is not None and diagnose:
                    self._handled = op[0]  # a SIGUSR1 look must not cancel the hang action for this op
                path = self._write_dump(reason)
            self._announce(reason, path)
            if diagnose:
                self._callback(path)
                self._diagnose_or_wait()
            return path
        except Exception as e:  # noqa: BLE001 - called from the training thread's error path
            self._safe_log(f"megascale: rank {self.rank}: hang dump failed: {type(e).__name__}: {e}")
            return None

    def _write_dump(self, reason: str) -> Path:
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "rank": self.rank, "reason": reason, "wall_ns": time.time_ns(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host_id(), "pid": os.getpid(),
            "record": read_record(self.inflight.dir, self.rank),
            "threads": thread_stacks(),
        }
        doc["flight_recorder"], doc["flight_recorder_note"] = flight_recorder()
        write_text_atomic(self.path, json.dumps(doc, indent=1, default=str))  # no part left on a full disk
        self.dumps += 1
        return self.path

    def _announce(self, reason: str, path: Path) -> None:
        try:
            where = self._op_text()
        except Exception:  # noqa: BLE001 - the record closed under us
            where = "an unknown op"
        self._safe_log(f"megascale: rank {self.rank}: {reason} in {where}; stacks and in-flight ops "
                       f"in {path}; run: megascale diagnose {self.run_dir}")

    def _op_text(self) -> str:
        rec = read_record(self.inflight.dir, self.rank)
        if not rec or not rec["current"]:
            step = int(self.inflight.words[STEP_W]) if rec is None else rec["step"]
            return f"no collective (step {step})"
        c = rec["current"]
        peer = f" with rank {c['peer']} (tag {c['tag']})" if "peer" in c else ""
        return f"{c['group']} {c['op']} #{c['seq']}{peer} (step {rec['step']})"

    def _callback(self, path: Path) -> None:
        if self.on_hang is None:
            return
        try:
            self.on_hang(path)
        except Exception as e:  # noqa: BLE001
            self._safe_log(f"megascale: rank {self.rank}: on_hang callback failed: {e}")

    # ------------------------------------------------------------------ the diagnosis

    def _diagnose_or_wait(self) -> None:
        """The lowest live rank in flight diagnoses; the others wait for its verdict, and take over if
        that rank stops being live or in flight meanwhile (it was the one stopped, or it moved on)."""
        from megascale.observe import diagnose as dg

        out = self.hang_dir / "diagnosis.txt"
        since_ns = self._since_ns()
        chosen = self._diagnoser(0)

        def mine_or_done() -> bool:
            nonlocal chosen
            if self._fresh(out, since_ns):
                return True
            if chosen != self.rank and not self._live_in_flight(chosen):
                chosen = self._diagnoser(chosen + 1)  # only the ranks above the one that dropped out
            return chosen == self.rank

        self._wait_for(mine_or_done, self.collect_s + 10.0)
        if self._stop.is_set():
            return
        if self._fresh(out, since_ns):
            self._safe_log(f"megascale: rank {self.rank}: diagnosis in {out}")
            return
        if chosen == self.rank:
            self._wait_for_dumps(time.monotonic() + self.collect_s)
        # else the chosen rank never delivered in time: diagnose here, without waiting any longer
        d = dg.diagnose_records(read_all(self.inflight.dir), dg.load_dumps(self.hang_dir), self.stale_s)
        dg.write_diagnosis(d, out)
        self._safe_log(dg.format_diagnosis(d, verbose=False) + f"\n(full diagnosis: {out})")

    def _since_ns(self) -> int:
        op = self._op_in_flight()
        return op[1] if op else time.time_ns() - int(self.timeout_s * 1e9)

    def _live_in_flight(self, rank: int, rec: dict | None = None) -> bool:
        """Is `rank` in an op and alive (fresh heartbeat, and not stopped or dead if on this host)?"""
        from megascale.observe.diagnose import rank_alive

        if rank == self.rank:
            return True
        rec = rec if rec is not None else read_record(self.inflight.dir, rank)
        return rec is not None and rec["current"] is not None and rank_alive(rec, self.stale_s)

    def _diagnoser(self, first: int) -> int:
        """The lowest rank >= `first` that is live and in flight; this rank at the latest. Reads the
        records in order and stops at the first such rank: O(1) reads at any scale, usually."""
        for rank in range(first, self.rank):
            if self._live_in_flight(rank):
                return rank
        return self.rank

    def _wait_for_dumps(self, deadline: float) -> None:
        """Until every live rank in flight has dumped for its current op, or the deadline."""

        def all_dumped() -> bool:
            recs = read_all(self.inflight.dir)
            return all(self._fresh(self.hang_dir / f"rank_{r:05d}.json", rec["current"]["since_ns"])
                       for r, rec in recs.items() if r != self.rank and self._live_in_flight(r, rec))

        self._wait_for(all_dumped, deadline - time.monotonic())

    def _wait_for(self, cond: Callable[[], bool], timeout_s: float) -> bool:
        """Poll `cond`, beating the heartbeat meanwhile: a rank waiting here must not look dead."""
        deadline = time.monotonic() + timeout_s
        while True:
            if cond():
                return True
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            self._beat()
            time.sleep(min(0.25, self.interval_s))

    @staticmethod
    def _fresh(path: Path, since_ns: int) -> bool:
        try:
            return path.stat().st_mtime_ns >= since_ns
        except OSError:
            return False

    def _safe_log(self, line: str) -> None:
        try:
            self.log(line)
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------- what goes into a dump


def thread_stacks() -> list[dict]:
    """Every Python thread's stack, innermost frame last (sys._current_frames works from any thread)."""
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        t = threads.get(ident)
        stack = traceback.extract_stack(frame)
        out.append({
            "ident": ident, "name": t.name if t else "?", "daemon": bool(t and t.daemon),
            "main": ident == main,
            "stack": [{"file": f.filename, "line": f.lineno, "func": f.name, "code": f.line} for f in stack],
            "text": "".join(traceback.format_list(stack)),
        })
    out.sort(key=lambda t: not t["main"])
    return out


def flight_recorder() -> tuple[dict | None, str]:
    """PyTorch's flight recorder (pg_status, the tail of its entries, and each group's global ranks), or
    None with why. Only if torch is already imported: a dump must not import it."""
    if _fr_size() <= 0:
        return None, "off (TORCH_FR_BUFFER_SIZE unset or 0)"
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "torch not imported"
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        fr = json.loads(_dump_fr_trace_json(True, False))
    except Exception as e:  # noqa: BLE001 - an old torch, a backend without it, a broken dump
        return None, f"unavailable: {type(e).__name__}: {e}"
    entries = fr.get("entries") or []
    fr["entries"] = entries[-FR_ENTRIES_KEPT:]
    fr["entries_total"] = len(entries)
    fr["pg_ranks"] = _pg_ranks(entries)
    return fr, "ok"


def _pg_ranks(entries: list[dict]) -> dict[str, list[int]]:
    """pg_id (pg_status's key) -> global ranks: entries carry (pg_id, group name), c10d name -> ranks."""
    try:
        from torch.distributed import distributed_c10d as c10d

        by_name = {name: sorted(c10d._world.pg_group_ranks[pg]) for pg, name in c10d._world.pg_names.items()}
    except Exception:  # noqa: BLE001 - not initialised, or private names moved
        return {}
    out = {}
    for e in entries:
        try:
            name = e["process_group"][0]
        except (KeyError, IndexError, TypeError):
            continue
        if name in by_name:
            out[str(e["pg_id"])] = by_name[name]
    return out
