"""The driver's verdict on a hang: who is stuck (observe/diagnose.py), and whether to go on without its host.

When an agent sees its ranks beat without a new step for the hang timeout (fault/driver.py), it
reads every rank's in-flight record (RUN_DIR/trace/inflight, which every host of the job shares, as
it shares the checkpoints), builds the wait-for graph and names the culprits: a rank stuck computing
that its peers wait on (a hung kernel, a deadlock), one that skipped a collective, one that stopped
answering, or a collective stuck inside one group. The diagnosis goes to
RUN_DIR/trace/hang/driver_diagnosis.txt; the agent logs its first line.

The culprits' host is evicted (the restart goes on without it, with a spare host or a smaller dp, as
after a failed self-check) only when the verdict is clear: every culprit on one host, the job on more
than one host, every other rank alive, and each culprit alive and answering yet not moving: stuck
computing while its peers wait ("idle": a hung kernel, a deadlock) or out of step with its group
("skipped"). The rest restarts the job with every host, as before:
- culprits on several hosts;
- a rank that is dead or no longer answers ("not responding": a stopped or dead process is a crash,
  the restart's business, and its own agent sees its beats stop);
- a collective stuck with every member inside it (the network or the backend: the self-check that
  opens the restart measures every host's links and evicts the one that fails);
- a rank already dead besides the culprits (the job is restarting: a peer's agent acted first and
  killed its workers).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from megascale.observe.diagnose import diagnose_records, find_inflight_dir, load_dumps, write_diagnosis
from megascale.observe.inflight import read_all

REPORT = "driver_diagnosis.txt"
EVICTED_KINDS = ("idle", "skipped")  # the diagnosis's kinds of culprit that cost their host its place


class HangVerdict(NamedTuple):
    text: str  # what the diagnosis found, one line for the log
    evict: str | None  # the host to go on without (host_id() of the culprits), or None: restart with all


def judge_hang(run_dir: str | Path, world: int, stale_s: float = 5.0,
               now_ns: int | None = None) -> HangVerdict:
    inflight = find_inflight_dir(run_dir)
    if inflight is None:
        return HangVerdict("no in-flight records to diagnose (observe.timers = false?)", None)
    # records of ranks beyond this world are a larger earlier layout's (before a shrink): not this job's
    recs = {r: rec for r, rec in read_all(inflight).items() if r < world}
    hang_dir = inflight.parent / "hang"
    d = diagnose_records(recs, load_dumps(hang_dir), stale_s, now_ns)
    try:
        hang_dir.mkdir(parents=True, exist_ok=True)
        write_diagnosis(d, hang_dir / REPORT)
    except OSError:
        pass  # the verdict is logged either way
    text = d.lines[0] if d.lines else "no verdict"
    if len(d.lines) > 1:
        text += f" (and {len(d.lines) - 1} more line(s) in {hang_dir / REPORT})"
    if not d.culprits:
        return HangVerdict(text, None)
    hosts = {d.states[r].host for r in d.culprits}
    job_hosts = {s.host for s in d.states.values() if s.present}
    gone = sorted(r for r, s in d.states.items() if r not in d.culprits and not s.alive)
    if len(hosts) != 1 or len(job_hosts) < 2 or gone or "" in hosts or \
            any(d.kinds.get(r) not in EVICTED_KINDS for r in d.culprits):
        return HangVerdict(text, None)
    return HangVerdict(text, hosts.pop())
