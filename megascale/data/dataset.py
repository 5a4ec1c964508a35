"""Train/validation split of documents, packing into fixed-length samples, and sample order.

Split by document, not by token range: a held-out document is never partly seen in
training, and the split does not move when seq_len changes. Within a split the documents
keep corpus order and are concatenated (each already ends in EOS) into one token stream,
cut into samples of seq_len + 1 tokens at stride seq_len: sample i covers stream tokens
[i*seq_len, (i+1)*seq_len], its input is the first seq_len and its target the last
seq_len, so every token of the stream is predicted exactly once. The tail that does not
fill a sample is dropped.

Randomness comes from numpy SeedSequences keyed by (seed, purpose[, epoch]), so the split
and each epoch's order are fixed by `data.seed` alone and independent of one another.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megascale.config import DataConfig
from megascale.data.indexed import IndexedDataset
from megascale.data.megatron import MegatronDataset, open_dataset
from megascale.errors import UserError

_SPLIT_STREAM = 1
_ORDER_STREAM = 2


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed & (2**64 - 1), spawn_key=key))


def split_documents(num_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) document ids, each sorted. val holds round(num_docs * val_fraction) of them,
    but at least one, and at least one stays for training, whenever val_fraction > 0 and
    there are two documents or more."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = 0
    if val_fraction > 0 and num_docs >= 2:
        n_val = min(max(round(num_docs * val_fraction), 1), num_docs - 1)
    perm = _rng(seed, _SPLIT_STREAM).permutation(num_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The training order of epoch `epoch`: a permutation of range(num_samples)."""
    return _rng(seed, _ORDER_STREAM, epoch).permutation(num_samples)


class PackedSamples:
    """Fixed-length samples over the concatenation of some documents of a dataset.

    Nothing is copied up front: the selected documents are described as runs of adjacent
    documents (contiguous in the memory-mapped .bin), and a sample is gathered from the
    one or few runs it overlaps.
    """

    def __init__(self, dataset: IndexedDataset | MegatronDataset, doc_ids: Sequence[int] | np.ndarray,
                 seq_len: int, name: str = "train") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.dataset, self.seq_len, self.name = dataset, seq_len, name
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        ids = self.doc_ids
        if len(ids):
            if ids.min() < 0 or ids.max() >= dataset.num_docs:
                raise IndexError(f"document ids out of range for {dataset.num_docs} documents")
            breaks = np.flatnonzero(np.diff(ids) != 1) + 1
            first, last = ids[np.r_[0, breaks]], ids[np.r_[breaks - 1, len(ids) - 1]]
        else:
            first = last = np.zeros(0, dtype=np.int64)
        self._run_start = dataset.offsets[first]  # where each run begins in the .bin
        run_len = dataset.offsets[last + 1] - self._run_start
        self._run_pos = np.concatenate([[0], np.cumsum(run_len)]).astype(np.int64)  # ... in the stream
        self.num_tokens = int(self._run_pos[-1])
        self.num_samples = max((self.num_tokens - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sample `i`: seq_len + 1 token ids, an int64 tensor."""
        return torch.from_numpy(self._gather(i))

    def _gather(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} {self.name} samples")
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        pos = i * self.seq_len
        run = int(np.searchsorted(self._run_pos, pos, side="right")) - 1
        filled = 0
        while filled < len(out):
            within = pos + filled - self._run_pos[run]
            take = min(int(self._run_pos[run + 1] - pos - filled), len(out) - filled)
            src = int(self._run_start[run] + within)
            out[filled : filled + take] = self.dataset.tokens[src : src + take]
            filled += take
            run += 1
        return out

    def batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Samples `indices` stacked: an int64 tensor [len(indices), seq_len + 1]."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            out[row] = self._gather(int(i))
        return torch.from_numpy(out)

    def __repr__(self) -> str:
        return (f"PackedSamples({self.name!r}, docs={len(self.doc_ids)}, tokens={self.num_tokens}, "
                f"seq_len={self.seq_len}, samples={self.num_samples})")


def open_splits(prefix: str | Path, data_cfg: DataConfig, seq_len: int,
                ) -> tuple[PackedSamples, PackedSamples]:
    """Open the dataset at `prefix` (megascale's or Megatron-LM's format) and return its (train,
    validation) samples, split by `data.val_fraction` and `data.seed`; with `data.blend` set, the
    blends of its datasets instead (megascale/data/blend.py; `prefix` is not used).

    The training split must yield at least one sample; an empty validation split is
    allowed (val_fraction = 0, or a one-document corpus) and has length 0.
    """
    if data_cfg.blend:
        from megascale.data.blend import open_blend  # it imports this module

        return open_blend(data_cfg, seq_len)
    return split_samples(open_dataset(prefix), data_cfg, seq_len, "data.path")


def split_samples(ds, data_cfg: DataConfig, seq_len: int, field: str) -> tuple[PackedSamples, PackedSamples]:
    """(train, validation) samples of one dataset, split by `data.val_fraction` and `data.seed`; a
    training split too short for one sample is an error naming `field`."""
    train_docs, val_docs = split_documents(ds.num_docs, data_cfg.val_fraction, data_cfg.seed)
    train = PackedSamples(ds, train_docs, seq_len, "train")
    if len(train) == 0:
        raise UserError(f"{field}: the training split of {ds.bin_path} has {train.num_tokens} tokens, "
                        f"too few for one sample of model.seq_len + 1 = {seq_len + 1}")
    return train, PackedSamples(ds, val_docs, seq_len, "val")
