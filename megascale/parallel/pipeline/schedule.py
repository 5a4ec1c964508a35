"""Pipeline schedules as pure lists of operations, and a unit-cost simulator to check them.

A schedule is, per pipeline rank, the order in which it runs forward (F) and backward (B)
passes of (micro-batch, model chunk). Writing it as data, not as control flow, lets the
tests compare it with Megatron-Core's schedules without processes, lets the simulator prove
it free of deadlock before a single message is sent, and leaves the executor
(`pipeline.py`) one loop that serves every schedule.

* "afab": all forwards, then all backwards (GPipe). The reference: the simplest correct
  order, and the most activation memory (m micro-batches in flight).
* "1f1b": PipeDream-flush / Megatron's non-interleaved schedule. Rank r runs pp - r - 1
  warm-up forwards, then alternates one forward and one backward, then drains the
  backwards. Same bubble as afab, (p - 1) / (m + p - 1), but at most pp micro-batches of
  activations alive.
* "interleaved": Megatron's interleaved 1F1B (Narayanan et al. 2021). Each rank holds vpp
  non-adjacent chunks (chunk c of rank r is virtual stage c * pp + r), so a micro-batch
  crosses the ranks vpp times and the bubble shrinks to (p - 1) / (v m + p - 1), for vpp
  times more point-to-point messages.

`recv_plan` turns a rank's op list into when each receive is posted (parallel.pp_overlap):
ahead of the op that takes it, in an order both ends of every channel share.

`ahead` (parallel.pp_warmup_ahead) gives every 1F1B rank but the last that many more warm-up forwards.
In 1F1B's steady phase a rank runs its next forward only after the backward before it, which needs the
gradient of an earlier micro-batch from downstream: so the activation the next stage waits for leaves
one round trip late (activation out, the forward and backward downstream, the gradient back), and on a
slow link the downstream ranks wait for it in every steady step. One forward more in hand and that
activation has left already: the links' latency leaves the steady phase (it stays in the warm-up and
cool-down). The price is that many more micro-batches of activations on those ranks; the order of the
backwards, and so the gradients, is unchanged.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

SCHEDULES = ("afab", "1f1b", "interleaved")


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


def afab(pp: int, rank: int, m: int, vpp: int = 1) -> list[Op]:
    """All forwards chunk by chunk, then all backwards in reverse chunk order."""
    fwd = [Op("F", mb, c) for c in range(vpp) for mb in range(m)]
    bwd = [Op("B", mb, c) for c in reversed(range(vpp)) for mb in range(m)]
    return fwd + bwd


def _ahead(pp: int, rank: int, ahead: int) -> int:
    """The extra warm-up forwards of `rank`: none on the last, which has nobody to run ahead of."""
    return ahead if rank < pp - 1 else 0


def one_f_one_b(pp: int, rank: int, m: int, ahead: int = 0) -> list[Op]:
    """Megatron's forward_backward_pipelining_without_interleaving, as an op list."""
    warmup = min(pp - rank - 1 + _ahead(pp, rank, ahead), m)
    ops = [Op("F", mb) for mb in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i), Op("B", i)]
    return ops + [Op("B", mb) for mb in range(m - warmup, m)]


def interleaved_warmup(pp: int, rank: int, m: int, vpp: int) -> int:
    """Warm-up forwards of rank r: enough for the first backward to find its inputs ready.

    With m == pp everything is warm-up (Megatron's all_warmup_microbatches): the steady
    phase would have no forward left to pair with a backward.
    """
    total = m * vpp
    if m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def interleaved_op(k: int, pp: int, vpp: int, forward: bool) -> Op:
    """The k-th forward (or backward) of a rank: Megatron's micro-batch -> model-chunk mapping.

    Micro-batches go in groups of pp: each group runs through chunk 0, then chunk 1, ...
    (backwards: the last chunk first), so a rank always has pp micro-batches' worth of work
    in a chunk before it needs the previous chunk's result from the last rank.
    """
    in_group = k % (pp * vpp)
    chunk = in_group // pp
    microbatch = (k // (pp * vpp)) * pp + k % pp
    return Op("F" if forward else "B", microbatch, chunk if forward else vpp - 1 - chunk)


def interleaved(pp: int, rank: int, m: int, vpp: int) -> list[Op]:
    """Megatron's forward_backward_pipelining_with_interleaving, as an op list (m % pp == 0)."""
    total, warmup = m * vpp, interleaved_warmup(pp, rank, m, vpp)
    ops = [interleaved_op(k, pp, vpp, True) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [interleaved_op(k + warmup, pp, vpp, True), interleaved_op(k, pp, vpp, False)]
    return ops + [interleaved_op(k, pp, vpp, False) for k in range(total - warmup, total)]


def schedule_ops(name: str, pp: int, rank: int, m: int, vpp: int = 1, ahead: int = 0) -> list[Op]:
    """The op list of one rank; the arguments are checked by `pipeline.stage.check_pipeline`.
    `ahead`: extra warm-up forwards of 1f1b (module doc). afab runs every forward first anyway, and the
    interleaved warm-up already runs pp - rank - 1 forwards ahead of the minimum (Megatron's)."""
    if name == "afab":
        return afab(pp, rank, m, vpp)
    if name == "1f1b":
        return one_f_one_b(pp, rank, m, ahead)
    if name == "interleaved":
        return interleaved(pp, rank, m, vpp)
    raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")


def theoretical_bubble(pp: int, m: int, vpp: int = 1) -> float:
    """Idle fraction of an ideal pipeline (equal stages, free communication): (p-1) / (v m + p - 1)."""
    return (pp - 1) / (vpp * m + pp - 1)


def simulate(name: str, pp: int, m: int, vpp: int = 1, f: float = 1.0, b: float = 2.0, ahead: int = 0
             ) -> float:
    """Run the schedule with unit costs (F takes f, B takes b, messages are free); the idle fraction.

    Every rank does the same work (m * vpp forwards and backwards of equal chunks), so the
    idle fraction of each is 1 - work / makespan; with f and b per whole stage it equals
    `theoretical_bubble` for these schedules.

    Raises RuntimeError on a deadlock (no rank can run its next op), and when a channel's
    messages would be received in another order than they were sent: the executor matches
    messages per (sender, receiver, direction) in order, as NCCL and gloo do.
    """
    done = timeline(name, pp, m, vpp, f, b, ahead)
    _check_message_order([schedule_ops(name, pp, r, m, vpp, ahead) for r in range(pp)], pp, vpp)
    return 1.0 - m * vpp * (f + b) / max(done.values())


def timeline(name: str, pp: int, m: int, vpp: int = 1, f: float = 1.0, b: float = 2.0, ahead: int = 0
             ) -> dict[tuple[str, int, int], float]:
    """When each (kind, microbatch, virtual stage) finishes under unit costs, messages free.

    Raises RuntimeError on a deadlock (no rank can run its next op)."""
    ops = [schedule_ops(name, pp, r, m, vpp, ahead) for r in range(pp)]
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> finish time
    clock, pos = [0.0] * pp, [0] * pp
    while any(pos[r] < len(ops[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(ops[r]):
                continue
            op = ops[r][pos[r]]
            vs = op.chunk * pp + r
            if op.kind == "F":
                deps = [("F", op.microbatch, vs - 1)] if vs > 0 else []
            else:
                deps = [("F", op.microbatch, vs)] + ([("B", op.microbatch, vs + 1)] if vs < last else [])
            if all(d in done for d in deps):
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + (f if op.kind == "F" else b)
                done[(op.kind, op.microbatch, vs)] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(ops[r][pos[r]]) for r in range(pp) if pos[r] < len(ops[r])}
            raise RuntimeError(f"{name} pp={pp} m={m} vpp={vpp}: deadlock, waiting ops {stuck}")
    return done


def received(op: Op, pp: int, rank: int, vpp: int) -> str | None:
    """The stream an op of `rank` receives on: "F" (its input, from the previous rank), "B" (its
    output's gradient, from the next rank), or None (the first / last virtual stage has neither)."""
    vs, last = op.chunk * pp + rank, pp * vpp - 1
    if op.kind == "F":
        return "F" if vs > 0 else None
    return "B" if vs < last else None


def sent(op: Op, pp: int, rank: int, vpp: int) -> str | None:
    """The stream an op of `rank` sends on: "F" (its output, to the next rank), "B" (its input's
    gradient, to the previous rank), or None."""
    vs, last = op.chunk * pp + rank, pp * vpp - 1
    if op.kind == "F":
        return "F" if vs < last else None
    return "B" if vs > 0 else None


def peer(stream: str, rank: int, pp: int, sending: bool) -> int:
    """The pipeline rank a stream's message goes to (sending) or comes from: F flows to rank + 1."""
    return (rank + (1 if (stream == "F") == sending else -1)) % pp


def _check_message_order(ops: list[list[Op]], pp: int, vpp: int) -> None:
    """Every channel (src, dst, kind) carries its messages in the order the receiver consumes them."""
    sent_on: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    received_on: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    step = {"F": 1, "B": -1}  # the virtual stage a stream's message is for, from the sender's
    for r, rank_ops in enumerate(ops):
        for op in rank_ops:
            vs = op.chunk * pp + r
            if s := sent(op, pp, r, vpp):
                sent_on.setdefault((r, peer(s, r, pp, True), s), []).append((op.microbatch, vs + step[s]))
            if s := received(op, pp, r, vpp):
                received_on.setdefault((peer(s, r, pp, False), r, s), []).append((op.microbatch, vs))
    if sent_on != received_on:
        bad = sorted(k for k in sent_on.keys() | received_on.keys() if sent_on.get(k) != received_on.get(k))
        raise RuntimeError(f"messages would be matched out of order on channels {bad}")


# ---- when to post each receive (pp_overlap)


@dataclass(frozen=True)
class Prefetch:
    """The receives one op posts, as streams in posting order (the k-th post of a stream is its k-th
    message): `before` ahead of the op's own wait and compute, `before_send` ahead of its send."""

    before: tuple[str, ...] = ()
    before_send: tuple[str, ...] = ()


@functools.lru_cache(maxsize=64)
def recv_plan(name: str, pp: int, rank: int, m: int, vpp: int = 1, depth: int = 1, ahead: int = 0
              ) -> tuple[Prefetch, ...]:
    """Per op of `rank`, the receives to post: each stream keeps `depth` posted beyond the one being
    consumed (MegaScale's prefetch: the next message's receive goes out as soon as the previous one
    is taken, so it lands during the compute in between), in an order both ends of every channel share.

    The order matters where a channel carries both directions, pp = 2 interleaved (the previous rank
    is the next one): NCCL runs a communicator's sends and receives one after another, so a receive
    posted before a send its peer waits for is a deadlock. Each channel's messages are ordered by
    when the unit-cost `timeline` sends them (ties: the lower sender first), the same list on both
    ends, and a rank issues its sends and receives in that order: a receive that would come too early
    waits for the send before it, a send first posts the receives before it. Everywhere else a
    channel has one direction and the order is just the receives'.
    """
    ops = schedule_ops(name, pp, rank, m, vpp, ahead)
    order = _channel_order(name, pp, rank, m, vpp, ops, ahead)
    posted, taken = dict.fromkeys("FB", 0), dict.fromkeys("FB", 0)
    total = {s: sum(received(op, pp, rank, vpp) == s for op in ops) for s in "FB"}

    def post(s: str, into: list[str]) -> None:
        ch = order[(s, peer(s, rank, pp, False))]
        if not ch or ch[0] != "R":
            raise RuntimeError(f"{name} pp={pp} rank={rank}: receive {s}{posted[s]} out of channel order")
        ch.popleft()
        posted[s] += 1
        into.append(s)

    plan = []
    for op in ops:
        before: list[str] = []
        if s := received(op, pp, rank, vpp):
            while posted[s] <= taken[s]:  # not posted ahead (depth 0, or the channel held it back)
                post(s, before)
            taken[s] += 1
        for s in "FB":  # prefetch
            ch = order.get((s, peer(s, rank, pp, False)))
            while posted[s] - taken[s] < depth and posted[s] < total[s] and ch[0] == "R":
                post(s, before)
        before_send: list[str] = []
        if s := sent(op, pp, rank, vpp):
            ch = order[(s, peer(s, rank, pp, True))]
            while ch[0] == "R":  # receives the peer sends first: posted ahead of this send
                post(s, before_send)
            ch.popleft()
        plan.append(Prefetch(tuple(before), tuple(before_send)))
    return tuple(plan)


def _channel_order(name: str, pp: int, rank: int, m: int, vpp: int, ops: list[Op], ahead: int = 0
                   ) -> dict[tuple[str, int], collections.deque[str]]:
    """This rank's sends ("S") and receives ("R") on each channel (stream, peer), in the channel's order."""
    done = timeline(name, pp, m, vpp, ahead=ahead)
    step = {"F": -1, "B": 1}  # the sender's virtual stage, from the receiver's
    events: dict[tuple[str, int], list[tuple[float, int, str]]] = collections.defaultdict(list)
    for op in ops:
        vs = op.chunk * pp + rank
        if s := sent(op, pp, rank, vpp):
            events[(s, peer(s, rank, pp, True))].append((done[(op.kind, op.microbatch, vs)], rank, "S"))
        if s := received(op, pp, rank, vpp):
            src = peer(s, rank, pp, False)
            events[(s, src)].append((done[(op.kind, op.microbatch, vs + step[s])], src, "R"))
    return {ch: collections.deque(kind for *_, kind in sorted(evs)) for ch, evs in events.items()}
