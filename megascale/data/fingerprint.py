"""What a dataset holds, in a few bytes: so that the ranks of a job can check they read the same data.

Each host of a multi-host job may keep its own copy of the corpus (`data.path` is host-local), and
copies drift: a host preprocessed from an older dump, a copy cut short and rebuilt, another
`--append-eod`. Nothing in training notices: every rank reads its own rows by global sample index, so
the dp replicas quietly train on different corpora (and the losses look fine). A fingerprint is
the dataset's size (documents, tokens) and a digest of its document boundaries and of token windows
spread over it; the paths are left out, since those may differ.

The digest samples rather than hashes everything: at most `OFFSETS` document offsets and `WINDOWS`
windows of `WINDOW` tokens, so it costs milliseconds on a corpus of any size (a few pages of the
memory-mapped .bin). Two copies of different corpora or tokenisations differ in their document
boundaries almost everywhere; the windows catch the same boundaries with other tokens. Token values
are hashed as int64, so a uint16 copy and an int32 copy of the same ids agree.
"""

from __future__ import annotations

import hashlib
import weakref

import numpy as np

from megascale.data.indexed import Documents

OFFSETS = 1 << 16  # document offsets hashed (all of them up to this many documents)
WINDOWS = 64  # token windows hashed, spread evenly over the .bin
WINDOW = 256  # tokens in each


def _spread(n: int, k: int) -> np.ndarray:
    """Up to `k` indices spread evenly over range(n), the first and last included."""
    return np.unique(np.linspace(0, n - 1, num=min(n, k)).astype(np.int64)) if n else np.zeros(0, np.int64)


_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an open dataset's, once per process


def fingerprint(ds: Documents) -> dict[str, object]:
    """{"docs", "tokens", "digest"} of `ds` (megascale's or Megatron-LM's format); computed once per open
    dataset (the start-up's check across hosts and the loader's state both ask)."""
    if ds in _KNOWN:
        return dict(_KNOWN[ds])
    h = hashlib.blake2b(digest_size=16)
    offsets = np.asarray(ds.offsets)
    h.update(np.ascontiguousarray(offsets[_spread(len(offsets), OFFSETS)], dtype="<i8").tobytes())
    n = len(ds.tokens)
    for start in (_spread(max(n - WINDOW + 1, 1), WINDOWS).tolist() if n else []):  # a short .bin: whole
        h.update(np.ascontiguousarray(ds.tokens[start : start + WINDOW], dtype="<i8").tobytes())
    _KNOWN[ds] = {"docs": int(ds.num_docs), "tokens": int(n), "digest": h.hexdigest()}
    return dict(_KNOWN[ds])


def describe(fp: dict[str, object]) -> str:
    docs, tokens = fp["docs"], fp["tokens"]
    return f"{docs:,} document{'s' * (docs != 1)}, {tokens:,} token{'s' * (tokens != 1)}"


def datasets_of(samples) -> list[tuple[str, Documents]]:
    """(the config field that names it, dataset) of each dataset the training samples read: the
    parts of a blend (`BlendedSamples.parts`), else the one dataset; none for rows held in memory (a
    benchmark's or a test's synthetic samples)."""
    if hasattr(samples, "parts"):
        return [(f"data.blend[{i}]", part.dataset) for i, part in enumerate(samples.parts)]
    return [("data.path", samples.dataset)] if hasattr(samples, "dataset") else []
