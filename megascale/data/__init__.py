"""The data pipeline: tokenizers, preprocessing into an indexed binary dataset, train/val
samples, and the resumable batch loader.

Names are imported on first use (PEP 562), so `megascale preprocess` and preprocessing
workers do not pay for importing torch, which only the loader needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Tokenizer": "tokenizer", "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer",
    "build_tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
    "preprocess": "preprocess", "PreprocessStats": "preprocess",
    "IndexedDataset": "indexed",
    "split_documents": "dataset", "epoch_permutation": "dataset", "PackedSamples": "dataset",
    "open_splits": "dataset",
    "BatchLoader": "loader",
    "ensure_dataset": "ensure",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
