"""Event simulation of one training step of a pipeline: 1F1B and interleaved 1F1B.

Each pipeline rank runs its forward (F) and backward (B) passes in the order Megatron-LM's
schedules issue them (warm-up forwards, then one-forward-one-backward, then cool-down
backwards; the interleaved schedule cycles through its `v` model chunks in groups of `p`
micro-batches). An op starts when its rank is free and its inputs have arrived:

    F(stage j, mb i) needs F(stage j-1, mb i) plus a point-to-point transfer if on another rank
    B(stage j, mb i) needs B(stage j+1, mb i) (plus transfer) and F(stage j, mb i)

Point-to-point transfers are on the timeline. With `async_p2p` (MegaScale's decoupled
send/receive) the sender hands the tensor off and continues; without it (Megatron-LM's
batched, blocking exchange) the sending rank is held for the transfer as well.

Data-parallel traffic runs on a separate stream per rank: with `dp_overlap` each chunk's
parameter all-gather is prefetched back to back from the start of the step (the first one
hidden behind data loading) and a chunk's first forward waits only for its own gather;
each chunk's gradient reduce-scatter starts as soon as that chunk's last backward is done,
overlapping the backward of the chunks still running. Without it the all-gathers precede
the first forward and the reduce-scatters follow the last backward, fully exposed.

With no communication and equal stage times the simulated bubble is exactly the closed
form (p - 1) / (v * m + p - 1); the tests check that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megascale.errors import UserError


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    chunk: int  # model chunk on this rank, 0..v-1
    mb: int  # micro-batch


@dataclass
class PipelineSpec:
    p: int
    v: int
    m: int
    fwd: list[float]  # per virtual stage (chunk * p + rank), seconds of compute (TP included)
    bwd: list[float]
    p2p: list[float] = field(default_factory=list)  # seconds of a transfer rank r -> r+1 (mod p)
    async_p2p: bool = True
    dp_ag: list[float] = field(default_factory=list)  # per chunk, seconds of the parameter all-gather
    dp_rs: list[float] = field(default_factory=list)  # per chunk, seconds of the gradient reduce-scatter
    dp_overlap: bool = True
    ahead: int = 0  # 1F1B: extra warm-up forwards on every rank but the last (parallel.pp_warmup_ahead)


@dataclass
class Event:
    rank: int
    kind: str  # "F", "B", "AG", "RS"
    chunk: int
    mb: int
    start: float
    end: float


@dataclass
class Timeline:
    events: list[Event]
    makespan: float  # end of the last compute or DP communication on any rank
    compute_end: float  # end of the last F/B on any rank
    busy: list[float]  # seconds of F/B compute per rank


def schedule(p: int, v: int, m: int, rank: int, ahead: int = 0) -> list[Op]:
    """Megatron-LM's op order on `rank` for 1F1B (v = 1) or interleaved 1F1B (v > 1); `ahead` more
    1F1B warm-up forwards on every rank but the last (parallel.pp_warmup_ahead)."""
    if v == 1:
        warm = min(p - rank - 1 + (ahead if rank < p - 1 else 0), m)
        ops = [Op("F", 0, i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", 0, warm + i), Op("B", 0, i)]
        ops += [Op("B", 0, i) for i in range(m - warm, m)]
        return ops
    if m % p:
        raise UserError(f"interleaved schedule: {m} micro-batches must be a multiple of pp={p}")
    total = m * v

    def fwd(k: int) -> Op:
        return Op("F", (k // p) % v, (k // (p * v)) * p + k % p)

    def bwd(k: int) -> Op:
        return Op("B", v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)

    # with m == p everything is warm-up (Megatron's all_warmup_microbatches), as the runtime runs it
    warm = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        ops += [fwd(warm + i), bwd(i)]
    ops += [bwd(k) for k in range(total - warm, total)]
    return ops


def max_inflight(ops: list[Op]) -> int:
    """Most chunk-micro-batches whose activations a rank holds at once (forward done, backward not)."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(spec: PipelineSpec, keep_events: bool = False) -> Timeline:
    p, v, m = spec.p, spec.v, spec.m
    nstages = p * v
    if len(spec.fwd) != nstages or len(spec.bwd) != nstages:
        raise ValueError(f"need {nstages} per-stage times, got {len(spec.fwd)} / {len(spec.bwd)}")
    p2p = spec.p2p or [0.0] * p
    ag = spec.dp_ag or [0.0] * v
    rs = spec.dp_rs or [0.0] * v
    queues = [schedule(p, v, m, r, spec.ahead if v == 1 else 0) for r in range(p)]
    ptr = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    f_end: dict[tuple[int, int], float] = {}  # (virtual stage, mb) -> end of that forward on its rank
    f_out: dict[tuple[int, int], float] = {}  # ... -> when its output has reached the next stage
    b_out: dict[tuple[int, int], float] = {}  # (virtual stage, mb) -> when its input-gradient has arrived
    events: list[Event] = []

    # Parameter all-gathers: when is chunk c's full parameter set present on a rank?
    ag_ready = [0.0] * v
    if spec.dp_overlap:
        t = 0.0
        for c in range(v):  # chunk 0's gather overlaps data loading; the rest are prefetched in order
            ag_ready[c] = 0.0 if c == 0 else t + ag[c]
            t = ag_ready[c]
        free = [0.0] * p
    else:
        start = sum(ag)
        ag_ready = [start] * v
        free = [start] * p
    last_b = [[0.0] * v for _ in range(p)]

    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(p):
            while ptr[r] < len(queues[r]):
                op = queues[r][ptr[r]]
                vs = op.chunk * p + r
                if op.kind == "F":
                    if vs == 0:
                        ready = ag_ready[op.chunk]
                    else:
                        prev = f_out.get((vs - 1, op.mb))
                        if prev is None:
                            break
                        ready = max(prev, ag_ready[op.chunk])
                    dur = spec.fwd[vs]
                else:
                    own = f_end.get((vs, op.mb))
                    if own is None:
                        break
                    if vs == nstages - 1:
                        ready = own
                    else:
                        nxt = b_out.get((vs + 1, op.mb))
                        if nxt is None:
                            break
                        ready = max(own, nxt)
                    dur = spec.bwd[vs]
                start = max(free[r], ready)
                end = start + dur
                busy[r] += dur
                # Hand the output on: forward to vs+1 on rank r+1, input-gradient to vs-1 on rank r-1.
                target = vs + 1 if op.kind == "F" else vs - 1
                hold = avail = end
                if 0 <= target < nstages and p > 1:
                    avail = end + (p2p[r] if op.kind == "F" else p2p[(r - 1) % p])
                    if not spec.async_p2p:
                        hold = avail  # blocking send: the rank waits for the transfer too
                if op.kind == "F":
                    f_end[(vs, op.mb)] = end
                    f_out[(vs, op.mb)] = avail
                else:
                    b_out[(vs, op.mb)] = avail
                if op.kind == "B":
                    last_b[r][op.chunk] = max(last_b[r][op.chunk], end)
                free[r] = hold
                if keep_events:
                    events.append(Event(r, op.kind, op.chunk, op.mb, start, end))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (a bug in the schedule order)")

    compute_end = max(free)
    makespan = compute_end
    for r in range(p):
        t = free[r]
        if spec.dp_overlap:
            stream = 0.0
            for c in sorted(range(v), key=lambda c: last_b[r][c]):
                s = max(stream, last_b[r][c])
                stream = s + rs[c]
                if keep_events:
                    events.append(Event(r, "RS", c, -1, s, stream))
            t = max(t, stream)
        else:
            t = t + sum(rs)
        makespan = max(makespan, t)
    if keep_events and spec.dp_overlap:
        prev = 0.0
        for c in range(v):
            events.append(Event(0, "AG", c, -1, prev if c else -ag[0], ag_ready[c]))
            prev = ag_ready[c]
    return Timeline(events=events, makespan=makespan, compute_end=compute_end, busy=busy)


def closed_form_bubble(p: int, v: int, m: int) -> float:
    """Megatron-LM's bubble fraction for equal stages and free communication."""
    return (p - 1) / (v * m + p - 1)
