"""Fault injection, off unless MEGASCALE_INJECT names a fault (tests and the soak benchmark use it).

    MEGASCALE_INJECT="kill@persist:4"        SIGKILL this process in stage 2 of the step-4 checkpoint,
                                             after the shards are written, before the commit marker
    MEGASCALE_INJECT="kill@persist:4:rank=1" only on global rank 1
    MEGASCALE_INJECT="delay@forward:0.02:rank=3"   rank 3 sleeps 20 ms in every forward (a slow GPU;
                                             acts through the timers, observe.timers = true)
    MEGASCALE_INJECT="skip@agree:5:rank=2"   rank 2 skips the step-5 loss all-reduce (a bug that
                                             desynchronises the collectives: the job hangs)
    MEGASCALE_INJECT="stop@step:3:rank=5"    rank 5 SIGSTOPs itself at the start of step 3 (a hung host)
    MEGASCALE_INJECT="nan@step:7"            the loss of step 7 (0-based) becomes NaN, once per process
    MEGASCALE_INJECT="skew@clock:50000000:rank=1"  rank 1's trace clock runs 50 ms ahead (what clock
                                             alignment must undo)

Several faults are separated by commas. A point in the code calls `inject(point, step)` (or asks
`skips`, `delays`, `skew_ns`); each costs a dict lookup when nothing is set.
"""

from __future__ import annotations

import os
import signal


def _parse(spec: str) -> list[tuple[str, str, float, int | None]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, rest = item.partition("@")
        parts = rest.split(":")
        if len(parts) < 2:
            raise ValueError(f"MEGASCALE_INJECT: {item!r} is not ACTION@POINT:VALUE[:rank=R]")
        rank = None
        if len(parts) > 2 and parts[2].startswith("rank="):
            rank = int(parts[2][5:])
        out.append((action, parts[0], float(parts[1]), rank))
    return out


def _mine(rank: int | None = None):
    spec = os.environ.get("MEGASCALE_INJECT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []  # a restarted job (megascale launch) runs clean, as after a real fault
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return [(a, w, v) for a, w, v, only in _parse(spec) if only is None or only == rank]


def inject(point: str, step: int) -> None:
    """Kill or stop this process here if a fault names this point and step."""
    for action, where, at in _mine():
        if where == point and at == step:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action not in ("skip", "delay", "skew", "nan"):
                raise ValueError(f"MEGASCALE_INJECT: unknown fault {action!r}")


_FIRED: set[tuple[str, int]] = set()


def fires_once(action: str, step: int) -> bool:
    """Whether the fault `action@step:STEP` is due now, once per process (a re-done step after a
    rollback runs clean)."""
    if (action, step) in _FIRED:
        return False
    due = any(a == action and w == "step" and at == step for a, w, at in _mine())
    if due:
        _FIRED.add((action, step))
    return due


def skips(point: str, step: int) -> bool:
    """Whether this rank is to skip the collective at `point` of step `step`."""
    return any(a == "skip" and w == point and at == step for a, w, at in _mine())


def delays(rank: int) -> dict[str, float]:
    """Seconds to sleep in each timed op of `rank` (op name -> seconds)."""
    return {w: v for a, w, v in _mine(rank) if a == "delay"}


def skew_ns(rank: int) -> int:
    """Nanoseconds added to `rank`'s trace clock."""
    return int(sum(v for a, w, v in _mine(rank) if a == "skew" and w == "clock"))
