"""Warm worker starts: workers forked from a server that imported torch and megascale once.

A worker started as a new interpreter (`python -m megascale train`, torchrun's way) spends most
of its start-up importing: torch, torch._dynamo (every torch optimizer imports it) and megascale
take 2.2 s on an idle core, and 4 workers of a host importing at once on 2 cores took 3.9 s, half
of a whole restart after a crash (detection 0.6 s, rendezvous 1.2 s, imports 3.9 s, set-up and
self-check 1.0 s). With `fault.prefork_workers` the agent starts one server per host that imports
all that once, while the first rendezvous runs; each worker is then a fork of it.

Elastic still starts and watches a process per worker, as torchrun does: a stand-in
(prefork_shim.py, a Python with no site and no imports beyond the standard library, ~20 ms) that
hands the server its arguments, environment, directory and standard streams, and mirrors the fork:

* a signal to the stand-in (elastic's SIGTERM, a Ctrl-C forwarded by the agent) is passed on;
* the fork's exit is the stand-in's: the same code, or death by the same signal;
* the stand-in's death (elastic's SIGKILL of a restart) is the fork's: the server sees the
  connection close and SIGKILLs it, stopped (SIGSTOP) or not.

A fork of the server is a clean process: the server has imported modules and run nothing (no
thread, no process group, no OpenMP pool), so nothing of a previous generation is inherited; each
fork starts its own session, takes the stand-in's environment (variables read when a library
loads, such as OMP_NUM_THREADS, are the server's: the agent's own) and reseeds `random`.
Off (`fault.prefork_workers = false`), workers are new interpreters, as under torchrun.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback

# what a worker imports before its first step (DCP too: a restore from storage reads through it)
PRELOAD = ("torch._dynamo", "megascale.cli", "megascale.train", "megascale.fault.selfcheck",
           "megascale.checkpoint.dcp_io")
ENV = "MEGASCALE_PREFORK"  # the server's socket, for the stand-ins

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefork_shim.py")  # elastic starts it


class Server:
    """This host's prefork server (a process of its own session: the job's signals go to the workers
    through their stand-ins); it ends with the process that started it."""

    def __init__(self):
        _sweep_stale()
        self.dir = tempfile.mkdtemp(prefix=f"megascale-prefork-{os.getpid()}-")
        self.path = os.path.join(self.dir, "server.sock")
        # bound and listening before the server runs: a stand-in that comes while it starts and
        # imports waits in the backlog
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.path)
        listener.listen(64)
        alive_r, self._alive_w = os.pipe()  # EOF on alive_r: this process is gone
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve; serve({listener.fileno()}, {alive_r})"],
            pass_fds=(listener.fileno(), alive_r), start_new_session=True)
        listener.close()
        os.close(alive_r)

    def argv(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        """The arguments of sys.executable that run `python <argv>` (-m MODULE ... or -c CODE ...) as a
        fork of this server."""
        return ("-S", SHIM, *argv)

    def close(self) -> None:
        os.close(self._alive_w)
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _sweep_stale() -> None:
    """Remove the socket folders of servers whose agent died with them (a host killed whole leaves its
    folder: nobody ran close()). A folder is named after its agent's pid; a live pid keeps it."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "megascale-prefork-*-*")):
        pid = os.path.basename(folder).split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # another user's live agent
            pass


def serve(listen_fd: int, alive_fd: int) -> None:
    """The server: preload, then fork a worker per stand-in that connects, and report its end."""
    srv = socket.socket(fileno=listen_fd)
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the loop
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    sel.register(alive_fd, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    conns: dict[int, socket.socket] = {}  # worker pid -> its stand-in's connection
    mine = [srv.fileno(), alive_fd, wake_r, wake_w, sel.fileno()]
    while True:
        for key, _ in sel.select():
            if key.fileobj is srv:
                conn, _ = srv.accept()
                try:
                    pid = _fork(conn, [*mine, *(c.fileno() for c in conns.values())])
                    conn.sendall(f"{pid}\n".encode())
                except (OSError, ValueError) as e:  # a stand-in that died while asking, or garbage
                    print(f"megascale: prefork server: a request failed ({e})", file=sys.stderr)
                    conn.close()
                    continue
                conns[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj == alive_fd:  # the agent is gone: so are its workers, and the socket's folder
                for pid in conns:
                    _kill(pid)
                shutil.rmtree(os.path.dirname(srv.getsockname()), ignore_errors=True)
                # no interpreter teardown: with torch loaded it took ~1 s, which the agent (and a job's
                # end) waited for, and the server holds nothing that needs it
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
            elif key.data in conns and _closed(key.fileobj):  # its stand-in died: SIGKILLed by elastic
                sel.unregister(key.fileobj)
                _kill(key.data)
        while conns:  # report every worker that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = conns.pop(pid, None)
            if conn is not None:
                end = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exit {os.waitstatus_to_exitcode(status)}")
                with contextlib.suppress(OSError):  # its stand-in may be gone
                    conn.sendall(f"{end}\n".encode())
                with contextlib.suppress(KeyError):  # unregistered already if so
                    sel.unregister(conn)
                conn.close()


def _closed(conn: socket.socket) -> bool:
    """Whether a stand-in's connection has ended. A stand-in sends nothing after its request, so a
    readable connection is a closed one: an EOF, or a reset when it died with our reply unread (a unix
    socket's reset, which must not end the server and with it every worker of the host)."""
    try:
        return not conn.recv(1)
    except OSError:
        return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork(conn: socket.socket, server_fds: list[int]) -> int:
    """Read a stand-in's request from conn and fork its worker; the worker's pid (in the server)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    need = 8 + int.from_bytes(data[:8], "big")
    while len(data) < need:
        more = conn.recv(need - len(data))
        if not more:
            raise ConnectionError("the stand-in left before its request was whole")
        data += more
    req = json.loads(data[8:])
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:  # the worker
        os.setsid()
        for fd in [*server_fds, conn.fileno()]:
            os.close(fd)
        for i, fd in enumerate(fds):  # the stand-in's stdin, stdout, stderr
            os.dup2(fd, i)
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        code = _run(req["argv"])
    finally:
        os._exit(code)


def _run(argv: list[str]) -> int:
    """`python <argv>` (`-m MODULE ...` or `-c CODE ...`) as the interpreter would run and end it: its
    exit code, its exit handlers run, its streams flushed."""
    try:
        if argv[:1] == ["-m"] and len(argv) > 1:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[:1] == ["-c"] and len(argv) > 1:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - python -c
        else:
            raise SystemExit(f"megascale: prefork server: {argv[:1]}: only -m MODULE and -c CODE run here")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the traceback a new interpreter would print
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code
