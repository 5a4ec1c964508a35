"""Sample text from a model or from a finished run directory (`megascale generate`)."""

from __future__ import annotations

from pathlib import Path

import torch

from megascale.checkpoint import latest_checkpoint, load_checkpoint
from megascale.config import load_config
from megascale.errors import UserError


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = 50, seed: int = 0) -> str:
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


def generate_from_run(path: str, prompt: str, max_new_tokens: int, temperature: float,
                      top_k: int | None, seed: int) -> str:
    """Rebuild the model of a run from its saved config and load the newest checkpoint's weights."""
    from megascale.data import build_tokenizer
    from megascale.model import GPT

    p = Path(path)
    if (p / "state.pt").exists():  # a checkpoint directory: its run directory is two levels up
        run_dir, ckpt = p.parent.parent, p
    else:
        run_dir, ckpt = p, latest_checkpoint(p)
    config_file = run_dir / "config.toml"
    if not config_file.exists():
        raise UserError(f"--checkpoint {path}: not a run directory (no config.toml)")
    if ckpt is None:
        raise UserError(f"--checkpoint {path}: the run has no checkpoint yet")
    cfg = load_config(config_file)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    state = load_checkpoint(ckpt)
    dtype = torch.float64 if cfg.train.dtype == "fp64" else torch.float32
    model = GPT(cfg.model).to(dtype)
    model.load_state_dict(state["model"])
    return sample_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k or None, seed)
