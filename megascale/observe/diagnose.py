"""`megascale diagnose RUN_DIR`: who is the job waiting for?

Every rank keeps its in-flight record (`observe.inflight`) in a memory-mapped file; the watchdog
(`observe.watchdog`) adds, on a hang, one JSON dump per live rank with its Python stacks and
PyTorch's flight recorder. From those this module builds the wait-for graph over the mesh and
names the rank(s) everybody is blocked on.

What each source covers:

* Our in-flight records (`RUN_DIR/trace/inflight/rank_NNNNN.bin` + `.json`), the primary
  source. They cover every op that goes through `observe.timers` (the collectives of tp, pp,
  dp, mp, emb and world, and the pipeline's point-to-point sends and receives, counted per
  channel), the optimizer step, and a heartbeat written once a second by the watchdog thread.
  They can be read from outside with no help from the rank: a SIGSTOP'd, dead or GIL-hung
  process still shows its last state, because the kernel owns the mapped pages. They do not
  see collectives issued outside the timers.
* PyTorch's flight recorder (`flight_recorder` in `RUN_DIR/trace/hang/rank_NNNNN.json`, when
  TORCH_FR_BUFFER_SIZE was set before init_process_group). It covers every collective that
  torch.distributed issued on each process group, timed or not, with its own per-group sequence
  numbers (so they differ from ours). With gloo its entries stay "scheduled" and only the
  per-group `pg_status` (last enqueued / last completed collective) tells progress. It exists only
  for ranks that were alive to dump it (never for the stopped or dead rank), so it is shown as
  corroboration from the waiting ranks' side, not used to build the graph.
* The hang dumps' Python stacks: where a live culprit's training thread is (shown for culprits).
* /proc/PID/stat, for ranks on the host this runs on: T (stopped, e.g. SIGSTOP), Z or no such
  process (dead). Evidence next to the heartbeat, which is the only liveness signal across hosts.

The graph. Rank A blocked in a collective of group G at sequence number k waits for each member
B of G (A's `groups[G]`) that has issued fewer than k collectives of G, that has no record, or
that is not responding (while A is). A member that has issued k and is alive is a co-waiter (no
edge). A receive (send) from (to) peer P with tag T, number k, waits for P if P's channel
(peer A, tag T) has sent (received) fewer than k messages, or P is not responding.

The verdict. Culprits are the sink strongly-connected components of that graph that somebody
waits on. A single rank there is either missing, not responding (stopped / dead / hung holding
the GIL), alive but in no collective (computing or somewhere the timers do not see), or alive and
in a collective whose members have all issued it (the collective itself is stuck: network or
backend). A component of several ranks is a cycle: the "rank skipped a collective" case (R
skipped the world all-reduce of step s, so the others wait for R in it while R already waits in a
tp op of step s+1 for peers who are still in step s). There the culprit is the rank whose step is
ahead of the others', else the one waited on by the most ranks in groups it is not blocked in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from megascale.errors import UserError
from megascale.fault.inject import host_id
from megascale.observe.inflight import read_all

MAX_EDGES_SHOWN = 24
MAX_RANKS_SHOWN = 32


class Edge(NamedTuple):
    waiter: int
    waited_for: int
    group: str
    op: str
    seq: int


@dataclasses.dataclass
class RankState:
    rank: int
    present: bool  # it wrote a record
    alive: bool  # heartbeat fresh and the process not seen stopped or dead
    evidence: str = ""  # why not alive, or what /proc says
    heartbeat_age_s: float | None = None
    host: str = ""
    pid: int = -1
    coords: dict[str, int] = dataclasses.field(default_factory=dict)
    step: int = -1
    current: dict | None = None  # the op in flight (inflight.read_record's "current")
    last: dict | None = None  # the op it last completed
    waiting_s: float = 0.0  # how long it has been in `current`


@dataclasses.dataclass
class Diagnosis:
    culprits: list[int]
    lines: list[str]  # the verdict, human text
    edges: list[Edge]
    states: dict[int, RankState]
    kinds: dict[int, str] = dataclasses.field(default_factory=dict)  # culprit -> why (see _KINDS)
    stuck_groups: list[dict] = dataclasses.field(default_factory=list)  # groups all in one op, none lagging
    notes: list[str] = dataclasses.field(default_factory=list)  # context: post-mortem, flight recorder ...
    # (waiter, waited for) -> "lag", "missing" or "not responding"
    why: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        edges = [{**e._asdict(), "why": self.why.get((e.waiter, e.waited_for), "")} for e in self.edges]
        return {"culprits": self.culprits, "kinds": {str(r): k for r, k in self.kinds.items()},
                "lines": self.lines, "notes": self.notes, "stuck_groups": self.stuck_groups, "edges": edges,
                "states": {str(r): dataclasses.asdict(s) for r, s in sorted(self.states.items())}}


_KINDS = ("missing", "not_responding", "skipped", "idle", "stuck_collective")


# ---------------------------------------------------------------------- loading


def find_inflight_dir(run_dir: str | Path) -> Path | None:
    """RUN_DIR/trace/inflight; also accepts the trace dir or the inflight dir itself."""
    run_dir = Path(run_dir)
    for d in (run_dir / "trace" / "inflight", run_dir / "inflight", run_dir):
        if any(d.glob("rank_*.bin")):
            return d
    return None


def load_dumps(hang_dir: Path) -> dict[int, dict]:
    """The watchdog's hang dumps (rank_NNNNN.json), by rank; unreadable ones are skipped."""
    out = {}
    for p in sorted(Path(hang_dir).glob("rank_*.json")):
        try:
            out[int(p.stem.split("_")[1])] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, t, Z ...), None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]


# ---------------------------------------------------------------------- liveness


def _liveness(recs: dict[int, dict], stale_s: float, now_ns: int) -> tuple[dict[int, RankState], list[str]]:
    notes = []
    ref_ns = now_ns
    beats = [r["heartbeat_ns"] for r in recs.values() if r["heartbeat_ns"] > 0]
    newest = max(beats, default=0)
    post_mortem = bool(beats) and (now_ns - newest) / 1e9 > stale_s
    if post_mortem:
        # Nobody beats any more: the job is over (or all stopped). Judge each rank against the
        # last rank still beating, so the one that stopped first still shows.
        ref_ns = newest
        notes.append(f"no rank's heartbeat is fresh (newest {(now_ns - newest) / 1e9:.1f} s old): the job is "
                     "not running; these are the records as they were at its end")
    here = host_id()  # pids can be checked on this host only
    states = {}
    for rank, r in recs.items():
        age = (ref_ns - r["heartbeat_ns"]) / 1e9 if r["heartbeat_ns"] > 0 else None
        alive, evidence = age is not None and age <= stale_s, ""
        if r.get("host") == here:
            alive, evidence = _proc_evidence(r["pid"], alive, post_mortem)
        cur = r["current"]
        waiting = max(0.0, (ref_ns - cur["since_ns"]) / 1e9) if cur else 0.0
        states[rank] = RankState(rank, True, alive, evidence, age, r.get("host", ""), r["pid"],
                                 dict(r.get("coords") or {}), r["step"], cur, r["last"], waiting)
    return states, notes


def _proc_evidence(pid: int, alive: bool, post_mortem: bool) -> tuple[bool, str]:
    st = proc_state(pid)
    if st in ("T", "t"):
        return False, "process stopped (SIGSTOP)" if st == "T" else "process stopped (traced)"
    if st is None or st == "Z":
        # After the job ended every process is gone: that says nothing about who hung.
        return (alive, "process gone") if post_mortem else (False, "process gone (dead)" if st is None
                                                             else "process dead (zombie)")
    return alive, "" if alive else f"process state {st} (hung holding the GIL?)"


def rank_alive(rec: dict, stale_s: float = 5.0, now_ns: int | None = None) -> bool:
    """One record's liveness as the diagnosis judges it: a fresh heartbeat and, on this host, a process
    that is neither stopped nor dead."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    alive = rec["heartbeat_ns"] > 0 and (now_ns - rec["heartbeat_ns"]) / 1e9 <= stale_s
    if rec.get("host") == host_id():
        alive = _proc_evidence(rec["pid"], alive, post_mortem=False)[0]
    return alive


# ---------------------------------------------------------------------- the graph


def _group_targets(recs, states, g, members, k, a_alive) -> list[tuple[int, str]]:
    out = []
    for b in members:
        rb = recs.get(b)
        if rb is None:
            out.append((b, "missing"))
        elif g in rb["issued"] and rb["issued"][g] < k:
            out.append((b, "lag"))
        elif a_alive and not states[b].alive:
            out.append((b, "not responding"))
    return out


def _p2p_target(recs, states, a, cur, a_alive) -> tuple[int, str] | None:
    p, tag, k = cur["peer"], cur.get("tag", -1), cur["seq"]
    rp = recs.get(p)
    if rp is None:
        return p, "missing"
    # A receive waits for the peer's send on the same channel; a (blocking) send for its receive.
    field = "sent" if cur["op"] == "recv" else "received"
    done = next((c[field] for c in rp["channels"] if c["peer"] == a and c["tag"] == tag), 0)
    if done < k:
        return p, "lag"
    if a_alive and not states[p].alive:
        return p, "not responding"
    return None


def build_graph(recs: dict[int, dict], states: dict[int, RankState]) -> tuple[list[Edge], dict]:
    """The wait-for edges, and why each is there ("lag", "missing", "not responding")."""
    edges, why = [], {}
    cache: dict[tuple, list] = {}
    for a, rec in sorted(recs.items()):
        cur = rec["current"]
        if cur is None or cur["seq"] < 0:  # seq -1: a channel the record had no room for
            continue
        a_alive = states[a].alive
        if "peer" in cur:
            t = _p2p_target(recs, states, a, cur, a_alive)
            targets = [t] if t else []
        else:
            members = rec["groups"].get(cur["group"]) or []
            # The groups of one kind partition the ranks, so (kind, first member, size) names one;
            # every waiter of a 12k-rank world all-reduce at the same k shares one scan of it.
            key = (cur["group"], members[0] if members else -1, len(members), cur["seq"], a_alive)
            if key not in cache:
                cache[key] = _group_targets(recs, states, cur["group"], members, cur["seq"], a_alive)
            targets = [t for t in cache[key] if t[0] != a]
        for b, reason in targets:
            edges.append(Edge(a, b, cur["group"], cur["op"], cur["seq"]))
            why[(a, b)] = reason
    return edges, why


def strongly_connected(nodes: list[int], succ: dict[int, list[int]]) -> list[list[int]]:
    """Tarjan's algorithm, iterative (a 12k-rank chain must not hit the recursion limit)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            nbrs = succ.get(v, [])
            if i < len(nbrs):
                work.append((v, i + 1))
                w = nbrs[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def _waiters(culprits: set[int], pred: dict[int, set[int]]) -> set[int]:
    """Every rank blocked on `culprits`, directly or through others."""
    seen, todo = set(), list(culprits)
    while todo:
        for w in pred.get(todo.pop(), ()):
            if w not in seen and w not in culprits:
                seen.add(w)
                todo.append(w)
    return seen


# ---------------------------------------------------------------------- text


def _op_text(op: dict | None, with_peer: bool = True) -> str:
    if not op:
        return "nothing"
    s = f"{op['group']} {op['op']} #{op['seq']}"
    if with_peer and "peer" in op:
        s += f" {'from' if op['op'] == 'recv' else 'to'} rank {op['peer']} (tag {op.get('tag', -1)})"
    return s


def _where(s: RankState) -> str:
    if not s.present:
        return f"rank {s.rank}"
    c = " ".join(f"{d}{s.coords[d]}" for d in ("dp", "pp", "tp") if d in s.coords)
    return f"rank {s.rank} ({c + ', ' if c else ''}host {s.host}, pid {s.pid})"


def _ranks_text(ranks) -> str:
    """0-3,6,9-10: a compact list of rank numbers."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def _last_text(s: RankState, step: bool = True) -> str:
    return f"last completed: {_op_text(s.last, False)}" + (f", at step {s.step}" if step else "")


def _count_text(n_all: int, n_direct: int) -> str:
    return f"{n_all} rank{'s wait' if n_all != 1 else ' waits'} on it ({n_direct} directly)"


# ---------------------------------------------------------------------- the verdict


def _stuck_groups(recs: dict[int, dict], states: dict[int, RankState]) -> list[dict]:
    """Groups whose members are all present, alive and in the same collective: nobody lags there."""
    seen, out = set(), []
    for rec in recs.values():
        cur = rec["current"]
        if cur is None or "peer" in cur:
            continue
        members = tuple(rec["groups"].get(cur["group"]) or ())
        key = (cur["group"], members, cur["seq"])
        if key in seen or len(members) < 2:
            continue
        seen.add(key)
        same = all(m in recs and states[m].alive and recs[m]["current"] is not None
                   and recs[m]["current"].get("peer") is None
                   and (recs[m]["current"]["group"], recs[m]["current"]["seq"]) == (cur["group"], cur["seq"])
                   for m in members)
        if same:
            out.append({"group": cur["group"], "members": list(members), "op": cur["op"], "seq": cur["seq"],
                        "waiting_s": round(min(states[m].waiting_s for m in members), 1)})
    return out


def _skippers(comp: list[int], states, edges) -> list[int]:
    """In a cycle: the rank(s) ahead of the others' step, else the most waited on outside their own op."""
    steps = {r: states[r].step for r in comp}
    top = max(steps.values())
    ahead = [r for r in comp if steps[r] == top]
    if len(ahead) < len(comp):
        return ahead
    count: dict[int, set] = defaultdict(set)
    for e in edges:
        cur = states[e.waited_for].current
        if e.waited_for in steps and (cur is None or cur["group"] != e.group):
            count[e.waited_for].add(e.waiter)
    best = max((len(v) for v in count.values()), default=0)
    return [r for r in comp if len(count.get(r, ())) == best] if best else comp


def _skip_line(r: int, recs, states, edges, n_all, n_direct) -> str:
    s = states[r]
    lag = [e for e in edges if e.waited_for == r and (s.current is None or e.group != s.current["group"])]
    by_group: dict[str, list[Edge]] = defaultdict(list)
    for e in lag:
        by_group[e.group].append(e)
    if not by_group:
        return (f"{_where(s)} is in a wait cycle; in flight: {_op_text(s.current)}; "
                f"{_count_text(n_all, n_direct)}")
    g, es = max(by_group.items(), key=lambda kv: len(kv[1]))
    k = max(e.seq for e in es)
    others = sorted({states[e.waiter].step for e in es})
    at = recs[r]["issued"].get(g, 0)
    return (f"{_where(s)} skipped or never reached {g} {es[0].op} #{k}: it is at #{at} there but already "
            f"in {_op_text(s.current)} of step {s.step} (the ranks waiting for it are at step "
            f"{_ranks_text(others)}); {_last_text(s, False)}; {_count_text(n_all, n_direct)}")


def _single_line(r: int, kind: str, s: RankState, n_all: int, n_direct: int, edges) -> str:
    waits = _count_text(n_all, n_direct)
    if kind == "missing":
        return (f"rank {r} has no in-flight record (it never started, or writes its trace elsewhere); "
                f"{waits}")
    if kind == "not_responding":
        age = f"heartbeat {s.heartbeat_age_s:.1f} s old" if s.heartbeat_age_s is not None else "no heartbeat"
        ev = f", {s.evidence}" if s.evidence else ""
        cur = f"{_op_text(s.current)} for {s.waiting_s:.1f} s" if s.current else "nothing (computing)"
        return f"{_where(s)} is not responding: {age}{ev}; {_last_text(s)}; in flight: {cur}; {waits}"
    # idle: alive, in no collective, and others wait for its next one
    want = sorted({f"{e.group} {e.op} #{e.seq}" for e in edges if e.waited_for == r})
    return (f"{_where(s)} is alive but in no collective (computing, loading data, or in an op the timers do "
            f"not see) while others wait for it in {', '.join(want)}; {_last_text(s)}; {waits}")


def _classify(comp, states, edges) -> tuple[list[int], str]:
    bad = [r for r in comp if not states[r].present]
    if bad:
        return bad, "missing"
    bad = [r for r in comp if not states[r].alive]
    if bad:
        return bad, "not_responding"
    if len(comp) > 1:
        return _skippers(comp, states, edges), "skipped"
    r = comp[0]
    return comp, "idle" if states[r].current is None else "stuck_collective"


def diagnose(run_dir: str | Path, stale_s: float = 5.0, now_ns: int | None = None) -> Diagnosis:
    """The wait-for graph of a run and who it is blocked on. Raises UserError without records."""
    inflight = find_inflight_dir(run_dir)
    if inflight is None:
        raise UserError(f"{run_dir}: no in-flight records (trace/inflight/rank_*.bin); was the run started "
                        "with observe.timers = true, and is this its run directory?")
    return diagnose_records(read_all(inflight), load_dumps(inflight.parent / "hang"), stale_s, now_ns)


def diagnose_records(recs: dict[int, dict], dumps: dict[int, dict] | None = None, stale_s: float = 5.0,
                     now_ns: int | None = None) -> Diagnosis:
    now_ns = time.time_ns() if now_ns is None else now_ns
    dumps = dumps or {}
    states, notes = _liveness(recs, stale_s, now_ns)
    for rec in recs.values():  # members named by some group but without a record of their own
        for members in rec["groups"].values():
            for m in members:
                if m not in states:
                    states[m] = RankState(m, present=False, alive=False, evidence="no record")
    edges, why = build_graph(recs, states)
    succ: dict[int, list[int]] = defaultdict(list)
    pred: dict[int, set[int]] = defaultdict(set)
    for e in edges:
        if e.waited_for not in succ[e.waiter]:
            succ[e.waiter].append(e.waited_for)
        pred[e.waited_for].add(e.waiter)
    comps = strongly_connected(sorted(states), succ)
    comp_of = {r: i for i, c in enumerate(comps) for r in c}
    culprits, kinds, lines = [], {}, []
    for i, comp in enumerate(comps):
        sink = all(comp_of[w] == i for r in comp for w in succ.get(r, ()))
        waited_on = any(pred.get(r) for r in comp)
        if not (sink and waited_on):
            continue
        names, kind = _classify(comp, states, edges)
        for r in names:
            culprits.append(r)
            kinds[r] = kind
    stuck = _stuck_groups(recs, states)
    lines += _culprit_lines(culprits, kinds, recs, states, edges, pred)
    lines += _stuck_lines(stuck, culprits, pred)
    _lonely_not_responding(culprits, kinds, lines, states, recs)
    if not lines:
        lines.append(_healthy_line(states, edges))
    elif edges and max(states[e.waiter].waiting_s for e in edges) < stale_s:
        notes.append(f"every wait is shorter than {stale_s:g} s: the job may just be busy, not hung")
    notes += _fr_lines(culprits, edges, recs, dumps, states)
    lines += _stack_lines(culprits, dumps, states)
    return Diagnosis(sorted(culprits), lines, edges, states, kinds, stuck, notes, why)


def _culprit_lines(culprits, kinds, recs, states, edges, pred) -> list[str]:
    lines = []
    stuck_reported = set()
    for r in culprits:
        n_all, n_direct = len(_waiters({r}, pred)), len(pred.get(r, ()))
        kind = kinds[r]
        if kind == "skipped":
            lines.append(_skip_line(r, recs, states, edges, n_all, n_direct))
        elif kind == "stuck_collective":
            stuck_reported.add(r)
        else:
            lines.append(_single_line(r, kind, states[r], n_all, n_direct, edges))
    if stuck_reported:
        # Several ranks alive in one collective whose members have all issued it: one line per op.
        by_op: dict[str, list[int]] = defaultdict(list)
        for r in sorted(stuck_reported):
            by_op[_op_text(states[r].current)].append(r)
        for op, ranks in by_op.items():
            n_all = len(_waiters(set(ranks), pred))
            wait = min(states[r].waiting_s for r in ranks)
            lines.append(f"ranks {_ranks_text(ranks)} are alive and all in {op} for {wait:.1f} s, and no "
                         f"member of the group lags: the collective itself is stuck (network or backend?); "
                         f"{n_all} other rank{'s' if n_all != 1 else ''} wait on them")
    return lines


def _stuck_lines(stuck, culprits, pred) -> list[str]:
    lines = []
    for g in stuck:
        if set(g["members"]) & set(culprits) or any(pred.get(m) for m in g["members"]):
            continue  # already told as culprits, or others wait on it (then it is a culprit)
        lines.append(f"group {g['group']} [{_ranks_text(g['members'])}]: every member is alive and in "
                     f"{g['group']} {g['op']} #{g['seq']} for {g['waiting_s']:.1f} s and none lags: the "
                     "collective itself is stuck (network or backend?)")
    return lines


def _lonely_not_responding(culprits, kinds, lines, states, recs) -> None:
    """A rank that stopped before anyone needed it: named when nothing else explains the job."""
    if culprits:
        return
    for r, s in sorted(states.items()):
        if s.present and not s.alive:
            culprits.append(r)
            kinds[r] = "not_responding"
            lines.append(_single_line(r, "not_responding", s, 0, 0, []))


def _healthy_line(states, edges) -> str:
    n = sum(s.present for s in states.values())
    blocked = sum(1 for s in states.values() if s.current)
    if not blocked:
        return f"no rank is in a collective: nothing is blocked ({n} ranks, all alive)"
    return (f"{blocked} of {n} ranks are in collectives, none waits on a lagging or dead rank: "
            "nothing is blocked")


def _fr_by_kind(rank: int, dump: dict, rec: dict) -> dict[str, tuple[int, int]]:
    """One live rank's flight recorder progress per group kind: (last enqueued, last completed)."""
    fr = dump.get("flight_recorder") or {}
    kinds = {}
    for kind, members in rec["groups"].items():
        kinds.setdefault(tuple(sorted(members)), kind)  # mp == tp when pp = 1: one process group
    out = {}
    for pg, st in (fr.get("pg_status") or {}).items():
        members = (fr.get("pg_ranks") or {}).get(str(pg))
        kind = kinds.get(tuple(sorted(members))) if members else None
        if kind is None:
            continue
        try:
            out[kind] = (int(st["last_enqueued_collective"]), int(st["last_completed_collective"]))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _fr_lines(culprits, edges, recs, dumps, states) -> list[str]:
    """Corroboration from PyTorch's flight recorder of the live ranks that wait."""
    waiters = sorted({e.waiter for e in edges if _fresh_dump(dumps.get(e.waiter), states[e.waiter])})
    if not waiters:
        return []
    seen: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for w in waiters:
        g = states[w].current["group"] if states[w].current else None
        prog = _fr_by_kind(w, dumps[w], recs[w])
        if g in prog:
            seen[(g, *prog[g])].append(w)
    lines = []
    for (g, enq, done), ranks in sorted(seen.items()):
        state = "one collective in flight" if enq > done else "none in flight there (the wait is elsewhere)"
        lines.append(f"flight recorder (PyTorch's own count of the group's collectives): ranks "
                     f"{_ranks_text(ranks)} on {g}: last enqueued #{enq}, last completed #{done}: {state}")
    return lines


def _fresh_dump(d: dict | None, s: RankState) -> bool:
    """A hang dump written while the rank was in its current op (not one left from an earlier hang)."""
    return bool(d) and s.present and (s.current is None or d.get("wall_ns", 0) >= s.current["since_ns"])


def _stack_lines(culprits, dumps, states) -> list[str]:
    """Where a live culprit's training thread is, from its hang dump (if written during this op)."""
    lines = []
    for r in culprits:
        d = dumps.get(r)
        if not _fresh_dump(d, states[r]):
            continue
        main = next((t for t in d.get("threads", []) if t.get("main")), None)
        if main and main.get("stack"):
            inner = main["stack"][-1:-4:-1]  # innermost first
            frames = " <- ".join(f"{Path(f['file']).name}:{f['line']} {f['func']}" for f in inner)
            lines.append(f"  rank {r} main thread: {frames}")
    return lines


# ---------------------------------------------------------------------- output


def format_diagnosis(d: Diagnosis, verbose: bool = True) -> str:
    present = [s for s in d.states.values() if s.present]
    blocked = sum(1 for s in present if s.current)
    dead = sum(1 for s in present if not s.alive)
    missing = sum(1 for s in d.states.values() if not s.present)
    head = f"{len(present)} ranks, {blocked} in a collective, {dead} not responding"
    head += f", {missing} without a record" if missing else ""
    out = [f"megascale diagnose: {head}"]
    culprit = ", ".join(str(r) for r in d.culprits) or "none"
    out.append(f"culprit{'s' if len(d.culprits) > 1 else ''}: {culprit}")
    out += [f"  {line}" if not line.startswith("  ") else line for line in d.lines]
    out += [f"note: {n}" for n in d.notes]
    if verbose and d.edges:
        out.append("wait-for graph (waiter -> waited for, in):")
        for e in d.edges[:MAX_EDGES_SHOWN]:
            out.append(f"  {e.waiter} -> {e.waited_for}  {e.group} {e.op} #{e.seq} "
                       f"(waiting {d.states[e.waiter].waiting_s:.1f} s)")
        if len(d.edges) > MAX_EDGES_SHOWN:
            out.append(f"  ... {len(d.edges) - MAX_EDGES_SHOWN} more")
    if verbose:
        out += _rank_table(d)
    return "\n".join(out)


def _rank_table(d: Diagnosis) -> list[str]:
    shown = sorted(d.states.values(), key=lambda s: (s.rank not in d.culprits, s.current is None, s.rank))
    out = ["ranks:"]
    for s in shown[:MAX_RANKS_SHOWN]:
        if not s.present:
            out.append(f"  rank {s.rank}: no record")
            continue
        why = [f"heartbeat {s.heartbeat_age_s:.1f} s old"] if s.heartbeat_age_s is not None else []
        live = "alive" if s.alive else f"NOT RESPONDING ({', '.join([*why, *filter(None, [s.evidence])])})"
        cur = f"in {_op_text(s.current)} for {s.waiting_s:.1f} s" if s.current else "in no collective"
        out.append(f"  {_where(s)} step {s.step}: {live}, {cur}; last {_op_text(s.last, False)}")
    if len(shown) > MAX_RANKS_SHOWN:
        out.append(f"  ... {len(shown) - MAX_RANKS_SHOWN} more")
    return out


# ---------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "diagnose", help="name the rank(s) a hung job is blocked on, from its in-flight records",
        description="Read RUN_DIR/trace/inflight (every rank's op in flight, even of a stopped or dead rank) "
                    "and the watchdog's dumps in RUN_DIR/trace/hang, build the wait-for graph over the mesh "
                    "and name the rank(s) everyone is blocked on and the op they last completed.",
    )
    p.add_argument("run", metavar="RUN_DIR", nargs="?", help="the run directory (or its trace directory)")
    p.add_argument("--hosts", action="store_true",
                   help="instead: self-check this host (under torchrun or megascale launch: every rank, with "
                        "the all-reduce and p2p checks); exit 1 if any check fails")
    p.add_argument("--min-fraction", type=float, default=0.5,
                   help="with --hosts: fail a matmul slower than this x the best rate recorded here")
    p.add_argument("--stale-s", type=float, default=5.0,
                   help="a heartbeat older than this means the rank is not responding (default 5)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=handler)
    return p


add_parser = register


def handler(args: argparse.Namespace) -> int:
    if args.hosts:
        from megascale.fault.selfcheck import hosts_main

        return hosts_main(["--min-fraction", str(args.min_fraction), *(["--json"] if args.json else [])])
    if args.run is None:
        raise UserError("diagnose: give a RUN_DIR (a hung job's run directory), or --hosts to self-check")
    d = diagnose(args.run, stale_s=args.stale_s)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
    else:
        print(format_diagnosis(d))
    sys.stdout.flush()
    return 0


def write_diagnosis(d: Diagnosis, path: Path) -> None:
    """The text verdict, atomically (a reader never sees half of it)."""
    from megascale.data.atomic import write_text_atomic  # here: megascale.data costs ~0.15 s to import
    write_text_atomic(path, format_diagnosis(d) + "\n")
