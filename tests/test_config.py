"""Config loading, overrides and validation: every mistake names the field and the reason."""

import subprocess
import sys
from pathlib import Path

import pytest

from megascale.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "[model]\nn_layers = 3\n"), ["model.d_model=128", "model.n_heads=4",
                                                                   "data.tokenizer=gpt2", "optim.lr=3e-4"])
    assert cfg.model.n_layers == 3 and cfg.model.d_model == 128
    assert cfg.data.tokenizer == "gpt2"
    assert cfg.optim.lr == pytest.approx(3e-4)


def test_int_is_accepted_for_float():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["model.attention=sliding", "model.window=64", "train.steps=7"])
    again = load_config(write(tmp_path, cfg.to_toml()))
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, field, reason",
    [
        (["model.n_layer=4"], "model.n_layer", "unknown field"),
        (["modle.n_layers=4"], "modle.n_layers", "unknown config section"),
        (["model.n_layers=four"], "model.n_layers", "expected int"),
        (["model.n_layers=2.5"], "model.n_layers", "expected int"),
        (["train.compile=1"], "train.compile", "expected bool"),
        (["model.d_model=100", "model.n_heads=3"], "model.n_heads", "do not divide"),
        (["model.attention=sliding", "model.window=512", "model.seq_len=256"], "model.window", "larger"),
        (["model.attention=sliding"], "model.window", "window > 0"),
        (["train.global_batch=30", "train.micro_batch=8"], "train.global_batch", "do not split"),
        (["model.style=bert"], "model.style", "must be one of"),
        (["optim.min_lr=1.0", "optim.lr=0.1"], "optim.min_lr", "above"),
        (["train.steps=0"], "train.steps", "> 0"),
        (["model.dropout=1.5"], "model.dropout", "[0, 1)"),
        (["optim.lr=nan"], "optim.lr", "finite number"),  # NaN passes every comparison
        (["observe.hang_timeout_s=inf"], "observe.hang_timeout_s", "finite number"),
        (["model.init_std=-1"], "model.init_std", "> 0"),
        (["model.rope_theta=0"], "model.rope_theta", "> 0"),
        (["model.norm_eps=-1e-5"], "model.norm_eps", ">= 0"),
        (["optim.eps=-1e-8"], "optim.eps", ">= 0"),
        (["optim.schedule=step"], "optim.schedule", "must be one of"),
        (["optim.schedule=wsd", "optim.decay_fraction=0"], "optim.decay_fraction", "(0, 1]"),
        (["train.eval_batches=0"], "train.eval_batches", "> 0"),  # validation of nothing: a NaN loss
        (['train.run_dir=""'], "train.run_dir", "current one"),
        (["noequals"], "noequals", "section.field=value"),
        # parallel layouts: checked before any process starts
        (["parallel.tp=4"], "parallel.tp", "whole heads"),
        (["model.d_model=128", "model.n_heads=4", "model.d_ff=101", "parallel.tp=2"],
         "parallel.tp", "MLP width"),
        (["model.seq_len=255", "parallel.tp=2", "parallel.sequence_parallel=true"],
         "parallel.sequence_parallel", "does not split"),
        (["parallel.vpp=2"], "parallel.vpp", "parallel.pp > 1"),
        (["parallel.pp=4", "parallel.vpp=2"], "model.n_layers", "do not fill"),
        (["parallel.pp=2", "train.global_batch=8", "train.micro_batch=8"], "train.global_batch",
         "fewer than parallel.pp=2"),
        (["parallel.pp=2", "parallel.vpp=2", "train.global_batch=24", "train.micro_batch=8"],
         "train.global_batch", "multiple of parallel.pp=2"),
        (["parallel.pp=2", "parallel.dp=2", "train.global_batch=32", "train.micro_batch=16"],
         "train.global_batch", "1 micro-batches per step"),
        (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=1f1b"], "parallel.schedule", "interleaved"),
        (["parallel.pp=2", "parallel.schedule=interleaved"], "parallel.schedule", "parallel.vpp > 1"),
        (["parallel.schedule=zigzag"], "parallel.schedule", "must be one of"),
        (["parallel.transport=mpi"], "parallel.transport", "must be one of"),
        (["parallel.tp_overlap_impl=nccl"], "parallel.tp_overlap_impl", "must be one of"),
        (["parallel.tp_overlap_branches=true"], "parallel.tp_overlap_branches", "needs parallel.tp_overlap"),
        (["parallel.tp_overlap=true", "parallel.tp_overlap_branches=true", "model.dropout=0.1"],
         "parallel.tp_overlap_branches", "needs model.dropout = 0"),
        (["parallel.pp_warmup_ahead=-1"], "parallel.pp_warmup_ahead", ">= 0"),
        (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_warmup_ahead=1"], "parallel.pp_warmup_ahead",
         "1f1b schedule, not interleaved"),
        (["parallel.dp_bucket_size=0"], "parallel.dp_bucket_size", "> 0"),
        (["distributed.store=etcd://host:2379"], "distributed.store", "tcp, tcp-legacy or redis://"),
        (["distributed.group_init=fast"], "distributed.group_init", "must be one of"),
        (["distributed.timeout_s=0"], "distributed.timeout_s", "> 0"),
        (["distributed.job_id=a/b"], "distributed.job_id", "'/'"),
        (["observe.hang_action=reboot"], "observe.hang_action", "must be one of"),
        (["observe.hang_timeout_s=0"], "observe.hang_timeout_s", "> 0"),
        (["observe.straggler_threshold=-0.1"], "observe.straggler_threshold", "> 0"),
        (["observe.straggler_window=-1"], "observe.straggler_window", ">= 0"),
        (["observe.buffer_records=0"], "observe.buffer_records", "> 0"),
        (["observe.trace_max_mb=-1"], "observe.trace_max_mb", ">= 0"),
        (["checkpoint.writer_process_min_mb=-1"], "checkpoint.writer_process_min_mb", ">= 0"),
        (["fault.monitor_interval_s=0"], "fault.monitor_interval_s", "> 0"),
        (["fault.rendezvous_poll_s=-1"], "fault.rendezvous_poll_s", ">= 0"),
        (["fault.rendezvous_last_call_s=0"], "fault.rendezvous_last_call_s", "> 0"),
        (["fault.heartbeat_timeout_s=1", "fault.heartbeat_interval_s=1"], "fault.heartbeat_timeout_s",
         "under two heartbeats"),
    ],
)
def test_errors_name_field_and_reason(overrides, field, reason):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert msg.startswith(field), msg
    assert reason in msg, msg
    assert "\n" not in msg


def test_unknown_key_in_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.stepz: unknown field \(did you mean steps\?\)"):
        load_config(write(tmp_path, "[train]\nstepz = 3\n"))


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_cli_config_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megascale", "train", "--config", "configs/cpu_default.toml",
                        "model.n_layrs=2", f"train.run_dir={tmp_path}/run"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_layrs: unknown field" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_print_config(tmp_path):
    # overrides may sit on either side of the options
    r = subprocess.run([sys.executable, "-m", "megascale", "train", "--config", "configs/cpu_default.toml",
                        "model.d_model=96", "--print-config", "model.n_layers=3"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "[model]" in r.stdout and "n_layers = 3" in r.stdout and "d_model = 96" in r.stdout


def test_world_size_must_match_the_processes():
    from megascale.config import check_world_size

    cfg = load_config(None, ["parallel.tp=2", "parallel.dp=2"])
    check_world_size(cfg, 4, "--nproc")
    want = r"^parallel.tp \* parallel.pp \* parallel.dp = 2 \* 1 \* 2 = 4 must equal --nproc = 8$"
    with pytest.raises(ConfigError, match=want):
        check_world_size(cfg, 8, "--nproc")
    with pytest.raises(ConfigError, match="megascale train --nproc 4"):
        check_world_size(cfg, 1, "the number of processes")
