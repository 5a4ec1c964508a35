"""Tokenizers: byte, offline GPT-2, trained BPE, tokenizer.json files and their errors."""

import json

import pytest

from megascale.data.tokenizer import ByteTokenizer, build_tokenizer, same_tokenizer, train_tokenizer
from megascale.errors import UserError

TEXTS = ["Hello world", "", "héllo wörld ✓ 日本語 🙂\n\ttabs", "  leading and trailing  \n\n",
         "ROMEO:\nBut soft!"]


def test_byte_round_trip_including_non_ascii():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.encode_array(text).tolist() == ids
        assert tok.decode(ids) == text
    assert tok.decode([72, 105, tok.eos_id, 33]) == "Hi!"  # EOS is a boundary, not a character
    assert tok.decode([0xFF, 65]) == "\ufffdA"  # a sampled invalid byte never raises


def test_gpt2_known_ids_and_round_trip():
    tok = build_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eos_id, tok.name) == (50257, 50256, "gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" Hello world") == [18435, 995]
    assert tok.encode("The quick brown fox") == [464, 2068, 7586, 21831]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"


def test_special_token_text_in_a_document_is_not_eos():
    tok = build_tokenizer("gpt2")
    ids = tok.encode("a<|endoftext|>b")
    assert tok.eos_id not in ids
    assert tok.decode(ids) == "a<|endoftext|>b"


def _corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("the cat sat on the mat. " * 40 + "naïve café")
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": f"the dog {i} ran after the cat"})
                                         for i in range(30)) + "\n")
    return d


def test_trained_bpe_round_trip(tmp_path):
    out = tmp_path / "tok" / "tokenizer.json"
    tok = train_tokenizer([_corpus(tmp_path)], out, vocab_size=300)
    assert out.is_file() and [p.name for p in out.parent.iterdir()] == ["tokenizer.json"]  # no temp files
    assert tok.eos_id == 0 and 257 < tok.vocab_size <= 300
    for text in TEXTS + ["the cat sat on the mat"]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat")  # merges learnt
    again = build_tokenizer(str(out))
    assert again.encode("the cat") == tok.encode("the cat")
    # provenance is the file's content, not where it lives
    moved = tmp_path / "elsewhere.json"
    moved.write_bytes(out.read_bytes())
    assert same_tokenizer(tok.name, build_tokenizer(str(moved)).name)
    assert not same_tokenizer(tok.name, "byte")


def test_train_rejects_tiny_vocab(tmp_path):
    with pytest.raises(UserError, match="vocab_size"):
        train_tokenizer([_corpus(tmp_path)], tmp_path / "t.json", vocab_size=100)


def test_missing_and_corrupt_tokenizer_files_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(UserError, match=f"data.tokenizer: tokenizer file {missing} does not exist"):
        build_tokenizer(str(missing), field="data.tokenizer")
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"')
    with pytest.raises(UserError, match=f"{bad} is not a valid Hugging Face tokenizer.json"):
        build_tokenizer(str(bad))


def test_tokenizer_without_end_of_document_token(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "no_eos.json"
    raw.save(str(path))
    with pytest.raises(UserError, match=f"{path}: the tokenizer has no end-of-document token"):
        build_tokenizer(str(path))
