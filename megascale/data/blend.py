"""`data.blend`: several datasets mixed by weight, in a fixed order that resumes exactly.

Megatron-LM blends with a precomputed index, not by drawing a dataset at random per sample:
sample i of the blend goes to the dataset that lags its target share the most, so the mix is
right over every prefix of the run (a random draw is only right on average, and a short run or
the first thousand steps can be far off). We keep that property but state it so that any
position can be computed on its own, without precomputing (or storing) an index for the whole
run, which is what lets the loader stay an infinite stream resumable at any sample:

    dataset d's k-th sample (k = 0, 1, ...) is due at (k + 1/2) / w_d   (w normalised to sum 1)

and the blend serves samples in order of due time (ties to the lower dataset index). Taking the
earliest due sample next is taking the dataset whose count lags its target the most, in units of
its own rate (Webster/Sainte-Laguë apportionment), so after any n samples dataset d has had
w_d * n of them to within 1/2 + w_d * D/2 samples for D datasets (measured over 10^5 samples:
0.5 for two or three datasets, 1.6 for eight), whatever n is. The n-th sample is found by counting,
per dataset, the samples due before a time T (a closed form, corrected against the exact keys
so that counting and sorting always agree), then sorting the few due near T: a batch costs
O(batch + datasets), at position 0 or 10^12 alike.

Each dataset is split into train/validation by document (`data.val_fraction`, `data.seed`) as a
lone dataset is. Within a dataset the k-th sample it contributes is sample k % N of its epoch
k // N, an epoch being a permutation keyed by (seed, dataset index, epoch) for training and
corpus order for validation. Everything depends on the weights, the sizes and the seed only, so
the same config gives the same batches, and data-parallel ranks, which all compute the same
global batch and read their own rows of it, agree.

The loader (megascale/data/loader.py) reads a `BlendedSamples` by position: it is `self_ordered`,
so stream position p is blend position p (the shuffling is inside each dataset), and its
`blend_signature` (weights and sizes) is saved with the loader position and checked on resume.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from megascale.config import DataConfig
from megascale.data.dataset import PackedSamples, _rng, split_samples
from megascale.data.megatron import open_dataset

_BLEND_STREAM = 3  # SeedSequence key of the per-dataset epoch orders (dataset.py uses 1 and 2)
_GAP = 64  # positions closer than this are looked up as one block


class BlendIndex:
    """Which dataset, and which of its samples, serves each position of the blend."""

    def __init__(self, weights: Sequence[float]) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not len(w) or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"blend weights must be positive and finite, got {list(weights)}")
        self.w = w / w.sum()

    def _due_before(self, t: float) -> np.ndarray:
        """Per dataset, how many of its samples are due strictly before time t (k with (k+½)/w < t)."""
        w = self.w
        c = np.maximum(np.ceil(t * w - 0.5), 0).astype(np.int64)  # the closed form, then exact keys
        while True:
            down = (c > 0) & ((c - 0.5) / w >= t)  # key of sample c-1 is not before t
            up = (c + 0.5) / w < t  # key of sample c is
            if not (down.any() or up.any()):
                return c
            c = c - down + up

    def _block(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, per-dataset sample number) of blend positions a .. b-1."""
        n = len(self.w)
        t_lo, t_hi = float(a - n - 1), float(b + n + 1)  # sum of counts is within n/2 of T
        c_lo = self._due_before(t_lo)
        while c_lo.sum() > a:
            t_lo -= n + 1
            c_lo = self._due_before(t_lo)
        c_hi = self._due_before(t_hi)
        while c_hi.sum() < b:
            t_hi += n + 1
            c_hi = self._due_before(t_hi)
        ks = [np.arange(c_lo[d], c_hi[d], dtype=np.int64) for d in range(n)]
        keys = np.concatenate([(k + 0.5) / self.w[d] for d, k in enumerate(ks)])
        ds = np.concatenate([np.full(len(k), d, dtype=np.int64) for d, k in enumerate(ks)])
        order = np.lexsort((ds, keys))  # by due time, ties to the lower dataset index
        base = int(c_lo.sum())
        sel = order[a - base : b - base]
        return ds[sel], np.concatenate(ks)[sel]

    def lookup(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, per-dataset sample number) of each blend position (any order, any size)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not len(pos):
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if pos.min() < 0:
            raise IndexError(f"blend position {int(pos.min())} is negative")
        uniq = np.unique(pos)
        d_u, k_u = np.empty_like(uniq), np.empty_like(uniq)
        start = 0
        for run in np.split(uniq, np.flatnonzero(np.diff(uniq) > _GAP) + 1):
            d, k = self._block(int(run[0]), int(run[-1]) + 1)
            off = run - run[0]
            d_u[start : start + len(run)], k_u[start : start + len(run)] = d[off], k[off]
            start += len(run)
        at = np.searchsorted(uniq, pos)
        return d_u[at], k_u[at]

    def counts(self, n: int) -> np.ndarray:
        """How many of the first n positions each dataset serves."""
        d, _ = self._block(0, n)
        return np.bincount(d, minlength=len(self.w))


class BlendedSamples:
    """Samples of several `PackedSamples` mixed by weight; the same surface as PackedSamples
    (len, batch, [], seq_len, num_tokens, name), so the loader, evaluation and the banner use it
    as they are.

    `len` is one pass's worth (the sum of the parts); the blend goes on past it, each dataset
    into its next epoch at its own pace, so position p is valid for every p >= 0.
    """

    self_ordered = True  # the loader reads position p as sample p (see the module doc)

    def __init__(self, parts: Sequence[PackedSamples], weights: Sequence[float], seed: int, *,
                 shuffle: bool, name: str = "train") -> None:
        if not parts or len(parts) != len(weights) or any(len(p) == 0 for p in parts):
            raise ValueError("a blend needs one non-empty sample set per weight")
        self.parts, self.seed, self.shuffle, self.name = list(parts), seed, shuffle, name
        self.weights = [float(w) for w in weights]
        self.index = BlendIndex(self.weights)
        self.seq_len = parts[0].seq_len
        self.sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        self.num_tokens = sum(p.num_tokens for p in parts)
        # what a resumed loader must find unchanged (lists, as they come back from JSON)
        self.blend_signature = [[w, int(n)] for w, n in zip(self.weights, self.sizes, strict=True)]
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._lock = threading.Lock()  # the prefetch thread and the caller both look up orders

    def __len__(self) -> int:
        return self.num_samples

    def _permutation(self, d: int, epoch: int) -> np.ndarray:
        with self._lock:
            key = (d, epoch)
            if key not in self._perms:
                mine = sorted(e for dd, e in self._perms if dd == d)
                if len(mine) >= 2:  # a batch spans at most two epochs of a dataset
                    del self._perms[(d, mine[0])]
                self._perms[key] = _rng(self.seed, _BLEND_STREAM, d, epoch).permutation(int(self.sizes[d]))
            return self._perms[key]

    def locate(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample index within that dataset's split) of each blend position."""
        d, k = self.index.lookup(positions)
        n = self.sizes[d]
        epoch, within = k // n, k % n
        if self.shuffle:
            for dd, e in set(zip(d.tolist(), epoch.tolist(), strict=True)):
                rows = (d == dd) & (epoch == e)
                within[rows] = self._permutation(dd, e)[within[rows]]
        return d, within

    def _gather(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        # NumPy only, like PackedSamples: this runs on the loader's prefetch thread.
        d, idx = self.locate(positions)
        out = np.empty((len(d), self.seq_len + 1), dtype=np.int64)
        for row, (dd, i) in enumerate(zip(d.tolist(), idx.tolist(), strict=True)):
            out[row] = self.parts[dd]._gather(i)
        return out

    def batch(self, positions: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Samples at blend `positions` stacked: an int64 tensor [len(positions), seq_len + 1]."""
        return torch.from_numpy(self._gather(positions))

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self._gather([i])[0])

    def __repr__(self) -> str:
        mix = ", ".join(f"{w:g}:{len(p)}" for w, p in zip(self.weights, self.parts, strict=True))
        return f"BlendedSamples({self.name!r}, [{mix}], seq_len={self.seq_len})"


def open_blend(data_cfg: DataConfig, seq_len: int) -> tuple[BlendedSamples, BlendedSamples | PackedSamples]:
    """(train, validation) blends of `data.blend`. Each dataset (either format) is split by
    `data.val_fraction` and `data.seed` as a lone one is; the validation blend mixes the
    non-empty validation splits with their weights, in a fixed order (an empty split, when every
    one is empty)."""
    train, val, w_train, w_val = [], [], [], []
    for i, (weight, path) in enumerate(data_cfg.blend):
        tr, va = split_samples(open_dataset(path), data_cfg, seq_len, f"data.blend[{i}]")
        train.append(tr)
        w_train.append(weight)
        if len(va):
            val.append(va)
            w_val.append(weight)
    blend_train = BlendedSamples(train, w_train, data_cfg.seed, shuffle=True, name="train")
    if not val:
        return blend_train, PackedSamples(train[0].dataset, [], seq_len, "val")
    return blend_train, BlendedSamples(val, w_val, data_cfg.seed, shuffle=False, name="val")
