"""FLOPs accounting against hand counts and against torch's own FLOP counter."""

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megascale.config import ConfigError, ModelConfig
from megascale.model import GPT
from megascale.perf.flops import (
    attended_keys,
    flops_per_token,
    forward_flops_per_token,
    hardware_flops_per_token,
    model_flops_per_token,
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
