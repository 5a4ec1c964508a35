"""The run directory is one job's: a lock against a second job, and an archive for an earlier run.

* `RunDirLock`: global rank 0 holds an exclusive `flock` on RUN_DIR/.lock for the whole run, so
  a requeued job started while the old one still lives gets one clear line instead of the two
  deleting each other's checkpoints. The lock dies with the process (no stale lock after a
  crash or kill -9).
* `archive_previous_run`: a fresh start (checkpoint.resume = false) in a directory that holds an
  earlier run's checkpoints or metrics moves them to RUN_DIR/archive/<time>/ first, so the new
  run's `keep` never trims against the old run's higher step numbers and a later resume never
  loads the old run's weights. Storage outside the run directory is not moved: the start is
  refused with one line instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path

from megascale.checkpoint.storage import Storage
from megascale.errors import UserError

_RUN_FILES = ("metrics.jsonl", "tensorboard", "config.toml", "trace", "timeline.json", "report.html")


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self._fh = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a+")  # noqa: SIM115 - held open for the run's lifetime
        except OSError as e:
            raise UserError(f"train.run_dir {self.path.parent}: cannot be created or written "
                            f"({e.strerror or e})") from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise UserError(f"train.run_dir {self.path.parent}: in use by another megascale job ({holder}); "
                            "wait for it to end, stop it, or use another run directory") from None
        try:  # who holds it, for a second job's line (unbuffered: a failed write leaves nothing to flush)
            os.ftruncate(fh.fileno(), 0)
            os.pwrite(fh.fileno(), f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        except OSError:  # a full disk: the flock alone is the lock; the run starts (or restarts) all the same
            pass
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def archive_previous_run(run_dir: Path, storage: Storage, default_storage: bool) -> Path | None:
    """Move an earlier run's checkpoints and metrics out of the way (see the module docstring)."""
    steps = storage.committed() + storage.partial()
    files = [run_dir / f for f in _RUN_FILES if (run_dir / f).exists()]
    if steps and not default_storage:
        raise UserError(f"checkpoint.path {storage.display}: holds checkpoints of an earlier run (steps "
                        f"{', '.join(str(s) for s, _ in steps[-3:])}); a fresh start there would mix the two "
                        "runs: resume (checkpoint.resume=true), or move them away or choose another path")
    if not steps and not files:
        return None
    dest = run_dir / "archive" / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        n += 1
    dest.mkdir(parents=True)
    if steps:
        shutil.move(storage.root, dest / "checkpoints")
    for f in files:
        shutil.move(str(f), dest / f.name)
    return dest
