"""Pipeline p2p overlap (parallel.pp_overlap): receives posted ahead, sends completed lazily.

The plan (`schedule.recv_plan`) is pure, so it is checked without processes: every receive is
posted once, before the op that takes it, and mostly one op or more ahead; and the plan runs
under NCCL's semantics, modelled here: one communicator per (direction, pair of ranks), tags
ignored, a communicator's sends and receives executed one after another, each send matched to
the receive at the head of the peer's. There the naive prefetch (post the next receive as soon as
the last was taken) hangs pp = 2 interleaved, which is why the plan orders each channel.

Through real gloo processes, with the per-direction groups NCCL gets (Mesh.build's p2p_groups),
overlap only moves when the bytes travel: losses and every gradient equal the blocking run's
bit for bit (float64, torch.equal), and each direction's messages go over its own group.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.distributed as dist
from _dist import WorkerPool, one_thread_fixture, pools_fixture  # noqa: F401 - fixtures found by name

from megascale.config import ModelConfig, ParallelConfig
from megascale.distributed import p2p
from megascale.model import GPT
from megascale.parallel import Mesh
from megascale.parallel.pipeline import PipelineStage, load_stage_state_dict, pipeline_step
from megascale.parallel.pipeline.comm import BACKWARD_TAG, FORWARD_TAG
from megascale.parallel.pipeline.schedule import (
    Prefetch,
    peer,
    received,
    recv_plan,
    schedule_ops,
    sent,
    timeline,
)

GRID = [("afab", 2, 4, 1), ("afab", 4, 4, 1), ("afab", 2, 4, 2), ("1f1b", 2, 8, 1), ("1f1b", 4, 4, 1),
        ("1f1b", 4, 9, 1), ("interleaved", 2, 2, 2), ("interleaved", 2, 4, 2), ("interleaved", 2, 6, 3),
        ("interleaved", 4, 8, 2), ("interleaved", 4, 12, 4)]


def posts(plan: tuple[Prefetch, ...], ops, pp: int, rank: int, vpp: int):
    """Per stream, (op index where each receive is posted, op index that takes it), in order."""
    where: dict[str, list[int]] = collections.defaultdict(list)
    takes: dict[str, list[int]] = collections.defaultdict(list)
    for i, (op, pre) in enumerate(zip(ops, plan, strict=True)):
        for s in pre.before:
            where[s].append(i)
        if s := received(op, pp, rank, vpp):
            takes[s].append(i)
        for s in pre.before_send:
            where[s].append(i)
    return {s: list(zip(where[s], takes[s], strict=True)) for s in takes | where}


# ---------------------------------------------------------------------------------------
# The plan, without processes


@pytest.mark.parametrize(("name", "pp", "m", "vpp"), GRID)
def test_ops_receive_what_the_timeline_sent_them_before(name, pp, m, vpp):
    """`received`/`sent` name the message each op consumes / produces: its producer (the
    neighbouring virtual stage's same pass) finishes before it starts in `simulate`'s timeline."""
    done, last = timeline(name, pp, m, vpp), pp * vpp - 1
    cost = {"F": 1.0, "B": 2.0}
    for r in range(pp):
        for op in schedule_ops(name, pp, r, m, vpp):
            vs = op.chunk * pp + r
            s = received(op, pp, r, vpp)
            assert s == (op.kind if (vs > 0 if op.kind == "F" else vs < last) else None)
            if s:
                src = vs - 1 if s == "F" else vs + 1
                assert src % pp == peer(s, r, pp, sending=False)
                start = done[(op.kind, op.microbatch, vs)] - cost[op.kind]
                assert done[(op.kind, op.microbatch, src)] <= start
            if t := sent(op, pp, r, vpp):
                assert t == op.kind and (vs + (1 if t == "F" else -1)) % pp == peer(t, r, pp, sending=True)


@pytest.mark.parametrize(("name", "pp", "m", "vpp"), GRID)
def test_plan_posts_every_receive_once_before_the_op_that_takes_it(name, pp, m, vpp):
    for r in range(pp):
        ops = schedule_ops(name, pp, r, m, vpp)
        for s, pairs in posts(recv_plan(name, pp, r, m, vpp), ops, pp, r, vpp).items():
            assert len(pairs) == sum(received(op, pp, r, vpp) == s for op in ops)
            assert all(p <= t for p, t in pairs), (r, s, pairs)
            ahead = [sum(p <= i < t for p, t in pairs) for i in range(len(ops))]  # beyond op i's own
            # depth 1; where a channel runs both ways, also those the peer sends before this
            # rank's next send (afab, pp = 2, vpp = 2: up to m - 1, the activations afab holds anyway)
            assert max(ahead) <= (m - 1 if pp == 2 and vpp > 1 else 1)


@pytest.mark.parametrize(("name", "pp", "m", "vpp"), GRID)
def test_plan_prefetches_one_op_ahead_or_more(name, pp, m, vpp):
    """Each stream's first receive is posted at the first op, the rest while an earlier op computes.
    Only pp = 2 interleaved holds some back: its channels carry both directions (see recv_plan)."""
    early = total = 0
    for r in range(pp):
        ops = schedule_ops(name, pp, r, m, vpp)
        for pairs in posts(recv_plan(name, pp, r, m, vpp), ops, pp, r, vpp).values():
            if not (pp == 2 and vpp > 1):
                assert pairs[0][0] == 0 and all(p < t for p, t in pairs[1:]), pairs
            early += sum(p < t for p, t in pairs[1:])
            total += len(pairs) - 1
    assert early / total >= (1.0 if not (pp == 2 and vpp > 1) else 0.5)


def test_plan_depth_zero_posts_each_receive_at_its_op():
    for r in range(4):
        ops = schedule_ops("1f1b", 4, r, 6)
        for pairs in posts(recv_plan("1f1b", 4, r, 6, depth=0), ops, 4, r, 1).values():
            assert all(p == t for p, t in pairs)


def blocking_plan(name, pp, rank, m, vpp, ahead=0) -> tuple[Prefetch, ...]:
    """pp_overlap = false: each receive posted (and waited for) at the op that takes it."""
    ops = schedule_ops(name, pp, rank, m, vpp, ahead)
    return tuple(Prefetch((s,) if (s := received(op, pp, rank, vpp)) else ()) for op in ops)


def naive_plan(name, pp, rank, m, vpp) -> tuple[Prefetch, ...]:
    """Prefetch without the channel order: a stream's first receive at the start, each next one as
    soon as the last is taken."""
    ops = schedule_ops(name, pp, rank, m, vpp)
    left = collections.Counter(received(op, pp, rank, vpp) for op in ops)
    plan, started = [], set()
    for op in ops:
        before = [s for s in "FB" if left[s] and s not in started]
        started.update(before)
        left.subtract(before)
        if (s := received(op, pp, rank, vpp)) and left[s]:
            before.append(s)
            left[s] -= 1
        plan.append(Prefetch(tuple(before)))
    return tuple(plan)


def run_nccl_model(name, pp, m, vpp, plan_of, ahead: int = 0) -> int:
    """Execute every rank's plan as NCCL would (see the module docstring); the messages delivered.

    RuntimeError if it hangs; AssertionError if a receive gets another op's message."""
    ops = [schedule_ops(name, pp, r, m, vpp, ahead) for r in range(pp)]
    actions = []
    for r in range(pp):
        plan, acts = plan_of(name, pp, r, m, vpp), []
        for op, pre in zip(ops[r], plan, strict=True):
            vs = op.chunk * pp + r
            acts += [("post", s, None) for s in pre.before]
            if s := received(op, pp, r, vpp):
                acts.append(("take", s, (op.microbatch, vs)))
            acts += [("post", s, None) for s in pre.before_send]
            if s := sent(op, pp, r, vpp):
                acts.append(("send", s, (op.microbatch, vs + (1 if s == "F" else -1))))
        actions.append(acts)
    queue = collections.defaultdict(collections.deque)  # (stream, rank, peer) -> that rank's ops on the comm
    posted = collections.defaultdict(collections.deque)  # (rank, stream) -> its posted receives' cells
    pos, delivered = [0] * pp, 0
    while True:
        moved = False
        for r in range(pp):  # hosts: posts and sends never block, a take waits for its message
            while pos[r] < len(actions[r]):
                kind, s, msg = actions[r][pos[r]]
                if kind == "post":
                    cell = {}
                    posted[(r, s)].append(cell)
                    queue[(s, r, peer(s, r, pp, sending=False))].append(("R", cell))
                elif kind == "send":
                    queue[(s, r, peer(s, r, pp, sending=True))].append(("S", msg))
                elif posted[(r, s)] and "msg" in posted[(r, s)][0]:
                    assert posted[(r, s)].popleft()["msg"] == msg, (name, pp, m, vpp, r, s)
                else:
                    break
                pos[r] += 1
                moved = True
        for (s, a, b), q in list(queue.items()):  # communicators: heads must pair a send with a receive
            other = queue[(s, b, a)]
            if q and other and q[0][0] == "S" and other[0][0] == "R":
                other.popleft()[1]["msg"] = q.popleft()[1]
                delivered += 1
                moved = True
        if not moved:
            break
    if any(pos[r] < len(actions[r]) for r in range(pp)) or any(queue.values()):
        stuck = {r: actions[r][pos[r]] for r in range(pp) if pos[r] < len(actions[r])}
        raise RuntimeError(f"hangs: ranks stuck at {stuck}")
    return delivered


@pytest.mark.parametrize(("name", "pp", "m", "vpp"), GRID)
def test_plan_runs_under_nccl_semantics(name, pp, m, vpp):
    want = sum(received(op, pp, r, vpp) is not None
               for r in range(pp) for op in schedule_ops(name, pp, r, m, vpp))
    assert run_nccl_model(name, pp, m, vpp, recv_plan) == want


@pytest.mark.parametrize(("pp", "m", "ahead"), [(2, 8, 1), (4, 9, 1), (4, 6, 2)])
def test_a_1f1b_run_ahead_is_planned_and_paired_like_megatrons_order(pp, m, ahead):
    """parallel.pp_warmup_ahead: every receive posted once, before the op that takes it, and the
    plan delivers every message under NCCL's pairing."""
    want = 0
    for r in range(pp):
        ops = schedule_ops("1f1b", pp, r, m, ahead=ahead)
        for s, pairs in posts(recv_plan("1f1b", pp, r, m, ahead=ahead), ops, pp, r, 1).items():
            assert len(pairs) == sum(received(op, pp, r, 1) == s for op in ops)
            assert all(p <= t for p, t in pairs), (r, s, pairs)
            want += len(pairs)
    plan = functools.partial(recv_plan, ahead=ahead)
    assert run_nccl_model("1f1b", pp, m, 1, plan, ahead) == want


def test_prefetch_without_the_channel_order_hangs_nccl_at_pp2_interleaved():
    """Rank 0's receive of chunk 1's input sits ahead of its chunk-0 sends, which rank 1 needs first."""
    with pytest.raises(RuntimeError, match="hangs"):
        run_nccl_model("interleaved", 2, 4, 2, naive_plan)
    assert run_nccl_model("1f1b", 4, 6, 1, naive_plan) > 0  # one direction per channel: fine there


def test_blocking_order_is_unpaired_at_pp2_interleaved_and_depth_zero_pairs_it():
    """The baseline (pp_overlap = false) in op order: under NCCL it needs a peer's send to be
    buffered at pp = 2 interleaved, as before this plan; with depth 0 the plan orders it."""
    with pytest.raises(RuntimeError, match="hangs"):
        run_nccl_model("interleaved", 2, 4, 2, blocking_plan)
    for name, pp, m, vpp in GRID:
        run_nccl_model(name, pp, m, vpp, lambda *a: recv_plan(*a, depth=0))
        if not (pp == 2 and vpp > 1):
            run_nccl_model(name, pp, m, vpp, blocking_plan)


# ---------------------------------------------------------------------------------------
# Real processes: overlap on equals overlap off, over the per-direction groups

VOCAB, SEQ = 97, 8


def model_config() -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layers=4, d_model=16, n_heads=2, tie_embeddings=True)


class RecordP2P:
    """Which group each isend / irecv of a tag went over (the P2P module calls distributed/p2p.py's,
    which hands them to the socket transport or to torch.distributed's)."""

    def __init__(self):
        self.calls: list[tuple[str, int, object]] = []

    def __enter__(self):
        self.real = p2p.isend, p2p.irecv

        def wrap(name, fn):
            def call(tensor, *args, group=None, tag=0, **kw):
                self.calls.append((name, tag, group))
                return fn(tensor, *args, group=group, tag=tag, **kw)
            return call

        p2p.isend, p2p.irecv = wrap("isend", self.real[0]), wrap("irecv", self.real[1])
        return self

    def __exit__(self, *exc):
        p2p.isend, p2p.irecv = self.real
        return False


def overlap_vs_blocking(rank, pp, vpp, schedule, m, ahead):
    mesh = Mesh.build(ParallelConfig(pp=pp, vpp=vpp), p2p_groups=True)
    assert mesh.pp_bwd_group is not None and mesh.pp_bwd_group is not mesh.pp_group
    mcfg = model_config()
    stage = PipelineStage(mcfg, mesh, vpp).to(torch.float64)
    torch.manual_seed(1234)
    load_stage_state_dict(stage, GPT(mcfg).to(torch.float64).state_dict())
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (m, SEQ + 1), generator=gen)
    mbs = [(t[None, :-1], t[None, 1:]) for t in tokens]
    runs, groups = [], {FORWARD_TAG: mesh.pp_group, BACKWARD_TAG: mesh.pp_bwd_group}
    for overlap in (False, True, True):  # twice on: nothing left over from a step
        for p in stage.parameters():
            p.grad = None
        with RecordP2P() as rec:
            result = pipeline_step(stage, mbs, 1, schedule, overlap=overlap, ahead=ahead)
        grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        wrong = [(op, tag) for op, tag, group in rec.calls if group is not groups[tag]]
        runs.append((result.loss, grads, result.bubble, [(op, tag) for op, tag, _ in rec.calls], wrong))
    return runs


def expected_calls(name, pp, rank, m, vpp, overlap, ahead=0) -> list[tuple[str, int]]:
    """The isend / irecv calls, in order, that the plan (or the blocking baseline) makes."""
    tag = {"F": FORWARD_TAG, "B": BACKWARD_TAG}
    ops = schedule_ops(name, pp, rank, m, vpp, ahead)
    plan = (recv_plan(name, pp, rank, m, vpp, ahead=ahead) if overlap
            else blocking_plan(name, pp, rank, m, vpp, ahead))
    calls = []
    for op, pre in zip(ops, plan, strict=True):
        calls += [("irecv", tag[s]) for s in pre.before + pre.before_send]
        if s := sent(op, pp, rank, vpp):
            calls.append(("isend", tag[s]))
    return calls


def _mesh_groups(rank):
    default = Mesh.build(ParallelConfig(pp=2))  # gloo: no second group unless asked
    forced = Mesh.build(ParallelConfig(pp=2), p2p_groups=True)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=forced.pp_bwd_group)
    flat = Mesh.build(ParallelConfig(dp=2), p2p_groups=True)  # pp = 1: nothing to carry
    return (default.pp_bwd_group is None, forced.pp_bwd_group is not forced.pp_group, x.item(),
            len(forced.groups()), forced.groups()[-1] is forced.pp_bwd_group, flat.pp_bwd_group is None)


def test_mesh_builds_the_backward_group_when_asked(pools):
    assert pools(2).run(_mesh_groups) == [(True, True, 3.0, 6, True, True)] * 2


CASES = {  # name: (pp, vpp, schedule, micro-batches, parallel.pp_warmup_ahead)
    "pp2-1f1b": (2, 1, "1f1b", 4, 0),
    "pp2-afab": (2, 1, "afab", 4, 0),
    "pp2-vpp2-interleaved-m2": (2, 2, "interleaved", 2, 0),
    "pp2-vpp2-interleaved-m4": (2, 2, "interleaved", 4, 0),
    "pp4-1f1b": (4, 1, "1f1b", 6, 0),
    "pp4-1f1b-ahead1": (4, 1, "1f1b", 6, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_gives_the_blocking_run_bit_for_bit(pools, case):
    pp, vpp, schedule, m, ahead = CASES[case]
    results = pools(pp).run(overlap_vs_blocking, pp, vpp, schedule, m, ahead)
    for r, ((loss_off, grads_off, bubble_off, calls_off, _), *on) in enumerate(results):
        for loss_on, grads_on, _, calls_on, _ in on:
            assert loss_on == loss_off
            assert grads_on.keys() == grads_off.keys()
            assert all(torch.equal(grads_on[k], g) for k, g in grads_off.items()), r
            assert calls_on == expected_calls(schedule, pp, r, m, vpp, True, ahead)  # the plan, as planned
        assert calls_off == expected_calls(schedule, pp, r, m, vpp, False, ahead)
        for *_, wrong in [results[r][0], *on]:
            assert not wrong, f"rank {r}: p2p over the other direction's group: {wrong}"
        print(f"\n{case} rank {r}: {len(calls_off)} p2p, bubble off {bubble_off:.2f} on {on[0][2]:.2f}")
    for tag in (FORWARD_TAG, BACKWARD_TAG):  # each direction carried messages, all of them received
        sends = sum(run[3].count(("isend", tag)) for runs in results for run in runs)
        assert sends == sum(run[3].count(("irecv", tag)) for runs in results for run in runs) > 0
