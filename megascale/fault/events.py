"""What the agents of a launched job saw and did, kept in the run directory: RUN_DIR/events/HOST.jsonl.

    {"t": 1733562000.1, "host": "10.0.0.2", "kind": "crash", "detail": "worker exit codes {1: -9}",
     "restart": 1, "max_restarts": 3, "since": 1733561999.6}

One JSON object per line, one file per host's agent: the hosts of a job share the run directory, and
appends from several machines to one file of a network filesystem are not atomic. The kinds:

    start      the agent began (run id, hosts MIN:MAX, workers per host, its pid)
    crash, no heartbeat, hang, evict
               a fault it saw (the same line it prints), with the restart it makes (None: none left) and,
               where the agent knows it, `since`: when the fault began (a crash: the monitor tick before,
               when every worker still ran; no heartbeat: the silent rank's last beat; a hang: when the
               stuck rank's step last moved), so ETTR tells the time to notice from the steps lost
    membership a host waits to join (restarted, a replacement): elastic's own restart, not counted
    restart    the workers run again: the seconds of each phase (stopped, rendezvous, workers started)
    evicted    this host leaves the job (failed self-check, straggler, hang)
    selfcheck  this host failed its self-check in a one-host job (not restarted)
    user error the workers exited 2 (not restarted)
    stopped    the workers saved and exited on SIGINT/SIGTERM (sent here or to another host): not restarted
    refused    an agent started on a host on the run's blocklist, and left
    end        the agent's last word: the job's exit code and its seconds

The stderr lines of each agent say the same, but a night's lines of a hundred hosts end up in a
hundred pods' logs; these files stay with the run, where `megascale report` finds them (its
"Faults and restarts" section: the events, and the seconds from each fault to the workers started
again). Written through LineFile: a full disk costs lines, never the agent.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from megascale.observe.linefile import LineFile

DIR = "events"


def log_path(run_dir: str | Path, host: str) -> Path:
    """RUN_DIR/events/<host>.jsonl, the host id made a safe file name (an IPv6 address has colons)."""
    return Path(run_dir) / DIR / f"{re.sub(r'[^A-Za-z0-9._-]', '_', host) or 'host'}.jsonl"


class EventLog:
    def __init__(self, run_dir: str | Path, host: str):
        self.host = host
        path = log_path(run_dir, host)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # LineFile says so at the first write
        self._file = LineFile(path, f"the agent's event log of host {host}")

    def write(self, kind: str, **fields: Any) -> None:
        rec = {"t": round(time.time(), 3), "host": self.host, "kind": kind, **fields}
        self._file.write(json.dumps(rec, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every host's events, in time order; a line a failure cut short is skipped."""
    out = []
    for p in sorted((Path(run_dir) / DIR).glob("*.jsonl")):
        try:
            lines = p.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("t"), (int, float)) and "kind" in rec:
                out.append(rec)
    return sorted(out, key=lambda r: r["t"])
