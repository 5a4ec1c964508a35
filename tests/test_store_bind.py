"""A single-host job's TCPStore listens on the loopback address only (not on every interface); job ids
that are no ids (plain torchrun's "none") are not used; a second job with the same id and attempt on
a shared Redis is refused."""

import datetime
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _redis import redis_server_fixture  # noqa: F401 - the fixture is found by its name

from megascale.distributed.store import open_store


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} give them) with a socket listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if int(p, 16) == port and state == "0A":  # 0A: LISTEN
                out.add(addr)
    return out


def test_rank0_store_binds_loopback(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store, words = open_store("tcp", 0, 1, datetime.timedelta(seconds=10))
    try:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or ::
    finally:
        del store


_EXIT_WITH_A_CLIENT = textwrap.dedent("""
    import datetime, sys, threading, time
    import torch.distributed as dist
    from megascale.distributed.store import open_store
    store, _ = open_store(sys.argv[1], 0, 2, datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, False, timeout=datetime.timedelta(seconds=10))
    client.set("x", "1")
    def hang_up():  # the client leaves while the interpreter is shutting down, as a peer rank does
        global client
        time.sleep(0.001)
        del client
    threading.Thread(target=hang_up).start()
""")


@pytest.mark.parametrize("spec", ["tcp", "tcp-legacy"])
def test_rank0_store_exits_cleanly_while_a_client_hangs_up(spec):
    """The listening descriptor has one owner, the store: a Python socket that also held it closed it
    at exit while the legacy server still polled it, and the process died of SIGABRT (POLLNVAL,
    "Unexpected poll revent on the master's listening socket"), failing a job that had finished."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_CLIENT, spec, str(port)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "revent" not in proc.stderr, proc.stderr[-2000:]


def test_plain_torchrun_run_id_none_is_no_job_id(monkeypatch):
    from megascale.distributed.store import job_identity

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default rdzv id, the same for every job
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_identity()[0] == "10.1.2.3:29500"
    assert job_identity("mine")[0] == "mine"


def test_a_second_job_with_the_same_id_is_refused_on_redis(redis_server, monkeypatch):
    import uuid

    import pytest

    from megascale.errors import UserError

    job = f"job-{uuid.uuid4().hex[:8]}"
    spec = redis_server.url
    first, _ = open_store(spec, 0, 2, datetime.timedelta(seconds=10), job)
    with pytest.raises(UserError, match=f"job {job!r} attempt 0 already ran on this store"):
        open_store(spec, 0, 2, datetime.timedelta(seconds=10), job)
    other, _ = open_store(spec, 0, 2, datetime.timedelta(seconds=10), job + "-b")  # its own id: fine
    other.set("k", "v")
