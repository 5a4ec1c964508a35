"""Hugging Face export and import against a real transformers install, on tiny random models.

Every supported model is trained for two steps as a run, exported through the CLI and loaded
with AutoModelForCausalLM: the logits must equal ours (float32, < 1e-4). Models without an
exact counterpart are refused with one line naming the field. Import: a transformers model
saved with save_pretrained, read by load_hf_state, gives the transformers logits; trained
further and exported again, it still matches.
"""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub: every model here is built locally

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig, MistralConfig
from transformers.utils import logging as hf_logging

from megascale.checkpoint.hf import hf_model_overrides, load_hf_state, save_hf
from megascale.checkpoint.model_state import read_model_state
from megascale.cli import main
from megascale.config import ModelConfig, load_config
from megascale.errors import UserError
from megascale.model import GPT
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
SEQ = 32
MAX_DIFFS: dict[str, float] = {}  # printed at the end of the module (pytest -s) for the record
hf_logging.disable_progress_bar()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf_corpus")
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "sonnets.txt")
    return d


@pytest.fixture(scope="module", autouse=True)
def report_diffs():
    yield
    for name, diff in MAX_DIFFS.items():
        print(f"max |logits - transformers logits| {name}: {diff:.3g}")


def tiny(corpus: Path, run_dir: Path, *extra: str):
    return load_config(None, [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", f"model.seq_len={SEQ}",
        "model.dropout=0.0",
        "train.global_batch=4", "train.micro_batch=4", "train.steps=2", "train.eval_interval=0",
        "optim.warmup_steps=0", "optim.lr=1e-2", "optim.min_lr=1e-3",  # weights (biases too) move off init
        "log.progress=false", "log.tensorboard=false", "log.jsonl=false", "log.sample_tokens=0",
        "log.peak_flops=1e12", "checkpoint.interval=0",
        f"data.source={json.dumps(str(corpus))}",
        f"data.path={json.dumps(str(corpus / 'ds'))}",  # a path of this module's own
        f"train.run_dir={json.dumps(str(run_dir))}", *extra,
    ])


def train_run(corpus: Path, run_dir: Path, *extra: str) -> Path:
    Trainer(tiny(corpus, run_dir, *extra), quiet=True).fit()
    return run_dir


def ours(model_cfg: ModelConfig, state: dict) -> GPT:
    model = GPT(model_cfg)
    model.load_state_dict(state)
    return model.eval()


def max_diff(model: GPT, hf_dir: Path, seed: int = 0) -> float:
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert hf.dtype == torch.float32
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (3, model.cfg.seq_len), generator=g)
    with torch.no_grad():
        a, b = model(tokens), hf(tokens).logits
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def export(run: Path, out: Path, *extra: str) -> int:
    return main(["export", str(run), "--format", "hf", "--output", str(out), *extra])


# ---------------------------------------------------------------------------------------
# Export: every supported combination, trained as a run, through the CLI

SUPPORTED = {
    "gpt2": ("GPT2LMHeadModel", []),
    "gpt2-nobias-untied": ("GPT2LMHeadModel", ["model.bias=false", "model.tie_embeddings=false"]),
    "gpt2-padded-vocab": ("GPT2LMHeadModel", ["model.vocab_size=300"]),
    # a window as long as the sequence is full attention, exactly: GPT-2 is its counterpart
    "gpt2-window-covers-seq": ("GPT2LMHeadModel", ["model.attention=sliding", f"model.window={SEQ}"]),
    "llama-bias": ("LlamaForCausalLM", ["model.style=llama"]),
    "llama-nobias-untied-padded": ("LlamaForCausalLM", ["model.style=llama", "model.bias=false",
                                                        "model.tie_embeddings=false",
                                                        "model.vocab_size=300"]),
    "mistral": ("MistralForCausalLM", ["model.style=llama", "model.bias=false", "model.attention=sliding",
                                       "model.window=8"]),
}


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_export_gives_equal_logits(corpus, tmp_path, capsys, name):
    arch, overrides = SUPPORTED[name]
    run = train_run(corpus, tmp_path / "run", *overrides)
    out = tmp_path / "hf"
    assert export(run, out) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors"] + (["generation_config.json"] if "padded" in name else []))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    cfg, state = read_model_state(run)
    diff = max_diff(ours(cfg.model, state), out)
    MAX_DIFFS[name] = diff
    assert diff < TOL, (name, diff)
    if "padded" in name:  # transformers' generate never samples the padded ids either
        assert GenerationConfig.from_pretrained(out).suppress_tokens == list(range(257, 300))
    # and back: the exported directory describes the run's model and imports to its weights
    back = load_config(None, hf_model_overrides(out)).model
    for field in ("style", "n_layers", "d_model", "n_heads", "vocab_size", "tie_embeddings", "seq_len"):
        assert getattr(back, field) == getattr(cfg.model, field), field
    imported = load_hf_state(out, cfg.model)
    assert set(imported) == set(state)
    assert all(torch.allclose(imported[k], state[k].float(), rtol=0, atol=0) for k in state)


UNSUPPORTED = {
    "parallel-gpt": (["model.block=parallel"], "model.block=parallel with model.style=gpt"),
    "parallel-llama": (["model.block=parallel", "model.style=llama"],
                       "model.block=parallel with model.style=llama"),
    "sliding-gpt": (["model.attention=sliding", "model.window=8"], "model.attention=sliding (model.window=8"),
    "sliding-llama-bias": (["model.style=llama", "model.attention=sliding", "model.window=8"],
                           "model.bias=true with model.attention=sliding"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_export_without_counterpart_is_one_line_exit_2(corpus, tmp_path, capsys, name):
    overrides, expect = UNSUPPORTED[name]
    run = train_run(corpus, tmp_path / "run", *overrides)
    capsys.readouterr()
    out = tmp_path / "out" / "hf"
    assert export(run, out) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megascale export: error: ") and expect in lines[0], lines
    assert "no Hugging Face counterpart" in lines[0]
    assert not (tmp_path / "out").exists(), "nothing may be written"


def test_export_refuses_to_overwrite_and_leaves_nothing_half_written(corpus, tmp_path, capsys, monkeypatch):
    run = train_run(corpus, tmp_path / "run")
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is fine to write into
    assert export(run, out) == 0
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert export(run, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output" in err[0] and "--force" in err[0], err

    # a failure while writing leaves the old output as it was, and no temporary files
    import safetensors.torch

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    assert export(run, out, "--force") == 2  # one line naming the output and why
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megascale export: error: --output {out}: cannot be written (disk full)"], err
    monkeypatch.undo()
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]

    (out / "stale.txt").write_text("from before")
    assert export(run, out, "--force") == 0
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    cfg, state = read_model_state(run)
    assert max_diff(ours(cfg.model, state), out) < TOL


def test_export_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert export(tmp_path / "nowhere", tmp_path / "hf") == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------
# Import: transformers models saved by save_pretrained


def hf_model(kind: str, vocab: int = 64):
    """A small random transformers model of `kind`, its biases and norms moved off their init."""
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    if kind == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, activation_function="gelu",
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    else:
        cls = LlamaConfig if kind == "llama" else MistralConfig
        extra = {"attention_bias": True} if kind == "llama" else {"sliding_window": 8}
        config = cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
                     tie_word_embeddings=kind == "mistral", **extra, **common)
    from transformers import AutoModelForCausalLM as Auto

    model = Auto.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # logits of order 1: a wrong layout could not hide
    return model


def imported(hf_dir: Path) -> GPT:
    cfg = load_config(None, hf_model_overrides(hf_dir)).model
    return ours(cfg, load_hf_state(hf_dir, cfg))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_import_round_trip(tmp_path, kind):
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
    model = imported(tmp_path / "hf")
    diff = max_diff(model, tmp_path / "hf")
    MAX_DIFFS[f"import {kind}"] = diff
    assert diff < TOL
    overrides = hf_model_overrides(tmp_path / "hf")
    if kind == "mistral":
        assert "model.attention=sliding" in overrides and "model.window=8" in overrides
    assert ("model.bias=true" in overrides) == (kind != "mistral")


def test_import_mistral_without_window_is_full_attention(tmp_path):
    hf_model("mistral").save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert "model.attention=full" in hf_model_overrides(tmp_path / "hf")
    assert max_diff(imported(tmp_path / "hf"), tmp_path / "hf") < TOL


def test_import_train_export_again(tmp_path):
    """hf -> load_hf_state -> a few AdamW steps -> save_hf -> transformers: equal logits."""
    hf_model("llama", vocab=96).save_pretrained(tmp_path / "hf")
    model = imported(tmp_path / "hf").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 96, (4, SEQ + 1), generator=g)
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(before["blocks.0.attn.qkv.bias"], model.state_dict()["blocks.0.attn.qkv.bias"])
    save_hf(model.cfg, model.state_dict(), tmp_path / "again")
    diff = max_diff(model.eval(), tmp_path / "again")
    MAX_DIFFS["import, train, export llama"] = diff
    assert diff < TOL


def test_import_mismatch_names_every_field_and_both_values(tmp_path):
    hf_model("gpt2").save_pretrained(tmp_path / "hf")
    cfg = load_config(None, [*hf_model_overrides(tmp_path / "hf"), "model.n_layers=3", "model.d_model=64",
                             "model.seq_len=64", "model.tie_embeddings=false"]).model
    with pytest.raises(UserError) as e:
        load_hf_state(tmp_path / "hf", cfg)
    msg = str(e.value)
    assert "\n" not in msg
    for text in ("model.n_layers=3", "has 2", "model.d_model=64", "has 32", "model.seq_len=64",
                 "model.tie_embeddings=false"):
        assert text in msg, (text, msg)
    # a shorter sequence than the model's positions is fine (the first seq_len positions)
    short = load_config(None, [*hf_model_overrides(tmp_path / "hf"), "model.seq_len=16"]).model
    assert load_hf_state(tmp_path / "hf", short)["embed.pos.weight"].shape == (16, 32)
    # attention and bias: a sliding window the model does not have, and biases a bias=false model lacks
    cfg = load_config(None, [*hf_model_overrides(tmp_path / "hf"), "model.attention=sliding",
                             "model.window=8", "model.bias=false"]).model
    with pytest.raises(UserError, match=r"model.attention=sliding, model.window=8.*model.bias=false"):
        load_hf_state(tmp_path / "hf", cfg)


def test_import_refuses_pickles_and_models_without_counterpart(tmp_path, monkeypatch):
    d = tmp_path / "pickled"
    hf_model("gpt2").save_pretrained(d)
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must not be called on a downloaded file")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(UserError, match=r"pytorch_model.bin.*only safetensors"):
        load_hf_state(d, ModelConfig(vocab_size=64))
    with pytest.raises(UserError, match="no config.json"):
        load_hf_state(tmp_path, ModelConfig(vocab_size=64))

    def refused(config: dict, expect: str):
        (tmp_path / "x").mkdir(exist_ok=True)
        shutil.copy(tmp_path / "base" / "model.safetensors", tmp_path / "x" / "model.safetensors")
        (tmp_path / "x" / "config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=expect):
            hf_model_overrides(tmp_path / "x")

    monkeypatch.undo()
    hf_model("llama").save_pretrained(tmp_path / "base")
    base = json.loads((tmp_path / "base" / "config.json").read_text())
    refused({**base, "num_key_value_heads": 2}, "grouped-query attention")
    refused({**base, "model_type": "gpt_neox"}, "model_type 'gpt_neox' has no megascale counterpart")
    refused({**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope type 'linear'")
    refused({**base, "mlp_bias": True}, "mlp_bias")
    gpt2 = tmp_path / "gpt2_new"
    hf_model("gpt2").save_pretrained(gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "activation_function": "gelu_new"}))
    with pytest.raises(UserError, match="activation_function='gelu_new'"):
        hf_model_overrides(gpt2)


# ---------------------------------------------------------------------------------------
# model.init_from=hf:DIR through the Trainer


def test_trainer_init_from_hf_train_export(corpus, tmp_path, capsys):
    """hf -> Trainer(model.init_from=hf:DIR) starts from those weights -> trains -> export -> equal logits."""
    hf_model("llama", vocab=300).save_pretrained(tmp_path / "hf")
    overrides = [o for o in hf_model_overrides(tmp_path / "hf") if not o.startswith("model.seq_len")]
    cfg = tiny(corpus, tmp_path / "run", *overrides, f"model.init_from=hf:{tmp_path / 'hf'}")
    trainer = Trainer(cfg, quiet=True)
    start = load_hf_state(tmp_path / "hf", cfg.model)
    assert all(torch.equal(trainer.model.state_dict()[k].float(), v) for k, v in start.items())
    trainer.fit()
    assert export(tmp_path / "run", tmp_path / "again") == 0, capsys.readouterr().err
    run_cfg, state = read_model_state(tmp_path / "run")
    assert not torch.equal(state["norm.weight"], start["norm.weight"])
    assert max_diff(ours(run_cfg.model, state), tmp_path / "again") < TOL
