"""`megascale train --nproc N`: start N local worker processes through torch's elastic launcher.

This is torchrun's own machinery (`torch.distributed.launcher.api.elastic_launch`), not a
home-made process manager: the same rendezvous, environment variables and failure handling
as `torchrun --nproc-per-node N -m megascale train ...`.

Exit codes: 0 when every worker succeeded; 2 when the workers stopped on a user error (the
workers agree on it and rank 0 printed it, once); 128 + n when the job was stopped by signal
n (the agent forwards SIGINT/SIGTERM to the workers, which finish their step and save);
otherwise the largest worker exit code, with torch's failure report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator

from megascale.errors import UserError

# Exit codes of a worker that ended as asked: a user error every rank reports alike (2), a stop by
# SIGINT or SIGTERM after the step and the save (130, 143: every rank agreed on it, train.py). Its peers
# end the same way by themselves.
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)
ORDERLY = {0, 2, *STOPPED}


def kill_the_rest_after_a_failure(pcontext, failed: Callable[[int], bool] = lambda code: code != 0) -> int:
    """When a worker has failed, SIGKILL the others before elastic sees it; the number killed.

    Elastic stops the rest with SIGTERM and waits up to 30 s: a worker stuck in a collective (its peer
    gone, its link down) or stopped does not act on SIGTERM, and the job's end or restart waited the
    whole grace. The state worth keeping is in host memory and storage already. A worker "failed" if
    it died by a signal or `failed(exit code)`. The exits are only peeked at (WNOWAIT): elastic reaps
    and reports them as before."""
    if pcontext is None:  # no workers running
        return 0
    alive, failure = [], False
    for pid in pcontext.pids().values():
        try:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            continue
        if ended is None:
            alive.append(pid)
        elif ended.si_code != os.CLD_EXITED or failed(ended.si_status):
            failure = True
    if not (failure and alive):
        return 0
    for pid in alive:  # each worker leads a session of its own (elastic starts it so)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    return len(alive)


@contextlib.contextmanager
def elastic_agent(cls) -> Iterator[None]:
    """elastic_launch builds a LocalElasticAgent by name; for the calls inside, it builds `cls`."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    api.LocalElasticAgent = cls
    try:
        yield
    finally:
        api.LocalElasticAgent = original


def _local_agent_class():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class LocalAgent(LocalElasticAgent):
        """torchrun's agent, except that a failed worker's peers are killed at once, not after 30 s."""

        def _monitor_workers(self, worker_group):
            kill_the_rest_after_a_failure(getattr(self, "_pcontext", None), lambda c: c not in ORDERLY)
            return super()._monitor_workers(worker_group)

    return LocalAgent


def launch_local(nproc: int, argv: list[str], prefork_workers: bool = False) -> int:
    """Run `python -m megascale <argv>` on `nproc` local processes; 0 if all succeeded. With
    `prefork_workers` each is a fork of one server that imported torch and megascale once (prefork.py),
    as `megascale launch`'s are: N workers importing at once took ~9 s of an 8-rank job on 2 cores."""
    if nproc < 1:
        raise UserError(f"--nproc: must be >= 1, got {nproc}")
    # torchrun's default: one thread per worker unless told otherwise (N workers x all cores each
    # would oversubscribe the machine); split the cores when there are more than workers. Set before
    # the prefork server starts: its forks keep the OpenMP pool size it loaded torch with.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    server = None
    if prefork_workers:  # before this process imports torch: the server's imports run beside its own
        from megascale.distributed import prefork

        server = prefork.Server()
        os.environ[prefork.ENV] = server.path
    try:
        return _launch_local(nproc, server.argv(("-m", "megascale", *argv)) if server else
                             ("-m", "megascale", *argv))
    finally:
        if server is not None:
            server.close()


def _launch_local(nproc: int, argv: tuple[str, ...]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"megascale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
    )
    # The agent logs its start-up and every worker's exit at WARNING/ERROR (each of its loggers
    # sets its own level, so only a global switch quiets them): a user error is reported by rank 0
    # itself, a signal by the exit code, and any other failure by the report printed below.
    logging.disable(logging.ERROR)
    try:
        with elastic_agent(_local_agent_class()):
            elastic_launch(config, entrypoint=sys.executable)(*argv)
    except ChildFailedError as e:
        by_rank = {rank: f.exitcode for rank, f in e.failures.items()}
        codes = set(by_rank.values())
        # A user error on every rank: rank 0 printed it and exited first (the others wait a
        # moment), and the agent may have stopped the rest (a negative code: killed by a signal).
        if by_rank.get(0) == 2 and all(c == 2 or c < 0 for c in codes):
            return 2
        signalled = {c for c in codes if c > 128}
        if signalled and codes <= signalled:
            return max(signalled)
        print(e.format_msg(), file=sys.stderr)
        return max(codes) if max(codes) > 0 else 1
    except SignalException as e:  # the agent was signalled; it has forwarded it and waited
        return 128 + int(e.sigval)
    finally:
        logging.disable(logging.NOTSET)
    return 0
