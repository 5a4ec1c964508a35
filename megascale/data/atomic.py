"""Write files so that readers see either the old version or the whole new one.

Every output of the data pipeline (tokenizer.json, <prefix>.bin, <prefix>.idx) is first
written next to its destination under a temporary name and then renamed over it with
`os.replace`, which is atomic on one filesystem. On an error or Ctrl-C the temporary
files are removed, so a failed run never leaves a half-written dataset that a later run
would mistake for a good one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from megascale.errors import UserError


def temp_name(final: Path) -> Path:
    """A sibling of `final` (same directory, so same filesystem) unique to this process."""
    return final.with_name(f"{final.name}.tmp.{os.getpid()}")


@contextlib.contextmanager
def atomic_outputs(*finals: str | Path) -> Iterator[list[Path]]:
    """Yield temporary paths to write; on success move them onto `finals`, in order.

    The order matters for multi-file outputs: the file a reader checks last (the .idx of
    a dataset) should be committed last.
    """
    paths = [Path(f) for f in finals]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    temps = [temp_name(p) for p in paths]
    try:
        yield temps
        for tmp, final in zip(temps, paths, strict=True):
            fsync(tmp)  # data on disk before the rename makes it visible
            os.replace(tmp, final)
    finally:
        for tmp in temps:  # only left over when something failed
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_outputs(path) as (tmp,):
        tmp.write_text(text, encoding="utf-8")


def write_command_output(path: str | Path, text: str, what: str) -> None:
    """A command's output file (`what`: "the report"), atomically; one that cannot be written (a full
    disk, no permission) is a UserError naming it, with no part of it left behind."""
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise UserError(f"cannot write {what} to {path} ({e.strerror or e}); choose another file with -o"
                        ) from None


def fsync(path: str | Path) -> None:
    """Flush a file's (or a directory's: its entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
