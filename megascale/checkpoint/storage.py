"""Stage 2: checkpoints in storage, in `torch.distributed.checkpoint` (DCP) format, committed atomically.

This module is where they live and what marks them complete (Storage, the commit marker); reading
and writing their tensors through DCP is `dcp_io.py`, imported only when a checkpoint is written or
read (DCP pulls in DTensor: 0.7 s of every process's start-up, for a job that may never persist).

Layout under the storage root (`checkpoint.path`, default RUN_DIR/checkpoints; a local path or
any fsspec URL)::

    step_000100/__0_0.distcp     rank 0's boxes (shards.py), written by DCP (write_rank_files)
    step_000100/__1_0.distcp     rank 1's ...
    step_000100/.metadata        DCP's metadata: every tensor's global shape and where its boxes lie,
                                 merged by rank 0 from the ranks' parts (no DCP collective: each
                                 rank writes alone, in its writer process, writer.py)
    step_000100/COMMIT.json      written last, by rank 0, after every rank's files are durable:
                                 step, sha256 and size of every file, the loader position, the
                                 (redacted) config and the layout that saved it

A directory without COMMIT.json is not a checkpoint: a writer killed mid-persist, a full disk
or an I/O error leaves the previous complete checkpoint the newest one. DCP's own tools read
the directory (`torch.distributed.checkpoint.load`, `format_utils.dcp_to_torch_save`).

Reading never unpickles anything but DCP's metadata classes: `.metadata` is a pickle by
DCP's design, so it is read with an unpickler that admits only those classes, torch dtypes
and sizes; tensor data is read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from megascale.data.atomic import fsync
from megascale.errors import UserError

PREFIX = "step_"
COMMIT = "COMMIT.json"
FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint that cannot be used: the message names the file and the problem."""


class StorageFailure(Exception):
    """A persist that failed elsewhere (the writer process): the message is the one line to log."""


# ---------------------------------------------------------------------------------------
# Where checkpoints live


class Storage:
    """The storage root: a local directory or an fsspec URL, with the few operations we need."""

    def __init__(self, root: str | Path):
        root = str(root)
        self.is_url = "://" in root and not root.startswith("file://")
        if self.is_url:
            self.fs, self.root = fsspec.core.url_to_fs(root)
            self.protocol = root.split("://", 1)[0]
        else:
            self.fs, self.root = LocalFileSystem(), os.path.abspath(root.removeprefix("file://"))
            self.protocol = "file"
        self.display = root

    def join(self, *parts: str) -> str:
        return str(PurePosixPath(self.root, *parts)) if self.is_url else os.path.join(self.root, *parts)

    def url(self, path: str) -> str:
        return f"{self.protocol}://{path}" if self.is_url else path

    def step_dir(self, step: int) -> str:
        return self.join(f"{PREFIX}{step:06d}")

    def _steps(self) -> list[tuple[int, str]]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            name = PurePosixPath(str(e)).name
            if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
                out.append((int(name[len(PREFIX):]), self.join(name)))
        return sorted(out)

    def committed(self) -> list[tuple[int, str]]:
        """Complete checkpoints (with a commit marker), oldest first."""
        return [(s, p) for s, p in self._steps() if self.fs.exists(f"{p}/{COMMIT}")]

    def partial(self) -> list[tuple[int, str]]:
        return [(s, p) for s, p in self._steps() if not self.fs.exists(f"{p}/{COMMIT}")]

    def read_commit(self, path: str) -> dict[str, Any]:
        f = f"{path}/{COMMIT}"
        try:
            with self.fs.open(f, "rb") as fh:
                record = json.loads(fh.read())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {self.url(f)}: cannot be read ({e})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT or "files" not in record:
            raise CheckpointError(f"checkpoint {self.url(f)}: not a megascale commit marker")
        return record

    def write_commit(self, path: str, record: dict[str, Any]) -> None:
        """The commit marker, atomically and durably (tmp, fsync, rename, fsync the directory)."""
        data = json.dumps(record, indent=1).encode()
        if self.is_url:
            with self.fs.open(f"{path}/{COMMIT}", "wb") as fh:  # object stores: a PUT is atomic
                fh.write(data)
            return
        tmp = os.path.join(path, COMMIT + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(path, COMMIT))
        fsync(path)

    def check_writable(self) -> None:
        """Create the root and write a file in it (removed again): a path no checkpoint can be saved to
        fails the start with one line, not the first save hours later."""
        probe = self.join(f".write_test_{os.getpid()}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(probe, "wb") as fh:
                fh.write(b"megascale")
            self.fs.rm(probe)
        except Exception as e:  # noqa: BLE001 - each fsspec backend raises its own kinds
            raise CheckpointError(f"checkpoint.path {self.display}: cannot write there "
                                  f"({type(e).__name__}: {e})") from None

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def sha256(self, path: str) -> tuple[str, int]:
        h, n = hashlib.sha256(), 0
        with self.fs.open(path, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
                n += len(block)
        return h.hexdigest(), n

    def writer(self, path: str):
        from megascale.checkpoint.dcp_io import writer

        return writer(self, path)

    def reader(self, path: str):
        from megascale.checkpoint.dcp_io import reader

        return reader(self, path)
