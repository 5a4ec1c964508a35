"""Make sure the dataset a config names exists, building it from `data.source` if needed."""

from __future__ import annotations

from megascale.config import DataConfig
from megascale.data.indexed import paths
from megascale.data.megatron import MegatronDataset, check_token_ids, open_dataset
from megascale.data.preprocessing import preprocess
from megascale.data.sources import expand_inputs
from megascale.data.tokenizer import build_tokenizer, same_tokenizer
from megascale.errors import UserError


def ensure_dataset(data_cfg: DataConfig, progress: bool = True) -> str:
    """Return the dataset prefix of `data_cfg`, preprocessing `data.source` into it when the
    .bin/.idx are missing. An existing dataset is validated and must have been built with
    `data.tokenizer`. Safe to call from several processes at once (outputs are atomic),
    though launchers should call it on one rank and wait, to tokenise only once.
    """
    prefix = data_cfg.path
    bin_path, idx_path = paths(prefix)
    tok = build_tokenizer(data_cfg.tokenizer, field="data.tokenizer")
    if data_cfg.blend:  # data.path and data.source are not used; "" as there is no one prefix
        _check_blend(data_cfg, tok)
        return ""
    if bin_path.is_file() and idx_path.is_file():
        ds = open_dataset(prefix)
        if isinstance(ds, MegatronDataset):  # Megatron-LM's format records no tokenizer
            check_token_ids(ds, tok.vocab_size, "data.path")
        elif not same_tokenizer(ds.tokenizer, tok.name):
            raise UserError(
                f"data.tokenizer: {tok.name!r} differs from {ds.tokenizer!r}, the tokenizer {idx_path} "
                f"was built with (set data.tokenizer to match, or delete {bin_path} and {idx_path} "
                "to rebuild)"
            )
        return prefix
    if not data_cfg.source:
        missing = bin_path if not bin_path.is_file() else idx_path
        raise UserError(f"data.path: {missing} does not exist "
                        "(run `megascale preprocess` or set data.source)")
    expand_inputs([data_cfg.source], field="data.source")  # a bad source is named as such, up front
    preprocess([data_cfg.source], prefix, data_cfg.tokenizer, workers=data_cfg.preprocess_workers,
               progress=progress, field="data.source", output_field="data.path")
    return prefix


def _check_blend(data_cfg: DataConfig, tok) -> None:
    """Every dataset of `data.blend` exists (nothing is built for a blend), is readable, and fits
    `data.tokenizer`; each problem is one error naming `data.blend[i]`."""
    for i, (_, path) in enumerate(data_cfg.blend):
        field = f"data.blend[{i}]"
        for p in paths(path):
            if not p.is_file():
                raise UserError(f"{field}: {p} does not exist (a blend's datasets are not built from "
                                "data.source; run `megascale preprocess` for each)")
        try:
            ds = open_dataset(path)
        except UserError as e:
            raise UserError(f"{field}: {e}") from None
        if isinstance(ds, MegatronDataset):
            check_token_ids(ds, tok.vocab_size, field)
        elif not same_tokenizer(ds.tokenizer, tok.name):
            raise UserError(f"{field}: {ds.idx_path} was built with tokenizer {ds.tokenizer!r}, not "
                            f"data.tokenizer {tok.name!r}; every dataset of a blend needs the same one")
