"""Find the input files of a corpus and read documents out of them.

Two formats, chosen by suffix:

- `.txt`: the whole file is one document (a play, a book, a web page);
- `.jsonl`: one JSON object per line with the document in its "text" field (the format
  of Megatron-LM's preprocess_data.py and most published corpora). Blank lines are
  skipped; anything else that is not such an object is an error naming file:line.

Inputs may be files, directories (searched recursively) and globs. Files are taken in
sorted order within each directory or glob, and inputs in the order given, so the
document order, and with it every later seed-driven choice, does not depend on the
filesystem's listing order.

Reading is split in two so that the expensive half runs in worker processes: the parent
enumerates `Task`s (cheap: a file name, or one raw JSONL line) and `load_document` turns a
task into text wherever it runs.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from megascale.errors import UserError

TEXT_SUFFIX = ".txt"
JSONL_SUFFIX = ".jsonl"
SUFFIXES = (TEXT_SUFFIX, JSONL_SUFFIX)


class Task(NamedTuple):
    """One document to read: a whole .txt file (line 0, raw None) or one JSONL line."""

    path: str
    line: int
    raw: bytes | None
    nbytes: int  # input bytes it covers, for the progress bar


def expand_inputs(inputs: Sequence[str | Path], field: str = "input") -> list[Path]:
    """Files named by `inputs` (files, directories, globs), in a deterministic order.

    `field` names the setting the inputs came from (`data.source`, `--input`) so that an
    error message points at what the user has to change.
    """
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not inputs:
        raise UserError(f"{field}: no input files given")
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text, recursive=True))
            found = [f for m in matches for f in _files_in(Path(m))]
            if not found:
                raise UserError(f"{field}: {text} matches no {' or '.join(SUFFIXES)} files")
            files.extend(found)
            continue
        path = Path(text)
        if not path.exists():
            raise UserError(f"{field}: {text} does not exist")
        if path.is_dir():
            found = _files_in(path)
            if not found:
                raise UserError(f"{field}: directory {text} holds no {' or '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.suffix in SUFFIXES:
            files.append(path)
        else:
            raise UserError(f"{field}: {text} is not a {' or '.join(SUFFIXES)} file (one document per "
                            ".txt file, or one JSON object with a \"text\" field per .jsonl line)")
    seen: set[Path] = set()
    unique = []
    for f in files:  # the same file named twice (overlapping globs) is read once
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def _files_in(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix in SUFFIXES else []
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    return []


def iter_tasks(files: Sequence[Path]) -> Iterator[Task]:
    """The documents of `files` in order, as tasks for `load_document`."""
    for path in files:
        if path.suffix == TEXT_SUFFIX:
            yield Task(str(path), 0, None, os.path.getsize(path))
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                yield Task(str(path), lineno, raw, len(raw))


def load_document(task: Task) -> str | None:
    """The text of one document; None for a blank JSONL line. Raises UserError naming file[:line]."""
    if task.raw is None:
        try:
            data = Path(task.path).read_bytes()
        except OSError as e:
            raise UserError(f"{task.path}: cannot read ({e.strerror})") from None
        return _decode(data, task.path)
    where = f"{task.path}:{task.line}"
    if not task.raw.strip():
        return None
    try:
        obj = json.loads(_decode(task.raw, where))
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or "text" not in obj:
        raise UserError(f'{where}: expected a JSON object with a "text" field')
    text = obj["text"]
    if not isinstance(text, str):
        raise UserError(f'{where}: the "text" field must be a string, got {type(text).__name__}')
    return text


def iter_texts(files: Sequence[Path]) -> Iterator[str]:
    """Every non-empty document of `files` as text, in order (for tokenizer training)."""
    for task in iter_tasks(files):
        text = load_document(task)
        if text:
            yield text


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not valid UTF-8 (byte {e.start})") from None
