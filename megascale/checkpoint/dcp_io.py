"""Checkpoint tensors through `torch.distributed.checkpoint` (DCP): each rank's boxes written alone
(write_rank_files, in the writer process), the metadata merged by rank 0, the commit (persist), and
reading any stored box into any live one (load_chunks): the layout-free restore.

Imported when a checkpoint is written or read, not at start-up (see storage.py). Reading never
unpickles anything but DCP's metadata classes (`.metadata` is a pickle by DCP's design), torch
dtypes and sizes; tensor data is read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _validate_global_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megascale.checkpoint.shards import Chunk
from megascale.checkpoint.storage import FORMAT, CheckpointError, Storage, StorageFailure


def writer(storage: Storage, path: str):
    """DCP's writer for one checkpoint directory: one file per rank, fsynced."""
    if storage.is_url:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(storage.url(path), single_file_per_rank=True, sync_files=True, thread_count=1)
    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)


def reader(storage: Storage, path: str):
    """DCP's reader for one checkpoint directory, with the safe metadata unpickler."""
    if storage.is_url:
        return _SafeFsspecReader(storage.url(path))
    return _SafeFileSystemReader(path)


# ---------------------------------------------------------------------------------------
# Safe metadata


_TORCH_NAMES = {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes/sizes/layouts and paths; nothing else."""

    def find_class(self, module: str, name: str):
        allowed = (module.startswith("torch.distributed.checkpoint.")
                   or (module == "torch" and name in _TORCH_NAMES)
                   or (module == "torch.serialization" and name == "_get_layout")
                   or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath")))
        if allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(stream) -> Metadata:
    md = _MetadataUnpickler(io.BytesIO(stream.read())).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError("not DCP metadata")
    return md


class _SafeReadMixin:
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as fh:
            md = read_metadata(fh)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _SafeFileSystemReader(_SafeReadMixin, FileSystemReader):
    pass


def _fsspec_reader_class():
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return type("_SafeFsspecReader", (_SafeReadMixin, FsspecReader), {})


def _SafeFsspecReader(path: str):  # noqa: N802 - a class made on first use (fsspec import is lazy)
    return _fsspec_reader_class()(path)


# ---------------------------------------------------------------------------------------
# DCP planners over our boxes


class _ChunkSavePlanner(DefaultSavePlanner):
    """Saves the given boxes (shards.Chunk with write=True) under their global names."""

    def __init__(self, chunks: list[Chunk]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {c.key: c for c in chunks if c.write}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for c in self.chunks.values():
            items.append(WriteItem(
                index=MetadataIndex(c.fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties.create_from_tensor(c.tensor),
                    size=torch.Size(c.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))].tensor


def _narrow(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into the given boxes whatever part of the stored tensors overlaps them."""

    def __init__(self, chunks: list[Chunk], where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.by_fqn: dict[str, list[Chunk]] = {}
        for c in chunks:
            self.by_fqn.setdefault(c.fqn, []).append(c)
        self.where = where
        self.bytes_read = 0

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import LoadPlan

        md = self.metadata.state_dict_metadata
        items = []
        for fqn, chunks in list(self.by_fqn.items()):
            stored = md.get(fqn)
            if stored is None and chunks[0].fallback in md:  # a pipeline's head copy from a pp = 1 save
                self.by_fqn.pop(fqn)
                fqn = chunks[0].fallback
                self.by_fqn.setdefault(fqn, []).extend(chunks)
                chunks = self.by_fqn[fqn]
                stored = md[fqn]
            if not isinstance(stored, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {self.where}: has no {fqn} (saved by another model or "
                                      "optimizer configuration)")
            if tuple(stored.size) != chunks[0].global_shape:
                raise CheckpointError(f"checkpoint {self.where}: {fqn} has shape {tuple(stored.size)} there, "
                                      f"{chunks[0].global_shape} in this model (the model config differs)")
            local = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                     for c in chunks]
            items += create_read_items_for_chunk_list(fqn, stored, local)
        seen = set()
        for it in items:
            info = self.metadata.storage_data.get(it.storage_index)
            if info is not None and (info.relative_path, info.offset) not in seen:
                seen.add((info.relative_path, info.offset))
                self.bytes_read += info.length
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item):
        chunk = self.by_fqn[read_item.dest_index.fqn][read_item.dest_index.index]
        return _narrow(chunk.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # read straight into the live state's view


# ---------------------------------------------------------------------------------------
# Persist and load


@dataclass
class PersistResult:
    step: int
    path: str
    ok: bool
    error: str = ""
    bytes_written: int = 0  # this rank's
    seconds: float = 0.0


def write_rank_files(storage: Storage, path: str, rank: int, chunks: list[Chunk]
                     ) -> tuple[dict[str, dict[str, Any]], Metadata]:
    """This rank's part of a checkpoint, no collective: its boxes through DCP into `__RANK_0.distcp`.

    DCP writes a one-process checkpoint into a scratch folder; its data file moves into `path` under
    the rank's name and its metadata (the rank's boxes and where they lie) is returned for rank 0 to
    merge (`commit`). Runs in the writer process (writer.py) or in a thread. Returns the file's
    {name: {sha256, bytes}} and the metadata part.
    """
    scratch = f"{path}/.rank{rank:05d}"
    storage.remove(scratch)
    with _quiet_dcp():
        dcp.save({}, storage_writer=storage.writer(scratch), planner=_ChunkSavePlanner(chunks), no_dist=True)
    with storage.fs.open(f"{scratch}/.metadata", "rb") as fh:
        part = read_metadata(fh)
    name = f"__{rank}_0.distcp"
    storage.fs.mv(f"{scratch}/__0_0.distcp", f"{path}/{name}")
    storage.remove(scratch)
    part.storage_data = {k: dataclasses.replace(v, relative_path=name) for k, v in part.storage_data.items()}
    digest, n = storage.sha256(f"{path}/{name}")
    return {name: {"sha256": digest, "bytes": n}}, part


def merge_metadata(parts: list[Metadata]) -> Metadata:
    """One DCP metadata from every rank's part: each tensor's boxes, and where each box lies.

    Raises ValueError unless the boxes tile every tensor exactly (in bounds, no overlap, the whole
    volume): DCP's own check of a global plan, which a per-rank save cannot run.
    """
    out = parts[0]
    for part in parts[1:]:
        for fqn, md in part.state_dict_metadata.items():
            mine = out.state_dict_metadata.get(fqn)
            if mine is None:
                out.state_dict_metadata[fqn] = md
            else:
                mine.chunks.extend(md.chunks)
        out.storage_data.update(part.storage_data)
    errors = _validate_global_plan([SavePlan([]), SavePlan([])], out)  # two plans: the fill is checked
    if errors:
        raise ValueError(f"the ranks' boxes do not tile the state ({errors[0]})")
    return out


def persist(storage: Storage, step: int, write, meta: dict[str, Any] | None, group: dist.ProcessGroup | None,
            rank: int, world: int, inject=None) -> PersistResult:
    """Collective over `group` (every rank, same order): write this rank's part, commit on rank 0.

    write(path) -> (files, metadata part) writes the rank's boxes (`write_rank_files`, in the writer
    process or here). Then one all-gather brings every rank's outcome to rank 0, which writes the
    merged `.metadata` and, last, COMMIT.json. Never raises for storage failures: the result says
    what went wrong, the same on every rank. `inject(point, step)` is the fault-injection hook.
    """
    t0 = time.perf_counter()
    path = storage.step_dir(step)
    error = ""
    try:
        if rank == 0:
            storage.remove(path)  # a partial directory of this step (no commit marker: not a checkpoint)
            storage.fs.makedirs(path, exist_ok=True)
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    error = _agree(error, group, world)
    files: dict[str, dict[str, Any]] = {}
    part = None
    if not error:
        try:
            if inject is not None:
                inject("write", step)  # e.g. a full disk (OSError ENOSPC)
            files, part = write(path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - disk full, I/O error, a dead writer
            error = first_line(e)
    if inject is not None:
        inject("persist", step)  # e.g. SIGKILL between the shards and the commit marker
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, (error, files, part), group=group)
    else:
        gathered = [(error, files, part)]
    errors = [e for e, _, _ in gathered if e]
    ok = not errors
    if ok and rank == 0:
        try:
            all_files = {}
            for _, f, _ in gathered:
                all_files |= f
            md = merge_metadata([p for _, _, p in gathered])
            with storage.fs.open(f"{path}/.metadata", "wb") as fh:
                pickle.dump(md, fh)  # DCP's own format: its tools read it
                if not storage.is_url:
                    fh.flush()
                    os.fsync(fh.fileno())
            md_digest, md_bytes = storage.sha256(f"{path}/.metadata")
            all_files[".metadata"] = {"sha256": md_digest, "bytes": md_bytes}
            storage.write_commit(path, {"format": FORMAT, "step": step, "files": all_files,
                                        "time": time.time(), **(meta or {})})
        except Exception as e:  # noqa: BLE001
            errors, ok = [first_line(e)], False
    result = [ok, errors[0] if errors else ""]
    if world > 1:
        dist.broadcast_object_list(result, src=_global_rank0(group), group=group)
    if not result[0] and rank == 0:  # every rank is done with it: its files would only take the room a
        with contextlib.suppress(Exception):  # later persist needs (a full disk); best effort
            storage.remove(path)
    if inject is not None and result[0] and not storage.is_url:
        inject("committed", step, [f"{path}/{name}" for name in files])  # e.g. a shard that rots on disk
    written = sum(f["bytes"] for f in files.values())
    return PersistResult(step, path, bool(result[0]), result[1], written, time.perf_counter() - t0)


def load_chunks(storage: Storage, path: str, chunks: list[Chunk]) -> int:
    """Read the boxes `chunks` describe from the checkpoint at `path` (no collectives); bytes read."""
    planner = _ChunkLoadPlanner(chunks, storage.url(path))
    try:
        with _quiet_dcp():
            dcp.load({}, storage_reader=storage.reader(path), planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged file: name it
        inner = _inner(e)
        if isinstance(inner, CheckpointError):  # ours, raised inside DCP's planning
            raise inner from None
        raise CheckpointError(f"checkpoint {storage.url(path)}: cannot be read ({first_line(e)})") from None
    return planner.bytes_read


def stored_tensors(storage: Storage, path: str) -> dict[str, TensorStorageMetadata]:
    """The global tensors a checkpoint holds: name -> DCP metadata (shape, dtype)."""
    f = f"{path}/.metadata"
    try:
        with storage.fs.open(f, "rb") as fh:
            md = read_metadata(fh)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {storage.url(f)}: cannot be read ({e})") from None
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def verify(storage: Storage, path: str, record: dict[str, Any], names: list[str]) -> str | None:
    """Check the named files against the commit marker's sha256; the first problem, or None."""
    for name in names:
        want = record["files"][name]
        f = f"{path}/{name}"
        try:
            digest, n = storage.sha256(f)
        except OSError as e:
            return f"checkpoint file {storage.url(f)}: cannot be read ({e})"
        if n != want["bytes"]:
            return f"checkpoint file {storage.url(f)}: {n} bytes, the commit marker says {want['bytes']}"
        if digest != want["sha256"]:
            return f"checkpoint file {storage.url(f)}: checksum mismatch (corrupted)"
    return None


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that no_dist means one process: that is what we ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _agree(error: str, group, world: int) -> str:
    if world == 1:
        return error
    out = [None] * world
    dist.all_gather_object(out, error, group=group)
    return next((e for e in out if e), "")


def _global_rank0(group) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def _inner(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (else e itself)."""
    if isinstance(e, CheckpointException) and e.failures:
        failure = sorted(e.failures.items())[0][1]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


def first_line(e: BaseException) -> str:
    """'OSError: [Errno 28] No space left on device', also from inside DCP's CheckpointException."""
    if isinstance(e, StorageFailure):
        return str(e)
    if isinstance(e, CheckpointException) and e.failures:
        rank, failure = sorted(e.failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return f"rank {rank}: {first_line(inner)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()
