"""Tokenise a corpus into an indexed binary dataset (`<prefix>.bin` + `<prefix>.idx`).

Documents are read and tokenised by a pool of worker processes while the parent writes
the results in input order, so the output is byte-for-byte the same whatever the number
of workers. Work is sent in batches of about `BATCH_BYTES` of input with `apply_async`,
at most a few batches per worker in flight, rather than with Pool.imap, whose feeder
thread reads the whole input ahead of the workers: memory stays bounded on a corpus of
any size.

Workers are forked where the platform allows it: they start in milliseconds and need
nothing re-imported, whereas a spawned worker re-imports the caller's main module (the
CLI, and with it torch). Each worker builds its own tokenizer from the spec, so nothing
the parent's tokenizer did (e.g. Rust thread pools) carries into the children.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megascale.data.atomic import atomic_outputs, temp_name
from megascale.data.indexed import encode_index, paths, token_dtype
from megascale.data.sources import Task, expand_inputs, iter_tasks, load_document
from megascale.data.tokenizer import Tokenizer, build_tokenizer
from megascale.errors import UserError

BATCH_BYTES = 256 * 1024
INFLIGHT_PER_WORKER = 4


@dataclass
class PreprocessStats:
    prefix: str
    docs: int
    tokens: int
    seconds: float
    input_bytes: int
    skipped: int  # empty documents (an empty .txt, a "text": "" line), which are left out
    dtype: str

    def __str__(self) -> str:
        rate = self.input_bytes / max(self.seconds, 1e-9) / 1e6
        skipped = f", {self.skipped} empty skipped" if self.skipped else ""
        return (f"{self.prefix}.bin/.idx: {self.docs} documents, {self.tokens} tokens ({self.dtype})"
                f"{skipped}; {self.input_bytes / 1e6:.1f} MB in {self.seconds:.2f} s ({rate:.1f} MB/s)")


def preprocess(
    inputs: Sequence[str | Path] | str | Path,
    output_prefix: str | Path,
    tokenizer_spec: str = "byte",
    workers: int = 1,
    progress: bool = True,
    field: str = "input",
    output_field: str = "output",
) -> PreprocessStats:
    """Tokenise `inputs` (files, directories, globs of .txt / .jsonl) into `output_prefix`.

    Each document is followed by the tokenizer's EOS. Empty documents are skipped. The
    files appear only when complete: on any error or interruption nothing is left behind
    (and an existing dataset at `output_prefix` is untouched). `field` names the setting
    the inputs came from, `output_field` the one of `output_prefix`, for error messages (a full disk
    is one of them).
    """
    if workers < 1:
        raise UserError(f"workers: must be >= 1, got {workers}")
    tok = build_tokenizer(tokenizer_spec)  # a bad spec fails here, before any worker starts
    files = expand_inputs(inputs, field)
    dtype = token_dtype(tok.vocab_size)
    bin_path, idx_path = paths(output_prefix)
    total_bytes = sum(f.stat().st_size for f in files)
    start = time.perf_counter()
    lengths: list[int] = []
    skipped = 0

    def unwritable(e: OSError) -> UserError:
        return UserError(f"{output_field}: {bin_path} cannot be written ({e.strerror or e})")

    try:
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        open(temp_name(bin_path), "wb").close()  # where the output cannot be written, say so before the work
    except OSError as e:
        raise unwritable(e) from None
    with atomic_outputs(bin_path, idx_path) as (tmp_bin, tmp_idx):
        with (
            open(tmp_bin, "wb") as out,
            _pipeline(tokenizer_spec, workers, iter_tasks(files)) as results,
            tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress,
                 desc=f"tokenising {len(files)} file{'s' * (len(files) != 1)}") as bar,
        ):
            for ids, nbytes in results:
                bar.update(nbytes)
                if ids is None:  # a blank JSONL line: not a document
                    continue
                if len(ids) == 0:  # an empty document: left out, but counted
                    skipped += 1
                    continue
                try:
                    out.write(ids.tobytes())
                except OSError as e:  # a full disk: one line; atomic_outputs removes the part written
                    raise unwritable(e) from None
                lengths.append(len(ids))
            try:
                out.flush()  # here, not in the close that ends the with, where its error would be a traceback
            except OSError as e:
                raise unwritable(e) from None
        if not lengths:
            raise UserError(f"{field}: {', '.join(map(str, files[:3]))}{' ...' * (len(files) > 3)} "
                            "contain no non-empty documents")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        try:
            tmp_idx.write_bytes(encode_index(dtype, tok.vocab_size, tok.name, offsets))
        except OSError as e:
            raise unwritable(e) from None
    return PreprocessStats(
        prefix=str(bin_path)[:-4], docs=len(lengths), tokens=int(offsets[-1]),
        seconds=time.perf_counter() - start, input_bytes=total_bytes, skipped=skipped, dtype=dtype.name,
    )


# ---------------------------------------------------------------------------------------
# Worker side: one tokenizer per process, built from the spec.

_encoder: _Encoder | None = None


class _Encoder:
    def __init__(self, spec: str) -> None:
        self.tok: Tokenizer = build_tokenizer(spec)
        self.dtype = token_dtype(self.tok.vocab_size)

    def __call__(self, batch: list[Task]) -> list[tuple[np.ndarray | None, int]]:
        """Per task: EOS-terminated ids, an empty array for an empty document, None for a blank line."""
        out: list[tuple[np.ndarray | None, int]] = []
        for task in batch:
            text = load_document(task)
            if not text:
                out.append((None if text is None else np.zeros(0, self.dtype), task.nbytes))
                continue
            ids = self.tok.encode_array(text)
            doc = np.empty(len(ids) + 1, dtype=self.dtype)  # cast here: smaller to send back
            doc[:-1] = ids
            doc[-1] = self.tok.eos_id
            out.append((doc, task.nbytes))
        return out


def _init_worker(spec: str) -> None:
    global _encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the pool
    _encoder = _Encoder(spec)


def _encode_batch(batch: list[Task]) -> list[tuple[np.ndarray | None, int]]:
    assert _encoder is not None, "worker not initialised"
    return _encoder(batch)


def _batches(tasks: Iterable[Task]) -> Iterator[list[Task]]:
    batch: list[Task] = []
    size = 0
    for task in tasks:
        batch.append(task)
        size += task.nbytes
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _pipeline:
    """Context manager yielding (ids | None, input bytes) per task, in input order."""

    def __init__(self, spec: str, workers: int, tasks: Iterable[Task]) -> None:
        self.spec, self.workers, self.tasks = spec, workers, tasks
        self.pool = None

    def __enter__(self) -> Iterator[tuple[np.ndarray | None, int]]:
        if self.workers == 1:
            encoder = _Encoder(self.spec)
            return (r for batch in _batches(self.tasks) for r in encoder(batch))
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        self.pool = ctx.Pool(self.workers, initializer=_init_worker, initargs=(self.spec,))
        return self._ordered(self.pool)

    def _ordered(self, pool) -> Iterator[tuple[np.ndarray | None, int]]:
        window: deque = deque()
        for batch in _batches(self.tasks):
            window.append(pool.apply_async(_encode_batch, (batch,)))
            if len(window) >= self.workers * INFLIGHT_PER_WORKER:
                yield from window.popleft().get()
        while window:
            yield from window.popleft().get()

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()  # on success all work is done; on error or Ctrl-C, stop it now
            self.pool.join()
