"""`megascale launch`: the job's driver on each host, torch.distributed.elastic's agent with eyes.

    megascale launch --nnodes 2 --nproc-per-node 4 --rdzv-endpoint host0:29400 --config c.toml ...

Every host runs one agent (`LocalElasticAgent`: rendezvous, worker processes, restarts), the
same as torchrun; ours adds what torchrun does not see. Each monitor tick it reads its workers'
heartbeats (`fault/heartbeat.py`) from the job's store and declares the worker group unhealthy,
so the agent restarts it (from the newest complete state: host memory where every rank still has
it, else storage), when

* a rank sends no heartbeat for `fault.heartbeat_timeout_s` (dead, SIGSTOP'd, GIL-hung), or
* a rank keeps beating but its step does not move for the hang timeout
  (`fault.hang_timeout_s`, or by default max(60 s, 20 x the median step)): a hang. Before its
  workers are stopped the agent diagnoses it from every rank's in-flight record (fault/hang.py);
  when the culprits all sit on one host of a multi-host job, that host is evicted (below) and the
  restart goes on without it (`fault.evict_hung_hosts`, default true);

and, as torchrun does, when a worker exits with an error. A worker that exits 2 (a user error:
bad config, path, dataset) or 4 (its host failed the self-check that every (re)start begins
with, fault/selfcheck.py) is not restarted: the same input, or the same host, fails the same way. The other
hosts' agents see the restarting host wait in a new rendezvous round and restart theirs, so the
whole job restarts together. Workers are stopped with SIGKILL: the state worth keeping is in
the host-memory snapshots and storage, and a stopped or hung process would not act on SIGTERM.

Eviction: in a multi-host job a host that fails the self-check is put on the run's blocklist
(fault/blocklist.py) by its first rank; its ranks exit 4, the others 5 (PeerHostEvicted). The failed
host's agent then leaves the rendezvous *without closing it* (elastic's agent would close it and end
the job everywhere) and exits 4; the others restart into a new round, which a spare host (an agent
started beyond --nnodes waits in elastic's redundancy list) completes in its place, or, with
`--nnodes MIN:MAX` and `parallel.dp = 0`, which closes with fewer hosts and a smaller dp (the
restore reshards). An agent never starts on a blocklisted host.

What each agent sees and does (its start, every fault, restart and eviction, its end) also goes to the
run's event log, RUN_DIR/events/HOST.jsonl (fault/events.py), which `megascale report` reads.

Faults injected with MEGASCALE_INJECT fire in the first attempt only (`fault/inject.py`), so a
restarted job runs clean, as after a real fault.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import statistics
import sys
import time
from contextlib import contextmanager

from megascale.config import FaultConfig
from megascale.distributed import prefork
from megascale.distributed.launch import STOPPED, elastic_agent, kill_the_rest_after_a_failure
from megascale.errors import UserError
from megascale.fault import blocklist, refusal, rendezvous
from megascale.fault.events import EventLog

_log = logging.getLogger("megascale.launch")
# The rounds' store's timeout (the workers' master address, elastic's exit barrier; elastic's default is
# 60 s). It bounds waiting for a key and the first connection (so an agent first waits for the store's
# port to open: `_wait_for_store`), not a call on a connection whose peer went silent, which returns only
# when TCP gets through or gives up. The rendezvous state, asked every monitor tick, is bounded by a
# thread of its own (fault/rendezvous.py).
STORE_READ_TIMEOUT_S = 10
STORE_RETRY_S = 5.0  # after a failed call, how long an agent's monitor leaves the rendezvous store alone
# When a job ends on every host alike (done, a user error, an agreed stop), how long the agent that serves
# the rendezvous store waits for the others to leave it before it ends and takes the store with it
LEAVE_WAIT_S = 30.0


def _say(msg: str) -> None:
    print(f"megascale launch: {msg}", file=sys.stderr, flush=True)


class _WorkerFailureSaid(logging.Filter):
    """Drops elastic's ERROR line for a failed worker ("failed (exitcode: 2) local_rank: 0 (pid: ..) of
    binary: ..."), the one line of its that the agent still printed: ours says it, with what follows
    (`crash: worker exit codes {...}; restarting ...`), and a user error's or a self-check's is the
    workers' own line above it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def _final(codes: set[int], code: int) -> bool:
    """Whether the workers stopped on an error that a restart cannot fix: every worker exited `code`, or
    some did and the agent killed the rest (negative codes)."""
    return code in codes and all(c == code or c < 0 for c in codes)


class HostEvicted(Exception):
    """This host is on the run's blocklist: its agent leaves the job (exit 4)."""


def make_agent_class():
    """The agent class (imported lazily: torch.distributed.elastic is heavy)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from megascale.fault.heartbeat import read_heartbeats

    class MegaScaleAgent(LocalElasticAgent):
        fault: FaultConfig = FaultConfig()
        multi_host = False  # --nnodes MAX > 1
        beat_store = None  # this host's beat store (a TCPStore server on 127.0.0.1, in this process)
        host = ""  # this host's id (MEGASCALE_HOST_ID)
        run_dir = ""  # the run's directory: its blocklist
        store_host = ""  # the --rdzv-endpoint's host: where the rendezvous store is served
        log = None  # the run's event log of this host (fault/events.py), or None
        last_round = None  # (the round's store, its hosts, its number) of the newest rendezvous

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._store_down = 0.0  # when a call to the rendezvous store last failed (0: the last one worked)
            self._refused = False  # another host will not join (fault/refusal.py): the job ends
            self._tolerate_store_outages(self._worker_group.spec.rdzv_handler)
            self._store_at = None  # the worker generation _progress is about
            self._generation = 0  # worker starts on this host: the beats' key (MEGASCALE_BEAT_GEN)
            self._progress: dict[int, tuple[int, float]] = {}  # rank -> (step, when it last changed)
            self._intervals: list[float] = []  # seconds per step seen in the beats (the auto hang timeout)
            self._healthy = False  # the last monitor tick found the workers healthy
            self._phases: dict[str, float] | None = None  # the restart in progress: phase -> seconds
            self._tick: float | None = None  # the last monitor tick, or the workers' (re)start after it

        # ---------------------------------------------------------------- the rendezvous store

        def _tolerate_store_outages(self, handler) -> None:
            """A link down for a few seconds, or the store's host busy, is no reason to end this host's part
            of the job: elastic asks the rendezvous store every monitor tick whether hosts wait to join, and
            raises on the first failed call. Here that reads as "none wait" (the workers' own faults are
            still seen through their exits and heartbeats)."""
            from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

            asked, close = handler.num_nodes_waiting, handler.shutdown

            def num_nodes_waiting() -> int:
                # each failed call costs up to the store's 3 s bound: after one, ask again only after
                # STORE_RETRY_S, so that a worker's exit meanwhile is seen at the next monitor tick
                if self._store_down and time.monotonic() - self._store_down < STORE_RETRY_S:
                    return 0
                try:
                    waiting = asked()
                except RendezvousConnectionError:
                    self._store_down = time.monotonic()
                    self._store_unreachable("asking who waits to join")
                    return 0
                self._store_down = 0.0
                return waiting

            def shutdown() -> bool:
                # the store's host has ended (a user error there ends its agent first) or is out of reach:
                # closing the rendezvous would retry a dead address for the close timeout. A host refused
                # to join: its store (if it served one) ends once this agent has read why
                return True if self._store_down or self._refused else close()

            handler.num_nodes_waiting, handler.shutdown = num_nodes_waiting, shutdown

        @staticmethod
        def _export_round(worker_group) -> None:
            """The workers' attempt number for keys in a shared store (distributed/store.py job_identity):
            the rendezvous round, which every host agrees on (private API; absent, the restart count)."""
            state = getattr(getattr(worker_group.spec.rdzv_handler, "_state_holder", None), "state", None)
            if isinstance(getattr(state, "round", None), int):
                os.environ["MEGASCALE_ROUND"] = str(state.round)

        def _store_unreachable(self, doing: str) -> None:
            now = time.monotonic()
            if now - getattr(self, "_said_unreachable", -1e9) > 10:  # a line per 10 s, not per tick
                self._said_unreachable = now
                _say(f"the rendezvous store is unreachable ({doing}); retrying")

        def _rendezvous(self, worker_group) -> None:
            # a new round right after a fault may find the store out of reach for a while (the link that
            # failed, the store's host restarting): retry for the rendezvous timeout, then fail as elastic
            # does
            from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

            deadline = time.monotonic() + self.fault.rendezvous_timeout_s
            while True:
                try:
                    self._timed("rendezvous", super()._rendezvous, worker_group)
                    self._export_round(worker_group)
                    type(self).last_round = (self._store, worker_group.group_world_size,
                                             os.environ.get("MEGASCALE_ROUND", str(self._generation)))
                    self._generation += 1  # the workers about to start beat under a key of their own
                    os.environ["MEGASCALE_BEAT_GEN"] = str(self._generation)
                    return
                except refusal.HostRefused:
                    self._refused = True
                    raise
                except RendezvousConnectionError:
                    # an evicted store host does not come back (its agent refuses to join): no use waiting
                    if time.monotonic() > deadline or blocklist.entry(self.run_dir, self.store_host):
                        raise
                    self._store_unreachable("joining the next round")
                    time.sleep(2.0)

        # ---------------------------------------------------------------- monitoring

        def _monitor_workers(self, worker_group):
            self._healthy = False
            self._kill_the_rest_after_a_failure()
            # every worker was running at the previous tick: a crash seen now began after it
            seen_running, self._tick = self._tick, time.time()
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                codes = {f.exitcode for f in result.failures.values()}
                if _final(codes, 4):
                    self._remaining_restarts = 0
                    if self.multi_host:
                        self._evicted(worker_group)
                    else:
                        _say("the host failed its self-check (its line is above): not restarting on it; "
                             "repair or replace it and launch again")
                        self._log("selfcheck", detail="the host failed its self-check: not restarting on it")
                elif _final(codes, 5):
                    self._event("evict", "another host was evicted (failed self-check or straggler: the "
                                "workers' line is above) and left the job")
                elif _final(codes, 2):
                    self._remaining_restarts = 0  # a user error: restarting cannot help
                    self._log("user error", detail="the workers' line is above: not restarted")
                elif any(_final(codes, c) for c in STOPPED):
                    # every rank agreed to stop, saved and exited: a signal to a worker, or to another host's
                    # agent (a scheduler preempting one pod or VM). The job was told to stop, not broken
                    self._remaining_restarts = 0
                    name = signal.Signals(max(codes) - 128).name
                    self._log("stopped", detail=f"the workers saved and exited on {name}: not restarted")
                    _say(f"stopped: every worker saved and exited on {name} (sent to a worker here or to "
                         "another host's launch); not restarted: run the same command to resume")
                else:
                    worst = {r: f.exitcode for r, f in result.failures.items()}
                    self._event("crash", f"worker exit codes {worst}", since=seen_running)
                return result
            if result.state != WorkerState.HEALTHY:
                return result
            why, since = self._check_beats(worker_group)
            if why is not None:
                hang = "no new step" in why
                self._event("hang" if hang else "no heartbeat", f"{why}; {self._judge_hang(worker_group)}"
                            if hang else why, since=since)
                return RunResult(state=WorkerState.UNHEALTHY)
            self._healthy = True  # if elastic restarts now, it is for a host waiting to join
            return result

        def _kill_the_rest_after_a_failure(self) -> None:
            """A failed worker's peers are SIGKILLed before elastic sees the failure (it would SIGTERM
            them and wait up to 30 s inside the monitor tick: 27 s of a link-fault restart once)."""
            killed = kill_the_rest_after_a_failure(getattr(self, "_pcontext", None))
            if killed:
                _say(f"a worker failed: stopping the other {killed} with SIGKILL")

        def _check_beats(self, worker_group) -> tuple[str | None, float | None]:
            """What is wrong with the workers' heartbeats, if anything, and since when: the last beat of a
            silent rank, the time a stuck rank's step last moved (as this agent saw it)."""
            if self.beat_store is None:
                return None, None
            if self._store_at != self._generation:  # new workers: forget the old ones' progress
                self._store_at = self._generation
                self._progress.clear()
            ranks = [w.global_rank for w in worker_group.workers]
            beats = read_heartbeats(self.beat_store, self._generation, ranks)
            if beats is None:
                return None, None
            now, f = time.time(), self.fault
            for rank, beat in beats.items():
                if beat.get("status") in ("done", "stopped", "failed"):
                    continue
                age = now - float(beat["t"])
                if age > f.heartbeat_timeout_s:
                    return (f"rank {rank} (pid {beat.get('pid')}) sent no heartbeat for {age:.1f} s "
                            f"(last at step {beat.get('step')}, {beat.get('status')}): dead or stopped",
                            float(beat["t"]))
                step = int(beat.get("step") or 0)
                last = self._progress.get(rank)
                if last is None or step != last[0]:
                    if last is not None and step > last[0]:
                        self._intervals.append((now - last[1]) / (step - last[0]))
                        self._intervals = self._intervals[-200:]
                    self._progress[rank] = (step, now)
                    continue
                limit = self._hang_timeout()
                if beat.get("status") == "training" and now - last[1] > limit:
                    return (f"rank {rank} (pid {beat.get('pid')}) beats but has made no new step for "
                            f"{now - last[1]:.1f} s (stuck after step {step}; hang timeout {limit:.0f} s)",
                            last[1])
            return None, None

        def _judge_hang(self, worker_group) -> str:
            """Who the hang waits on (fault/hang.py, read while every rank is still in place); in a multi-host
            job with one clear culprit host, that host goes on the blocklist, so the restart goes on without
            it. What to say about it."""
            from megascale.fault.hang import judge_hang

            try:
                world = worker_group.workers[0].world_size if worker_group.workers else 0
                verdict = judge_hang(self.run_dir, world)
            except Exception as e:  # noqa: BLE001 - a failed diagnosis must not stop the restart
                return f"the diagnosis failed ({type(e).__name__}: {e})"
            said = f"diagnosis: {verdict.text}"
            if verdict.evict is None or not self.multi_host:
                return said
            if not self.fault.evict_hung_hosts:
                return f"{said} (fault.evict_hung_hosts = false: host {verdict.evict} stays)"
            try:
                blocklist.add(self.run_dir, verdict.evict, f"hang: {verdict.text}",
                              worker_group.spec.rdzv_handler.get_run_id())
            except OSError as e:  # the list is how the culprit's own agent learns that it is out
                why = f"the run's blocklist ({blocklist.path(self.run_dir)}) cannot be written"
                return f"{said}; host {verdict.evict} stays: {why} ({e.strerror or e})"
            return f"{said}; evicting host {verdict.evict}"

        def _hang_timeout(self) -> float:
            if self.fault.hang_timeout_s > 0:
                return self.fault.hang_timeout_s
            median = statistics.median(self._intervals) if self._intervals else 3.0
            return max(60.0, 20 * median)

        def _event(self, kind: str, detail: str, since: float | None = None) -> None:
            """A fault seen now (`since`: when it began, as far as this agent can tell: ETTR's detection
            time, observe/ettr.py), said and logged."""
            left, most = self._remaining_restarts, self._worker_group.spec.max_restarts
            self._log(kind, detail=detail, restart=most - left + 1 if left > 0 else None, max_restarts=most,
                      since=round(since, 3) if since is not None else None)
            then = (f"restarting the job (restart {most - left + 1} of {most})" if left > 0
                    else f"no restarts left (fault.max_restarts={most}): the job fails")
            _say(f"{kind}: {detail}; {then}")

        def _restart_workers(self, worker_group) -> None:
            # a host on the blocklist never restarts: elastic restarts a healthy-looking group when another
            # host waits in a new round, and an evicted host's workers may not have exited 4 by then
            if self.multi_host and blocklist.entry(self.run_dir, self.host) is not None:
                self._stop_workers(worker_group)  # a hung host's workers are still there, and deaf to SIGTERM
                self._evicted(worker_group)
                raise HostEvicted(self.host)
            if self._healthy:  # elastic's own restart: a membership change, not counted as a restart
                _say("membership: a host waits to join (restarted, a replacement, or after a fault it saw "
                     "first); restarting the job to take it in")
                self._log("membership", detail="a host waits to join")
            self._healthy = False
            self._phases = {}
            super()._restart_workers(worker_group)
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in self._phases.items())
            self._log("restart", phases={k: round(v, 3) for k, v in self._phases.items()},
                      round=os.environ.get("MEGASCALE_ROUND"))
            self._tick = time.time()  # the new workers run from here: a crash seen next began after it
            _say(f"restart: {parts} (round {os.environ.get('MEGASCALE_ROUND', '?')}); the workers' own "
                 "start-up is in the run's startup records")

        def _timed(self, phase: str, fn, *args):
            """fn(*args), its seconds kept as a phase of the restart in progress (the restart line)."""
            t0 = time.monotonic()
            try:
                return fn(*args)
            finally:
                if self._phases is not None:
                    self._phases[phase] = self._phases.get(phase, 0.0) + time.monotonic() - t0

        def _start_workers(self, worker_group):
            return self._timed("workers started", super()._start_workers, worker_group)

        def _log(self, kind: str, **fields) -> None:
            if self.log is not None:
                self.log.write(kind, **fields)

        def _evicted(self, worker_group) -> None:
            self._remaining_restarts = 0
            self._log("evicted", detail=(blocklist.entry(self.run_dir, self.host) or {}).get("reason", ""))
            self._leave_quietly(worker_group.spec.rdzv_handler)
            _say(f"this host ({self.host}) is evicted (failed self-check, straggler or hang: its line is "
                 f"above), on the run's blocklist ({blocklist.path(self.run_dir)}); the other hosts go on "
                 "without it")

        # ---------------------------------------------------------------- stopping

        @staticmethod
        def _leave_quietly(handler) -> None:
            """Make the agent's final rendezvous shutdown a departure: elastic's closes the rendezvous for
            every host (the job ends); an evicted host must only leave it, so the others go on."""
            def leave() -> bool:
                try:  # private API: stop the keep-alives and run the exit op (as next_rendezvous does)
                    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

                    handler._stop_heartbeats()
                    handler._op_executor.run(_RendezvousExitOp(),
                                             handler._get_deadline(handler._settings.timeout.close))
                except Exception:  # noqa: BLE001 - the keep-alives stop with the process; it expires
                    pass
                return True

            handler.shutdown = leave

        def _stop_workers(self, worker_group) -> None:
            # SIGKILL, not SIGTERM: what must survive is in host memory and storage already, and a
            # stopped or hung worker would not act on SIGTERM (elastic would wait 30 s for nothing)
            self._timed("stopped", self._shutdown, signal.SIGKILL, 5)

    return MegaScaleAgent


def _wait_for_store(endpoint: str, timeout: float) -> None:
    """Until the rendezvous store at `endpoint` (host:port) accepts connections, or `timeout` s: hosts start
    in any order, and the store's host may come up after this one. Nothing to wait for when the
    endpoint is an address of this host, whose agent will serve the store itself."""
    if not rendezvous.is_this_host(rendezvous.split_endpoint(endpoint)[0]):
        rendezvous.store_reachable(endpoint, timeout, lambda: _say(
            f"waiting up to {timeout:.0f} s for the rendezvous store at {endpoint}"))


def _beat_store():
    """This host's beat store: a TCPStore server in the agent's process on 127.0.0.1 (a free port), whose
    address the workers inherit (MEGASCALE_BEAT_STORE). Beats stay on the host, outlive every worker
    generation and need nothing of the job's store. None if it cannot be made (no beats then)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
    except (RuntimeError, ValueError) as e:
        _say(f"no heartbeat store on this host ({e}): hangs and stopped workers go unseen")
        return None
    os.environ["MEGASCALE_BEAT_STORE"] = f"127.0.0.1:{store.port}"
    return store


@contextmanager
def _our_agent(fault: FaultConfig, multi_host: bool, host: str, run_dir: str, beat_store, store_host: str,
               log: EventLog):
    """elastic_launch builds a LocalElasticAgent by name; for this call it builds ours."""
    cls = make_agent_class()
    cls.fault, cls.multi_host, cls.host, cls.run_dir, cls.log = fault, multi_host, host, run_dir, log
    cls.store_host = store_host
    cls.beat_store = beat_store
    with elastic_agent(cls):
        yield cls


def _launch_where_open(config, argv: tuple[str, ...], agent, endpoint: str) -> None:
    """elastic_launch, in a rendezvous this launch can join. Elastic closes a job's rendezvous when the job
    ends, and a store that outlives the job (megascale rdzv-store) keeps it closed: the same command run
    again (to resume after a stop, or after a failure) ended in RendezvousClosedError. The job's id has
    generations (`<id>`, then `<id>.1`, ...; the current one under megascale/generation/<id> in the
    store): an agent joins the current one, and where that is closed before it had a round there (an
    earlier launch's), moves the job on to the next by compare-and-set, so every host of the new launch
    lands on the same one."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import elastic_launch

    base, moved = config.run_id, False
    key = f"megascale/generation/{base}"
    generation = _generation(endpoint, key)
    while True:
        config.run_id = base if generation == 0 else f"{base}.{generation}"
        try:
            elastic_launch(config, entrypoint=sys.executable)(*argv)
            return
        except RendezvousClosedError:
            if agent.last_round is not None or moved:
                raise  # closed by a host of this launch: its end, not an earlier launch's
            try:
                store = rendezvous.connect(endpoint)
                store.add(key, 0)  # the key exists from here on (compare_set on a missing key sets nothing)
                generation = int(store.compare_set(key, str(generation), str(generation + 1)))
            except (RuntimeError, ValueError, OSError):
                raise RendezvousClosedError from None
            moved = True
            _say(f"the rendezvous {config.run_id} was closed by an earlier launch of this job; joining "
                 f"{base if generation == 0 else f'{base}.{generation}'}")


def _generation(endpoint: str, key: str) -> int:
    """The job's current generation, where its store outlives launches: 0 where this agent serves the store
    (a new one) or cannot ask."""
    host, port = rendezvous.split_endpoint(endpoint)
    if port == 0 or rendezvous.is_this_host(host):
        return 0
    try:
        return int(rendezvous.connect(endpoint).add(key, 0))
    except (RuntimeError, ValueError, OSError):
        return 0


def _leave_together(agent) -> None:
    """At an end every host's agent reaches alike (done, a user error, an agreed stop): the agent that
    serves the rendezvous store waits, up to LEAVE_WAIT_S, for the others to say they are done with it,
    before it ends and takes the store with it. It used to end first, at its own workers' exit, while
    the others' monitors, keep-alives and rendezvous closes still called the store: each failed call
    printed C++ connection errors with 20 frames of stack into their logs, under the line that said why
    the job ended, and cost its host's agent up to 3 s a call. A store outside the job (megascale
    rdzv-store) outlives every agent: nobody waits."""
    if agent is None or agent.last_round is None or not agent.multi_host:
        return
    store, hosts, round_ = agent.last_round
    key = f"megascale/left/{round_}"
    try:
        if not rendezvous.serves_store():
            store.add(key, 1)  # the last call this agent makes on the store
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        while (left := store.add(key, 0)) < hosts - 1:
            if time.monotonic() > deadline:
                _say(f"{hosts - 1 - left} of the other {hosts - 1} hosts' agents did not say within "
                     f"{LEAVE_WAIT_S:g} s that they are done with the rendezvous store; ending without them")
                return
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store or a peer gone already: nothing to wait for
        pass


def rendezvous_configs(min_nodes: int, max_nodes: int, fault: FaultConfig) -> dict:
    """The rendezvous handler's settings (elastic's rdzv_configs) for a job of MIN:MAX hosts."""
    # last call: once MIN hosts are in, how long a round waits for more (a MIN:MAX job's hosts start with
    # some skew, and a round closed early would run smaller than it could); with MIN = MAX a round
    # closes as the last host joins, and this never runs
    last_call = 2 if min_nodes == max_nodes else fault.rendezvous_last_call_s
    rdzv = {"join_timeout": fault.rendezvous_timeout_s, "last_call_timeout": last_call, "close_timeout": 10,
            "poll_interval": fault.rendezvous_poll_s}
    if max_nodes > 1:  # a dead host leaves the rendezvous after 3 missed 1 s keep-alives, not 15 s
        rdzv |= {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "read_timeout": STORE_READ_TIMEOUT_S}
    return rdzv


def launch(nnodes: str, nproc_per_node: int, rdzv_endpoint: str, run_id: str, train_argv: list[str],
           fault: FaultConfig, local_addr: str | None = None, run_dir: str = "runs/default") -> int:
    """Run `megascale train <train_argv>` as this host's part of the job; the job's exit code."""
    min_nodes, max_nodes = rendezvous.parse_nnodes(nnodes)
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node: must be >= 1, got {nproc_per_node}")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    rdzv = rendezvous_configs(min_nodes, max_nodes, fault)
    if max_nodes > 1:
        # Elastic shares the rendezvous TCPStore with the workers and publishes its address once, in the
        # first round: a host that joins a later round (a machine restarted after a crash) then waits
        # for keys that the round's rank 0 never writes again, and the job deadlocks. Per-round stores
        # fix it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config_args = dict(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, run_id=run_id,
                       max_restarts=fault.max_restarts, monitor_interval=fault.monitor_interval_s,
                       local_addr=local_addr, rdzv_configs=rdzv)
    os.environ["MEGASCALE_LAUNCH"] = "1"  # the workers' cue: self-check before training (fault.selfcheck)
    os.environ[rendezvous.NNODES_ENV] = f"{min_nodes}:{max_nodes}"
    # the host's name in the job: its address as the others reach it (simulated hosts share a hostname)
    host = os.environ.setdefault("MEGASCALE_HOST_ID", local_addr or socket.gethostname())
    log = EventLog(run_dir, host)
    banned = blocklist.entry(run_dir, host)
    if banned is not None:
        _say(f"this host ({host}) was evicted from this run at {banned.get('time')}: {banned.get('reason')}; "
             f"not joining. Once it is repaired: megascale launch --unblock {host} --config ... (or delete "
             f"its entry from {blocklist.path(run_dir)})")
        log.write("refused", detail=f"evicted at {banned.get('time')}: {banned.get('reason')}")
        log.close()
        return 4
    t0 = time.time()
    log.write("start", run_id=run_id, nnodes=nnodes, nproc_per_node=nproc_per_node, pid=os.getpid())
    argv = ("-m", "megascale", "train", *train_argv)
    server = None
    if fault.prefork_workers:
        # started before this process imports torch (~2 s): the server's own imports (~3 s) run beside
        # those, the wait for the store and the first rendezvous; a host started again after a crash
        # trains that much sooner
        server = prefork.Server()
        os.environ[prefork.ENV] = server.path
        argv = server.argv(argv)
    code = 1
    try:
        code = _run_agent(config_args, fault, max_nodes, host, run_dir, rdzv_endpoint, argv, t0, log)
        return code
    finally:
        if server is not None:
            server.close()
        log.write("end", code=code, seconds=round(time.time() - t0, 3))
        log.close()


def _run_agent(config_args: dict, fault: FaultConfig, max_nodes: int, host: str, run_dir: str,
               rdzv_endpoint: str, argv: tuple[str, ...], t0: float, log: EventLog) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher.api import LaunchConfig

    if max_nodes > 1:  # after the blocklist: an evicted host leaves at once, store or no store
        _wait_for_store(rdzv_endpoint, fault.rendezvous_timeout_s)
    rendezvous.register()
    config = LaunchConfig(rdzv_backend=rendezvous.BACKEND, rdzv_endpoint=rdzv_endpoint, **config_args)
    logging.disable(logging.WARNING)  # the agent's own chatter; ours goes to stderr by _say
    said = _WorkerFailureSaid()
    elastic_workers = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    elastic_workers.addFilter(said)
    agent = None
    try:
        store_host = rendezvous.split_endpoint(rdzv_endpoint)[0]
        with _our_agent(fault, max_nodes > 1, host, run_dir, _beat_store(), store_host, log) as agent:
            _launch_where_open(config, argv, agent, rdzv_endpoint)
        _leave_together(agent)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        for final in (4, 2, *STOPPED):  # the workers said why (a failed self-check, a user error, a stop)
            if _final(codes, final):
                if final != 4:  # every host's workers ended alike: so do the agents
                    _leave_together(agent)
                return final
        _say(f"the job failed after {time.time() - t0:.0f} s:\n{e.format_msg()}")
        return max(codes) if max(codes) > 0 else 1
    except HostEvicted:
        return 4
    except refusal.HostRefused as e:  # another host's own checks failed before its agent started
        _say(f"{e}; ending here too (not restarted): fix it there, then launch every host again")
        log.write("user error", detail=str(e))
        return 2
    except RendezvousConnectionError as e:
        # _rendezvous retried: the store is gone, most often with its host
        store_host = rendezvous.split_endpoint(rdzv_endpoint)[0]
        banned = blocklist.entry(run_dir, store_host)
        gone = (f"its host {store_host} was evicted ({banned.get('reason')}) and does not come back"
                if banned is not None
                else f"its host {store_host} has been out of reach for {fault.rendezvous_timeout_s:.0f} s")
        _say(f"the rendezvous store at {rdzv_endpoint} is gone ({e}): {gone}. A store served by the agent "
             "of the --rdzv-endpoint host ends the job with it; one outside the job (megascale rdzv-store) "
             "outlives any host")
        return 1
    except RendezvousTimeoutError:
        lo, hi = config_args["min_nodes"], max_nodes
        nnodes = lo if lo == hi else f"{lo}:{hi}"
        _say(f"no rendezvous round formed within fault.rendezvous_timeout_s = {fault.rendezvous_timeout_s:g} "
             f"s: fewer than {lo} host(s) joined at {rdzv_endpoint} (--nnodes {nnodes}). Is every host's "
             "agent started, with the same --rdzv-endpoint, --rdzv-id and --nnodes?")
        if rendezvous.serves_store():  # the agents still waiting read the rendezvous closed before it goes
            time.sleep(2 * (fault.rendezvous_poll_s or rendezvous.poll_interval_s(max_nodes)) + 1)
        return 1
    except RendezvousClosedError:
        # another agent closed it: its round never formed (a timeout there, another --nnodes) or the job
        # ended there; elastic's traceback said neither
        _say(f"the rendezvous {config.run_id} at {rdzv_endpoint} was closed by another host's agent, "
             "which has ended (its log says why: a rendezvous timeout, another --nnodes, the job's end); "
             "this host cannot join it. Launch every host again, with the same --nnodes")
        return 1
    except SignalException as e:
        # the workers have saved and exited (elastic's shutdown waited for them), those of the other hosts
        # too, through the stop agreement: their agents end alike (a second signal ends the wait)
        _leave_together(agent)
        return 128 + int(e.sigval)
    finally:
        logging.disable(logging.NOTSET)
        elastic_workers.removeFilter(said)
    return 0
