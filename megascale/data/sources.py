"""Find the input files of a corpus and read documents out of them.

Four formats, chosen by suffix:

- `.txt`: the whole file is one document (a play, a book, a web page);
- `.jsonl`: one JSON object per line with the document in its "text" field (the format
  of Megatron-LM's preprocess_data.py and most published corpora). Blank lines are
  skipped; anything else that is not such an object is an error naming file:line;
- `.jsonl.gz`: the same, gzip-compressed (as corpora are usually shipped), read as a stream;
- `.parquet`: one document per row of its "text" column (the Hugging Face Hub's format),
  read a batch of rows at a time with pyarrow; a null is an empty document.

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
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from megascale.errors import UserError

TEXT_SUFFIX = ".txt"
JSONL_SUFFIX = ".jsonl"
JSONL_GZ_SUFFIX = ".jsonl.gz"
PARQUET_SUFFIX = ".parquet"
SUFFIXES = (TEXT_SUFFIX, JSONL_SUFFIX, JSONL_GZ_SUFFIX, PARQUET_SUFFIX)
KINDS = ".txt, .jsonl, .jsonl.gz or .parquet"  # for messages
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: memory stays bounded on a file of any size


class Task(NamedTuple):
    """One document to read: a whole .txt file (line 0, raw None), one JSONL line (of a .jsonl or
    a .jsonl.gz), or one Parquet row (raw: its "text" as UTF-8, line: the row, from 1)."""

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
                raise UserError(f"{field}: {text} matches no {KINDS} files")
            files.extend(found)
            continue
        path = Path(text)
        if not path.exists():
            raise UserError(f"{field}: {text} does not exist")
        if path.is_dir():
            found = _files_in(path)
            if not found:
                raise UserError(f"{field}: directory {text} holds no {KINDS} files")
            files.extend(found)
        elif kind_of(path):
            files.append(path)
        else:
            raise UserError(f"{field}: {text} is not a {KINDS} file (one document per .txt file, one "
                            "JSON object with a \"text\" field per .jsonl line, one row of the \"text\" "
                            "column per Parquet row)")
    seen: set[Path] = set()
    unique = []
    for f in files:  # the same file named twice (overlapping globs) is read once
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def kind_of(path: Path) -> str | None:
    """The format of a file by its suffix (one of SUFFIXES), or None. By name, not Path.suffix:
    the suffix of a .jsonl.gz is .gz."""
    name = path.name
    return next((s for s in (JSONL_GZ_SUFFIX, *SUFFIXES) if name.endswith(s)), None)


def _files_in(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if kind_of(path) else []
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and kind_of(p))
    return []


def iter_tasks(files: Sequence[Path]) -> Iterator[Task]:
    """The documents of `files` in order, as tasks for `load_document`."""
    for path in files:
        kind = kind_of(path)
        if kind == TEXT_SUFFIX:
            yield Task(str(path), 0, None, os.path.getsize(path))
        elif kind == JSONL_GZ_SUFFIX:
            yield from _gzip_lines(path)
        elif kind == PARQUET_SUFFIX:
            yield from _parquet_rows(path)
        else:
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    yield Task(str(path), lineno, raw, len(raw))


def _gzip_lines(path: Path) -> Iterator[Task]:
    """The lines of a .jsonl.gz, decompressed as a stream. Each task counts the compressed bytes
    read for it, so the progress bar (sized by the files on disk) ends at 100%."""
    done = 0
    with open(path, "rb") as raw_file:
        try:
            with gzip.GzipFile(fileobj=raw_file) as f:
                for lineno, raw in enumerate(f, start=1):
                    now = raw_file.tell()
                    yield Task(str(path), lineno, raw, now - done)
                    done = now
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut file, EOFError
            raise UserError(f"{path}: not a readable gzip file ({e})") from None
    rest = os.path.getsize(path) - done
    if rest > 0:  # the gzip trailer: no document, only bytes for the progress bar
        yield Task(str(path), 0, b"", rest)


def _parquet_rows(path: Path) -> Iterator[Task]:
    """The rows of a Parquet file's "text" column, PARQUET_BATCH_ROWS at a time. The parent only
    decodes the column (pyarrow, compiled); tokenising stays in the workers, as for JSONL."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - a dependency of the package
        raise UserError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    if "text" not in schema.names:
        raise UserError(f'{path}: no "text" column (its columns: {", ".join(schema.names) or "none"})')
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind))):
        raise UserError(f'{path}: the "text" column must hold strings, it holds {kind}')
    rows, size = max(pf.metadata.num_rows, 1), os.path.getsize(path)
    row = done = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
            # as bytes: the workers decode them, the parent never builds the Python strings
            for raw in batch.column(0).cast(pa.large_binary()).to_pylist():
                row += 1
                share = size * row // rows - done  # the file's bytes spread over its rows
                done += share
                yield Task(str(path), row, raw if raw is not None else b"", share)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: cannot read the Parquet rows from row {row + 1} ({e})") from None


def load_document(task: Task) -> str | None:
    """The text of one document; None for a blank JSONL line. Raises UserError naming file[:line]."""
    if task.raw is None:
        try:
            data = Path(task.path).read_bytes()
        except OSError as e:
            raise UserError(f"{task.path}: cannot read ({e.strerror})") from None
        return _decode(data, task.path)
    where = f"{task.path}:{task.line}"
    if task.path.endswith(PARQUET_SUFFIX):  # a row's text as it is: never JSON, never blank
        return _decode(task.raw, where)
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
