"""Inputs users already have: Megatron-LM's indexed datasets (written here by Megatron-Core's own
IndexedDatasetBuilder), and Parquet and gzip'd JSONL for `megascale preprocess`."""

import gzip
import json
import struct
import warnings

import numpy as np
import pytest
import torch

from megascale.config import DataConfig, load_config
from megascale.data.dataset import open_splits
from megascale.data.ensure import ensure_dataset
from megascale.data.indexed import IndexedDataset
from megascale.data.loader import BatchLoader
from megascale.data.megatron import MegatronDataset, open_dataset
from megascale.data.preprocessing import preprocess
from megascale.data.sources import iter_texts
from megascale.data.tokenizer import build_tokenizer
from megascale.errors import UserError

# Megatron-Core's builder calls numpy.array on the torch tensor preprocess_data.py hands it: numpy 2 notes it
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

@pytest.fixture(scope="module")
def mcore():
    """Megatron-Core's indexed_dataset module (the Makefile's dev setup installs it, --no-deps)."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": not needed here
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                   reason="megatron-core is not installed (make dev installs it)")


def _docs(n=20, seed=0, vocab=257, eod=256):
    """Token ids of n documents of varied length, each ending in EOD as preprocess_data.py's
    --append-eod writes them."""
    rng = np.random.default_rng(seed)
    return [np.r_[rng.integers(0, eod, int(rng.integers(0, 60))), eod].astype(np.int64) for _ in range(n)]


def write_megatron(mcore, prefix, docs, dtype=np.uint16, sentences=False):
    """A dataset as Megatron-LM's preprocess_data.py writes it: one add_document per document, with
    the sequence (sentence) lengths of --split-sentences when `sentences`."""
    b = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        cut = len(doc) // 2
        lengths = [cut, len(doc) - cut] if sentences and cut else [len(doc)]
        b.add_document(torch.from_numpy(doc), lengths)
    b.finalize(f"{prefix}.idx")
    return prefix


# ---- Megatron-LM's format


@pytest.mark.parametrize("dtype,sentences", [(np.uint16, False), (np.int32, True), (np.uint8, False)])
def test_reads_what_indexed_dataset_builder_writes(mcore, tmp_path, dtype, sentences):
    docs = _docs(vocab=250, eod=249)
    prefix = write_megatron(mcore, tmp_path / "corpus_text_document", docs, dtype, sentences)
    ds = open_dataset(prefix)
    assert isinstance(ds, MegatronDataset) and ds.dtype == np.dtype(dtype).newbyteorder("<")
    assert ds.num_docs == len(docs) and ds.num_tokens == sum(map(len, docs))
    assert all(np.array_equal(ds.doc(i), d) for i, d in enumerate(docs))
    assert isinstance(ds.tokens, np.memmap)  # read in place, not copied
    # ... and agrees with Megatron's own reader, sequence by sequence
    theirs = mcore.IndexedDataset(str(prefix))
    assert np.array_equal(ds.sequence_lengths, theirs.sequence_lengths)
    assert np.array_equal(ds.document_indices, theirs.document_indices)
    ours = np.concatenate([ds.tokens[p // ds.dtype.itemsize:][:n]
                           for p, n in zip(ds.sequence_pointers, ds.sequence_lengths, strict=True)])
    assert np.array_equal(ours, np.concatenate([theirs[i] for i in range(len(theirs))]))


def test_add_item_and_end_document_and_empty_documents(mcore, tmp_path):
    b = mcore.IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.uint16)
    for doc in ([1, 2, 3], [], [4]):  # the item-at-a-time API, an empty document in the middle
        b.add_item(torch.tensor(doc, dtype=torch.int64))
        b.end_document()
    b.end_document()  # an empty document at the end: no sequence at all
    b.finalize(str(tmp_path / "d.idx"))
    ds = open_dataset(tmp_path / "d.idx")  # a path ending in .idx (or .bin) names the same dataset
    assert [ds.doc(i).tolist() for i in range(ds.num_docs)] == [[1, 2, 3], [], [4], []]


def test_samples_are_the_documents_concatenated(mcore, tmp_path):
    docs = _docs(30, seed=1)
    prefix = write_megatron(mcore, tmp_path / "m", docs)
    stream = np.fromfile(tmp_path / "m.bin", dtype="<u2").astype(np.int64)  # the .bin, read plainly
    assert np.array_equal(stream, np.concatenate(docs))
    train, val = open_splits(str(prefix) + ".bin", DataConfig(val_fraction=0.0), seq_len=16)
    assert len(val) == 0 and train.num_tokens == len(stream)
    for i in range(len(train)):
        assert np.array_equal(train[i].numpy(), stream[i * 16 : i * 16 + 17])
    # a held-out split works as for megascale's own format: whole documents, seed-driven
    train, val = open_splits(prefix, DataConfig(val_fraction=0.2, seed=5), seq_len=8)
    assert len(train) and len(val) and train.num_tokens + val.num_tokens == len(stream)


def test_loader_order_resume_and_dp_split_on_megatron_data(mcore, tmp_path):
    prefix = write_megatron(mcore, tmp_path / "m", _docs(40, seed=2))
    train, _ = open_splits(prefix, DataConfig(val_fraction=0.1), seq_len=8)
    full = BatchLoader(train, 4, seed=3, prefetch=0)
    want = [full.next_batch() for _ in range(12)]
    first = BatchLoader(train, 4, seed=3, prefetch=2)
    got = [first.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    second = BatchLoader(train, 4, seed=3, prefetch=2)
    second.load_state_dict(state)
    got += [second.next_batch() for _ in range(7)]
    second.close()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got, strict=True))
    halves = [BatchLoader(train, 4, seed=3, dp_rank=r, dp_size=2, prefetch=0).next_batch()[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), want[0][0])


def test_the_same_tokens_have_one_fingerprint_in_any_format_and_dtype(mcore, tmp_path):
    """Hosts' copies are compared by fingerprint (distributed/same_config.py): a Megatron copy in
    uint16 or int32 (with sentences) and megascale's own of the same documents agree; a copy with
    one document less or other tokens does not."""
    from megascale.data.fingerprint import fingerprint
    from megascale.data.indexed import encode_index

    docs = _docs(200, seed=4)
    own = tmp_path / "own"
    own.with_suffix(".bin").write_bytes(np.concatenate(docs).astype("<u2").tobytes())
    offsets = np.r_[0, np.cumsum([len(d) for d in docs])]
    own.with_suffix(".idx").write_bytes(encode_index(np.dtype("<u2"), 257, "byte", offsets))
    want = fingerprint(open_dataset(own))
    assert want["docs"] == 200 and want["tokens"] == sum(len(d) for d in docs)
    for dtype, sentences in ((np.uint16, False), (np.int32, True)):
        prefix = write_megatron(mcore, tmp_path / f"m{np.dtype(dtype).name}", docs, dtype, sentences)
        assert fingerprint(open_dataset(prefix)) == want
    other = [np.r_[(d[:-1] + 1) % 256, d[-1]] for d in docs]  # the same lengths, other tokens
    for name, changed in (("less", docs[1:]), ("tok", other)):
        got = fingerprint(open_dataset(write_megatron(mcore, tmp_path / name, changed)))
        assert got["digest"] != want["digest"], name


def test_format_is_told_by_the_magic_bytes(mcore, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    preprocess([tmp_path / "in.jsonl"], tmp_path / "own", "byte", progress=False)
    assert isinstance(open_dataset(tmp_path / "own"), IndexedDataset)
    assert isinstance(open_dataset(write_megatron(mcore, tmp_path / "m", _docs(3))), MegatronDataset)
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" * 4)
    with pytest.raises(UserError, match=f"{tmp_path / 'x.idx'}: not a dataset index .*MMIDIDX"):
        open_dataset(tmp_path / "x")


def _idx_pack(version=1, code=8, n_seq=None, n_doc=None):
    return lambda b: (b[:9] + struct.pack("<QB", version, code)
                      + (b[18:26] if n_seq is None else struct.pack("<Q", n_seq))
                      + (b[26:34] if n_doc is None else struct.pack("<Q", n_doc)) + b[34:])


@pytest.mark.parametrize("which,change,problem", [
    ("bin", lambda b: b[:-2], r"\.bin: truncated \(\d+ bytes, but .*\.idx describes \d+ uint16 tokens"),
    ("bin", lambda b: b + b"\0\0", r"\.bin: has trailing bytes"),
    ("bin", lambda b: b"", r"\.bin: truncated \(0 bytes"),
    ("idx", lambda b: b[:20], r"\.idx: truncated \(20 bytes, the header alone is 34\)"),
    ("idx", lambda b: b[:5], r"\.idx: truncated \(5 bytes"),
    ("idx", lambda b: b[:-8], r"\.idx: truncated \(\d+ bytes, \d+ expected for 6 sequences and 7 document"),
    ("idx", lambda b: b + b"\0" * 3, r"\.idx: has trailing bytes"),
    ("idx", lambda b: b"", r"\.idx: empty file"),
    ("idx", lambda b: b"MMIDIDX\x00\x01" + b[9:], r"\.idx: not a Megatron-LM dataset index \(bad magic"),
    ("idx", _idx_pack(version=2), r"\.idx: Megatron index version 2, this megascale reads version 1"),
    ("idx", _idx_pack(code=7), r"\.idx: holds float32 values, not token ids"),
    ("idx", _idx_pack(code=42), r"\.idx: unknown token dtype code 42"),
    ("idx", _idx_pack(n_seq=2**40), r"\.idx: truncated"),
    ("idx", lambda b: b[:34 + 4] + struct.pack("<i", 999) + b[34 + 8:], r"\.idx: sequence pointers do not"),
    ("idx", lambda b: b[:-8] + struct.pack("<q", 3), r"\.idx: corrupt document indices \(they must run"),
])
def test_bad_or_truncated_files_are_one_clear_error(mcore, tmp_path, which, change, problem):
    prefix = write_megatron(mcore, tmp_path / "m", _docs(5, seed=3) + [np.array([7, 256])])
    path = tmp_path / f"m.{which}"
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(UserError, match=str(tmp_path / "m") + problem) as err:
        open_dataset(prefix)
    assert "\n" not in str(err.value)
    # the training path reports the same, as one line naming the file (exit 2 from the CLI)
    with pytest.raises(UserError, match=problem):
        ensure_dataset(DataConfig(path=str(prefix)))


def test_multimodal_index_is_refused(mcore, tmp_path):
    b = mcore.IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.uint16, multimodal=True)
    b.add_document(torch.tensor([1, 2, 3]), [3], modes=[0])
    b.finalize(str(tmp_path / "mm.idx"))
    with pytest.raises(UserError, match=r"mm\.idx: a multimodal index"):
        open_dataset(tmp_path / "mm")


def test_token_ids_must_fit_the_tokenizer(mcore, tmp_path):
    prefix = write_megatron(mcore, tmp_path / "gpt2ish", [np.array([5, 50_000, 50_256])])
    with pytest.raises(UserError, match=r"data.path: .*gpt2ish\.bin holds token id 50256, outside the "
                                        r"vocabulary of data.tokenizer \(257 ids\)"):
        ensure_dataset(DataConfig(path=str(prefix), tokenizer="byte"))
    assert ensure_dataset(DataConfig(path=str(prefix), tokenizer="gpt2")) == str(prefix)


# ---- training on it: the real Trainer


def test_trainer_trains_on_megatron_tokens(mcore, tmp_path):
    from megascale.train import Trainer

    tok = build_tokenizer("byte")
    texts = [f"Document {i}: " + "to be or not to be, that is the question. " * (1 + i % 4)
             for i in range(40)]
    docs = [np.array(tok.encode(t) + [tok.eos_id], dtype=np.int64) for t in texts]  # --append-eod
    prefix = write_megatron(mcore, tmp_path / "shk_text_document", docs)
    cfg = load_config(None, [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=8", "train.micro_batch=4", "train.steps=3", "train.eval_interval=0",
        "optim.warmup_steps=1", "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0",
        f"data.path={json.dumps(str(prefix) + '.bin')}", "data.val_fraction=0.0",
        f"train.run_dir={json.dumps(str(tmp_path / 'run'))}", "checkpoint.interval=0",
    ])
    trainer = Trainer(cfg, quiet=True)
    seen = []
    real = trainer.loader.next_batch

    def recording():
        x, y = real()
        seen.append((x.clone(), y.clone()))
        return x, y

    trainer.loader.next_batch = recording
    result = trainer.fit()
    assert result["steps"] == 3 and all(np.isfinite(result["losses"]))
    stream = np.fromfile(f"{prefix}.bin", dtype="<u2").astype(np.int64)
    assert len(seen) == 3
    for step, (x, y) in enumerate(seen):  # every row is its sample's slice of the .bin, shifted by one
        for row, i in enumerate(trainer.loader.global_indices(step)):
            piece = torch.from_numpy(stream[i * 32 : i * 32 + 33])
            assert torch.equal(x[row], piece[:-1]) and torch.equal(y[row], piece[1:])


# ---- `megascale preprocess` of Parquet and .jsonl.gz


TEXTS = ["First document.\nTwo lines.", "Ünïcödé ✓ 日本", "x", "", "a longer one " * 50]


def _expected(texts, tok):
    return [tok.encode(t) + [tok.eos_id] for t in texts if t]


def _parquet(path, texts, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts, **columns}), path,
                   row_group_size=2)
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_text_column(tmp_path, workers):
    src = _parquet(tmp_path / "train-00000.parquet", [*TEXTS, None])
    stats = preprocess([src], tmp_path / "pq", "byte", workers=workers, progress=False)
    ds = IndexedDataset(tmp_path / "pq")
    assert [ds.doc(i).tolist() for i in range(ds.num_docs)] == _expected(TEXTS, build_tokenizer("byte"))
    assert (stats.docs, stats.skipped, stats.input_bytes) == (4, 2, src.stat().st_size)  # "" and null


def test_parquet_without_text_column_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"content": ["a", "b"], "id": [1, 2]}), src)
    with pytest.raises(UserError, match=f'{src}: no "text" column \\(its columns: content, id\\)'):
        preprocess([src], tmp_path / "o", "byte", progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), src)
    with pytest.raises(UserError, match=f'{src}: the "text" column must hold strings, it holds int64'):
        preprocess([src], tmp_path / "o", "byte", progress=False)
    src.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=f"{src}: not a readable Parquet file"):
        preprocess([src], tmp_path / "o", "byte", progress=False)
    assert not list(tmp_path.glob("o.*"))  # nothing half-written


def _jsonl_lines(texts):
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def test_jsonl_gz_equals_the_uncompressed_file(tmp_path):
    texts = [f"line {i} " + "wörd " * (i % 13) for i in range(300)]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.jsonl").write_bytes(_jsonl_lines(texts))
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl_lines(texts)))
    (tmp_path / "gz" / "notes.gz").write_bytes(gzip.compress(b"not a corpus"))  # ignored in a directory
    preprocess([tmp_path / "plain"], tmp_path / "p", "byte", workers=2, progress=False)
    stats = preprocess([tmp_path / "gz"], tmp_path / "g", "byte", workers=2, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"p{suffix}").read_bytes() == (tmp_path / f"g{suffix}").read_bytes()
    assert stats.docs == 300 and stats.input_bytes == (tmp_path / "gz" / "a.jsonl.gz").stat().st_size


def test_bad_jsonl_gz(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(gzip.compress(_jsonl_lines(["good"]) + b"{broken\n"))
    with pytest.raises(UserError, match=f"{src}:2: not valid JSON"):
        preprocess([src], tmp_path / "o", "byte", progress=False)
    src.write_bytes(gzip.compress(_jsonl_lines(["good"] * 50))[:-20])  # cut short
    with pytest.raises(UserError, match=f"{src}: not a readable gzip file"):
        preprocess([src], tmp_path / "o", "byte", progress=False)
    src.write_bytes(b"plain text, not gzip")
    with pytest.raises(UserError, match=f"{src}: not a readable gzip file"):
        preprocess([src], tmp_path / "o", "byte", progress=False)


def test_mixed_directory_and_tokenizer_training_read_every_format(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("alpha")
    (d / "b.jsonl").write_bytes(_jsonl_lines(["beta"]))
    (d / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl_lines(["gamma"])))
    _parquet(d / "d.parquet", ["delta", "epsilon"])
    from megascale.data.sources import expand_inputs

    assert list(iter_texts(expand_inputs([d]))) == ["alpha", "beta", "gamma", "delta", "epsilon"]
    stats = preprocess([d], tmp_path / "all", "byte", progress=False)
    assert stats.docs == 5
