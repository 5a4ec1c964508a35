"""The GPT against a straightforward reference built by hand from the module's own weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from megascale.config import ConfigError, ModelConfig
from megascale.model import GPT, LayerFactory
from megascale.model.rotary import Rotary


def tiny(**kw):
    base = dict(vocab_size=257, seq_len=12, n_layers=2, d_model=16, n_heads=4)
    return ModelConfig(**{**base, **kw})


def build(cfg, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return GPT(cfg).to(dtype)


def tokens(cfg, b=3, s=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, s or cfg.seq_len), generator=g)


# ---------------------------------------------------------------------------------------
# Reference: every step written out, reading the weights in their documented layouts


def ref_norm(cfg, norm, x):
    if cfg.style == "llama":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * norm.weight
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + cfg.norm_eps) * norm.weight
    return y + norm.bias if norm.bias is not None else y


def ref_linear(layer, x):
    y = x @ layer.weight.T
    return y + layer.bias if layer.bias is not None else y


def ref_rotate(cfg, x):
    """Rotate pair (x[k], x[k + hd/2]) by angle pos * theta^(-2k/hd), one pair at a time."""
    s, hd = x.shape[-2], x.shape[-1]
    half = hd // 2
    out = x.clone()
    for pos in range(s):
        for k in range(half):
            a = pos * cfg.rope_theta ** (-2 * k / hd)
            c, sn = math.cos(a), math.sin(a)
            x1, x2 = x[..., pos, k], x[..., pos, k + half]
            out[..., pos, k] = x1 * c - x2 * sn
            out[..., pos, k + half] = x2 * c + x1 * sn
    return out


def ref_attention(cfg, attn, x):
    b, s, d = x.shape
    hd = cfg.head_dim
    # qkv features ordered (head, [q, k, v], head_dim)
    qkv = ref_linear(attn.qkv, x).view(b, s, cfg.n_heads, 3, hd)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    if cfg.style == "llama":
        q, k = ref_rotate(cfg, q), ref_rotate(cfg, k)
    i = torch.arange(s)
    dist = i[:, None] - i[None, :]
    allowed = (dist >= 0) & ((dist < cfg.window) if cfg.attention == "sliding" else True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    y = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return ref_linear(attn.proj, y.transpose(1, 2).reshape(b, s, d))


def ref_mlp(cfg, mlp, x):
    h = ref_linear(mlp.fc_in, x)
    if cfg.style == "llama":  # features ordered (ffn, [gate, up])
        gate, up = h[..., 0::2], h[..., 1::2]
        return ref_linear(mlp.fc_out, gate * torch.sigmoid(gate) * up)
    gelu = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return ref_linear(mlp.fc_out, gelu)


def ref_block(cfg, blk, x):
    if cfg.block == "parallel":
        return (
            x
            + ref_attention(cfg, blk.attn, ref_norm(cfg, blk.norm1, x))
            + ref_mlp(cfg, blk.mlp, ref_norm(cfg, blk.norm2, x))
        )
    h = x + ref_attention(cfg, blk.attn, ref_norm(cfg, blk.norm1, x))
    return h + ref_mlp(cfg, blk.mlp, ref_norm(cfg, blk.norm2, h))


def ref_logits(cfg, model, idx):
    x = model.embed.tok.weight[idx]
    if cfg.style == "gpt":
        x = x + model.embed.pos.weight[: idx.shape[1]]
    for blk in model.blocks:
        x = ref_block(cfg, blk, x)
    return ref_norm(cfg, model.norm, x) @ model.head.weight.T


def variant_id(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


VARIANTS = [
    dict(),
    dict(block="parallel"),
    dict(attention="sliding", window=3),
    dict(block="parallel", attention="sliding", window=5),
    dict(style="llama", bias=False),
    dict(style="llama", bias=False, block="parallel", attention="sliding", window=4),
    dict(tie_embeddings=False, bias=False, d_ff=24),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=variant_id)
def test_block_equals_reference(kw):
    cfg = tiny(**kw)
    model = build(cfg)
    # Non-trivial norms and biases, so that a swapped weight would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    for blk in model.blocks:
        torch.testing.assert_close(blk(x), ref_block(cfg, blk, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kw", VARIANTS, ids=variant_id)
def test_model_equals_reference(kw):
    cfg = tiny(**kw)
    model = build(cfg)
    idx, targets = tokens(cfg), tokens(cfg, seed=2)
    ref = ref_logits(cfg, model, idx)
    torch.testing.assert_close(model(idx), ref, rtol=1e-10, atol=1e-12)
    loss = model(idx, targets)
    assert loss.dim() == 0
    ref_loss = F.cross_entropy(ref.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)


def test_parallel_block_differs_from_sequential():
    seq, par = build(tiny()), build(tiny(block="parallel"))
    par.load_state_dict(seq.state_dict())
    idx = tokens(tiny())
    assert not torch.allclose(seq(idx), par(idx))


def test_rotary_depends_only_on_relative_position():
    hd, theta = 8, 10000.0
    rot = Rotary(hd, 32, theta).double()
    q, k = torch.randn(2, hd, dtype=torch.float64)
    qs, ks = rot(q.expand(32, hd)), rot(k.expand(32, hd))  # q and k placed at every position
    for i, j, shift in [(5, 2, 7), (3, 3, 20), (10, 0, 1)]:
        torch.testing.assert_close(qs[i] @ ks[j], qs[i + shift] @ ks[j + shift], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(qs[5] @ ks[2], qs[5] @ ks[3])
    torch.testing.assert_close(rot(q.expand(32, hd)).norm(dim=-1), q.norm().expand(32))  # a rotation
    # offset: the token at position p rotates the same whether or not earlier ones are present
    torch.testing.assert_close(rot(q.expand(4, hd), offset=6), qs[6:10])


def test_rotary_tables_rebuilt_exactly_in_float64():
    rot = Rotary(8, 16).double()
    f64 = dict(dtype=torch.float64)
    expected = torch.outer(torch.arange(16, **f64), 10000.0 ** (-torch.arange(4, **f64) / 4)).cos()
    assert rot.cos.dtype == torch.float64
    torch.testing.assert_close(rot.cos, expected, rtol=0, atol=1e-15)


def test_tied_embeddings_share_storage():
    model = build(tiny())
    assert model.head.weight is model.embed.tok.weight
    assert model.head.weight.data_ptr() == model.embed.tok.weight.data_ptr()
    untied = build(tiny(tie_embeddings=False))
    assert untied.head.weight.data_ptr() != untied.embed.tok.weight.data_ptr()
    v, d = 257, 16
    assert untied.num_params() - model.num_params() == v * d  # the tied head is counted once
    assert model.num_params(exclude_embeddings=True) == untied.num_params(exclude_embeddings=True)
    assert model.num_params(exclude_embeddings=True) == model.num_params() - v * d - 12 * d


def test_recompute_gives_identical_loss_and_grads():
    results = []
    for recompute in (False, True):
        cfg = tiny(recompute=recompute, dropout=0.2)
        model = build(cfg)
        torch.manual_seed(123)  # same dropout masks in both runs
        loss = model(tokens(cfg), tokens(cfg, seed=2))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads0[name], grads1[name], rtol=0, atol=0, msg=name)


def test_init_scaled_residual_projections():
    cfg = ModelConfig(vocab_size=512, seq_len=16, n_layers=8, d_model=256, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    residual = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith(("attn.proj.weight", "mlp.fc_out.weight")):
            assert p.std().item() == pytest.approx(residual, rel=0.05), name
        elif name.endswith(("qkv.weight", "fc_in.weight", "tok.weight", "pos.weight")):
            assert p.std().item() == pytest.approx(cfg.init_std, rel=0.05), name
        elif "norm" in name and name.endswith("weight"):
            assert torch.all(p == 1), name
        else:
            assert name.endswith("bias") and torch.all(p == 0), name


def test_generate_shape_determinism_and_cropping():
    cfg = tiny()
    model = build(cfg, dtype=torch.float32)
    prompt = tokens(cfg, b=2, s=5)

    def sample(seed, **kw):
        return model.generate(prompt, 20, generator=torch.Generator().manual_seed(seed), **kw)

    out = sample(0)
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)  # beyond seq_len = 12: cropped
    assert torch.equal(out, sample(0)) and not torch.equal(out, sample(1))
    assert torch.equal(sample(0, temperature=0), sample(1, temperature=0))  # greedy
    top1 = sample(3, top_k=1)
    assert torch.equal(top1, sample(0, temperature=0))
    assert ((out >= 0) & (out < cfg.vocab_size)).all()
    model.train()
    sample(0)
    assert model.training  # mode restored


def test_odd_vocab_float32_and_bf16_autocast():
    cfg = tiny(vocab_size=257, style="llama", bias=False, attention="sliding", window=5)
    model = build(cfg, dtype=torch.float32)
    idx, targets = tokens(cfg), tokens(cfg, seed=2)
    loss32 = model(idx, targets)
    assert model(idx).shape == (3, cfg.seq_len, 257)
    assert loss32.item() == pytest.approx(math.log(257), rel=0.05)  # small init: near uniform
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16 = model(idx, targets)
    loss16.backward()
    assert loss16.dtype == torch.float32 and loss16.item() == pytest.approx(loss32.item(), rel=0.02)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_ignore_index_and_length_check():
    cfg = tiny()
    model = build(cfg)
    idx, targets = tokens(cfg), tokens(cfg, seed=2)
    masked = targets.clone()
    masked[:, 6:] = -1
    ref = F.cross_entropy(model(idx)[:, :6].flatten(0, 1), targets[:, :6].flatten())
    torch.testing.assert_close(model(idx, masked), ref)
    with pytest.raises(ValueError, match="seq_len"):
        model(tokens(cfg, s=cfg.seq_len + 1))


def test_vocab_must_be_known():
    with pytest.raises(ConfigError, match="model.vocab_size"):
        GPT(tiny(vocab_size=0))
    with pytest.raises(ConfigError, match="model.attention"):
        GPT(tiny(attention="local"))


def test_layers_come_from_the_factory_with_their_roles():
    calls = []

    class Recording(LayerFactory):
        def linear(self, in_features, out_features, bias, style):
            calls.append(("linear", in_features, out_features, bias, style))
            return super().linear(in_features, out_features, bias, style)

        def embedding(self, num_embeddings, dim, style="vocab"):
            calls.append(("embedding", num_embeddings, dim, style))
            return super().embedding(num_embeddings, dim, style)

    GPT(tiny(n_layers=1, style="llama", bias=False, d_ff=32), Recording())
    assert calls == [
        ("embedding", 257, 16, "vocab"),
        ("linear", 16, 48, False, "column"),  # qkv
        ("linear", 16, 16, False, "row"),  # attention out
        ("linear", 16, 64, False, "column"),  # gate + up
        ("linear", 32, 16, False, "row"),  # down
        ("linear", 16, 257, False, "head"),
    ]


def test_flops_delegate_to_perf():
    from megascale.perf.flops import flops_per_token

    cfg = tiny()
    model = build(cfg)
    assert model.flops_per_token() == flops_per_token(cfg)
    assert model.flops_per_token(training=False) == flops_per_token(cfg, training=False)
