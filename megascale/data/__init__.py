"""The data pipeline: tokenizers, preprocessing into an indexed binary dataset, train/val
samples, and the resumable batch loader.

The torch-free parts are imported here directly. The sample and loader classes, which
need torch, are imported on first use (PEP 562), so `megascale preprocess` and its worker
processes start without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from megascale.data.ensure import ensure_dataset
from megascale.data.indexed import IndexedDataset
from megascale.data.preprocessing import PreprocessStats, preprocess
from megascale.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer, train_tokenizer

_LAZY = {
    "split_documents": "dataset", "epoch_permutation": "dataset", "PackedSamples": "dataset",
    "open_splits": "dataset", "BatchLoader": "loader",
}
__all__ = [
    "BatchLoader", "ByteTokenizer", "HFTokenizer", "IndexedDataset", "PackedSamples", "PreprocessStats",
    "Tokenizer", "build_tokenizer", "ensure_dataset", "epoch_permutation", "open_splits", "preprocess",
    "split_documents", "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
