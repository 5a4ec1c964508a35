"""Megatron-LM's indexed datasets (`MMIDIDX`), read in place.

Users of Megatron-LM already have their corpora tokenised by its `tools/preprocess_data.py`
(Megatron-Core's `megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`): a `.bin` of
token ids back to back and a `.idx` that describes it. Re-tokenising terabytes to train here
would be a waste, so this reads those files byte for byte as Megatron writes them, through
np.memmap (no copy of the tokens, one page cache for every rank), and presents the same
surface as our own `IndexedDataset` (`tokens`, `offsets`, `num_docs`, ...): `PackedSamples`,
the split, the seed-driven order, the data-parallel slice and the resumable loader all work on
it unchanged.

The .idx (Megatron-Core 0.x, `_IndexWriter`; native byte order, little-endian on every host
Megatron runs on):

    magic            9 bytes   b"MMIDIDX\\0\\0"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   uint64    S
    document count   uint64    D: the length of document_indices, i.e. documents + 1
    sequence_lengths int32 x S     tokens per sequence
    sequence_pointers int64 x S    byte offset of each sequence in the .bin
    document_indices int64 x D     sequence index where each document starts; 0 first, S last
    (sequence_modes  int8 x S      only in multimodal datasets, which this does not read)

A Megatron "sequence" is a sentence when preprocess_data.py ran with --split-sentences and a
whole document otherwise; the sequences of a document are adjacent in the .bin. Our unit is the
document (the train/validation split is by document), so a document here spans its sequences.
Documents are used as stored: preprocess_data.py's --append-eod is what puts the EOD after each
document, and Megatron's GPTDataset concatenates them exactly like this (it inserts nothing).

The format says nothing of the tokenizer or the vocabulary, so `vocab_size` is None and
`check_token_ids` checks the ids against `data.tokenizer`'s vocabulary instead.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from megascale.data.indexed import MAGIC as MEGASCALE_MAGIC
from megascale.data.indexed import Documents, IndexedDataset, paths
from megascale.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
INT_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}
FLOAT_DTYPES = {6: "float64", 7: "float32"}
_CHUNK = 1 << 22  # index entries checked per step: bounded memory on an index of any size
ID_CHECK_TOKENS = 1 << 24  # tokens whose ids `check_token_ids` reads (all of a dataset up to 16M tokens)


class MegatronDataset(Documents):
    """A read-only, memory-mapped Megatron-LM indexed dataset. Problems in the files are
    UserErrors that name the file and what is wrong with it."""

    vocab_size = None  # not recorded by the format
    tokenizer = ""  # nor is the tokenizer

    def __init__(self, prefix: str | Path) -> None:
        self.bin_path, self.idx_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise UserError(f"{p}: dataset file does not exist")
        self._read_index()
        size = self.bin_path.stat().st_size
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise UserError(f"{self.bin_path}: {what} ({size} bytes, but {self.idx_path} describes "
                            f"{self.num_tokens} {self.dtype.name} tokens, {expected} bytes)")
        # np.memmap refuses empty files; an empty corpus is an empty array.
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                       if size else np.empty(0, dtype=self.dtype))

    def _read_index(self) -> None:
        where = self.idx_path
        size = where.stat().st_size
        with open(where, "rb") as f:
            head = f.read(_HEAD.size)
        if head[: len(MAGIC)] != MAGIC and not (len(head) < len(MAGIC) and MAGIC.startswith(head)):
            raise UserError(f"{where}: not a Megatron-LM dataset index (bad magic bytes)")
        if len(head) < _HEAD.size:
            raise UserError(f"{where}: truncated ({size} bytes, the header alone is {_HEAD.size})")
        _, version, code, n_seq, n_doc = _HEAD.unpack(head)
        if version != VERSION:
            raise UserError(f"{where}: Megatron index version {version}, this megascale reads version "
                            f"{VERSION}")
        if code in FLOAT_DTYPES:
            raise UserError(f"{where}: holds {FLOAT_DTYPES[code]} values, not token ids")
        if code not in INT_DTYPES:
            raise UserError(f"{where}: unknown token dtype code {code}")
        want = _HEAD.size + 12 * n_seq + 8 * n_doc
        if size == want + n_seq and n_seq:
            raise UserError(f"{where}: a multimodal index (it has sequence modes); only text datasets "
                            "are read")
        if size != want:
            what = "truncated" if size < want else "has trailing bytes"
            raise UserError(f"{where}: {what} ({size} bytes, {want} expected for {n_seq} sequences and "
                            f"{n_doc} document indices)")
        if n_doc < 1:
            raise UserError(f"{where}: corrupt (no document indices)")
        self.dtype = np.dtype(INT_DTYPES[code])
        # Views into a memory map of the index: nothing is read until it is used.
        raw = np.memmap(where, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
        pos = _HEAD.size
        self.sequence_lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=pos)
        pos += 4 * n_seq
        self.sequence_pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=pos)
        pos += 8 * n_seq
        self.document_indices = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=pos)
        self._check_index(n_seq)
        item = self.dtype.itemsize
        self.num_tokens = (int(self.sequence_pointers[-1]) // item + int(self.sequence_lengths[-1])
                           if n_seq else 0)
        # Token offset where each document starts (the sequence pointer of its first sequence; a
        # document that starts at S is empty and at the end), then the total, as IndexedDataset has.
        starts = self.document_indices[:-1]
        inside = starts < n_seq
        offsets = np.full(n_doc, self.num_tokens, dtype=np.int64)
        offsets[:-1][inside] = self.sequence_pointers[starts[inside]] // item
        self.offsets = offsets
        self.num_docs = n_doc - 1

    def _check_index(self, n_seq: int) -> None:
        """The sequences tile the .bin in order (pointer = the previous one + its length), and the
        document indices rise from 0 to S: what IndexedDatasetBuilder writes, and what makes each
        document one contiguous run. Checked in chunks, so a huge index costs no big temporaries."""
        where, item = self.idx_path, self.dtype.itemsize
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        expect_next = 0
        for lo in range(0, n_seq, _CHUNK):
            hi = min(lo + _CHUNK, n_seq)
            ln = lengths[lo:hi].astype(np.int64)
            if ln.min() < 0:
                raise UserError(f"{where}: corrupt sequence lengths (negative)")
            ends = np.cumsum(ln * item) + expect_next
            starts = np.concatenate(([expect_next], ends[:-1]))
            if not np.array_equal(pointers[lo:hi], starts):
                raise UserError(f"{where}: sequence pointers do not follow the sequence lengths (a "
                                "corrupt index, or one whose .bin has gaps)")
            expect_next = int(ends[-1])
        if docs[0] != 0 or docs[-1] != n_seq:
            raise UserError(f"{where}: corrupt document indices (they must run from 0 to the {n_seq} "
                            f"sequences, not {docs[0]} to {docs[-1]})")
        for lo in range(0, len(docs) - 1, _CHUNK):
            if np.any(np.diff(docs[lo : lo + _CHUNK + 1]) < 0):
                raise UserError(f"{where}: corrupt document indices (not increasing)")

    def __repr__(self) -> str:
        return (f"MegatronDataset({str(self.bin_path)[:-4]!r}, docs={self.num_docs}, "
                f"tokens={self.num_tokens}, dtype={self.dtype.name})")


def open_dataset(prefix: str | Path) -> IndexedDataset | MegatronDataset:
    """The dataset at `prefix` (or its .bin/.idx), in whichever format its .idx's magic bytes say:
    megascale's own (`megascale preprocess`) or Megatron-LM's. So `data.path` (and each path of
    `data.blend`) takes either with no further setting."""
    bin_path, idx_path = paths(prefix)
    for p in (idx_path, bin_path):
        if not p.is_file():
            raise UserError(f"{p}: dataset file does not exist")
    with open(idx_path, "rb") as f:
        head = f.read(len(MAGIC))
    if not head:
        raise UserError(f"{idx_path}: empty file (not a dataset index; rebuild it)")
    if head.startswith(MEGASCALE_MAGIC):
        return IndexedDataset(prefix)
    if head.startswith(b"MMIDIDX") or MAGIC.startswith(head):  # the reader names what is wrong
        return MegatronDataset(prefix)
    raise UserError(f"{idx_path}: not a dataset index (bad magic bytes: neither megascale's "
                    f"{MEGASCALE_MAGIC!r} nor Megatron-LM's {MAGIC!r})")


def check_token_ids(ds: MegatronDataset, vocab_size: int, field: str) -> None:
    """The token ids of a Megatron dataset must fit the vocabulary of `data.tokenizer` (the format
    does not record which tokenizer wrote it), else the embedding lookup fails mid-run. Reads the
    first ID_CHECK_TOKENS tokens only (milliseconds), so a huge corpus is checked in part."""
    head = np.asarray(ds.tokens[:ID_CHECK_TOKENS])
    if not len(head):
        return
    lo, hi = int(head.min()), int(head.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise UserError(f"{field}: {ds.bin_path} holds token id {bad}, outside the vocabulary of "
                        f"data.tokenizer ({vocab_size} ids); set data.tokenizer to the tokenizer the "
                        "dataset was built with")
