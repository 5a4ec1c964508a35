"""A single-host job's TCPStore listens on the loopback address only (not on every interface)."""

import datetime
import socket
from pathlib import Path

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
