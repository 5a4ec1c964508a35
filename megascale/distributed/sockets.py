"""Point-to-point messages over plain TCP sockets, for CPU jobs: `parallel.transport = "sockets"`.

Why. torch's gloo backend spends far more CPU on a message than its bytes need: the call goes
through gloo's work queue, its pair's "ready to receive" handshake and its event-loop thread
(strace of a 64-byte all-reduce between two ranks: ~28 futex calls and ~60 system calls each).
On a rank that shares its cores with the others (every CPU job) that CPU comes out of the
compute an overlap runs beside, which is why communication on CPU looked like compute. Here a
message is a header and a payload, written by one thread and read by another:
`benchmarks/transport.py` gives both transports' wall and CPU per exchange: over three runs
gloo took 1.3-3.7x our wall time and 1.1-3.8x our CPU for a direct all-gather of 4 KiB - 1 MiB
(wide swings between runs on a shared VM). The dp2 x pp2 x tp2 ablation's steps
(`benchmarks/ablation.py`) are 9-13% shorter on it (two rows, the transports back to back).

What it carries: the exchanges that are point-to-point underneath, the direct reduce-scatters
and all-gathers of DP and TP/SP (distributed/direct.py) and the pipeline's activations and
gradients, and the sums and maxima over a mesh's groups (`Mesh.all_reduce`: TP without SP, the tp
gradient syncs, the vocab-parallel loss, the grad norm, LAMB's norms, the tied embedding's gradient),
in one exchange where they are small or between two ranks, else as a direct reduce-scatter and
all-gather (`direct.all_reduce`; the latter 1.8-4x faster than gloo's all-reduce at 4 KiB - 1 MiB in
one run). The rest (barriers, broadcasts, the world group's step-end all-reduce) stays on gloo:
`p2p.py` routes a group's sends and receives here once `Mesh.build` has registered it.

Design.
- One connection per ordered pair of ranks, opened by the sender on its first message to that
  peer, so no two ranks race to open the same one. Messages of a pair arrive in send order.
- Every message is a 16-byte header, (key, length), and its bytes. The key is the group's
  channel and the message's tag; a receive posted for (source, key) takes that source's messages
  of that key in order, as gloo matches (peer, tag). A message that arrives before its receive
  is read into memory and copied once the receive is posted (MPI's unexpected-message queue):
  otherwise a receiver waiting for it would block every message behind it on the connection.
- A thread per outgoing connection writes the queued sends, so `isend` returns at once and the
  compute goes on while the bytes move.
- Who reads. A receive of up to _PULL_BYTES is read by the thread that waits for it: the kernel
  holds the bytes that arrive while the rank computes, and the wait takes them straight into the
  tensor (with the messages ahead of it on the connection, in order). Handing each message to a
  reader thread instead cost far more than the bytes: the reader is woken on the rank's core (an
  IPI from the sender's), takes the GIL, wakes the waiter; on a 2-core VM a 128 KiB all-gather
  took ~350 us of CPU that way against ~80 us for a raw send and receive by the main thread, and
  `benchmarks/overlap.py --dims tp`'s GEMMs ran 1.43-1.49x slower than with no communication,
  1.28-1.40x after (H 7.5-10.2% -> 10.7-33.2%, medians 9.3% -> 18.9%; 4 and 9 runs). Larger receives
  (DP's buckets) are read by the connection's reader thread as their bytes arrive, so they move
  during the compute whatever the socket buffers hold. An idle reader also looks now and then
  (_IDLE_CHECK_S) for what nobody has read since its last look (a message before its receive is
  posted), so that a sender is never held up for long by a full buffer.
- Failure: a connection that closes or errs fails every pending and later receive from (or send
  to) that peer, naming it, once a wait or the reader reads its end (a wait at once, the idle
  reader within _IDLE_CHECK_MAX_S). A wait takes the group's collective timeout, like gloo's, and
  fails with "timed out" (what observe/session.py reads as a hang); one that times out inside a
  message fails the connection, whose stream is then out of step.
- Addresses: a rank listens on the interface through which it reaches MASTER_ADDR, on a port the
  kernel picks, and publishes host:port in the job's store under a nonce rank 0 draws, so that a
  rank of an earlier attempt can neither be found nor connect (its hello names another nonce).
"""

from __future__ import annotations

import datetime
import functools
import os
import select
import socket
import struct
import threading
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist
from torch import Tensor

_HEADER = struct.Struct("<qq")  # key, payload bytes
_HELLO = struct.Struct("<qq")  # nonce, sender rank
_CONNECT_TIMEOUT_S = 60.0
# Receives up to this size are read by the thread that waits for them (see "Who reads" above); larger
# ones (DP's buckets) by the connection's reader as their bytes arrive, so that they move during compute
_PULL_BYTES = 512 * 1024
# How often an idle reader looks for a connection that has data nobody read since its last look (a
# message before its receive is posted: its sender may wait for room in the buffer): every 20 ms after
# it found one, backing off to 320 ms while it finds none (each look takes the GIL from the compute)
_IDLE_CHECK_S, _IDLE_CHECK_MAX_S = 0.02, 0.32


class TransportError(dist.DistBackendError):
    """A send or receive that failed or timed out; the message names the peer rank."""


# Guards a Handle's lazily made Event against its _finish (one lock for all: held for a few bytecodes)
_EVENTS = threading.Lock()


class Handle:
    """One send or receive in flight (the `Work` of this transport).

    Most finish before anybody waits for them, or in the waiting thread itself (a send written by its
    caller, a receive its wait reads), so the Event a blocked wait needs is made only then: making one
    (a Condition over a lock, in Python) cost ~3 us warm and several times that right after a GEMM,
    twice per exchange, on the compute thread."""

    __slots__ = ("op", "peer", "_done", "_event", "_error", "_keep", "_pull")

    def __init__(self, op: str, peer: int, keep: Tensor | None = None):
        self.op, self.peer, self._keep = op, peer, keep  # a send's tensor stays alive until written
        self._done, self._event, self._error = False, None, None
        self._pull = None  # a receive's: reads the connection in the waiting thread until this completes

    def _finish(self, error: str | None = None) -> None:
        with _EVENTS:
            if self._done:  # finished already (a failure racing a completion): the first one stands
                return
            self._error, self._keep, self._done = error, None, True
            event = self._event
        if event is not None:
            event.set()

    def is_completed(self) -> bool:
        return self._done

    def _wait_done(self, seconds: float | None) -> bool:
        if self._done:
            return True
        with _EVENTS:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(seconds)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if self._pull is not None and not self._done:
            done = self._pull(self, None if seconds is None else time.monotonic() + seconds)
        else:
            done = self._wait_done(seconds)
        if not done:
            raise TransportError(f"sockets transport: {self.op} with rank {self.peer} timed out after "
                                 f"{seconds:g} s")
        if self._error is not None:
            raise TransportError(f"sockets transport: {self.op} with rank {self.peer} failed: {self._error}")
        return True


def _bytes(t: Tensor, what: str) -> memoryview:
    """The tensor's memory as bytes, without a copy (so a receive lands in the tensor itself)."""
    if t.device.type != "cpu":
        raise ValueError(f"sockets transport: {what} tensor on {t.device}, only CPU tensors travel")
    if not t.is_contiguous():
        raise ValueError(f"sockets transport: {what} tensor must be contiguous")
    t = t.detach()
    try:  # two tensor ops, not four: ~1.4 us less a call (two calls an exchange)
        return memoryview(t.numpy()).cast("B")
    except TypeError:  # a dtype numpy lacks (bfloat16), or an empty tensor of several dimensions
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _read_into(sock: socket.socket, view: memoryview) -> None:
    # MSG_WAITALL: the kernel fills the whole view before it returns. A plain recv returns whatever has
    # arrived, which on a rate-limited link is a few segments: one Python iteration, and one take of the
    # GIL from the training thread, per segment (a blocking socket only; with a timeout it reads as usual)
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            raise ConnectionError("connection closed")
        got += k


def _read_until(sock: socket.socket, view: memoryview, deadline: float | None) -> int:
    """Fill `view` from the socket by `deadline` (time.monotonic; None: no limit); the bytes read, fewer
    only when the deadline passed. Whatever has arrived is taken without sleeping (MSG_DONTWAIT): the
    common case, a message that came during the compute a wait follows."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
        except BlockingIOError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return got
            try:
                select.select([sock], [], [], left)
            except ValueError as e:  # closed meanwhile (its descriptor is -1)
                raise ConnectionError("connection closed") from e
            continue
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return got


class _NotYet(Exception):
    """A wait's deadline passed before the connection's next message began (the stream is in step)."""


class _Desync(ConnectionError):
    """A wait's deadline passed in the middle of a message: the stream can no longer be read in step."""


class _Early:
    """A message that arrived before its receive was posted: read into memory, copied when claimed."""

    __slots__ = ("data", "complete", "claimed_by")

    def __init__(self, n: int):
        self.data = bytearray(n)
        self.complete = False
        self.claimed_by: tuple[memoryview, Handle] | None = None


def _deliver(data: bytearray, view: memoryview, handle: Handle) -> None:
    if len(data) != len(view):
        handle._finish(f"a message of {len(data)} bytes for a receive of {len(view)}")
        return
    view[:] = data
    handle._finish()


class _Outbound:
    """The connection to one peer and the thread that writes its queued sends in order.

    A send that finds the connection idle is written by its caller, as much as the socket takes
    without blocking (usually all of it): no thread hand-off, which costs more CPU than the write
    on a busy machine. The writer thread takes the rest, and everything queued behind it."""

    def __init__(self, transport: SocketTransport, peer: int):
        self.transport, self.peer = transport, peer
        self.queue: deque[tuple[bytes, memoryview, Handle]] = deque()  # (header left, payload left, op)
        self.cond = threading.Condition()
        self.error: str | None = None
        self.sock: socket.socket | None = None  # set once connected
        self.writing = False  # the writer thread is writing an item (outside the lock)
        threading.Thread(target=self._run, name=f"ms_send_{peer}", daemon=True).start()

    def put(self, key: int, view: memoryview, handle: Handle) -> None:
        head = _HEADER.pack(key, len(view))
        with self.cond:
            if self.error is not None:
                handle._finish(self.error)
                return
            if self.sock is not None and not self.queue and not self.writing:
                try:
                    sent = self.sock.sendmsg([head, view] if len(view) else [head], (), socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    sent = 0  # the writer thread meets the error again, and fails what is queued
                if sent == len(head) + len(view):
                    handle._finish()
                    return
                if sent < len(head):
                    head = head[sent:]
                else:
                    head, view = b"", view[sent - len(head):]
            self.queue.append((head, view, handle))
            self.cond.notify()

    def _run(self) -> None:
        t = self.transport
        current: Handle | None = None
        try:
            sock = t._connect(self.peer)
            with self.cond:
                self.sock = sock
            while True:
                with self.cond:
                    self.writing = False
                    while not self.queue and not t.closed:
                        self.cond.wait()
                    if t.closed:
                        break
                    head, view, current = self.queue.popleft()
                    self.writing = True
                if head:
                    sock.sendall(head)
                if len(view):
                    sock.sendall(view)
                current._finish()
                current = None
            self._fail("the transport was closed", None)
        except (OSError, ValueError, RuntimeError) as e:  # connection lost, peer gone, store timeout
            self._fail(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, current)

    def _fail(self, why: str, current: Handle | None) -> None:
        with self.cond:
            self.error = why if not self.transport.closed else "the transport was closed"
            failed = [h for _, _, h in self.queue]
            self.queue.clear()
        for h in ([current] if current is not None else []) + failed:
            h._finish(self.error)


class _Inbound:
    """What one peer has sent, or will: receives posted ahead, and messages that came first, per key;
    and its connection, read by one thread at a time (`reading`)."""

    def __init__(self, lock: threading.Lock):
        self.posted: defaultdict[int, deque[tuple[memoryview, Handle]]] = defaultdict(deque)
        self.early: defaultdict[int, deque[_Early]] = defaultdict(deque)
        self.error: str | None = None  # set once the peer's connection is gone: nothing more comes
        self.sock: socket.socket | None = None  # once the peer has connected
        self.reading = threading.Lock()  # held by the thread reading a message from the socket
        self.large = 0  # posted receives of more than _PULL_BYTES: the reader reads ahead for them
        self.reads = 0  # messages read from the connection so far (by anyone)
        self.changed = threading.Condition(lock)  # a large receive posted, the connection up or gone


class SocketTransport:
    """This process's end of the socket transport: `isend` and `irecv` by global rank and key."""

    def __init__(self, store: dist.Store, rank: int, world: int, nonce: int, address: str):
        self.rank, self.world, self.nonce, self.store = rank, world, nonce, store
        self.closed = False
        self._lock = threading.Lock()
        self._out: dict[int, _Outbound] = {}
        self._in: defaultdict[int, _Inbound] = defaultdict(lambda: _Inbound(self._lock))
        self._socks: list[socket.socket] = []
        self._priority: dict[int, int] = {}  # peer -> SO_PRIORITY of the connection to it (set_priority)
        self._listener = socket.create_server((address, 0), backlog=max(16, world))
        self._socks.append(self._listener)
        store.set(self._key(rank), f"{address}:{self._listener.getsockname()[1]}")
        threading.Thread(target=self._accept, name="ms_accept", daemon=True).start()

    def _key(self, rank: int) -> str:
        return f"sockets/{self.nonce}/{rank}"

    # ---- the operations

    def isend(self, tensor: Tensor, dst: int, key: int) -> Handle:
        view = _bytes(tensor, "send")
        handle = Handle("send", dst, tensor)
        with self._lock:
            out = self._out.get(dst)
            if out is None:
                out = self._out[dst] = _Outbound(self, dst)
        out.put(key, view, handle)
        return handle

    def irecv(self, tensor: Tensor, src: int, key: int) -> Handle:
        view = _bytes(tensor, "receive")
        handle = Handle("receive", src, tensor)
        with self._lock:
            inbound = self._in[src]
            handle._pull = functools.partial(self._pull, inbound, src)
            early = inbound.early[key].popleft() if inbound.early[key] else None
            if early is None:
                if inbound.error is not None:
                    handle._finish(inbound.error)
                else:
                    inbound.posted[key].append((view, handle))
                    if len(view) > _PULL_BYTES:
                        inbound.large += 1
                        inbound.changed.notify_all()
                return handle
            if not early.complete:  # still being read: whoever reads it delivers it
                if inbound.error is not None:  # ... unless its connection broke off inside it
                    handle._finish(inbound.error)
                else:
                    early.claimed_by = (view, handle)
                return handle
        _deliver(early.data, view, handle)
        return handle

    def set_priority(self, peer: int, priority: int) -> None:
        """Mark the connection to `peer` with SO_PRIORITY `priority`, now or when it opens (who gets
        which, and why: p2p.prioritise)."""
        with self._lock:
            self._priority[peer] = priority
            out = self._out.get(peer)
        if out is not None:
            with out.cond:
                if out.sock is not None:
                    out.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)

    # ---- connections

    def _connect(self, peer: int) -> socket.socket:
        where = self.store.get(self._key(peer)).decode()
        host, port = where.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks.append(sock)
            priority = self._priority.get(peer)
        if priority is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)
        sock.sendall(_HELLO.pack(self.nonce, self.rank))
        return sock

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._read, args=(sock,), name="ms_recv", daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        """The reader of one peer's connection: reads ahead for large receives, else drains now and then."""
        try:
            hello = bytearray(_HELLO.size)
            sock.settimeout(_CONNECT_TIMEOUT_S)
            _read_into(sock, memoryview(hello))
            nonce, src = _HELLO.unpack(hello)
            if nonce != self.nonce or not 0 <= src < self.world:
                sock.close()  # a rank of another job or attempt
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.append(sock)
                inbound = self._in[src]
                inbound.sock = sock
                inbound.changed.notify_all()  # a wait that came before the connection reads now
        except (OSError, ConnectionError):
            sock.close()
            return
        idle, seen = _IDLE_CHECK_S, -1
        try:
            while not self.closed and inbound.error is None:
                with self._lock:
                    if not inbound.large:  # nothing to read ahead for: sleep, not woken by what arrives
                        inbound.changed.wait(idle)
                    ahead = inbound.large > 0
                if ahead:  # wake at the first byte, read the message
                    if select.select([sock], [], [], None)[0]:
                        with inbound.reading:
                            if select.select([sock], [], [], 0)[0]:  # a wait may have read it meanwhile
                                self._read_message(inbound, src, sock, None)
                    continue
                stalled, seen = inbound.reads == seen, inbound.reads  # nobody read since the last look
                if not (stalled and select.select([sock], [], [], 0)[0]):
                    idle = min(2 * idle, _IDLE_CHECK_MAX_S)
                    continue
                idle = _IDLE_CHECK_S
                with inbound.reading:  # drain what is there: its sender goes on
                    while select.select([sock], [], [], 0)[0]:
                        self._read_message(inbound, src, sock, None)
            raise ConnectionError("the transport was closed")
        except (OSError, ValueError, ConnectionError) as e:  # ValueError: select on a closed socket
            self._peer_gone(inbound, src, None, e)  # a no-op if _read_message already did

    def _pull(self, inbound: _Inbound, src: int, handle: Handle, deadline: float | None) -> bool:
        """A receive's wait: read this peer's messages in this thread, in stream order, until `handle`
        completes; False if the deadline passed first. No thread hand-off: the reader is not woken."""
        while not handle.is_completed():
            with self._lock:
                while inbound.sock is None and inbound.error is None:  # the peer has not connected yet
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    inbound.changed.wait(left)
            if deadline is None:
                inbound.reading.acquire()
            else:
                left = deadline - time.monotonic()
                if left <= 0 or not inbound.reading.acquire(timeout=left):
                    return False
            try:
                if not handle.is_completed():
                    self._read_message(inbound, src, inbound.sock, deadline)
            except _NotYet:
                return False
            except ConnectionError as e:  # _read_message failed the receives on the connection ...
                if not handle.is_completed():  # ... this one too, unless nothing it read was for it
                    handle._finish(inbound.error or str(e))
            finally:
                inbound.reading.release()
        return True

    def _read_message(self, inbound: _Inbound, src: int, sock: socket.socket, deadline: float | None) -> None:
        """Read the connection's next message into its posted receive, or keep it as an early one.
        Holding inbound.reading. _NotYet: the deadline passed before the message began;
        ConnectionError: the connection is gone (or out of step), every receive on it failed."""
        early: _Early | None = None
        target: tuple[memoryview, Handle] | None = None
        try:
            header = bytearray(_HEADER.size)
            got = _read_until(sock, memoryview(header), deadline)
            if got == 0:
                raise _NotYet
            if got < len(header):
                raise _Desync("timed out in the middle of a message header")
            key, n = _HEADER.unpack(header)
            inbound.reads += 1  # under inbound.reading
            with self._lock:
                posted = inbound.posted.get(key)
                target = posted.popleft() if posted else None
                if target is None:
                    early = _Early(n)
                    inbound.early[key].append(early)
                elif len(target[0]) > _PULL_BYTES:
                    inbound.large -= 1
            if target is not None:
                view, handle = target
                if len(view) == n:
                    self._read_payload(sock, view, deadline)
                    handle._finish()
                else:  # read it anyway, the stream stays in step; the receive fails
                    self._read_payload(sock, memoryview(bytearray(n)), deadline)
                    handle._finish(f"a message of {n} bytes for a receive of {len(view)}")
                return
            self._read_payload(sock, memoryview(early.data), deadline)
            with self._lock:
                early.complete = True
                claimed = early.claimed_by
            if claimed is not None:  # its receive was posted while it was being read
                _deliver(early.data, *claimed)
        except (OSError, ConnectionError) as e:
            self._peer_gone(inbound, src, early, e, target[1] if target is not None else None)
            if isinstance(e, _Desync):
                sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionError(str(e)) from e

    @staticmethod
    def _read_payload(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
        if deadline is None:
            _read_into(sock, view)  # the kernel fills it: no Python loop per segment
        elif _read_until(sock, view, deadline) < len(view):
            raise _Desync("timed out in the middle of a message")

    def _peer_gone(self, inbound: _Inbound, src: int, early: _Early | None, e: Exception,
                   reading: Handle | None = None) -> None:
        """Fail every receive on this connection: those posted, the one being read (`reading`, or the
        one that claimed the early message being read), and any posted later."""
        why = "the transport was closed" if self.closed else f"connection from rank {src} lost ({e})"
        with self._lock:
            if inbound.error is None:
                inbound.error = why
            failed = [h for q in inbound.posted.values() for _, h in q]
            inbound.posted.clear()
            inbound.large = 0
            inbound.changed.notify_all()
            if early is not None and early.claimed_by is not None:
                failed.append(early.claimed_by[1])
        for h in failed + ([reading] if reading is not None and not reading.is_completed() else []):
            h._finish(inbound.error)

    def close(self) -> None:
        """Stop: every connection closed (the peers' waits on this rank fail at once), threads end."""
        self.closed = True
        with self._lock:
            socks, outs = list(self._socks), list(self._out.values())
            for inbound in self._in.values():
                inbound.changed.notify_all()
        for out in outs:
            with out.cond:
                out.cond.notify_all()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def local_address() -> str:
    """The address of the interface through which this host reaches MASTER_ADDR (a UDP socket's
    connect sends nothing: it only asks the kernel for the route), where the peers can reach us."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
