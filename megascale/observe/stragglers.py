"""Slow ranks, found from the always-on timers (MegaScale §4.3: 0.5% of hosts ran ~10% slower).

Every `observe.straggler_window` steps each rank hands in the median duration of each compute op
in the window (forward, backward, optimizer: the time inside those spans minus what they spent
blocked in nested collectives, so a rank waiting on a slow tp peer does not look slow itself; the
median, so that a few preempted instances on a shared host do not make a straggler). Rank 0
compares each rank with the median of the *other* ranks that do the same work (the same
pipeline stage: every dp and tp rank of a stage runs the same layers on the same shapes);
leaving the rank itself out keeps a small group (2 peers) from halving the signal. A rank slower
by more than `threshold` in `windows` consecutive windows is a straggler: one `straggler`
record per (rank, op) streak. Slower counts only where the excess is worth a step's while: at
least `threshold` times the stage's longest op (its median over the stage), so that a 1 ms
optimizer preempted into 3-7x on a shared machine is not a straggler beside a 5 ms backward, while
a host slower at everything by the threshold still shows in its longest op. Every window also
yields one `ranks` record per op (every rank's seconds and relative time), from which the report
draws its heat map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

COMPUTE_OPS = ("forward", "backward", "optimizer")
_MIN_SECONDS = 1e-5  # below this an op's time is noise (an op a stage barely runs)


@dataclass
class StragglerDetector:
    coords: list[tuple[int, int, int]]  # (dp, pp, tp) of each global rank
    hosts: list[str]
    threshold: float = 0.1
    windows: int = 2
    _streak: dict[tuple[int, str], int] = field(default_factory=dict)

    def update(self, step: int, first_step: int, seconds: np.ndarray) -> tuple[list[dict], list[dict]]:
        """seconds: (world, len(COMPUTE_OPS)) each rank's median seconds per op in this window.
        Returns (ranks records, straggler records) for the metrics log."""
        seconds = np.asarray(seconds, dtype=np.float64)
        stage = np.array([c[1] for c in self.coords])
        ranks_recs, found = [], []
        # per rank: the excess that counts, `threshold` x its stage's longest op (medians over the stage)
        floor = np.zeros(len(stage))
        for s in np.unique(stage):
            members = stage == s
            floor[members] = self.threshold * np.median(seconds[members], axis=0).max()
        for j, op in enumerate(COMPUTE_OPS):
            col = seconds[:, j]
            rel = np.ones_like(col)
            ref = np.full_like(col, np.nan)
            for s in np.unique(stage):
                members = np.flatnonzero(stage == s)
                if len(members) < 2:
                    continue  # a stage of one rank has nobody to compare with
                for r in members:
                    others = col[members[members != r]]
                    med = float(np.median(others))
                    ref[r] = med
                    rel[r] = col[r] / med if med > _MIN_SECONDS else 1.0
            if col.max() < _MIN_SECONDS:
                continue
            ranks_recs.append({"step": step, "window": [first_step, step], "op": op,
                               "seconds": [round(float(v), 6) for v in col],
                               "relative": [round(float(v), 4) for v in rel]})
            for r in range(len(col)):
                key = (r, op)
                if rel[r] > 1 + self.threshold and col[r] - ref[r] >= floor[r]:
                    self._streak[key] = self._streak.get(key, 0) + 1
                    if self._streak[key] == self.windows:
                        dp, pp, tp = self.coords[r]
                        found.append({"step": step, "rank": r, "host": self.hosts[r], "dp": dp, "pp": pp,
                                      "tp": tp, "op": op, "slower_by": round(float(rel[r] - 1), 4),
                                      "seconds": round(float(col[r]), 6), "median_s": round(float(ref[r]), 6),
                                      "windows": self.windows})
                else:
                    self._streak.pop(key, None)
        return ranks_recs, found


def costliest(found: list[dict]) -> dict:
    """The straggler record that costs the job most: the largest excess seconds over its peers' median,
    not the largest ratio. A synchronous step waits for its slowest rank by that excess, and a tiny op
    (an optimizer step of 1-5 ms) reaches a ratio of 3-7x from one preemption on a shared machine
    (measured in the eviction test, beside the slow host's forward 24x slower by 0.1 s; a loaded CI
    run once evicted the healthy host there). Ties go to the lowest rank, so every rank names the
    same one."""
    return max(found, key=lambda r: (r["seconds"] - r["median_s"], -r["rank"]))
