"""The indexed binary dataset: `<prefix>.bin` holds token ids, `<prefix>.idx` says where
each document starts.

The .bin is the token ids of all documents back to back (each ending in EOS), uint16
when the vocabulary fits (<= 65535 ids, half the disk and page cache of uint32) and
uint32 otherwise. It is read through np.memmap, so a corpus far larger than memory costs
nothing to open and every rank shares one copy in the page cache.

The .idx (little-endian):

    magic        8 bytes   b"MSCLIDX\\0"
    version      uint32    1
    dtype code   uint32    1 = uint16, 2 = uint32
    vocab size   uint64
    spec length  uint32    then the tokenizer's provenance string, UTF-8
    num docs     uint64
    offsets      int64 x (num docs + 1)   token offset of each document; the last is the total

The .idx is written after the .bin and checked against it on open, so a reader never
trusts a .bin whose index does not describe it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from megascale.errors import UserError

MAGIC = b"MSCLIDX\0"
VERSION = 1
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # little-endian on every host
_HEAD = struct.Struct("<8sIIQI")  # magic, version, dtype code, vocab size, spec length
_COUNT = struct.Struct("<Q")


def token_dtype(vocab_size: int) -> np.dtype:
    return DTYPE_CODES[1] if vocab_size <= 65535 else DTYPE_CODES[2]


def encode_index(dtype: np.dtype, vocab_size: int, tokenizer: str, offsets: np.ndarray) -> bytes:
    code = next(c for c, d in DTYPE_CODES.items() if d == dtype)
    spec = tokenizer.encode("utf-8")
    offsets = np.ascontiguousarray(offsets, dtype="<i8")
    return (_HEAD.pack(MAGIC, VERSION, code, vocab_size, len(spec)) + spec
            + _COUNT.pack(len(offsets) - 1) + offsets.tobytes())


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """The .bin and .idx of a dataset prefix (a prefix that already ends in .bin/.idx is accepted)."""
    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class Documents:
    """Documents as slices of one memory-mapped token array: what every on-disk format here gives the
    loader. A subclass sets `tokens` (the map), `offsets` (num_docs + 1 token positions) and `num_docs`."""

    tokens: np.ndarray
    offsets: np.ndarray
    num_docs: int

    def __len__(self) -> int:
        return self.num_docs

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document `i` (a view into the memory map; megascale's own format ends each with
        its EOS)."""
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for {self.num_docs} documents")
        i %= self.num_docs
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class IndexedDataset(Documents):
    """A read-only, memory-mapped tokenised corpus. Problems in the files are UserErrors
    that name the file and what is wrong with it."""

    def __init__(self, prefix: str | Path) -> None:
        self.bin_path, self.idx_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise UserError(f"{p}: dataset file does not exist")
        self._read_index(self.idx_path.read_bytes())
        size = self.bin_path.stat().st_size
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            raise UserError(f"{self.bin_path}: {size} bytes, but {self.idx_path} describes {self.num_tokens} "
                            f"{self.dtype.name} tokens ({expected} bytes); rebuild the dataset")
        # np.memmap refuses empty files; an empty corpus is an empty array.
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if size
                       else np.empty(0, dtype=self.dtype))

    def _read_index(self, data: bytes) -> None:
        where = self.idx_path
        if len(data) < _HEAD.size or data[:8] != MAGIC:
            raise UserError(f"{where}: not a megascale dataset index (bad magic bytes)")
        _, version, code, vocab_size, spec_len = _HEAD.unpack_from(data)
        if version != VERSION:
            raise UserError(f"{where}: index version {version}, this megascale reads version {VERSION}")
        if code not in DTYPE_CODES:
            raise UserError(f"{where}: unknown token dtype code {code}")
        pos = _HEAD.size
        if len(data) < pos + spec_len + _COUNT.size:
            raise UserError(f"{where}: truncated ({len(data)} bytes, header incomplete)")
        try:
            self.tokenizer = data[pos : pos + spec_len].decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{where}: corrupt tokenizer name") from None
        pos += spec_len
        (num_docs,) = _COUNT.unpack_from(data, pos)
        pos += _COUNT.size
        want = pos + 8 * (num_docs + 1)
        if len(data) != want:
            what = "truncated" if len(data) < want else "has trailing bytes"
            raise UserError(f"{where}: {what} ({len(data)} bytes, {want} expected for {num_docs} documents)")
        offsets = np.frombuffer(data, dtype="<i8", offset=pos).astype(np.int64)
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise UserError(f"{where}: document offsets are corrupt (not increasing from 0)")
        self.dtype = DTYPE_CODES[code]
        self.vocab_size = int(vocab_size)
        self.num_docs = int(num_docs)
        self.offsets = offsets
        self.num_tokens = int(offsets[-1])

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.bin_path)[:-4]!r}, docs={self.num_docs}, "
                f"tokens={self.num_tokens}, dtype={self.dtype.name}, tokenizer={self.tokenizer!r})")
