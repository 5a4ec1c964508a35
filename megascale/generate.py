"""Sample text from a model or from a finished run directory (`megascale generate`).

Sampling options, each checked with one UserError naming it: max_new_tokens >= 0,
temperature >= 0 (0: greedy decoding, the most likely token each step), top_k >= 1 or None
(None: no top-k; a top_k at least the vocabulary keeps every token). Ids past the
tokenizer's vocabulary (a model.vocab_size padded beyond it) are never sampled.
"""

from __future__ import annotations

import math

import torch

from megascale.errors import UserError


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """The sampling options a person gives, as one UserError each (named as on the command line)."""
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens: must be >= 0, got {max_new_tokens}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UserError(f"--temperature: must be a finite number >= 0 (0: greedy decoding), "
                        f"got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k: must be >= 1 (sample among the k most likely tokens; k at least the "
                        f"vocabulary keeps them all), got {top_k}")


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = 50, seed: int = 0) -> str:
    """`prompt` continued by `max_new_tokens` sampled tokens, decoded.

    Only ids of the tokenizer are sampled: when the model's vocabulary is padded past it, the
    padded ids' logits are masked to -inf first."""
    check_sampling(max_new_tokens, temperature, top_k)
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    vocab_limit = tokenizer.vocab_size if tokenizer.vocab_size < model.cfg.vocab_size else None
    was_training = model.training
    model.eval()
    try:
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen,
                             vocab_limit=vocab_limit)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0].tolist())


def generate_from_run(path: str, prompt: str, max_new_tokens: int, temperature: float,
                      top_k: int | None, seed: int) -> str:
    """Rebuild the model of a run (or of one checkpoint directory in it) and sample from it.

    The weights and config come from `read_model_state`, whatever format and layout the
    checkpoint was saved in."""
    from megascale.checkpoint.model_state import read_model_state
    from megascale.data import build_tokenizer
    from megascale.model import GPT

    check_sampling(max_new_tokens, temperature, top_k)  # before the checkpoint is read
    cfg, state = read_model_state(path)
    tokenizer = build_tokenizer(cfg.data.tokenizer, field="data.tokenizer (of the run)")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(f"--checkpoint {path}: data.tokenizer={cfg.data.tokenizer!r} has "
                        f"{tokenizer.vocab_size} ids, more than the model's model.vocab_size="
                        f"{cfg.model.vocab_size}")
    dtype = torch.float64 if cfg.train.dtype == "fp64" else torch.float32
    model = GPT(cfg.model).to(dtype)
    model.load_state_dict(state)
    return sample_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k, seed)
