"""The stand-in that elastic starts for each worker of a prefork server (prefork.py), run as a script:

    python -S .../prefork_shim.py -m megascale train ...   (MEGASCALE_PREFORK: the server's socket)

No site, no package imports: it starts in ~20 ms. It hands the server its arguments, environment,
directory and standard streams, passes on every signal it gets to the worker the server forked, and
ends as the worker ended (the same exit code, or death by the same signal). If it is SIGKILLed, the
server sees its connection close and SIGKILLs the worker.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

def main() -> None:
    # Signals are caught from the first line: one that comes before the server has named the worker
    # (elastic's SIGTERM at a quick restart) is held and passed on once it has, rather than ending the
    # stand-in alone and leaving its worker to be SIGKILLed when the server sees the connection close.
    worker: list[int] = []
    held: list[int] = []

    def forward(n: int, _frame) -> None:
        if worker:
            os.kill(worker[0], n)
        else:
            held.append(n)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    where = os.environ["MEGASCALE_PREFORK"]
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(where)
    except OSError as e:
        sys.exit(f"megascale: the prefork server at {where} is gone ({e})")
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(s, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    replies = s.makefile("r")
    line = replies.readline()  # the worker's pid, once the server has preloaded and forked
    if not line:
        sys.exit(f"megascale: the prefork server at {where} ended before starting this worker")
    worker.append(int(line))
    for n in held:
        os.kill(worker[0], n)
    kind, _, n = replies.readline().partition(" ")
    if kind == "signal":  # die the same death, so elastic reads the same negative exit code
        if int(n) in FORWARDED:
            signal.signal(int(n), signal.SIG_DFL)
        os.kill(os.getpid(), int(n))
    sys.exit(int(n) if kind == "exit" else 1)


if __name__ == "__main__":
    main()
