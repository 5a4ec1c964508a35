"""Fault injection, off unless MEGASCALE_INJECT names a fault (tests and the soak benchmark use it).

    MEGASCALE_INJECT="kill@persist:4"        SIGKILL this process in stage 2 of the step-4 checkpoint,
                                             after the shards are written, before the commit marker
    MEGASCALE_INJECT="kill@persist:4:rank=1" only on global rank 1
    MEGASCALE_INJECT="delay@forward:0.02:rank=3"   rank 3 sleeps 20 ms in every forward (a slow GPU;
                                             acts through the timers, observe.timers = true)
    MEGASCALE_INJECT="delay@exit:3:host=H"     host H's workers take 3 s longer to exit on a user error (a
                                             big process's teardown: the other hosts' agents end first)
    MEGASCALE_INJECT="skip@agree:5:rank=2"   rank 2 skips the step-5 loss all-reduce (a bug that
                                             desynchronises the collectives: the job hangs)
    MEGASCALE_INJECT="stop@step:3:rank=5"    rank 5 SIGSTOPs itself at the start of step 3 (a hung host)
    MEGASCALE_INJECT="hang@step:3:rank=5"    rank 5's training thread blocks for good at the start of step 3
                                             while its other threads go on (a stuck kernel or a deadlock:
                                             it beats, it makes no progress, its peers wait for it)
    MEGASCALE_INJECT="nan@step:7"            the loss of step 7 (0-based) becomes NaN, once per process
    MEGASCALE_INJECT="full@write:4"          the step-4 checkpoint's write fails as on a full disk (ENOSPC)
    MEGASCALE_INJECT="corrupt@committed:6:rank=1"  once the step-6 checkpoint is committed, a byte of each
                                             of rank 1's shard files is flipped (bit rot, a bad disk)
    MEGASCALE_INJECT="skew@clock:50000000:rank=1"  rank 1's trace clock runs 50 ms ahead (what clock
                                             alignment must undo)

Several faults are separated by commas. Each may name where and when it fires, after its value:
`rank=R` (global rank), `host=H` (the host's id, `host_id()`: under `megascale launch` its
--local-addr, so simulated hosts that share one hostname differ), `local=L` (the local rank: which
global ranks a host gets is the rendezvous's choice) and `attempt=K` (the agent's
restart count; default 0, so a restarted job runs clean, as after a real fault). A point in the code
calls `inject(point, step)` (or asks `skips`, `delays`, `skew_ns`); each costs a dict lookup when
nothing is set.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
from collections.abc import Sequence
from typing import NamedTuple


class Fault(NamedTuple):
    action: str  # kill, stop, hang, nan, skip, delay, skew, full, corrupt, fail
    point: str  # where in the code: step, persist, forward, selfcheck, ...
    value: float  # the step, the seconds, the check number
    rank: int | None = None  # only this global rank
    host: str | None = None  # only this host (host_id())
    attempt: int | None = None  # only in this attempt (None: not named; see `here`)
    local: int | None = None  # only this local rank (LOCAL_RANK: "the second rank of host H")


def host_id() -> str:
    """This host's name in the job: MEGASCALE_HOST_ID (set by `megascale launch` to its --local-addr,
    else the hostname), or the hostname."""
    return os.environ.get("MEGASCALE_HOST_ID") or socket.gethostname()


def _parse(spec: str) -> list[Fault]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, rest = item.partition("@")
        parts = rest.split(":")
        if len(parts) < 2:
            raise ValueError(f"MEGASCALE_INJECT: {item!r} is not "
                             "ACTION@POINT:VALUE[:rank=R][:host=H][:local=L][:attempt=K]")
        where: dict = {}
        for q in parts[2:]:
            key, _, val = q.partition("=")
            if key not in ("rank", "host", "attempt", "local") or not val:
                raise ValueError(f"MEGASCALE_INJECT: {item!r}: {q!r} is not rank=R, host=H, local=L "
                                 "or attempt=K")
            where[key] = val if key == "host" else int(val)
        out.append(Fault(action, parts[0], float(parts[1]), **where))
    return out


def attempt() -> int:
    """This agent's restart count (0 outside `megascale launch` and torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def here(f: Fault, rank: int, default_attempt: int | None = 0) -> bool:
    """Whether fault f is for this process: its rank, its host and its attempt (the one it names, else
    `default_attempt`; None: every attempt)."""
    want = f.attempt if f.attempt is not None else default_attempt
    return ((f.rank is None or f.rank == rank) and (f.host is None or f.host == host_id())
            and (f.local is None or f.local == int(os.environ.get("LOCAL_RANK", "0")))
            and (want is None or want == attempt()))


def _mine(rank: int | None = None):
    spec = os.environ.get("MEGASCALE_INJECT")
    if not spec:
        return []
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return [(f.action, f.point, f.value) for f in _parse(spec) if here(f, rank)]


def inject(point: str, step: int, files: Sequence[str] = ()) -> None:
    """Act out a fault that names this point and step: kill, stop or hang this process, fail like a full disk
    (raise OSError ENOSPC), or corrupt `files` (flip a byte in the middle of each, as bit rot would)."""
    for action, where, at in _mine():
        if where == point and at == step:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action == "hang":
                threading.Event().wait()  # never set: only a signal ends this process now
            elif action == "full":
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: full@{point}:{step})")
            elif action == "corrupt":
                for f in files:
                    with open(f, "r+b") as fh:
                        fh.seek(os.path.getsize(f) // 2)
                        byte = fh.read(1)
                        fh.seek(-len(byte), os.SEEK_CUR)
                        fh.write(bytes([byte[0] ^ 0xFF]) if byte else b"")
            elif action not in ("skip", "delay", "skew", "nan", "fail"):
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
