"""The hosts evicted from a run: RUN_DIR/blocklist.json, one entry per host, with the reason.

A host that fails its self-check (fault/selfcheck.py) is written here by its first rank, and its
agent leaves the job (fault/driver.py). From then on `megascale launch` refuses to start on that
host for this run, with the reason on one line: a cluster manager that restarts the failed pod, or
a person who relaunches every host, does not bring the broken machine back into the job. Once
the machine is repaired, `megascale launch --unblock HOST` (or deleting its entry) lets it in again.

The file lives in the run directory because that is the one place every host of a job shares
already (checkpoint shards are written there), and it belongs to the run, not to the cluster:
another job is not told what to think of the machine. Writes are whole-file replacements under
an flock, so two hosts evicted at once both stay listed and a reader never sees half a file.
"""

from __future__ import annotations

import fcntl
import json
import time
from contextlib import contextmanager
from pathlib import Path

NAME = "blocklist.json"


def path(run_dir: str | Path) -> Path:
    return Path(run_dir) / NAME


@contextmanager
def _locked(run_dir: str | Path):
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / f".{NAME}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read(run_dir: str | Path) -> dict[str, dict]:
    """host -> {"reason", "time", "job"}; an unreadable file reads as empty (it is advice, not state)."""
    try:
        data = json.loads(path(run_dir).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(run_dir: str | Path, data: dict) -> None:
    from megascale.data.atomic import write_text_atomic  # here: megascale.data costs ~0.15 s to import
    write_text_atomic(path(run_dir), json.dumps(data, indent=1, sort_keys=True) + "\n")


def add(run_dir: str | Path, host: str, reason: str, job: str = "") -> None:
    """Raises OSError when the file cannot be written (a full disk): the list as it was stays whole,
    and the caller says that the host leaves without being kept out of a relaunch (see `unwritten`)."""
    with _locked(run_dir):
        data = read(run_dir)
        data[host] = {"reason": reason, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "job": job}
        _write(run_dir, data)


def remove(run_dir: str | Path, host: str) -> bool:
    """Take `host` off the list; whether it was on it."""
    with _locked(run_dir):
        data = read(run_dir)
        if host not in data:
            return False
        del data[host]
        _write(run_dir, data)
        return True


def unwritten(run_dir: str | Path, host: str, e: OSError) -> str:
    """What to say when `add` failed: the eviction still happens, only its record for later is missing."""
    return (f"host {host} could not be put on the run's blocklist ({path(run_dir)}: {e.strerror or e}): it "
            "leaves this job, but a relaunch would take it back")


def entry(run_dir: str | Path, host: str) -> dict | None:
    return read(run_dir).get(host)
