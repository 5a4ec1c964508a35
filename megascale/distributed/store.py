"""Which key-value store the ranks meet in (`distributed.store`), and opening it.

- "tcp": PyTorch's TCPStore with its libuv server (the default since torch 2.4). Under
  torchrun or `--nproc` the launcher's agent already runs one for the job, and the ranks
  use it; a job started by hand (MASTER_ADDR/MASTER_PORT, no agent) has rank 0 host it.
- "tcp-legacy": the TCPStore server of torch < 2.4, one thread polling all sockets. Rank 0
  hosts it (on MASTER_PORT without an agent, else on a free port it announces through the
  agent's store). Kept to measure against.
- "redis://host:port/db": a Redis server outside the job (`redis_store.RedisStore`): it
  serves many clients at once, outlives a crashed rank 0, and serves many jobs. Password
  from MEGASCALE_REDIS_PASSWORD.

Every store is scoped to one job and one attempt (restart), so a restarted job or another
job on the same store never reads a stale key: Redis by a key prefix, a shared TCPStore by a
PrefixStore.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

from megascale.errors import UserError


def job_identity(job_id: str = "") -> tuple[str, int]:
    """(job id, attempt): distributed.job_id, else the launcher's run id, else MASTER_ADDR:MASTER_PORT;
    and the rendezvous round or the launcher's restart count. Plain multi-node torchrun's run id is
    "none" for every job: that is no id (two such jobs on one Redis would read each other's keys)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id.lower() == "none":
        run_id = ""
    job = job_id or run_id or \
        f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '0')}"
    # the attempt: `megascale launch`'s rendezvous round, the same on every host (an agent's restart count
    # is its own: elastic restarts a healthy host for a joining one without counting it, and two rounds
    # with one count would share keys); else the launcher's restart count
    return job, int(os.environ.get("MEGASCALE_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def claim_job(store: dist.Store, job: str, attempt: int, rank: int) -> None:
    """Rank 0 marks this attempt of `job` as taken in a store that outlives jobs (Redis); a second job
    with the same id and attempt is refused with one line instead of reading the first one's keys."""
    if rank != 0:
        return
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    got = store.compare_set("owner", "", token)
    got = got.decode() if isinstance(got, bytes) else str(got)
    if got != token:
        raise UserError(f"distributed.job_id: job {job!r} attempt {attempt} already ran on this store "
                        f"(owner {got}); give this job its own distributed.job_id, or wait for the old "
                        "keys to expire")


def open_store(spec: str, rank: int, world_size: int, timeout: datetime.timedelta,
               job_id: str = "") -> tuple[dist.Store, str]:
    """The job's store for this rank, and a few words saying which it is (for the start-up log)."""
    if spec not in ("tcp", "tcp-legacy") and not spec.startswith("redis://"):
        raise UserError(f"distributed.store: must be tcp, tcp-legacy or redis://host:port/db, got {spec!r}")
    job, attempt = job_identity(job_id)
    if spec.startswith("redis://"):
        from megascale.distributed.redis_store import open_redis_store

        store = open_redis_store(spec, job_id=job, attempt=attempt, timeout=timeout)
        claim_job(store, job, attempt, rank)
        return store, f"redis at {store.address} (prefix {store.prefix})"

    host, port = os.environ.get("MASTER_ADDR", "localhost"), int(os.environ.get("MASTER_PORT", "0"))
    agent = _launcher_store(host, port, world_size, timeout)
    if spec == "tcp" and agent is not None:
        return dist.PrefixStore(f"megascale/{attempt}", agent), f"tcp (the launcher's, at {host}:{port})"
    libuv = spec == "tcp"
    kind = "libuv" if libuv else "legacy"
    if agent is None:  # no launcher store: rank 0 hosts ours on MASTER_PORT, as torch's env:// does
        try:
            fd = _loopback_listener(host, port)[0] if rank == 0 else None
            store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False,
                                  multi_tenant=True, use_libuv=libuv, master_listen_fd=fd)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"distributed.store: cannot open a TCPStore at {host}:{port} "
                            f"({str(e).splitlines()[0]})") from None
        return store, f"tcp-{kind} (hosted by rank 0 at {host}:{port})"
    # under a launcher: rank 0 hosts a second store on a free port and announces it in the first
    key = f"megascale/{attempt}/{kind}_store"
    if rank == 0:
        address = _my_address(host)
        fd, port = _loopback_listener(address, 0)
        store = dist.TCPStore(address, port, world_size, True, timeout=timeout, wait_for_workers=False,
                              use_libuv=libuv, master_listen_fd=fd)
        agent.set(key, f"{store.host}:{store.port}")
    else:
        where = agent.get(key).decode()
        store_host, store_port = where.rsplit(":", 1)
        store = dist.TCPStore(store_host, int(store_port), world_size, False, timeout=timeout,
                              use_libuv=libuv)
    return store, f"tcp-{kind} (hosted by rank 0 at {store.host}:{store.port})"


def _launcher_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE), which every worker joins as a client."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(host, port, world_size, False, timeout=timeout)


def _loopback_listener(host: str, port: int) -> tuple[int | None, int]:
    """(descriptor, port) of a socket listening on the loopback address only, when `host` is a loopback
    name or address, else (None, `port`); the TCPStore it is handed to owns the descriptor (and closes it
    when the store goes).

    TCPStore's server, given a host, still listens on every interface: a single-host job would
    take connections from the whole network. Handing it a socket bound to 127.0.0.1 (or ::1) keeps
    such a job's store on this machine; a multi-host job's store must listen where the others
    reach it, and does (the start-up log says where)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None, port
    loop = [i for i in infos if i[4][0] in ("127.0.0.1", "::1") or i[4][0].startswith("127.")]
    if not loop or len(loop) != len(infos):
        return None, port
    family, _, _, _, addr = loop[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr[:2])
        sock.listen(1024)
    except OSError:
        sock.close()
        return None, port  # the port is taken: TCPStore reports that itself, in its own words
    # Detached, not kept: TCPStore's server closes the descriptor it is given, so a Python socket still
    # holding it would close it a second time when collected, perhaps while the server still polls it
    # (CI: "Unexpected poll revent on the master's listening socket: 32", POLLNVAL, then SIGABRT at exit)
    # or after the number went to another file.
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def _my_address(master_addr: str) -> str:
    """Where the other ranks reach rank 0: the master address on one machine, else rank 0's hostname."""
    one_machine = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    return master_addr if one_machine else socket.getfqdn()
