"""`megascale generate` and sample_text: padded ids never sampled, options checked, any checkpoint read."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import megascale.checkpoint.model_state as model_state
from megascale.checkpoint import list_checkpoints
from megascale.cli import main
from megascale.config import ModelConfig, load_config
from megascale.data.tokenizer import ByteTokenizer
from megascale.errors import UserError
from megascale.generate import generate_from_run, sample_text
from megascale.model import GPT
from megascale.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
BYTES = 257  # the byte tokenizer's vocabulary
PADDED = 320


def padded_model(seed: int = 0) -> GPT:
    """A GPT whose padded ids (>= 257) carry by far the largest logits: unmasked, they would win."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(vocab_size=PADDED, seq_len=16, n_layers=1, d_model=32, n_heads=2,
                            tie_embeddings=False)).eval()
    with torch.no_grad():
        model.head.weight[BYTES:] = model.head.weight[BYTES:].sign() * 5.0
    return model


def test_padded_ids_are_never_sampled():
    model = padded_model()
    idx = torch.tensor([[1, 2, 3]])
    gen = torch.Generator().manual_seed(0)
    unmasked = model.generate(idx, 30, temperature=1.0, generator=gen)
    assert (unmasked[:, 3:] >= BYTES).any(), "the test model must prefer padded ids"
    for temperature, top_k in ((1.0, None), (1.0, 5), (2.0, 1000), (0.0, None)):
        gen = torch.Generator().manual_seed(0)
        out = model.generate(idx, 60, temperature=temperature, top_k=top_k, generator=gen, vocab_limit=BYTES)
        assert out.shape == (1, 63) and int(out.max()) < BYTES, (temperature, top_k)
    # sample_text masks to the tokenizer's vocabulary by itself (the byte tokenizer could not even
    # decode an id >= 256: it used to crash here)
    for seed in range(3):
        text = sample_text(model, ByteTokenizer(), "ab", 40, temperature=1.0, top_k=None, seed=seed)
        assert text.startswith("ab")


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_sliding_window_generation_meets_few_shapes_and_samples_as_unpadded(style):
    """Past the window each context is right-padded to a power of two (or seq_len): a 100-token greedy
    generation at seq_len 64, window 8 runs the body on 8 lengths at most (1-8 as they come, then 16,
    32, 64), not 64, and picks the very tokens an unpadded run does (causal: padding after the last
    token changes nothing before it; float64, so any leak would show)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=BYTES, seq_len=64, n_layers=2, d_model=32, n_heads=2, style=style,
                      attention="sliding", window=8)
    model = GPT(cfg).double().eval()
    lengths, body = [], model.body

    def recording(ids):
        lengths.append(ids.shape[1])
        return body(ids)

    model.body = recording
    idx = torch.tensor([[3, 1, 4]])
    out = model.generate(idx, 100, temperature=0)
    assert set(lengths) - set(range(1, 9)) == {16, 32, 64}, sorted(set(lengths))
    # the same generation, one unpadded forward per token
    want = idx
    with torch.no_grad():
        for _ in range(100):
            logits = model.head(body(want[:, -cfg.seq_len:])[:, -1])
            want = torch.cat((want, logits.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, want)


def test_sample_text_without_padding_and_zero_tokens():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=BYTES, seq_len=16, n_layers=1, d_model=32, n_heads=2)).eval()
    assert sample_text(model, ByteTokenizer(), "hi", 0) == "hi"
    greedy = [sample_text(model, ByteTokenizer(), "hi", 10, temperature=0, seed=s) for s in (0, 1)]
    assert greedy[0] == greedy[1]  # temperature 0 is greedy: the seed does not matter


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_new_tokens": -1}, "--max-new-tokens: must be >= 0"),
    ({"temperature": -0.5}, "--temperature: must be a finite number >= 0"),
    ({"temperature": math.nan}, "--temperature"),
    ({"temperature": math.inf}, "--temperature"),
    ({"top_k": 0}, "--top-k: must be >= 1"),
    ({"top_k": -3}, "--top-k: must be >= 1"),
])
def test_bad_options_are_one_user_error_each(kwargs, field):
    model = padded_model()
    args = {"max_new_tokens": 5, "temperature": 0.8, "top_k": 50, **kwargs}
    with pytest.raises(UserError) as e:
        sample_text(model, ByteTokenizer(), "x", args["max_new_tokens"], args["temperature"], args["top_k"])
    assert str(e.value).startswith(field) and "\n" not in str(e.value)
    with pytest.raises(ValueError):  # the model itself refuses a top_k it cannot honour, too
        model.generate(torch.tensor([[1]]), 1, top_k=0)


# ---------------------------------------------------------------------------------------
# From a run: read through read_model_state, whatever the checkpoint's format


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny trained run whose model.vocab_size (320) is padded past the byte tokenizer's 257."""
    d = tmp_path_factory.mktemp("gen")
    (d / "corpus").mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "sonnets_gut.txt", d / "corpus" / "sonnets.txt")
    cfg = load_config(None, [
        "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
        f"model.vocab_size={PADDED}", "model.tie_embeddings=false", "train.global_batch=4",
        "train.micro_batch=4", "train.steps=2", "train.eval_interval=0", "optim.warmup_steps=0",
        "log.progress=false", "log.tensorboard=false", "log.jsonl=false", "log.sample_tokens=0",
        "log.peak_flops=1e12", "checkpoint.interval=0",
        f"data.source={json.dumps(str(d / 'corpus'))}", f"data.path={json.dumps(str(d / 'cache' / 'ds'))}",
        f"train.run_dir={json.dumps(str(d / 'run'))}",
    ])
    Trainer(cfg, quiet=True).fit()
    return d / "run"


def test_generate_from_run_reads_model_state(run, monkeypatch):
    calls = []
    real = model_state.read_model_state

    def spy(path):
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(model_state, "read_model_state", spy)
    # untrained-ish, near-uniform logits over 320 ids: unmasked, some of 200 tokens would be padded
    # ones, which the byte tokenizer cannot decode
    text = generate_from_run(str(run), "To be", 200, temperature=1.0, top_k=None, seed=0)
    assert text.startswith("To be") and calls == [str(run)]
    (_, ckpt), = list_checkpoints(run)  # one checkpoint directory of the run, given directly
    same = generate_from_run(str(ckpt), "To be", 200, temperature=1.0, top_k=None, seed=0)
    assert same == text and calls[-1] == str(ckpt)


def _cli(capsys, *args) -> tuple[int, list[str], str]:
    rc = main(["generate", *args])
    out = capsys.readouterr()
    return rc, out.err.strip().splitlines(), out.out


def test_generate_cli_errors_are_one_line_exit_2(run, tmp_path, capsys):
    rc, err, out = _cli(capsys, "--checkpoint", str(run), "--prompt", "O", "--max-new-tokens", "5")
    assert rc == 0 and out.startswith("O"), err
    for args, expect in ((["--top-k", "0"], "--top-k"), (["--temperature", "-1"], "--temperature"),
                         (["--max-new-tokens", "-2"], "--max-new-tokens")):
        rc, err, _ = _cli(capsys, "--checkpoint", str(run), *args)
        assert rc == 2 and len(err) == 1 and expect in err[0], (args, err)
        # the options are checked before any checkpoint is read
        rc, err, _ = _cli(capsys, "--checkpoint", str(tmp_path / "nowhere"), *args)
        assert rc == 2 and len(err) == 1 and expect in err[0], (args, err)
    rc, err, _ = _cli(capsys, "--checkpoint", str(tmp_path / "nowhere"))
    assert rc == 2 and len(err) == 1 and "nowhere" in err[0], err
