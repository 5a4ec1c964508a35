"""An append-only file of lines (metrics, a rank's trace) that a full or failing disk does not take down.

    f = LineFile(run_dir / "metrics.jsonl", "metrics")
    f.write(json.dumps(record) + "\n")     # False if it could not be written (said once per outage)

Metrics and traces are what a job leaves to be looked at, not what it computes: a disk that fills up
with them at 3 a.m. must cost their lines, not the run (the checkpoints, which do matter, have their
own failure handling). The first failed write of an outage is one line on stderr; the lines written
meanwhile are lost; the first write that succeeds again says how many were. After a failure the file
is closed (the failed line may stay cut short in it) and reopened on the next write, which starts
with a newline, so what follows begins a line of its own: readers skip an empty or broken line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def say(msg: str) -> None:
    print(f"megascale: {msg}", file=sys.stderr, flush=True)


class LineFile:
    def __init__(self, path: str | Path, what: str, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.what = what  # the file's name in messages ("metrics", "trace of rank 3")
        self._warn = warn or say
        self._f = None  # opened at the first write (and again after a failure)
        self._cut = False  # a failure may have cut the last line short
        self.failing: OSError | None = None  # the error of the outage in progress
        self.lost = 0  # writes lost in it

    def write(self, text: str) -> bool:
        """Append `text` and flush it to the OS. False (and nothing raised) if the disk refused it."""
        try:
            if self._f is None:
                self._f = open(self.path, "a")  # noqa: SIM115 - lives with this object
                if self._cut:
                    text = "\n" + text
            self._f.write(text)
            self._f.flush()
        except OSError as e:
            self._drop()
            self._cut = True
            if self.failing is None:
                self.failing = e
                self._warn(f"{self.what}: cannot write {self.path} ({e.strerror or e}); its lines are lost "
                           "until it can be written again; training goes on")
            self.lost += 1
            return False
        if self.failing is not None:
            self._warn(f"{self.what}: writing {self.path} again ({self.lost} writes were lost)")
            self.failing, self.lost, self._cut = None, 0, False
        return True

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()  # (its flush fails again; the file is closed all the same)
            except OSError:
                pass

    def close(self) -> None:
        self._drop()
