"""The prefork server (megascale/distributed/prefork.py): a worker forked from it behaves, to the process
that started its stand-in (elastic's agent), as a new interpreter would: its arguments, environment,
directory and streams; its exit code or death by signal; signals passed on; and it dies with its
stand-in, even stopped."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from megascale.distributed import prefork


@pytest.fixture(scope="module")
def server():
    s = prefork.Server()
    yield s
    s.close()


def start(server: prefork.Server, code: str, *args: str, **env: str) -> subprocess.Popen:
    """`python -c code args...` as a fork of the server, through its stand-in, as elastic starts it."""
    return subprocess.Popen([sys.executable, *server.argv(("-c", code, *args))],
                            env={**os.environ, prefork.ENV: server.path, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def gone(pid: int, within: float = 10.0) -> bool:
    end = time.time() + within
    while time.time() < end:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_worker_gets_its_stand_ins_arguments_environment_directory_and_streams(server, tmp_path):
    code = ("import os, sys; print(sys.argv[1:], os.environ['PREFORK_TEST'], os.getcwd(), "
            "os.getsid(0) == os.getpid(), 'torch' in sys.modules); print('to stderr', file=sys.stderr); "
            "sys.exit(3)")
    p = subprocess.Popen([sys.executable, *server.argv(("-c", code, "a", "b c"))], cwd=tmp_path,
                         env={**os.environ, prefork.ENV: server.path, "PREFORK_TEST": "yes"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    # its own session (signals reach it through the stand-in only) and torch imported already
    assert out.split("\n")[0] == f"['a', 'b c'] yes {tmp_path} True True"
    assert "to stderr" in err


def test_a_worker_killed_by_a_signal_is_a_stand_in_killed_by_it(server):
    p = start(server, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL


def test_an_uncaught_error_prints_its_traceback_and_exits_1(server):
    p = start(server, "raise ValueError('boom')")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "ValueError: boom" in err and "Traceback" in err


def test_sigterm_to_the_stand_in_reaches_the_worker(server):
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
            "print(os.getpid(), flush=True)\n"
            "time.sleep(60)\n")
    p = start(server, code)
    worker = int(p.stdout.readline())
    assert worker != p.pid
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 7


def caught(pid: int, sig: int) -> bool:
    """Whether process pid has a handler for sig (its SigCgt mask)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_signal_before_the_worker_exists_is_held_and_passed_on(server):
    # the server is stopped, so the stand-in waits for its worker's pid; elastic's SIGTERM comes then
    os.kill(server._proc.pid, signal.SIGSTOP)
    try:
        p = start(server, "import time; time.sleep(60)")
        end = time.time() + 30
        while not caught(p.pid, signal.SIGTERM):
            assert time.time() < end, "the stand-in never caught SIGTERM while it waited for its worker"
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert p.poll() is None, "the stand-in died alone, before its worker existed"
    finally:
        os.kill(server._proc.pid, signal.SIGCONT)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM  # the worker got it, died of it, and the stand-in mirrored that


def test_a_stand_in_that_dies_with_its_reply_unread_does_not_end_the_server(server):
    # a unix socket closed with unread data resets its peer: the server's read fails with ECONNRESET
    r, w = os.pipe()
    s = socket.socket(socket.AF_UNIX)
    s.connect(server.path)
    req = json.dumps({"argv": ["-c", "import time; time.sleep(60)"], "env": dict(os.environ),
                      "cwd": os.getcwd()}).encode()
    socket.send_fds(s, [len(req).to_bytes(8, "big") + req], [r, w, w])
    select.select([s], [], [], 60)
    worker = int(s.recv(64, socket.MSG_PEEK).split(b"\n")[0])  # a peek: the reply stays unread
    s.close()
    assert gone(worker), f"worker {worker} outlived its stand-in"
    p = start(server, "print('still serving')")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out == "still serving\n", err
    os.close(r)
    os.close(w)


def test_a_stopped_worker_dies_with_its_stand_in(server):
    p = start(server, "import os, time; print(os.getpid(), flush=True); time.sleep(60)")
    worker = int(p.stdout.readline())
    os.kill(worker, signal.SIGSTOP)  # a frozen worker: deaf to everything but SIGKILL
    os.killpg(p.pid, signal.SIGKILL)  # what elastic does to the stand-in's group at a restart
    p.wait(timeout=10)
    assert gone(worker), f"worker {worker} outlived its stand-in"


def test_a_server_whose_owner_was_killed_ends_and_leaves_nothing(tmp_path):
    code = ("import sys, time; from megascale.distributed import prefork; s = prefork.Server(); "
            "print(s.dir, s._proc.pid, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    folder, server = owner.stdout.readline().split()
    owner.kill()  # SIGKILL: no close(), as when a host's agent dies
    owner.wait()
    assert gone(int(server), within=30), "the server outlived its owner"
    assert not os.path.exists(folder)


def test_the_next_server_sweeps_the_folder_of_one_killed_with_its_agent(tmp_path):
    # a host killed whole: agent and server both SIGKILLed, nobody removes the socket's folder
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"megascale-prefork-{dead.pid}-")
    open(os.path.join(stale, "server.sock"), "w").close()
    s = prefork.Server()
    try:
        assert not os.path.exists(stale)
        assert os.path.exists(s.dir)  # its own, named after a live pid (this one)
    finally:
        s.close()


def test_the_server_ends_with_its_owner_and_a_late_stand_in_says_so(tmp_path):
    s = prefork.Server()
    proc = s._proc
    s.close()
    assert proc.poll() is not None
    assert not os.path.exists(s.dir)
    p = subprocess.run([sys.executable, *s.argv(("-c", "pass"))], env={**os.environ, prefork.ENV: s.path},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert f"the prefork server at {s.path} is gone" in p.stderr
