"""Pipeline parallelism without processes: partitioning, schedule orders, the simulator, config errors.

The schedule orders are Megatron-Core's (schedules.py: forward_backward_pipelining_without_
interleaving and _with_interleaving), written out by hand for small cases from its formulas:
1F1B warm-up pp - rank - 1; interleaved warm-up (pp - rank - 1) * 2 + (vpp - 1) * pp (all of
it when m == pp), and the k-th forward runs micro-batch (k // (pp vpp)) pp + k % pp on chunk
(k % (pp vpp)) // pp, backwards on the mirrored chunk.
"""

from __future__ import annotations

import pytest
import torch

from megascale.config import ConfigError, ModelConfig, ParallelConfig
from megascale.model import GPT
from megascale.parallel.mesh import Mesh
from megascale.parallel.pipeline import (
    PipelineStage,
    check_pipeline,
    gather_stage_state_dict,
    load_stage_state_dict,
    partition,
    pipeline_step,
    rank_chunks,
    schedule_ops,
    simulate,
    theoretical_bubble,
)


def ops(name: str, pp: int, rank: int, m: int, vpp: int = 1, ahead: int = 0) -> str:
    return " ".join(str(op) for op in schedule_ops(name, pp, rank, m, vpp, ahead))


# ---------------------------------------------------------------------------------------
# Partitioning


@pytest.mark.parametrize(("layers", "pp", "vpp", "want"), [
    (8, 2, 1, [range(0, 4), range(4, 8)]),
    (8, 4, 2, [range(i, i + 1) for i in range(8)]),
    (10, 4, 1, [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]),  # extras to the first stages
    (5, 2, 2, [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]),
    (12, 2, 3, [range(0, 2), range(2, 4), range(4, 6), range(6, 8), range(8, 10), range(10, 12)]),
])
def test_partition_is_balanced_and_contiguous(layers, pp, vpp, want):
    got = partition(layers, pp, vpp)
    assert got == want
    assert [i for r in got for i in r] == list(range(layers))


def test_interleaved_rank_holds_non_adjacent_chunks():
    # 8 layers, pp=2, vpp=2: virtual stages [0,1] [2,3] [4,5] [6,7]; chunk c of rank r is stage 2c + r
    assert rank_chunks(8, 2, 2, 0) == [range(0, 2), range(4, 6)]
    assert rank_chunks(8, 2, 2, 1) == [range(2, 4), range(6, 8)]
    assert rank_chunks(16, 4, 2, 3) == [range(6, 8), range(14, 16)]


def test_stage_builds_only_its_layers_and_keys_match_the_gpt():
    cfg = ModelConfig(vocab_size=37, seq_len=8, n_layers=8, d_model=16, n_heads=2, tie_embeddings=False)
    full_keys = set(GPT(cfg).state_dict())
    stages = [PipelineStage(cfg, Mesh(dp=1, pp=2, tp=1, rank=r), vpp=2) for r in range(2)]
    first, last = stages
    assert [int(n) for n, _ in first.blocks.named_children()] == [0, 1, 4, 5]
    assert [int(n) for n, _ in last.blocks.named_children()] == [2, 3, 6, 7]
    assert first.embed is not None and first.head is None and first.norm is None
    assert last.embed is None and last.head is not None and last.norm is not None
    keys = [set(s.state_dict()) for s in stages]
    assert keys[0] | keys[1] == full_keys and not keys[0] & keys[1]  # disjoint, and all of the GPT


@pytest.mark.parametrize("tie", [True, False])
def test_single_stage_equals_gradient_accumulation(tie):
    """pp=1: the executor is plain gradient accumulation; state round trip and grads equal the GPT's."""
    cfg = ModelConfig(vocab_size=37, seq_len=8, n_layers=3, d_model=16, n_heads=2, style="llama",
                      block="parallel", attention="sliding", window=3, bias=False, tie_embeddings=tie)
    torch.manual_seed(0)
    gpt = GPT(cfg).double()
    stage = PipelineStage(cfg, Mesh(1, 1, 1, 0)).double()
    assert stage.state_dict().keys() == gpt.state_dict().keys()
    load_stage_state_dict(stage, gpt.state_dict())
    tokens = torch.randint(0, 37, (4, 9))
    mbs = [(tokens[i:i + 2, :-1], tokens[i:i + 2, 1:]) for i in (0, 2)]
    result = pipeline_step(stage, mbs, micro_batch=2)
    loss = gpt(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    grads = dict(stage.named_parameters())
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-12, atol=1e-14)
    full = gather_stage_state_dict(stage)
    assert all(torch.equal(full[k], v) for k, v in gpt.state_dict().items())


# ---------------------------------------------------------------------------------------
# Schedules


def test_1f1b_order_is_megatrons():
    # pp=4, m=6: warm-up 3, 2, 1, 0 forwards, then one forward one backward, then the drain
    assert ops("1f1b", 4, 0, 6) == "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0"
    assert ops("1f1b", 4, 1, 6) == "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 B4.0 B5.0"
    assert ops("1f1b", 4, 3, 6) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0"


def test_1f1b_run_ahead_adds_warmup_forwards_on_all_but_the_last_rank():
    # parallel.pp_warmup_ahead=1: one more forward before the first backward; backwards in the same order
    assert ops("1f1b", 2, 0, 4, ahead=1) == "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 B2.0 B3.0"
    assert ops("1f1b", 2, 1, 4, ahead=1) == ops("1f1b", 2, 1, 4)  # the last rank has nobody to run ahead of
    assert ops("1f1b", 4, 1, 6, ahead=2) == "F0.0 F1.0 F2.0 F3.0 F4.0 B0.0 F5.0 B1.0 B2.0 B3.0 B4.0 B5.0"
    assert ops("1f1b", 2, 0, 2, ahead=3) == ops("afab", 2, 0, 2)  # capped by the micro-batches
    for pp, m, ahead in [(2, 4, 1), (2, 8, 2), (4, 4, 1), (4, 9, 1), (4, 9, 3)]:
        # the same ideal bubble (messages free), no deadlock, channels in order
        assert simulate("1f1b", pp, m, ahead=ahead) == pytest.approx(theoretical_bubble(pp, m))


def test_interleaved_order_is_megatrons():
    # pp=2, vpp=2, m=4: warm-up 4 on rank 0, 2 on rank 1; micro-batches in groups of pp per chunk
    assert ops("interleaved", 2, 0, 4, 2) == (
        "F0.0 F1.0 F0.1 F1.1 "                          # warm-up
        "F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "      # steady 1F1B
        "B2.1 B3.1 B2.0 B3.0")                          # cool-down
    assert ops("interleaved", 2, 1, 4, 2) == (
        "F0.0 F1.0 "
        "F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 "
        "B2.0 B3.0")
    # m == pp: all forwards are warm-up (Megatron's all_warmup_microbatches)
    assert ops("interleaved", 2, 1, 2, 2) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"


def test_afab_runs_every_forward_first():
    assert ops("afab", 2, 1, 3) == "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0"
    assert ops("afab", 2, 0, 2, 2) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"


@pytest.mark.parametrize(("name", "pp", "m", "vpp"), [
    ("afab", 2, 4, 1), ("afab", 4, 3, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 9, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3),
    ("interleaved", 4, 12, 4),
])
def test_schedules_run_without_deadlock_and_reach_the_theoretical_bubble(name, pp, m, vpp):
    """Unit costs per chunk (F = 1/v, B = 2/v of a stage): the idle fraction is (p-1)/(v m + p-1),
    and every channel's messages are consumed in the order they are sent."""
    bubble = simulate(name, pp, m, vpp, f=1 / vpp, b=2 / vpp)
    assert bubble == pytest.approx(theoretical_bubble(pp, m, vpp))


def test_afab_with_chunks_runs_and_idles_less_than_without():
    assert simulate("afab", 4, 3, 2, f=0.5, b=1.0) < theoretical_bubble(4, 3)


def test_simulator_catches_a_deadlock(monkeypatch):
    import megascale.parallel.pipeline.schedule as sched

    real = sched.one_f_one_b
    # the last rank tries a backward before the forward it depends on
    bad = [sched.Op("B", 0), sched.Op("F", 0), sched.Op("F", 1), sched.Op("B", 1)]
    monkeypatch.setattr(sched, "one_f_one_b",
                        lambda pp, rank, m, ahead=0: bad if rank == 1 else real(pp, rank, m))
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate("1f1b", 2, 2)


def test_simulator_catches_messages_out_of_order(monkeypatch):
    import megascale.parallel.pipeline.schedule as sched

    real = sched.one_f_one_b
    swapped = [sched.Op("F", 1), sched.Op("B", 1), sched.Op("F", 0), sched.Op("B", 0)]
    monkeypatch.setattr(sched, "one_f_one_b",
                        lambda pp, rank, m, ahead=0: swapped if rank == 1 else real(pp, rank, m))
    with pytest.raises(RuntimeError, match="out of order"):
        simulate("1f1b", 2, 2)


# ---------------------------------------------------------------------------------------
# Config errors


@pytest.mark.parametrize(("layers", "pp", "vpp", "m", "schedule", "field"), [
    (4, 1, 2, 4, "interleaved", "parallel.vpp"),      # interleaving needs pp > 1
    (4, 2, 2, 4, "1f1b", "parallel.vpp"),             # chunks need the interleaved schedule
    (4, 2, 1, 4, "interleaved", "parallel.vpp"),      # interleaved without chunks
    (3, 2, 2, 4, "interleaved", "model.n_layers"),    # fewer layers than virtual stages
    (4, 4, 1, 3, "1f1b", "train.global_batch"),       # 1F1B: m >= pp
    (4, 2, 2, 3, "interleaved", "train.global_batch"),  # interleaved: m % pp == 0
    (4, 2, 1, 4, "gpipe", "pipeline schedule"),
    (4, 2, 1, 4, "afab", "parallel.pp_warmup_ahead"),  # run-ahead is for 1f1b
])
def test_bad_layouts_are_config_errors_naming_the_field(layers, pp, vpp, m, schedule, field):
    cfg = ModelConfig(vocab_size=37, n_layers=layers)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_pipeline(cfg, ParallelConfig(pp=pp, vpp=vpp, pp_warmup_ahead=int(schedule == "afab")), m,
                       schedule)


def test_pipeline_step_checks_before_sending_anything():
    cfg = ModelConfig(vocab_size=37, seq_len=8, n_layers=2, d_model=16, n_heads=2, tie_embeddings=False)
    stage = PipelineStage(cfg, Mesh(dp=1, pp=2, tp=1, rank=0))  # no process group: must not be reached
    with pytest.raises(ConfigError, match="fewer than parallel.pp=2"):
        pipeline_step(stage, [None], micro_batch=1)


def test_forward_context_wraps_each_forward_only():
    """The Trainer's autocast goes around forwards, as on one process; backward runs outside it."""
    import contextlib

    cfg = ModelConfig(vocab_size=37, seq_len=8, n_layers=2, d_model=16, n_heads=2)
    stage = PipelineStage(cfg, Mesh(1, 1, 1, 0))
    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(torch.is_grad_enabled())
        yield

    tokens = torch.randint(0, 37, (3, 9))
    pipeline_step(stage, [(t[None, :-1], t[None, 1:]) for t in tokens], micro_batch=1, forward_context=ctx)
    assert len(entered) == 3
