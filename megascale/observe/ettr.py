"""ETTR, MegaScale's effective training time ratio, of a launched job, and where the rest of its time went.

From the launch agents' event logs (fault/events.py: starts, faults, restarts, ends, each with its wall
clock) and rank 0's metrics (each train record with its end time and its step's seconds): the steps
that count over the wall time some agent of the job ran, and the rest of that time cut into the
gaps between steps, each given to its cause (start-up, faults, evaluation, checkpoints, ...).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

FAULTS = ("crash", "no heartbeat", "hang", "evict", "membership")  # what a restart follows (fault/events.py)


def timed(train: list[dict]) -> list[dict]:
    """The train records (in file order) with a wall clock and a step time (older runs' have no `time`),
    by time; of a step logged twice only the later (a NaN rollback re-does steps in the same file: the
    first pass of each was work lost, not training that counts)."""
    newest = {r.get("step"): r for r in train if isinstance(r.get("time"), (int, float))
              and isinstance(r.get("step_time"), (int, float))}
    return sorted(newest.values(), key=lambda r: r["time"])


def ettr_text(events: list[dict], train: list[dict]) -> str:
    """ETTR, MegaScale's effective training time ratio: the seconds of the steps that count (the run's
    train records, in which a resumed run's re-done steps replace the lost ones) over the wall time in
    which an agent of the job ran (`agent_spans`): from the first agent's start to the last one's end
    (or to the newest step, for a job that has not ended or whose agents were killed), less the time
    between launches with no agent at all (a requeued job's wait in its scheduler's queue is not the
    job's to lose). '' without timed train records (a run from before they had `time`)."""
    records = timed(train)
    spans = agent_spans(events, [r["time"] for r in records])
    steps = [r for r in records if any(a <= r["time"] <= b for a, b in spans)]
    wall = sum(b - a for a, b in spans)
    if wall <= 0 or not steps:
        return ""
    productive = sum(r["step_time"] for r in steps)
    ends = [e["t"] for e in events if e["kind"] == "end"]
    to = "the last one's end" if ends and max(ends) >= spans[-1][1] else "the newest step"
    idle = spans[-1][1] - spans[0][0] - wall
    less = f", less {idle:.0f} s between launches with no agent running" if idle >= 0.5 else ""
    return (f"ETTR {100 * productive / wall:.1f}% ({productive:.0f} s of training steps in {wall:.0f} s "
            f"from the first agent's start to {to}{less})")


def agent_spans(events: list[dict], step_times: list[float]) -> list[tuple[float, float]]:
    """The stretches of wall time in which at least one agent of the job ran, in order, not overlapping:
    per host, each start to its end; an agent that left no end (killed with its machine) to its last
    sign of life, the later of its own last event and the newest train record (`step_times`, sorted)
    before its host's next start (for the newest agent: the newest record)."""
    by_host: dict[Any, list[dict]] = defaultdict(list)
    for e in events:
        by_host[e.get("host")].append(e)

    def alive_until(opened: float, seen: float, before: float = float("inf")) -> float:
        i = bisect.bisect_right(step_times, before) - 1  # the newest record before `before`
        return max(seen, step_times[i]) if i >= 0 and step_times[i] >= opened else seen

    spans = []
    for mine in by_host.values():
        opened = seen = None
        for e in mine:
            if e["kind"] == "start":
                if opened is not None:  # the earlier agent never said its end
                    spans.append((opened, alive_until(opened, seen, e["t"])))
                opened = seen = e["t"]
            elif opened is not None:
                seen = e["t"]
                if e["kind"] == "end":
                    spans.append((opened, seen))
                    opened = None
        if opened is not None:
            spans.append((opened, alive_until(opened, seen)))
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


# the causes of lost time, in the order they are told
CAUSES = ("start-up", "lost steps", "detection", "recovery", "evaluation", "checkpoints", "between steps",
          "the end")


def _lost_then_noticed(out: dict[str, float], lo: float, fault: tuple[float, float | None]) -> None:
    """From `lo` to a fault seen at t that began at `since`: the steps trained meanwhile were lost (their
    records replaced by the re-done ones), then the time to notice it. A fault with no `since` (a NaN
    rollback: the step that saw it was the last; an older agent's event) was all lost steps."""
    t, since = fault
    began = t if since is None else min(max(since, lo), t)
    out["lost steps"] += began - lo
    out["detection"] += t - began


def lost_time(events: list[dict], metrics: dict[str, list[dict]]) -> dict[str, float]:
    """The agents' wall time that was no counted step (`ettr_text`'s wall less its productive seconds),
    by cause, from the agents' events and rank 0's metrics by kind ("train", "layout", "val",
    "checkpoint", "rollback"): every gap between two steps (a step runs from its record's `time` less
    its `step_time` to its `time`) of one agent span, and from a span's start to its first step and from
    its last step to its end, is given whole to one cause, so the parts add up to the whole:

    * from a span's start to its first step: start-up (agents, rendezvous, workers, restore); where a
      fault came first, start-up only to the failed attempt's layout record (its training began), then
      lost steps and detection as below, recovery after it;
    * a gap in which an agent saw a fault or the job rolled back a NaN loss: up to when the first of them
      began (its event's `since`: fault/events.py), the steps lost (trained after the state later
      restored, their records replaced by the re-done ones); from then to when it was seen, detection;
      from it to the next step, the recovery (a restart, or the rollback's restore);
    * after a step with a validation pass (its `seconds` where the record has them) and a checkpoint
      save: evaluation, then checkpoints;
    * from the last step of a span to its end: the end (the final save, the agents' exit);
    * any other gap: between steps (logging, the loop's own work)."""
    records = timed(metrics.get("train", []))
    spans = agent_spans(events, [r["time"] for r in records])
    rollbacks = [(r["time"], None) for r in metrics.get("rollback", [])
                 if isinstance(r.get("time"), (int, float))]
    faults = sorted([(e["t"], e.get("since")) for e in events if e["kind"] in FAULTS] + rollbacks,
                    key=lambda f: f[0])
    seen_at = [t for t, _ in faults]
    # an attempt's layout record: its workers start training (kept when a resume truncates the steps)
    layouts = [r["time"] for r in metrics.get("layout", []) if isinstance(r.get("time"), (int, float))]
    evals = {r["step"]: r.get("seconds") for r in metrics.get("val", [])}
    saved = {r["step"] for r in metrics.get("checkpoint", [])}
    out = dict.fromkeys(CAUSES, 0.0)
    for a, b in spans:
        steps = [r for r in records if a <= r["time"] <= b]
        if not steps:
            out["start-up"] += b - a  # no step at all: the job never got going in this span
            continue
        first = max(a, steps[0]["time"] - steps[0]["step_time"])
        seen = [f for f in faults[bisect.bisect_left(seen_at, a):] if f[0] <= first]
        if seen:  # the first attempt failed: what it trained, if anything (records truncated), was lost
            began = min([t for t in layouts if a <= t <= seen[0][0]], default=seen[0][0])
            out["start-up"] += began - a
            _lost_then_noticed(out, began, seen[0])
            out["recovery"] += first - seen[0][0]
        else:
            out["start-up"] += first - a
        out["the end"] += b - steps[-1]["time"]
        for before, after in zip(steps, steps[1:], strict=False):
            lo, hi = before["time"], after["time"] - after["step_time"]
            gap = max(0.0, hi - lo)
            seen = [f for f in faults[bisect.bisect_left(seen_at, lo):] if f[0] <= hi]
            if seen:
                _lost_then_noticed(out, lo, seen[0])
                out["recovery"] += hi - seen[0][0]
            elif before["step"] in saved:  # evaluation (its own seconds, where known) comes first
                took = min(gap, evals.get(before["step"]) or 0.0) if before["step"] in evals else 0.0
                out["evaluation"] += took
                out["checkpoints"] += gap - took
            elif before["step"] in evals:
                out["evaluation"] += gap
            else:
                out["between steps"] += gap
    return out


def lost_text(lost: dict[str, float]) -> str:
    """'the rest: 12.0 s start-up, ...' (the parts of half a second or more), or ''."""
    parts = [f"{lost[c]:.1f} s {c}" for c in CAUSES if lost.get(c, 0.0) >= 0.5]
    return "the rest: " + ", ".join(parts) if parts else ""
