"""FLOPs accounting against hand counts and against torch's own FLOP counter."""

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megascale.config import ConfigError, ModelConfig
from megascale.model import GPT
from megascale.perf.flops import (
    EXACT,
    PUBLISHED,
    attended_keys,
    flops_per_token,
    forward_flops_per_token,
    hardware_flops_per_token,
    mfu_conventions,
    model_flops_per_token,
    published_flops_per_token,
    published_param_count,
)


def small(**kw):
    base = dict(vocab_size=100, seq_len=16, n_layers=2, d_model=64, n_heads=4)
    return ModelConfig(**{**base, **kw})


def test_hand_count_gpt_full():
    # d = 64, ffn = 4 * 64 = 256, L = 2, V = 100, s = 16: causal keys per query (16 + 1) / 2 = 8.5
    qkv = 2 * 64 * 192  # 24576
    scores = 2 * 64 * 8.5  # 1088
    values = 2 * 64 * 8.5  # 1088
    out = 2 * 64 * 64  # 8192
    mlp = 2 * 2 * 64 * 256  # 65536
    per_layer = qkv + scores + values + out + mlp  # 100480
    head = 2 * 64 * 100  # 12800
    forward = 2 * per_layer + head  # 213760
    assert forward == 213760

    f = forward_flops_per_token(small())
    assert (f.qkv, f.attn_scores, f.attn_values, f.attn_out_proj, f.mlp, f.head) == (
        2 * qkv, 2 * scores, 2 * values, 2 * out, 2 * mlp, head
    )  # fmt: skip
    assert f.total == forward and f.blocks == 2 * per_layer
    assert flops_per_token(small(), training=False) == forward
    assert flops_per_token(small()) == 3 * forward == 641280
    assert flops_per_token(small(), recompute=True) == 3 * forward + 2 * per_layer == 842240


def test_hand_count_llama_swiglu():
    # ffn_dim = 64 * ceil(int(8 * 64 / 3) / 64) = 64 * ceil(170 / 64) = 192; three matmuls
    cfg = small(style="llama", bias=False)
    assert cfg.ffn_dim == 192
    assert forward_flops_per_token(cfg).mlp == 2 * 3 * 2 * 64 * 192


def test_attended_keys_matches_brute_force():
    for s in range(1, 40):
        assert attended_keys(s) == sum(i + 1 for i in range(s)) / s == (s + 1) / 2
        for w in range(1, s + 3):
            assert attended_keys(s, w) == pytest.approx(sum(min(i + 1, w) for i in range(s)) / s, rel=1e-15)


def test_sliding_window_is_cheaper():
    full = forward_flops_per_token(small(seq_len=256))
    for w in (1, 16, 128, 255):
        slid = forward_flops_per_token(small(seq_len=256, attention="sliding", window=w))
        assert slid.attn_scores < full.attn_scores and slid.total < full.total
        assert slid.qkv == full.qkv and slid.mlp == full.mlp
    same = forward_flops_per_token(small(seq_len=256, attention="sliding", window=256))
    assert same == full


def test_model_vs_hardware_flops():
    cfg = small(recompute=True)
    assert model_flops_per_token(cfg) == flops_per_token(cfg)
    assert hardware_flops_per_token(cfg) == flops_per_token(cfg, recompute=True)
    assert hardware_flops_per_token(small()) == model_flops_per_token(small())


def test_breakdown_dict_and_seq_len_override():
    d = forward_flops_per_token(small()).as_dict()
    assert set(d) == {"qkv", "attn_scores", "attn_values", "attn_out_proj", "mlp", "head", "blocks", "total"}
    assert forward_flops_per_token(small(), seq_len=1).attn_scores == 2 * 2 * 64 * 1


def test_unknown_vocab_is_a_config_error():
    with pytest.raises(ConfigError, match="model.vocab_size"):
        forward_flops_per_token(small(vocab_size=0))


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_matmul_flops_match_torch_counter(style):
    """The projection and head terms equal what torch counts for the model's mm/addmm."""
    cfg = small(style=style, bias=style == "gpt")
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(idx)
    counts = counter.get_flop_counts()["Global"]
    counted = sum(n for op, n in counts.items() if str(op).split(".")[-1] in ("mm", "addmm"))
    f = forward_flops_per_token(cfg)
    assert counted == idx.numel() * (f.qkv + f.attn_out_proj + f.mlp + f.head)


def test_flops_module_imports_no_torch():
    code = "import sys, megascale.perf.flops; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- published convention


def test_published_hand_count_small_gpt():
    # d = 64, f = 256, L = 2, V = 100, s = 16, biases on, tied embeddings
    attn = 4 * 64 * 64 + 4 * 64  # qkv + out weights and biases: 16640
    mlp = 2 * 64 * 256 + 256 + 64  # fc-in, fc-out weights and biases: 33088
    norms = 2 * (64 + 64)  # two LayerNorms with bias: 256
    n = 2 * (attn + mlp + norms) + (64 + 64) + 100 * 64  # + final norm + the (tied) head: 106496
    assert published_param_count(small()) == n == 106496
    assert published_flops_per_token(small()) == 6 * n + 12 * 2 * 64 * 16 == 663552
    # position and untied token tables are lookups: N does not change with them
    assert published_param_count(small(tie_embeddings=False)) == n
    assert published_param_count(small(seq_len=1024)) == n


def test_published_gpt3_175b():
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads, s = 2048, V = 50257
    cfg = ModelConfig(vocab_size=50257, seq_len=2048, n_layers=96, d_model=12288, n_heads=96)
    d = 12288
    blocks = 96 * (12 * d * d + 13 * d)  # 12 d^2 weights, 13 d biases and norm parameters per layer
    n = blocks + 2 * d + 50257 * d
    assert published_param_count(cfg) == n == 174_579_093_504  # ~174.6e9: "175B"
    attention = 12 * 96 * d * 2048  # 12 L d s = 2.90e10
    assert published_flops_per_token(cfg) == 6 * n + attention == 1_076_465_590_272  # 1.076e12 per token
    # 6N alone is 1.047e12; the exact causal count is 1.4% lower than the published one
    assert published_flops_per_token(cfg) / model_flops_per_token(cfg) == pytest.approx(1.0137, abs=1e-4)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"bias": False},
        {"tie_embeddings": False},
        {"block": "parallel"},
        {"style": "llama", "bias": False},
        {"style": "llama", "bias": True, "tie_embeddings": False, "block": "parallel"},
        {"d_ff": 96},
    ],
)
def test_published_n_is_the_models_matmul_parameters(kw):
    """N = the model's parameters without its lookup tables, plus the head's weight counted once."""
    cfg = small(**kw)
    head = cfg.vocab_size * cfg.d_model
    assert published_param_count(cfg) == GPT(cfg).num_params(exclude_embeddings=True) + head


def test_exact_against_published_at_s_1():
    # At s = 1 both count attention over one key; what is left is that 6N also counts the norms
    # (and biases) as if they were weights: 6 * (2L + 1) * d for a bias-free llama model.
    cfg = small(style="llama", bias=False)
    exact, published = model_flops_per_token(cfg, seq_len=1), published_flops_per_token(cfg, seq_len=1)
    assert published - exact == 6 * (2 * cfg.n_layers + 1) * cfg.d_model
    # and at s tokens the published count adds attention over s keys instead of (s + 1) / 2
    s = cfg.seq_len
    assert published_flops_per_token(cfg) - model_flops_per_token(cfg) == (
        published - exact + 12 * cfg.n_layers * cfg.d_model * (s - (s + 1) / 2)
    )


def test_mfu_conventions_names_both():
    cfg = small()
    both = mfu_conventions(cfg)
    assert list(both) == [EXACT, PUBLISHED] == ["exact (causal (s+1)/2 keys)", "PaLM/Megatron 6N+12Lds"]
    assert both[EXACT] == model_flops_per_token(cfg) and both[PUBLISHED] == published_flops_per_token(cfg)
    assert mfu_conventions(cfg, seq_len=4)[PUBLISHED] == published_flops_per_token(cfg, seq_len=4)
    # the convention knows no windows: a sliding-window model costs it the full s
    slid = small(attention="sliding", window=4)
    assert published_flops_per_token(slid) == both[PUBLISHED] and model_flops_per_token(slid) < both[EXACT]
    with pytest.raises(ConfigError, match="model.vocab_size"):
        published_flops_per_token(small(vocab_size=0))
