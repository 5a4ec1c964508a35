"""Reading the per-rank trace files (`RUN_DIR/trace/rank_NNNNN.jsonl`, written by observe.timers).

    ranks = read_run(run_dir)             # RankTrace per rank, events on rank 0's clock
    for e in ranks[3].events: e.op, e.stream, e.t0, e.dur, e.blocked, ...

A file is a sequence of segments, one per process that wrote it (a resumed run appends one):
a header line, clock lines (the measured offset to rank 0 at a moment of this rank's clock)
and event lines. Each event is moved onto rank 0's clock by the offset interpolated between
its segment's clock measurements (nearest one outside them), so drift between re-checks is
corrected too. A line cut short by a crash is skipped. A bounded trace (observe.trace_max_mb) keeps
its older part in `rank_NNNNN.jsonl.1`, read first: each of the two files starts with the header.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from megascale.observe.timers import FIELDS


class Event(NamedTuple):
    op: str
    stream: str
    t0: int  # ns on rank 0's clock (aligned)
    dur: int  # ns
    step: int
    micro: int
    chunk: int
    group: str | None
    seq: int
    peer: int
    blocked: int  # ns of the span this rank was waiting
    nbytes: int
    tag: int

    @property
    def t1(self) -> int:
        return self.t0 + self.dur


@dataclass
class RankTrace:
    rank: int
    header: dict  # the newest segment's header
    events: list[Event] = field(default_factory=list)
    clocks: list[dict] = field(default_factory=list)  # every clock line (offset_ns, err_ns, mono_ns)
    notes: list[dict] = field(default_factory=list)
    dropped: int = 0

    @property
    def coords(self) -> dict[str, int]:
        return self.header.get("coords", {})

    @property
    def host(self) -> str:
        return self.header.get("host", "?")


def trace_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "trace"


def read_rank(path: str | Path, align: bool = True, steps: tuple[int, int] | None = None) -> RankTrace:
    """One rank's trace file (`rank_NNNNN.jsonl`), with its older part (`.1`) when it has one; with
    `steps` (lo, hi), only the events of those steps (the others are skipped unparsed: a long run's
    trace is hundreds of MB a rank, and a report or timeline wants a window of it)."""
    path = Path(path)
    segments: list[tuple[dict, list[dict], list[list]]] = []
    notes, dropped = [], 0
    for line in _lines(path):
        if steps is not None and line.startswith("["):
            step = _step_of(line)
            if step is not None and not steps[0] <= step <= steps[1]:
                continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, list):
            if segments and (steps is None or steps[0] <= _int(obj, 4) <= steps[1]):
                segments[-1][2].append(obj)
            continue
        if not isinstance(obj, dict):
            continue
        kind = obj.get("type")
        if kind == "header":
            segments.append((obj, [], []))
        elif kind == "clock" and segments:
            segments[-1][1].append(obj)
        elif kind == "note":
            notes.append(obj)
        elif kind == "dropped":
            dropped += int(obj.get("records", 0))
    if not segments:
        raise ValueError(f"{path}: not a megascale trace (no header line)")
    header = segments[-1][0]
    out = RankTrace(int(header["rank"]), header, notes=notes, dropped=dropped)
    n = len(FIELDS)
    for _, clocks, rows in segments:
        out.clocks.extend(clocks)
        at = [c["mono_ns"] for c in clocks]
        offs = [c["offset_ns"] for c in clocks]
        for r in rows:
            if len(r) < n:
                r = [*r, *([-1] * (n - len(r)))]
            t0 = int(r[2])
            if align and offs:
                t0 += _offset_at(at, offs, t0)
            out.events.append(Event(r[0], r[1], t0, *r[3:n]))
    out.events.sort(key=lambda e: e.t0)
    return out


def last_step(run_dir: str | Path) -> int | None:
    """The newest step in the run's traces (the tail of the first rank's file, or of its older part when
    the file was just started and holds no event yet), None if neither has one."""
    files = sorted(trace_dir(run_dir).glob("rank_*.jsonl"))
    if not files:
        return None
    for path in (files[0], files[0].with_name(files[0].name + ".1")):
        if not path.exists():
            continue
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - (1 << 16)))
            tail = f.read().decode(errors="replace").splitlines()
        found = [s for s in map(_step_of, (ln for ln in tail if ln.startswith("[")))
                 if s is not None and s >= 0]
        if found:
            return max(found)
    return None


def step_window(run_dir: str | Path, spec: str | None, default: int) -> tuple[int, int] | None:
    """The steps a reader of a run's traces takes: `spec` "A:B" (inclusive), "all" (None: every step), or
    None: the newest `default` steps. ValueError naming --steps if `spec` selects nothing."""
    if spec == "all":
        return None
    if spec is None:
        last = last_step(run_dir)
        return None if last is None else (max(0, last - default + 1), last)
    try:
        lo, hi = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"--steps: {spec!r} is not A:B or all") from None
    if not 0 <= lo <= hi:
        raise ValueError(f"--steps: {spec!r} selects no step (A:B with 0 <= A <= B)")
    return lo, hi


def _lines(path: Path):
    """The lines of a rank's trace, its older part's first, read as a stream (a cut last line stays a line
    of its own). Both files are opened before either is read, the current one first: a rank of a live job
    that switches files meanwhile (renames the current one over the older part) takes nothing from a
    reader that has them open, where reading the older part first, then opening the current one, would
    find a new file and miss every record of the part it had not read."""
    with contextlib.ExitStack() as stack:
        parts = []
        for p in (path, path.with_name(path.name + ".1")):
            try:
                parts.append(stack.enter_context(open(p, errors="replace")))  # noqa: SIM115 - the stack's
            except FileNotFoundError:
                continue
        if len(parts) == 2 and os.fstat(parts[0].fileno()).st_ino == os.fstat(parts[1].fileno()).st_ino:
            parts.pop()  # the switch came between the two opens: the older part is the file already open
        if not parts:
            raise FileNotFoundError(f"{path}: no such trace file")
        for f in reversed(parts):
            yield from f


def _step_of(line: str) -> int | None:
    """An event line's step (its 5th field) without parsing the JSON; None if it does not read so."""
    parts = line.split(",", 5)
    try:
        return int(parts[4])
    except (IndexError, ValueError):
        return None


def _int(row: list, i: int) -> int:
    try:
        return int(row[i])
    except (IndexError, TypeError, ValueError):
        return -1


def _offset_at(at: list[int], offs: list[int], t: int) -> int:
    """The offset at local time t: linear between the measurements around it, else the nearest."""
    i = bisect.bisect_left(at, t)
    if i == 0:
        return offs[0]
    if i == len(at):
        return offs[-1]
    a0, a1 = at[i - 1], at[i]
    w = (t - a0) / (a1 - a0) if a1 > a0 else 0.0
    return int(offs[i - 1] + w * (offs[i] - offs[i - 1]))


def read_run(run_dir: str | Path, align: bool = True,
             steps: tuple[int, int] | None = None) -> dict[int, RankTrace]:
    """Every rank's trace in `run_dir` (only steps [lo, hi] with `steps`), by rank. ValueError if there
    is none."""
    files = sorted(trace_dir(run_dir).glob("rank_*.jsonl"))
    if not files:
        raise ValueError(f"{trace_dir(run_dir)}: no trace files (rank_NNNNN.jsonl); was observe.timers on?")
    out = {}
    for f in files:
        t = read_rank(f, align, steps)
        out[t.rank] = t
    return out


def p2p_pairs(ranks: dict[int, RankTrace]) -> list[tuple[Event, Event, int, int]]:
    """Matched (send, recv, src, dst): the k-th send from src to dst on a tag is the k-th receive."""
    sends, recvs = {}, {}
    for r, t in ranks.items():
        for e in t.events:
            if e.op == "send" and e.peer >= 0:
                sends[(r, e.peer, e.tag, e.step, e.seq)] = e
            elif e.op == "recv" and e.peer >= 0:
                recvs[(e.peer, r, e.tag, e.step, e.seq)] = e
    return [(s, recvs[k], k[0], k[1]) for k, s in sends.items() if k in recvs]
