"""Stage 2's writer process: one per rank, so persisting costs the training process nothing.

Writing a checkpoint in a thread of the training process looked free and was not: DCP
serialises each tensor with `torch.save`, whose zip writer holds the GIL while it copies and
checksums the record, and the training thread, which needs the GIL between every two ops,
waits each time (a 100M-parameter model stepped 70% slower during a persist on 2 cores).
A process has its own interpreter. It reads the snapshot straight from the slot file in
/dev/shm (the table says where each box lies), writes the rank's part with
`dcp_io.write_rank_files`, and sends back the file's checksum and the metadata part; the
training process's persist thread only waits on the pipe and does the one all-gather and, on
rank 0, the commit (dcp_io.persist).

The process is started (spawn: no fork of a process with gloo and OpenMP threads) at the first
persist that training goes on beside (a final one that the training process waits for is written
from that process when no writer is running yet: nothing trains to be protected), niced, and
restarted after it dies: a killed writer is a failed persist (one line, training goes on), never a
lost job. It exits when the training process goes away (EOF on the
pipe).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

from megascale.checkpoint.storage import StorageFailure


class WriterProcess:
    @staticmethod
    def possible() -> bool:
        """A daemonic process (a multiprocessing pool's worker) may start no children: the persist
        then writes from a thread (torchrun's and `--nproc`'s workers are not daemonic)."""
        return not mp.current_process().daemon

    def __init__(self, rank: int):
        self.rank = rank
        self._proc = None
        self._conn = None
        self.started = 0  # processes started so far (a dead one is replaced at the next persist)

    def running(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def write(self, storage_root: str, path: str, slot_file: str, table: list, extra: bytes
              ) -> tuple[dict[str, dict[str, Any]], Any]:
        """The rank's files of the checkpoint at `path` from the snapshot in `slot_file`; raises
        StorageFailure naming what failed there (disk full, ...) or that the writer died."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send((storage_root, path, slot_file, table, extra))
            ok, value = self._conn.recv()
        except (EOFError, OSError) as e:
            code = self._proc.exitcode if self._proc.join(5) is None else None
            self._proc = None
            raise StorageFailure(f"the checkpoint writer process of rank {self.rank} died "
                                 f"(exit code {code})") from e
        if not ok:
            raise StorageFailure(value)
        return value

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.rank), daemon=True,
                                 name=f"megascale-writer-{self.rank}")
        self._proc.start()
        self.started += 1
        child.close()
        self._conn = parent

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
        self._proc = None


def _serve(conn, rank: int) -> None:
    """The writer's loop: one request per persist, until None or the parent is gone."""
    os.nice(10)
    import numpy as np
    import torch

    from megascale.checkpoint.dcp_io import first_line, write_rank_files
    from megascale.checkpoint.shards import Chunk
    from megascale.checkpoint.snapshot import DTYPES
    from megascale.checkpoint.storage import Storage
    from megascale.fault.inject import inject

    torch.set_num_threads(1)  # copies and checksums: one core, the others are training's
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        storage_root, path, slot_file, table, extra = msg
        try:
            buffer = np.memmap(slot_file, dtype=np.uint8, mode="c")  # copy-on-write: never written
            chunks = []
            for fqn, offsets, sizes, dtype, off, write, shape in table:
                if not write:
                    continue
                d = DTYPES[dtype]
                n = int(np.prod(sizes, dtype=np.int64)) * d.itemsize
                box = torch.from_numpy(buffer[off:off + n]).view(d).view(sizes)
                chunks.append(Chunk(fqn, tuple(shape), tuple(offsets), box, True))
            blob = torch.frombuffer(bytearray(extra), dtype=torch.uint8)
            chunks.append(Chunk(f"rank/{rank:05d}/extra", tuple(blob.shape), (0,), blob, True))
            step = int(os.path.basename(path).rsplit("_", 1)[-1])
            inject("writer", step)  # e.g. SIGKILL of this process mid-persist
            reply = (True, write_rank_files(Storage(storage_root), path, rank, chunks))
            del chunks, buffer
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too: the parent logs it
            reply = (False, first_line(e))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
