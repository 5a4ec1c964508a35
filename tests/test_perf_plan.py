"""The planner end to end: predictions, layout search and the `plan` command."""

import json

import pytest

from megascale.config import ModelConfig, load_config
from megascale.errors import UserError
from megascale.perf import cli, planner
from megascale.perf.flops import model_flops_per_token
from megascale.perf.presets import load_preset
from megascale.perf.step import MEGASCALE, MEGATRON, Layout, Settings, predict

CFG = ModelConfig(vocab_size=512, seq_len=256, n_layers=8, d_model=512, n_heads=8)


@pytest.fixture(scope="module")
def a100():
    return load_preset("a100", use_calibration=False)


def test_prediction_adds_up_and_mfu_is_consistent(a100):
    lay = Layout(tp=2, pp=2, dp=2, vpp=2, micro_batch=2)
    for st in (MEGATRON, MEGASCALE):
        p = predict(CFG, lay, a100, st, global_batch=32, explain=True)
        assert sum(vars(p.breakdown).values()) == pytest.approx(p.step_time, rel=1e-9)
        flops = model_flops_per_token(CFG) * 32 * CFG.seq_len
        assert p.mfu == pytest.approx(flops / (p.step_time * 8 * a100.peak_flops))
        assert 0 < p.mfu < 1
    slow = predict(CFG, lay, a100, MEGATRON, 32)
    fast = predict(CFG, lay, a100, MEGASCALE, 32)
    assert fast.step_time < slow.step_time


def test_layout_errors_name_the_problem(a100):
    with pytest.raises(UserError, match="n_heads"):
        predict(CFG, Layout(tp=3), a100, MEGASCALE, 8)
    with pytest.raises(UserError, match="multiple of pp"):
        predict(CFG, Layout(pp=2, vpp=2, micro_batch=1), a100, MEGASCALE, 3)


def test_search_ranks_fitting_layouts_first(a100):
    res = planner.search(CFG, a100, 16, 64, MEGASCALE, top=3)
    assert res.evaluated == len(res.ranked) > 3
    fitting = [p for p in res.ranked if p.fits]
    assert res.ranked[: len(fitting)] == fitting
    assert [p.step_time for p in fitting] == sorted(p.step_time for p in fitting)
    assert all(p.breakdown is not None for p in res.ranked[:3])
    assert all(p.layout.world == 16 for p in res.ranked)


def test_memory_limit_marks_or_recomputes():
    big = load_config("configs/gpt_175b.toml").model
    a100 = load_preset("a100", use_calibration=False)
    p = predict(big, Layout(tp=1, pp=1, dp=8, micro_batch=1), a100, MEGASCALE, 8)
    assert not p.fits  # 175B parameters do not fit on one GPU, however sharded the optimizer


def test_plan_command_json_and_table(capsys):
    argv = ["--config", "configs/gpt_175b.toml", "--cluster", "a100", "--gpus", "128", "--batch", "96",
            "--settings", "both", "--top", "2", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["settings"]) == {"megatron", "megascale"}
    row = doc["settings"]["megascale"][0]
    assert {"step_time", "tokens_per_s", "mfu", "memory", "fits", "breakdown"} <= set(row)
    assert cli.main(["--config", "configs/gpt_175b.toml", "--gpus", "128", "--batch", "96",
                     "--layout", "8,8,6,1", "--explain"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "pipeline bubble" in out and "tp8 pp8 v6 dp2 mb1" in out


def test_plan_with_the_config_settings_runs_ahead_as_the_config_says(capsys):
    rows = []
    for ahead in (0, 1):
        argv = ["--config", "configs/gpt_175b.toml", "--cluster", "a100", "--gpus", "128", "--batch", "96",
                "--settings", "config", "--layout", "8,8,1,1", "--json", "parallel.vpp=1",
                f"parallel.pp_warmup_ahead={ahead}"]
        assert cli.main(argv) == 0
        rows.append(json.loads(capsys.readouterr().out)["settings"]["config"][0])
    assert [r["settings"]["pp_warmup_ahead"] for r in rows] == [0, 1]
    # rank 0 holds one more micro-batch of activations, and the steady phase no longer waits on p2p
    assert rows[1]["memory"]["activations"] > rows[0]["memory"]["activations"]
    assert rows[1]["step_time"] <= rows[0]["step_time"]


def test_plan_command_user_errors(capsys):
    assert cli.main(["--config", "configs/gpt_175b.toml", "--cluster", "nope"]) == 2
    assert cli.main(["--config", "configs/gpt_175b.toml", "--gpus", "512", "--layout", "8,x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_fused_parallel_blocks_collectives_are_hidden_only_with_their_flag():
    """parallel.tp_overlap_branches off: the fused block keeps its all-gather and reduce-scatter exposed
    (the runtime runs them in place), as with tp_overlap off; on: less of them is exposed."""
    a100 = load_preset("a100", use_calibration=False)
    lay = Layout(tp=8, pp=1, dp=1, micro_batch=1, sequence_parallel=True)
    tp = {name: predict(CFG, lay, a100, Settings(name, tp_overlap=on, tp_overlap_branches=branches), 8,
                        explain=True).breakdown.tp_exposed
          for name, on, branches in (("off", False, False), ("in place", True, False), ("on", True, True))}
    assert tp["in place"] == pytest.approx(tp["off"])
    assert tp["on"] < tp["off"]
