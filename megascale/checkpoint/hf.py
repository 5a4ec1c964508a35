"""Hugging Face export and import: our GPT as GPT-2, Llama or Mistral, and back.

    megascale export runs/x --format hf --output hf/x        # model.safetensors + config.json
    AutoModelForCausalLM.from_pretrained("hf/x")               # same logits as our GPT
    state = load_hf_state("hf/x", cfg.model)                   # model.init_from=hf:hf/x
    hf_model_overrides("hf/x")                                 # ["model.style=llama", ...]

Only exact counterparts are written or read: the Hugging Face model must give the same
logits as ours (up to float rounding). Which of our models have one:

| ours                                                  | Hugging Face                           |
|-------------------------------------------------------|----------------------------------------|
| style=gpt, block=sequential, attention=full           | GPT-2 (activation "gelu", exact erf)   |
| style=llama, block=sequential, attention=full         | Llama (attention_bias = model.bias)    |
| style=llama, block=sequential, attention=sliding,     | Mistral (sliding_window = model.window)|
| bias=false                                            |                                        |

A sliding window at least as long as model.seq_len is full attention (exactly), and maps as
full attention. Refused, each with the field and the reason: the parallel block (GPT-2,
Llama and Mistral are sequential; GPT-NeoX's parallel residual has rotary positions, LayerNorm
and a GeLU MLP, which is neither of our styles), a sliding window in the GPT style (GPT-2 has
none), and attention biases with a sliding window (Mistral has none).

Layouts (ours -> theirs):

* qkv: our fused rows are ordered (head, [q, k, v], head_dim); GPT-2's c_attn is ([q, k, v],
  head, head_dim), Llama's q_proj/k_proj/v_proj are (head, head_dim) each.
* GPT-2's Conv1D stores weights (in, out): the transpose of nn.Linear's.
* SwiGLU: our fused fc_in rows are (ffn, [gate, up]); Llama has gate_proj and up_proj.
* Rotary: ours pairs x[k] with x[k + hd/2] ("rotate half"), as Hugging Face Llama does: no
  permutation of q/k rows. Same inverse frequencies theta^(-2k/hd).
* Sliding window: ours and Mistral's both let a token see itself and the previous window-1.
* bias=false in the GPT style: GPT-2 always has biases; they are written as zeros (exact).
* Untied embeddings: tie_word_embeddings=false and an lm_head.weight of its own.
* A padded vocabulary (model.vocab_size above the tokenizer's): every row is exported, so the
  logits stay equal; generation_config.json then lists the padded ids in suppress_tokens, so
  Hugging Face's generate never samples them either.

Weights are read and written as safetensors only: a pickled pytorch_model.bin is refused,
since unpickling a downloaded file can run code.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megascale.config import ModelConfig
from megascale.data.atomic import fsync
from megascale.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Hugging Face model types we read, and the class defaults of the config fields we use when
# a config.json leaves them out (as save_pretrained does for some).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
             "tie_word_embeddings": True, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    "llama": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "num_key_value_heads": None, "head_dim": None},
    "mistral": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "num_key_value_heads": 8, "head_dim": None, "sliding_window": 4096},
}
# Non-parameter tensors older files may carry; they hold no weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# ---------------------------------------------------------------------------------------
# Which Hugging Face architecture, if any, is our model


def effective_window(m: ModelConfig) -> int | None:
    """The sliding window that changes anything: None for full attention or a window >= seq_len."""
    if m.attention == "sliding" and m.window < m.seq_len:
        return m.window
    return None


def hf_architecture(m: ModelConfig) -> str:
    """"gpt2", "llama" or "mistral": the exact Hugging Face counterpart of `m`; else one UserError."""
    reasons = []
    window = effective_window(m)
    if m.block == "parallel":
        if m.style == "gpt":
            reasons.append("model.block=parallel with model.style=gpt: GPT-2 has only the sequential block, "
                           "and GPT-NeoX's parallel residual uses rotary positions where model.style=gpt "
                           "learns absolute ones")
        else:
            reasons.append("model.block=parallel with model.style=llama: Llama and Mistral have only the "
                           "sequential block, and GPT-NeoX's parallel residual uses LayerNorm and a GeLU MLP "
                           "where model.style=llama has RMSNorm and SwiGLU")
    if window is not None and m.style == "gpt":
        reasons.append(f"model.attention=sliding (model.window={m.window} < model.seq_len={m.seq_len}) with "
                       "model.style=gpt: GPT-2 has no sliding-window attention (Mistral's sliding_window is "
                       "Llama style only)")
    if window is not None and m.style == "llama" and m.bias:
        reasons.append("model.bias=true with model.attention=sliding: Mistral, Hugging Face's sliding-window "
                       "Llama, has no attention biases (train with model.bias=false)")
    if reasons:
        raise UserError("; ".join(reasons) + ": no Hugging Face counterpart gives the same logits "
                        "(supported: GPT-2, Llama, Mistral with sequential blocks)")
    if m.style == "gpt":
        return "gpt2"
    return "mistral" if window is not None else "llama"


# ---------------------------------------------------------------------------------------
# Export


def hf_config(m: ModelConfig, eos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of our model's Hugging Face counterpart."""
    arch = hf_architecture(m)
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings,
              "initializer_range": m.init_std, "bos_token_id": eos_id, "eos_token_id": eos_id,
              "use_cache": True, "dtype": dtype}
    if arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": m.seq_len, "n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads,
                "n_inner": m.ffn_dim, "activation_function": "gelu", "layer_norm_epsilon": m.norm_eps,
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    out = {"architectures": ["LlamaForCausalLM" if arch == "llama" else "MistralForCausalLM"],
           "model_type": arch, **common,
           "hidden_size": m.d_model, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
           "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads, "head_dim": m.head_dim,
           "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
           "attention_dropout": m.dropout}
    if arch == "llama":
        out.update(attention_bias=m.bias, mlp_bias=False, pretraining_tp=1)
    else:
        out["sliding_window"] = m.window
    return out


def hf_tensors(m: ModelConfig, state: dict[str, Tensor],
               dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Our one-process state dict as the Hugging Face model's named tensors (contiguous, CPU)."""
    arch = hf_architecture(m)
    d, hd, h = m.d_model, m.head_dim, m.n_heads

    def get(name: str) -> Tensor:
        if name not in state:
            raise UserError(f"checkpoint: the model state has no {name} (does it match its config?)")
        return state[name].detach().to("cpu", torch.float64)

    def zeros(n: int) -> Tensor:
        return torch.zeros(n, dtype=torch.float64)

    def bias(name: str, n: int) -> Tensor:
        return get(name) if m.bias else zeros(n)

    def qkv_split(t: Tensor) -> Tensor:  # (head, [q,k,v], hd, ...) -> ([q,k,v], head, hd, ...)
        return t.unflatten(0, (h, 3, hd)).transpose(0, 1)

    out: dict[str, Tensor] = {}
    if arch == "gpt2":
        p = "transformer."
        out[p + "wte.weight"] = get("embed.tok.weight")
        out[p + "wpe.weight"] = get("embed.pos.weight")
        for i in range(m.n_layers):
            o, b = f"{p}h.{i}.", f"blocks.{i}."
            out[o + "ln_1.weight"] = get(b + "norm1.weight")
            out[o + "ln_1.bias"] = bias(b + "norm1.bias", d)
            out[o + "attn.c_attn.weight"] = qkv_split(get(b + "attn.qkv.weight")).reshape(3 * d, d).t()
            out[o + "attn.c_attn.bias"] = qkv_split(bias(b + "attn.qkv.bias", 3 * d)).reshape(3 * d)
            out[o + "attn.c_proj.weight"] = get(b + "attn.proj.weight").t()
            out[o + "attn.c_proj.bias"] = bias(b + "attn.proj.bias", d)
            out[o + "ln_2.weight"] = get(b + "norm2.weight")
            out[o + "ln_2.bias"] = bias(b + "norm2.bias", d)
            out[o + "mlp.c_fc.weight"] = get(b + "mlp.fc_in.weight").t()
            out[o + "mlp.c_fc.bias"] = bias(b + "mlp.fc_in.bias", m.ffn_dim)
            out[o + "mlp.c_proj.weight"] = get(b + "mlp.fc_out.weight").t()
            out[o + "mlp.c_proj.bias"] = bias(b + "mlp.fc_out.bias", d)
        out[p + "ln_f.weight"] = get("norm.weight")
        out[p + "ln_f.bias"] = bias("norm.bias", d)
    else:
        p = "model."
        out[p + "embed_tokens.weight"] = get("embed.tok.weight")
        for i in range(m.n_layers):
            o, b = f"{p}layers.{i}.", f"blocks.{i}."
            out[o + "input_layernorm.weight"] = get(b + "norm1.weight")
            q, k, v = qkv_split(get(b + "attn.qkv.weight")).reshape(3, d, d)
            out[o + "self_attn.q_proj.weight"], out[o + "self_attn.k_proj.weight"] = q, k
            out[o + "self_attn.v_proj.weight"] = v
            out[o + "self_attn.o_proj.weight"] = get(b + "attn.proj.weight")
            if m.bias:  # hf_architecture refused biases for Mistral
                qb, kb, vb = qkv_split(get(b + "attn.qkv.bias")).reshape(3, d)
                out[o + "self_attn.q_proj.bias"], out[o + "self_attn.k_proj.bias"] = qb, kb
                out[o + "self_attn.v_proj.bias"] = vb
                out[o + "self_attn.o_proj.bias"] = get(b + "attn.proj.bias")
            out[o + "post_attention_layernorm.weight"] = get(b + "norm2.weight")
            gate, up = get(b + "mlp.fc_in.weight").unflatten(0, (m.ffn_dim, 2)).unbind(1)
            out[o + "mlp.gate_proj.weight"], out[o + "mlp.up_proj.weight"] = gate, up
            out[o + "mlp.down_proj.weight"] = get(b + "mlp.fc_out.weight")
        out[p + "norm.weight"] = get("norm.weight")
    if not m.tie_embeddings:  # tied: Hugging Face ties lm_head to the embedding itself
        out["lm_head.weight"] = get("head.weight")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def save_hf(m: ModelConfig, state: dict[str, Tensor], output: str | Path, force: bool = False,
            dtype: str = "float32", tokenizer_vocab: int | None = None, eos_id: int | None = None) -> str:
    """Write our model as a Hugging Face directory; returns its architecture ("gpt2", ...).

    Everything is checked and converted in memory first, then written to a temporary sibling
    of `output` and renamed into place: a failure leaves no half-written output. An existing
    non-empty `output` is replaced only with force=True. `tokenizer_vocab` below
    m.vocab_size (a padded vocabulary) writes the padded ids into generation_config.json's
    suppress_tokens.
    """
    if dtype not in DTYPES:
        raise UserError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(output)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {out}: exists and is not empty; pass --force to replace it")
    config = hf_config(m, eos_id=eos_id, dtype=dtype)
    tensors = hf_tensors(m, state, DTYPES[dtype])
    generation = None
    if tokenizer_vocab is not None and tokenizer_vocab < m.vocab_size:
        generation = {"bos_token_id": eos_id, "eos_token_id": eos_id,
                      "suppress_tokens": list(range(tokenizer_vocab, m.vocab_size))}

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise UserError(f"--output {out}: cannot be written ({e.strerror or e})") from None
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if generation is not None:
            (tmp / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        for f in tmp.iterdir():
            fsync(f)
        if out.exists() or out.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except (OSError, SafetensorError) as e:  # (safetensors' own error for an I/O failure: a full disk)
        # one line, and nothing of it left (an existing output stays)
        raise UserError(f"--output {out}: cannot be written ({getattr(e, 'strerror', None) or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left over when something failed
    return config["model_type"]


def export_run(run: str | Path, output: str | Path, force: bool = False, dtype: str = "float32") -> str:
    """`megascale export RUN --format hf --output DIR`: the newest checkpoint of a run (or the given
    checkpoint directory) as a Hugging Face model directory. Returns the architecture."""
    from megascale.checkpoint.model_state import read_model_state

    cfg, state = read_model_state(run)
    hf_architecture(cfg.model)  # refuse before anything else is done
    tokenizer_vocab, eos_id = _tokenizer_info(cfg.data.tokenizer)
    return save_hf(cfg.model, state, output, force=force, dtype=dtype, tokenizer_vocab=tokenizer_vocab,
                   eos_id=eos_id)


def _tokenizer_info(spec: str) -> tuple[int | None, int | None]:
    """(vocab size, eos id) of the run's tokenizer, or (None, None) where it cannot be read now."""
    from megascale.data import build_tokenizer

    try:
        tok = build_tokenizer(spec)
    except UserError:  # e.g. a tokenizer.json that moved since training: the weights export all the same
        return None, None
    return tok.vocab_size, tok.eos_id


# ---------------------------------------------------------------------------------------
# Import


def read_hf(directory: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, the tensors of model.safetensors or its shards), never unpickling anything."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"hf:{d}: not a directory")
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file():
        raise UserError(f"hf:{d}: no {CONFIG_FILE} (not a Hugging Face model directory)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"hf:{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"hf:{cfg_path}: not a JSON object")
    if (d / WEIGHTS_FILE).is_file():
        files = [d / WEIGHTS_FILE]
    elif (d / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise UserError(f"hf:{d / INDEX_FILE}: not a safetensors index ({e})") from None
        files = [d / name for name in sorted(set(weight_map.values()))]
    else:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise UserError(f"hf:{d}: has {', '.join(pickles)} but no {WEIGHTS_FILE}: only safetensors are "
                            "read (a pickled checkpoint can run code when loaded); convert it to safetensors "
                            "with a tool you trust first")
        raise UserError(f"hf:{d}: no {WEIGHTS_FILE}")
    tensors: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise UserError(f"hf:{d}: the index names {f.name}, which is missing")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise UserError(f"hf:{f}: not a readable safetensors file ({e})") from None
    return config, tensors


def _field(config: dict[str, Any], key: str, *legacy: str) -> Any:
    """A config value (null included: Mistral's "sliding_window": null is no window), or its
    architecture's default where config.json leaves it out."""
    for k in (key, *legacy):
        if k in config:
            return config[k]
    return _DEFAULTS[config["model_type"]].get(key)


def _rope_theta(config: dict[str, Any], where: str) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UserError(f"hf:{where}: rope type {rope_type!r} has no megascale counterpart (only the plain "
                        "rotary of model.rope_theta)")
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def describe_hf(directory: str | Path) -> dict[str, Any]:
    """The ModelConfig fields of the Hugging Face model in `directory` (UserError if it has none)."""
    config, tensors = read_hf(directory)
    return _describe(config, tensors, str(directory))


def _describe(config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> dict[str, Any]:
    arch = config.get("model_type")
    if arch not in _DEFAULTS:
        raise UserError(f"hf:{where}: model_type {arch!r} has no megascale counterpart (supported: "
                        f"{', '.join(_DEFAULTS)})")
    f = lambda key, *legacy: _field(config, key, *legacy)  # noqa: E731
    nonzero_bias = any(k.endswith(".bias") and not k.endswith(_IGNORED_SUFFIXES) and bool(t.any())
                       for k, t in tensors.items())
    if arch == "gpt2":
        act = f("activation_function")
        if act != "gelu":
            raise UserError(f"hf:{where}: activation_function={act!r}; megascale's GPT style uses the "
                            "exact (erf) GeLU, Hugging Face's \"gelu\" (gelu_new and gelu_pytorch_tanh are "
                            "the tanh approximation, whose logits differ)")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if bool(f(key)) != want:
                raise UserError(f"hf:{where}: {key}={f(key)} has no megascale counterpart (needs {want})")
        d = int(f("n_embd", "hidden_size"))
        return {"style": "gpt", "block": "sequential", "attention": "full", "window": 0,
                "n_layers": int(f("n_layer", "num_hidden_layers")), "d_model": d,
                "n_heads": int(f("n_head", "num_attention_heads")), "d_ff": int(f("n_inner") or 4 * d),
                "vocab_size": int(f("vocab_size")), "seq_len": int(f("n_positions", "n_ctx")),
                "norm_eps": float(f("layer_norm_epsilon")), "tie_embeddings": bool(f("tie_word_embeddings")),
                "bias": nonzero_bias}
    act = f("hidden_act")
    if act != "silu":
        raise UserError(f"hf:{where}: hidden_act={act!r}; megascale's Llama style uses SwiGLU (silu)")
    d, heads = int(f("hidden_size")), int(f("num_attention_heads"))
    kv_heads = int(f("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise UserError(f"hf:{where}: num_key_value_heads={kv_heads} < num_attention_heads={heads} "
                        "(grouped-query attention) has no megascale counterpart")
    head_dim = int(f("head_dim") or d // heads)
    if head_dim * heads != d:
        raise UserError(f"hf:{where}: head_dim={head_dim} x {heads} heads is not hidden_size={d}; megascale "
                        "needs d_model = n_heads x head size")
    if arch == "llama" and f("mlp_bias"):
        raise UserError(f"hf:{where}: mlp_bias=true has no megascale counterpart (SwiGLU has no biases)")
    max_pos = int(f("max_position_embeddings"))
    window = None
    if arch == "mistral":
        layer_types = config.get("layer_types")
        if layer_types and len(set(layer_types)) > 1:
            raise UserError(f"hf:{where}: layer_types mixes {sorted(set(layer_types))}; megascale uses one "
                            "attention for every layer")
        sw = f("sliding_window")
        full = layer_types and set(layer_types) == {"full_attention"}
        window = None if (sw is None or full or int(sw) >= max_pos) else int(sw)
    return {"style": "llama", "block": "sequential", "attention": "full" if window is None else "sliding",
            "window": window or 0, "n_layers": int(f("num_hidden_layers")), "d_model": d, "n_heads": heads,
            "d_ff": int(f("intermediate_size")), "vocab_size": int(f("vocab_size")), "seq_len": max_pos,
            "norm_eps": float(f("rms_norm_eps")), "tie_embeddings": bool(f("tie_word_embeddings")),
            "rope_theta": _rope_theta(config, where), "bias": nonzero_bias}


def hf_model_overrides(directory: str | Path) -> list[str]:
    """The `model.field=value` overrides that describe the Hugging Face model in `directory`.

    model.seq_len is its maximum positions; model.bias is false when the model has no nonzero
    bias (GPT-2 always stores biases: all zero is bias=false, exactly).
    """
    out = []
    for key, value in describe_hf(directory).items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = repr(value) if isinstance(value, float) else str(value)
        out.append(f"model.{key}={text}")
    return out


def _mismatches(m: ModelConfig, hf: dict[str, Any]) -> list[str]:
    problems = []

    def differ(field: str, ours: Any, theirs: Any, note: str = "") -> None:
        problems.append(f"model.{field}={_show(ours)} but the Hugging Face model has {_show(theirs)}{note}")

    for field in ("style", "block", "n_layers", "d_model", "n_heads", "vocab_size", "tie_embeddings"):
        if getattr(m, field) != hf[field]:
            differ(field, getattr(m, field), hf[field])
    if m.ffn_dim != hf["d_ff"]:
        note = f" (model.d_ff=0 means {m.ffn_dim} here)" if not m.d_ff else ""
        differ("d_ff", m.d_ff, hf["d_ff"], note)
    if m.seq_len > hf["seq_len"]:
        differ("seq_len", m.seq_len, f"{hf['seq_len']} positions", " (model.seq_len may not exceed them)")
    if not math.isclose(m.norm_eps, hf["norm_eps"], rel_tol=1e-9):
        differ("norm_eps", m.norm_eps, hf["norm_eps"])
    if "rope_theta" in hf and m.style == "llama" and not math.isclose(m.rope_theta, hf["rope_theta"],
                                                                     rel_tol=1e-9):
        differ("rope_theta", m.rope_theta, hf["rope_theta"])
    theirs = hf["window"] if hf["attention"] == "sliding" and hf["window"] < m.seq_len else None
    if effective_window(m) != theirs:
        ours_text = f"sliding, model.window={m.window}" if m.attention == "sliding" else "full"
        theirs_text = f"a sliding window of {theirs}" if theirs else "full attention"
        problems.append(f"model.attention={ours_text} but the Hugging Face model has {theirs_text} "
                        f"(within model.seq_len={m.seq_len})")
    if not m.bias and hf["bias"]:
        differ("bias", False, "nonzero biases")
    return problems


def _show(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def load_hf_state(directory: str | Path, model_cfg: ModelConfig) -> dict[str, Tensor]:
    """The one-process GPT state dict for `model_cfg` from a Hugging Face model directory.

    Reads config.json and model.safetensors (or its shards) only. A config that does not
    match `model_cfg` raises one UserError naming every mismatched model.* field with both
    values; hf_model_overrides(directory) gives the fields that do match. Floating tensors
    come back as float32 (float64 ones stay float64).
    """
    config, tensors = read_hf(directory)
    where = str(directory)
    hf = _describe(config, tensors, where)
    problems = _mismatches(model_cfg, hf)
    if problems:
        raise UserError(f"model.init_from=hf:{where}: does not match the model config: "
                        + "; ".join(problems))
    m = model_cfg
    arch = config["model_type"]
    prefix = "transformer." if arch == "gpt2" else "model."
    names = {k.removeprefix(prefix): k for k in tensors}
    used: set[str] = set()

    def get(name: str) -> Tensor:
        key = names.get(name)
        if key is None:
            raise UserError(f"hf:{where}: the weights have no {prefix}{name}")
        used.add(key)
        t = tensors[key]
        return t if t.dtype == torch.float64 else t.float()

    def bias(name: str, n: int) -> Tensor | None:
        key = names.get(name)
        if key is None:
            return torch.zeros(n)
        return get(name)

    d, h, hd, ffn = m.d_model, m.n_heads, m.head_dim, m.ffn_dim

    def qkv_join(t: Tensor) -> Tensor:  # ([q,k,v], head, hd, ...) -> (head, [q,k,v], hd, ...) flat
        return t.unflatten(0, (3, h, hd)).transpose(0, 1).flatten(0, 2)

    state: dict[str, Tensor] = {}
    if arch == "gpt2":
        state["embed.tok.weight"] = get("wte.weight")
        state["embed.pos.weight"] = get("wpe.weight")[: m.seq_len]
        for i in range(m.n_layers):
            o, b = f"h.{i}.", f"blocks.{i}."
            parts = {"norm1": "ln_1", "norm2": "ln_2"}
            for ours, theirs in parts.items():
                state[b + ours + ".weight"] = get(o + theirs + ".weight")
                if m.bias:
                    state[b + ours + ".bias"] = bias(o + theirs + ".bias", d)
                else:
                    bias(o + theirs + ".bias", d)  # all zero (checked): mark it read
            state[b + "attn.qkv.weight"] = qkv_join(get(o + "attn.c_attn.weight").t())
            state[b + "attn.proj.weight"] = get(o + "attn.c_proj.weight").t()
            state[b + "mlp.fc_in.weight"] = get(o + "mlp.c_fc.weight").t()
            state[b + "mlp.fc_out.weight"] = get(o + "mlp.c_proj.weight").t()
            biases = {"attn.qkv": qkv_join(bias(o + "attn.c_attn.bias", 3 * d)),
                      "attn.proj": bias(o + "attn.c_proj.bias", d),
                      "mlp.fc_in": bias(o + "mlp.c_fc.bias", ffn),
                      "mlp.fc_out": bias(o + "mlp.c_proj.bias", d)}
            if m.bias:
                state.update({b + k + ".bias": v for k, v in biases.items()})
        state["norm.weight"] = get("ln_f.weight")
        if m.bias:
            state["norm.bias"] = bias("ln_f.bias", d)
        else:
            bias("ln_f.bias", d)
    else:
        state["embed.tok.weight"] = get("embed_tokens.weight")
        for i in range(m.n_layers):
            o, b = f"layers.{i}.", f"blocks.{i}."
            a = o + "self_attn."
            state[b + "norm1.weight"] = get(o + "input_layernorm.weight")
            qkv = torch.stack([get(a + f"{x}_proj.weight") for x in "qkv"])
            state[b + "attn.qkv.weight"] = qkv_join(qkv.flatten(0, 1))
            state[b + "attn.proj.weight"] = get(a + "o_proj.weight")
            biases = {"attn.qkv": qkv_join(torch.cat([bias(a + f"{x}_proj.bias", d) for x in "qkv"])),
                      "attn.proj": bias(a + "o_proj.bias", d)}
            if m.bias:
                state.update({b + k + ".bias": v for k, v in biases.items()})
            state[b + "norm2.weight"] = get(o + "post_attention_layernorm.weight")
            gate, up = get(o + "mlp.gate_proj.weight"), get(o + "mlp.up_proj.weight")
            state[b + "mlp.fc_in.weight"] = torch.stack((gate, up), dim=1).flatten(0, 1)
            state[b + "mlp.fc_out.weight"] = get(o + "mlp.down_proj.weight")
        state["norm.weight"] = get("norm.weight")
    if m.tie_embeddings:
        state["head.weight"] = state["embed.tok.weight"]
        if "lm_head.weight" in tensors:
            used.add("lm_head.weight")
    else:
        if "lm_head.weight" not in tensors:
            raise UserError(f"hf:{where}: tie_word_embeddings=false but the weights have no lm_head.weight")
        used.add("lm_head.weight")
        t = tensors["lm_head.weight"]
        state["head.weight"] = t if t.dtype == torch.float64 else t.float()
    extra = sorted(k for k in tensors if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise UserError(f"hf:{where}: tensors megascale has no place for: {shown}")
    state = {k: v.contiguous() for k, v in state.items()}
    if m.tie_embeddings:  # one tensor under both names, as GPT.state_dict() has it
        state["head.weight"] = state["embed.tok.weight"]
    _check_shapes(state, m, where)
    return state


def _check_shapes(state: dict[str, Tensor], m: ModelConfig, where: str) -> None:
    from megascale.model import GPT

    with torch.device("meta"):
        want = GPT(m).state_dict()
    missing = sorted(set(want) - set(state))
    if missing:
        raise UserError(f"hf:{where}: no weights for {', '.join(missing[:5])}")
    for k, t in want.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise UserError(f"hf:{where}: {k} has shape {tuple(state[k].shape)}, the model needs "
                            f"{tuple(t.shape)}")
