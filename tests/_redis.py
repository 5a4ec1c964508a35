"""Real redis-server processes for the store tests (nothing mocked).

A test module imports the `*_fixture` functions and asks for the fixtures by their
names (`redis_server`, `redis_auth_server`, `redis_server_to_stop`).

Each server listens on a free loopback port, keeps nothing on disk (`--save ""`,
`--appendonly no`, its files in a temporary folder) and is stopped when its fixture ends.
`make test` installs Debian's redis-server; without it these tests fail, on purpose: a
skipped store test would let a broken store pass CI unseen.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

PASSWORD = "s3cret-for-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server child process; `url` is where it answers."""

    def __init__(self, workdir: Path, password: str | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: `make test` installs it "
                        "(apt-get install redis-server)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        for _ in range(3):  # another process may take the free port before the server binds it
            self.port = free_port()
            args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(workdir), "--daemonize", "no", "--loglevel", "warning"]
            if password:
                args += ["--requirepass", password]
            self.log = workdir / f"redis-{self.port}.log"
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            if self._wait_ready(timeout_s=10.0):
                return
            self.stop()
        pytest.fail(f"redis-server did not start; its log: {self.log.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with redis.Redis(port=self.port, password=self.password, socket_timeout=1) as r:
                    if r.ping():
                        return True
            except redis.RedisError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(name="redis_server", scope="module")
def redis_server_fixture(tmp_path_factory):
    """A server shared by a test module; tests keep apart by key prefix."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(name="redis_auth_server", scope="module")
def redis_auth_server_fixture(tmp_path_factory):
    """A server that wants the password `PASSWORD`."""
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    yield server
    server.stop()


@pytest.fixture(name="redis_server_to_stop")
def redis_server_to_stop_fixture(tmp_path):
    """A server of the test's own, which the test may stop."""
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()
