"""Preprocessing into the indexed dataset, reading it back, and what happens when files are bad."""

import argparse
import json
import os
import struct

import numpy as np
import pytest

import megascale.data.preprocessing as pre
from megascale.data.cli import register
from megascale.data.indexed import IndexedDataset
from megascale.data.preprocessing import preprocess
from megascale.data.tokenizer import ByteTokenizer, build_tokenizer
from megascale.errors import UserError

DOCS = ["First document.\nTwo lines.", "Ünïcödé ✓ 日本", "x", "a longer one " * 50]


def _txt_corpus(tmp_path):
    d = tmp_path / "txt"
    (d / "sub").mkdir(parents=True)
    for i, text in enumerate(DOCS):
        (d / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (d / "notes.md").write_text("not a document")  # ignored inside a directory
    return d


def _jsonl(path, texts, extra_lines=()):
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n", encoding="utf-8")
    return path


def _expected(texts, tok):
    return [tok.encode(t) + [tok.eos_id] for t in texts]


def _listing(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("spec", ["byte", "gpt2"])
def test_round_trip_directory_of_txt(tmp_path, spec):
    out = tmp_path / "out" / "ds"
    stats = preprocess([_txt_corpus(tmp_path)], out, spec, workers=1, progress=False)
    tok = build_tokenizer(spec)
    # rglob in sorted order: doc0.txt, doc2.txt, sub/doc1.txt, sub/doc3.txt
    order = [DOCS[0], DOCS[2], DOCS[1], DOCS[3]]
    ds = IndexedDataset(out)
    assert [ds.doc(i).tolist() for i in range(ds.num_docs)] == _expected(order, tok)
    assert (stats.docs, stats.tokens) == (4, ds.num_tokens) == (ds.num_docs, int(ds.doc_lengths.sum()))
    assert (ds.vocab_size, ds.tokenizer, ds.dtype) == (tok.vocab_size, spec, np.dtype("<u2"))
    assert _listing(out.parent) == ["ds.bin", "ds.idx"]


def test_workers_give_identical_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(pre, "BATCH_BYTES", 64)  # many small batches, so order across workers matters
    texts = [f"document {i}: " + "wörd " * (i % 17) for i in range(120)]
    src = _jsonl(tmp_path / "docs.jsonl", texts)
    outs = {}
    for w in (1, 2):
        preprocess([src], tmp_path / f"w{w}", "byte", workers=w, progress=False)
        outs[w] = [(tmp_path / f"w{w}{s}").read_bytes() for s in (".bin", ".idx")]
    assert outs[1] == outs[2]
    ds = IndexedDataset(tmp_path / "w2")
    assert [ds.doc(i).tolist() for i in range(ds.num_docs)] == _expected(texts, build_tokenizer("byte"))


def test_jsonl_globs_blank_lines_and_empty_documents(tmp_path):
    _jsonl(tmp_path / "b.jsonl", ["bee", ""], extra_lines=["", "   "])
    _jsonl(tmp_path / "a.jsonl", ["ay", "ay again"])
    stats = preprocess([str(tmp_path / "*.jsonl")], tmp_path / "o", "byte", workers=2, progress=False)
    assert (stats.docs, stats.skipped) == (3, 1)  # blank lines are not documents; "" is skipped
    ds = IndexedDataset(tmp_path / "o")
    byte = build_tokenizer("byte")
    assert [ds.doc(i).tolist() for i in range(3)] == _expected(["ay", "ay again", "bee"], byte)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("line,problem", [
    ("{not json", "not valid JSON"),
    ('{"txt": "no text field"}', 'expected a JSON object with a "text" field'),
    ('{"text": 42}', 'the "text" field must be a string'),
])
def test_bad_jsonl_line_names_file_and_line_and_leaves_nothing(tmp_path, workers, line, problem):
    src = _jsonl(tmp_path / "in.jsonl", ["good one", "good two"], extra_lines=[line])
    out = tmp_path / "out"
    out.mkdir()
    (out / "ds.bin").write_bytes(b"old")  # an earlier dataset is left as it was
    with pytest.raises(UserError, match=f"{src}:3: {problem}"):
        preprocess([src], out / "ds", "byte", workers=workers, progress=False)
    assert _listing(out) == ["ds.bin"] and (out / "ds.bin").read_bytes() == b"old"


def test_interrupt_leaves_nothing_half_written(tmp_path, monkeypatch):
    calls = []

    def interrupted(self, text):
        calls.append(text)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)

    monkeypatch.setattr(ByteTokenizer, "encode_array", interrupted)
    src = _jsonl(tmp_path / "in.jsonl", [f"doc {i}" for i in range(10)])
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], tmp_path / "out" / "ds", "byte", workers=1, progress=False)
    assert _listing(tmp_path / "out") == []


def test_input_errors(tmp_path):
    with pytest.raises(UserError, match=f"input: {tmp_path / 'missing'} does not exist"):
        preprocess([tmp_path / "missing"], tmp_path / "o", progress=False)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(UserError, match=r"x.csv is not a .txt, .jsonl, .jsonl.gz or .parquet file"):
        preprocess([tmp_path / "x.csv"], tmp_path / "o", progress=False)
    with pytest.raises(UserError, match=r"matches no .txt, .jsonl, .jsonl.gz or .parquet files"):
        preprocess([str(tmp_path / "*.txt")], tmp_path / "o", progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="contain no non-empty documents"):
        preprocess([tmp_path / "empty.txt"], tmp_path / "o", progress=False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="latin1.txt: not valid UTF-8"):
        preprocess([tmp_path / "latin1.txt"], tmp_path / "o", progress=False)
    assert not list(tmp_path.glob("o.*"))


def test_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "big.json"))
    (tmp_path / "d.txt").write_text("w1 w69999 w65536 w0")
    preprocess([tmp_path / "d.txt"], tmp_path / "o", str(tmp_path / "big.json"), progress=False)
    ds = IndexedDataset(tmp_path / "o")
    assert ds.dtype == np.dtype("<u4") and ds.vocab_size == 70_002
    assert ds.doc(0).tolist() == [1, 69999, 65536, 0, 70_000]


# ---- a damaged dataset is a UserError naming the file


@pytest.fixture
def dataset(tmp_path):
    _jsonl(tmp_path / "in.jsonl", ["one", "two two", "three three three"])
    preprocess([tmp_path / "in.jsonl"], tmp_path / "ds", "byte", progress=False)
    return tmp_path / "ds"


def _rewrite(path, fn):
    path.write_bytes(fn(path.read_bytes()))


def test_bad_magic(dataset):
    idx = dataset.with_suffix(".idx")
    _rewrite(idx, lambda b: b"GARBAGE!" + b[8:])
    with pytest.raises(UserError, match=f"{idx}: not a megascale dataset index"):
        IndexedDataset(dataset)


@pytest.mark.parametrize("cut", [4, 30, 1])
def test_truncated_index(dataset, cut):
    idx = dataset.with_suffix(".idx")
    _rewrite(idx, lambda b: b[: len(b) - cut] if cut != 4 else b[:cut])
    with pytest.raises(UserError, match=f"{idx}: (truncated|not a megascale)"):
        IndexedDataset(dataset)


def test_offsets_not_matching_bin(dataset):
    bin_, idx = dataset.with_suffix(".bin"), dataset.with_suffix(".idx")
    _rewrite(bin_, lambda b: b[:-2])
    with pytest.raises(UserError, match=f"{bin_}: .* bytes, but {idx} describes"):
        IndexedDataset(dataset)


def test_offsets_not_increasing(dataset):
    idx = dataset.with_suffix(".idx")
    # swap the middle two offsets: [0, 4, 12, 30] -> [0, 12, 4, 30]
    _rewrite(idx, lambda b: b[:-24] + struct.pack("<qq", 12, 4) + b[-8:])
    with pytest.raises(UserError, match=f"{idx}: document offsets are corrupt"):
        IndexedDataset(dataset)


def test_missing_files(dataset):
    os.remove(dataset.with_suffix(".bin"))
    with pytest.raises(UserError, match=f"{dataset.with_suffix('.bin')}: dataset file does not exist"):
        IndexedDataset(dataset)


# ---- command line


def _cli(argv):
    parser = argparse.ArgumentParser(prog="megascale")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_preprocess_and_tokenizer_train(tmp_path, capsys):
    corpus = _txt_corpus(tmp_path)
    tok = tmp_path / "tok.json"
    assert _cli(["tokenizer", "train", "--input", str(corpus), "--output", str(tok), "--vocab-size", "280",
                 "--no-progress"]) == 0
    out = tmp_path / "ds"
    assert _cli(["preprocess", "--input", str(corpus), "--output", str(out), "--tokenizer", str(tok),
                 "--workers", "2", "--no-progress"]) == 0
    assert "4 documents" in capsys.readouterr().out
    assert IndexedDataset(out).tokenizer.startswith(f"{tok}@sha256:")
    with pytest.raises(UserError, match="--workers: must be >= 1"):
        _cli(["preprocess", "--input", str(corpus), "--output", str(out), "--workers", "0"])
    with pytest.raises(UserError, match="--input: .*missing does not exist"):
        _cli(["preprocess", "--input", str(tmp_path / "missing"), "--output", str(out), "--no-progress"])


def test_package_exports_the_functions_not_the_submodules():
    import megascale.data
    from megascale.data import preprocess as exported

    assert exported is preprocess and callable(megascale.data.preprocess)
    assert all(hasattr(megascale.data, name) for name in megascale.data.__all__)
