"""Fault injection, off unless MEGASCALE_INJECT names a fault (tests and the soak benchmark use it).

    MEGASCALE_INJECT="kill@persist:4"        SIGKILL this process in stage 2 of the step-4 checkpoint,
                                             after the shards are written, before the commit marker
    MEGASCALE_INJECT="kill@persist:4:rank=1" only on global rank 1

A point in the code calls `inject(point, step)`; it costs a dict lookup when nothing is set.
"""

from __future__ import annotations

import os
import signal


def _parse(spec: str) -> list[tuple[str, str, int, int | None]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, rest = item.partition("@")
        parts = rest.split(":")
        rank = None
        if len(parts) > 2 and parts[2].startswith("rank="):
            rank = int(parts[2][5:])
        out.append((action, parts[0], int(parts[1]), rank))
    return out


def inject(point: str, step: int) -> None:
    spec = os.environ.get("MEGASCALE_INJECT")
    if not spec:
        return
    rank = int(os.environ.get("RANK", "0"))
    for action, where, at, only in _parse(spec):
        if where == point and at == step and (only is None or only == rank):
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"MEGASCALE_INJECT: unknown fault {action!r}")
