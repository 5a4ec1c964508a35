"""A job that survives the night, measured: a long `megascale launch` run with a random fault every
1-3 minutes, and what each cost.

    python benchmarks/soak.py [--minutes 20] [--gap 60:180] [--nproc 2] [--seed 0] [overrides]
    python benchmarks/soak.py --hosts 2 [--kinds kill,stop,link,host] ...   # on a simulated cluster (root)
    python benchmarks/soak.py --faults 2 --first 0 --gap 0:0 ...   # 2 faults, each after the last recovered

The job (the CPU default model, dp over every rank, host-memory snapshots every 5 steps, storage
every 100) runs under `megascale launch`; this script plays the night: at random moments it
SIGKILLs a worker (kill: a crash) or SIGSTOPs one (stop: a frozen process). With `--hosts N` the job
runs on N simulated hosts (network namespaces, megascale.fault.netns: one agent each, host 0 holding
the rendezvous), and two more faults can strike a host other than host 0: its link goes down for
`--link-down-s` (link: a flapping NIC; longer than the hang timeout, so the job must notice), or the
whole host dies, agent and workers, and its pod is started again 5 s later with its host memory gone
(host). It reads the drivers' stderr and the run's metrics as they come, and at the end stops the job
with SIGTERM (a clean stop) and prints, per fault: the kind, the seconds to detection (a driver's first
line about it) and to the first step after the restart; and for the run: ETTR, effective training
time = the step time of the steps that count (the run's final metrics, re-done steps once) / wall time.

Goals on this machine: a crash detected in under 5 s, a hang in under 30 s, training again
within 60 s of any fault, ETTR at least 90%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a driver's line that says it saw the fault: a crash, a stopped or hung rank, a host gone from the job
DETECTED = ("crash:", "no heartbeat:", "hang:", "membership:")
CLUSTER_KINDS = ("link", "host")  # faults of a whole simulated host (--hosts only)


def worker_pids(run: Path) -> dict[int, int]:
    """rank -> pid of the current workers (from their in-flight records' sidecars)."""
    out = {}
    for p in (run / "trace" / "inflight").glob("rank_*.json"):
        try:
            info = json.loads(p.read_text())
            state = Path(f"/proc/{info['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, KeyError, IndexError):
            continue
        if state not in ("Z", "T", "X"):  # running: not a zombie, not one stopped by an earlier fault
            out[info["rank"]] = info["pid"]
    return out


def metric_records(run: Path) -> list[dict]:
    """The run's metrics.jsonl records so far (a line still being written is skipped)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for x in lines:
        try:
            out.append(json.loads(x))
        except ValueError:
            continue
    return out


def train_records(run: Path) -> list[dict]:
    return [r for r in metric_records(run) if r.get("kind") == "train"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--gap", default="60:180", help="seconds between faults, MIN:MAX (uniform)")
    ap.add_argument("--first", type=float, default=None, help="seconds to the first fault (default: a gap)")
    ap.add_argument("--nproc", type=int, default=2, help="workers per host")
    ap.add_argument("--hosts", type=int, default=0, help="simulated hosts (network namespaces; 0: this host)")
    ap.add_argument("--link-down-s", type=float, default=20.0, help="how long a link fault lasts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=None, help="kill,stop (and link,host with --hosts); default: all")
    ap.add_argument("--cycle", action="store_true", help="the kinds in turn instead of at random")
    ap.add_argument("--verbose", action="store_true", help="print every line the job writes to stderr")
    ap.add_argument("--keep", default=None, help="run in this directory and keep it (trace, metrics)")
    ap.add_argument("--faults", type=int, default=0,
                    help="this many faults, each once the job trains again after the one before; end when "
                         "it trains again after the last (0: faults for the whole --minutes)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    lo, hi = (float(v) for v in a.gap.split(":"))
    kinds = (a.kinds or ",".join(("kill", "stop", *(CLUSTER_KINDS if a.hosts > 1 else ())))).split(",")
    if a.hosts < 2 and set(kinds) & set(CLUSTER_KINDS):
        ap.error(f"--kinds {a.kinds}: link and host faults need --hosts 2 or more")
    with tempfile.TemporaryDirectory() as tmp, Night(a, Path(a.keep or tmp)) as night:
        t0 = night.t0
        faults = []
        end = t0 + 60 * a.minutes
        next_at = t0 + (a.first if a.first is not None else rng.uniform(lo, hi))
        try:
            while time.time() < end and night.running():
                time.sleep(0.2)
                # --faults: each fault (after its gap) once the job trains again after the one before
                if a.faults and faults and not recovered(night, faults[-1]):
                    continue
                if a.faults and len(faults) >= a.faults:
                    break
                if time.time() < next_at:
                    continue
                pids = worker_pids(night.run)
                if not pids or not train_records(night.run):
                    continue  # starting up: a fault needs a running job
                kind = kinds[len(faults) % len(kinds)] if a.cycle else rng.choice(kinds)
                fault = {"kind": kind, "t": time.time(), "lines_from": len(night.lines)}
                if kind in CLUSTER_KINDS:
                    fault["host"] = h = rng.randrange(1, a.hosts)  # host 0 holds the rendezvous
                    what = night.link_fault(h) if kind == "link" else night.host_fault(h)
                else:
                    fault["rank"] = rank = rng.choice(sorted(pids))
                    os.kill(pids[rank], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                    what = f"rank {rank} (pid {pids[rank]})"
                faults.append(fault)
                print(f"[{time.time() - t0:7.1f} s] fault: {kind} {what}", flush=True)
                next_at = time.time() + rng.uniform(lo, hi)
        finally:
            wall = time.time() - t0  # the night ends here: the clean stop after it is not training time
            night.stop()
        report(faults, night.lines, night.run, wall, t0)
        if a.keep:  # the drivers' lines beside the trace, each with its time since the start
            Path(a.keep).mkdir(parents=True, exist_ok=True)
            (Path(a.keep) / "drivers.log").write_text("".join(f"{t - t0:8.2f} {x}\n" for t, x in night.lines))


def recovered(night: Night, fault: dict) -> bool:
    """Whether a step ended after a driver's line about `fault` (see report: the first step after it)."""
    after = night.lines[fault["lines_from"]:]
    seen = next((t for t, line in after if any(m in line for m in DETECTED)), None)
    return seen is not None and first_step_after(night.run, seen) is not None


class Night:
    """The job: one `megascale launch` here, or one per simulated host; the lines its drivers write."""

    def __init__(self, a: argparse.Namespace, tmp: Path):
        self.a, self.run = a, tmp / "run"
        self.world = a.nproc * max(1, a.hosts)
        self.lines: list[tuple[float, str]] = []
        self.cluster = None
        self.agents: dict[int, subprocess.Popen] = {}
        self.t0 = time.time()
        self._threads: list[threading.Thread] = []
        self._shm = Path("/dev/shm") / f"megascale-soak-{os.getpid()}"

    def __enter__(self) -> Night:
        if self.a.hosts > 1:
            from megascale.fault import netns

            ok, why = netns.available()
            if not ok:
                raise SystemExit(f"soak --hosts: no simulated cluster here: {why}")
            self.cluster = netns.SimCluster(self.a.hosts)
        for h in range(max(1, self.a.hosts)):
            self._start(h)
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.close()
        shutil.rmtree(self._shm, ignore_errors=True)

    def argv(self, h: int) -> list[str]:
        a = self.a
        # snapshots every 5 steps: Young's interval sqrt(2 x cost x time between faults) = sqrt(2 x 0.02 s
        # (a snapshot's blocked time here) x 120 s) = 2.2 s, ~5 steps of 0.45 s; every 10 lost ~1 s more
        # per fault in re-done steps than the extra snapshots cost
        argv = [sys.executable, "-m", "megascale", "launch", "--nproc-per-node", str(a.nproc),
                "--max-restarts", "1000", "--config", str(ROOT / "configs" / "cpu_default.toml"),
                "train.steps=1000000", "train.eval_interval=0", "train.log_interval=0", "log.progress=false",
                "log.tensorboard=false", "log.sample_tokens=0", "checkpoint.memory_interval=5",
                "checkpoint.interval=100", "checkpoint.keep=2", f"parallel.dp={self.world}",
                "fault.heartbeat_interval_s=1", "fault.heartbeat_timeout_s=4", "fault.selfcheck_min_speed=0",
                f"data.path={json.dumps(str(ROOT / 'data' / 'cache' / 'shakespeare'))}",
                f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}", f"train.run_dir={self.run}"]
        if self.cluster is not None:
            c = self.cluster
            # each host its own host memory (a dead machine's snapshots die with it); a hang (a link down)
            # is noticed after 15 s, not after the default max(60 s, 20 steps)
            argv[4:4] = ["--nnodes", str(a.hosts), "--rdzv-endpoint", f"{c.addr(0)}:29400", "--rdzv-id",
                         "soak", "--local-addr", c.addr(h)]
            argv += [f"checkpoint.memory_dir={self._shm / f'host{h}'}", "fault.hang_timeout_s=15"]
        return argv + list(a.overrides)

    def _start(self, h: int) -> None:
        kw = dict(cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        env = {"OMP_NUM_THREADS": "1"}
        if self.cluster is not None:
            p = self.cluster.popen(h, self.argv(h), env=env, **kw)
        else:
            p = subprocess.Popen(self.argv(h), env={**os.environ, **env}, start_new_session=True, **kw)
        self.agents[h] = p
        tag = f"h{h} " if self.cluster is not None else ""
        t = threading.Thread(target=self._read, args=(p, tag), daemon=True)
        t.start()
        self._threads.append(t)

    def _read(self, p: subprocess.Popen, tag: str) -> None:
        for line in p.stderr:
            self.lines.append((time.time(), line.rstrip()))
            if self.a.verbose or line.startswith("megascale launch:"):
                print(f"[{time.time() - self.t0:7.1f} s] {tag}{line.rstrip()[:300]}", flush=True)

    def running(self) -> bool:
        """Whether the job goes on: host 0's driver (the one holding the rendezvous) has not ended."""
        return self.agents[0].poll() is None

    def link_fault(self, h: int) -> str:
        """Host h's link down for --link-down-s, then up again (a thread brings it back)."""
        self.cluster.link_down(h)

        def later():
            time.sleep(self.a.link_down_s)
            self.cluster.link_up(h)
            print(f"[{time.time() - self.t0:7.1f} s] link of host {h} up again", flush=True)

        threading.Thread(target=later, daemon=True).start()
        return f"host {h}'s link down for {self.a.link_down_s:g} s"

    def host_fault(self, h: int) -> str:
        """Every process of host h SIGKILLed; its host memory gone; its pod started again 5 s later."""
        self.cluster.kill_host(h)
        shutil.rmtree(self._shm / f"host{h}", ignore_errors=True)

        def later():
            time.sleep(5)
            self._start(h)

        threading.Thread(target=later, daemon=True).start()
        return f"host {h} (agent and workers), started again in 5 s"

    def stop(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)  # a clean stop: the step in flight, a checkpoint
        for p in self.agents.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for t in self._threads:
            t.join(timeout=5)


def report(faults: list[dict], lines: list[tuple[float, str]], run: Path, wall: float, t0: float) -> None:
    recs = train_records(run)
    steps = {}
    for r in recs:  # a step re-done after a restart counts once: its last record
        steps[r["step"]] = r
    productive = sum(r["step_time"] for r in steps.values())
    for f in faults:
        hit = next((t for t, line in lines[f["lines_from"]:] if any(m in line for m in DETECTED)), None)
        f["detect_s"] = None if hit is None else hit - f["t"]
        # the first step to end after the driver saw it (a step already past its collectives when the
        # fault struck may still end on rank 0: that one is not "training again")
        after = first_step_after(run, f["t"] if hit is None else hit)
        f["first_step_s"] = None if after is None else after + (0.0 if hit is None else hit - f["t"])
        d = "not detected" if hit is None else f"detected in {f['detect_s']:.1f} s"
        s = ("no step after it" if f["first_step_s"] is None
             else f"training again after {f['first_step_s']:.1f} s")
        who = f"host {f['host']}" if "host" in f else f"rank {f['rank']}"
        print(f"fault at {f['t'] - t0:7.1f} s: {f['kind']} of {who}: {d}, {s}")
    for kind in sorted({f["kind"] for f in faults}):
        ds = [f["detect_s"] for f in faults if f["kind"] == kind and f["detect_s"] is not None]
        fs = [f["first_step_s"] for f in faults if f["kind"] == kind and f["first_step_s"] is not None]
        n = sum(f["kind"] == kind for f in faults)
        nan = float("nan")
        print(f"{kind}: {n} fault(s), detected {len(ds)}; detection median "
              f"{statistics.median(ds) if ds else nan:.1f} s (max {max(ds, default=nan):.1f}); "
              f"fault to first step median {statistics.median(fs) if fs else nan:.1f} s "
              f"(max {max(fs, default=nan):.1f})")
    print(f"run: {wall:.0f} s wall, {len(steps)} steps that count ({len(recs)} step records), {len(faults)} "
          f"fault(s); ETTR {100 * productive / wall:.1f}% (productive step time {productive:.0f} s / wall)")
    agents_view(run)
    restart_phases(lines, run)
    if steps:
        # a step slowed by the job's own machinery (snapshots, their replicas, persists) would count as
        # productive time: compare the mean step with a fault-free run's (--first 1e9) to see it
        times = [r["step_time"] for r in steps.values()]
        print(f"step time: mean {statistics.mean(times):.3f} s, median {statistics.median(times):.3f} s")


def agents_view(run: Path) -> None:
    """The report's ETTR, from the agents' event logs, and where the rest of the time went (ettr.py)."""
    from megascale.fault.events import read_events
    from megascale.observe.ettr import ettr_text, lost_text, lost_time

    events, recs = read_events(run), metric_records(run)
    kinds = {k: [r for r in recs if r.get("kind") == k]
             for k in ("train", "layout", "val", "checkpoint", "rollback")}
    if events and ettr_text(events, kinds["train"]):
        print(f"agents' view: {ettr_text(events, kinds['train'])}; {lost_text(lost_time(events, kinds))}")


def restart_phases(lines: list[tuple[float, str]], run: Path) -> None:
    """Where a restart's seconds went, medians over the run: the agents' phases (their `restart:` lines)
    and rank 0's start-up phases (the run's startup records after the first start)."""
    agent: dict[str, list[float]] = {}
    for _, line in lines:
        if "megascale launch: restart: " in line:
            for part in line.split("restart: ", 1)[1].split(" (round")[0].split(", "):
                name, secs, _ = part.rsplit(" ", 2)  # "workers started 0.01 s"
                agent.setdefault(name, []).append(float(secs))
    workers: dict[str, list[float]] = {}
    for r in [r for r in metric_records(run) if r.get("kind") == "startup"][1:]:
        for k, v in r.items():
            if k not in ("kind", "step", "time") and isinstance(v, (int, float)):  # time: when logged
                workers.setdefault(k, []).append(v)
    if agent:
        print("restart, agents (median s): "
              + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in agent.items()))
    if workers:
        print(f"restart, rank 0's start-up over {len(next(iter(workers.values())))} restarts (median s): "
              + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in workers.items()))


def first_step_after(run: Path, t: float) -> float | None:
    """Seconds from t to the first step record written after t (the run's metrics file has the wall time
    of each record only implicitly: the file is polled while the job runs, so use the trace instead)."""
    best = None
    for p in (run / "trace").glob("rank_00000.jsonl"):
        wall_at = None
        for line in p.read_text().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("type") == "header":
                wall_at = (obj["wall_ns"] / 1e9, obj["mono_ns"])  # maps this segment's clock to wall time
            elif isinstance(obj, list) and wall_at is not None and obj[0] == "optimizer":
                end = wall_at[0] + (obj[2] + obj[3] - wall_at[1]) / 1e9
                if end > t and (best is None or end < best):
                    best = end
    return None if best is None else best - t


if __name__ == "__main__":
    main()
