"""Metrics sinks: a JSONL file and TensorBoard events in the run directory.

Every record is a flat dict with a `step`. The JSONL file is the machine-readable truth
(one JSON object per line, flushed per record so a crash loses at most the line being
written); TensorBoard gets the numeric fields as scalars under `<kind>/<name>`. A disk that
refuses them (full) costs their records, with one line saying so, never the run (linefile.py);
TensorBoard, whose writer cannot recover, is then off for the rest of the run.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from megascale.data.atomic import write_text_atomic
from megascale.observe.linefile import LineFile, say

_NOT_SCALARS = ("kind", "step", "time")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, jsonl: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None, warn=say):
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._warn = warn
        if resume_step is not None:
            try:
                truncate_after(self.jsonl_path, resume_step)
            except OSError as e:  # a restart on a full disk: the run goes on, the file as it is
                warn(f"metrics: cannot rewrite {self.jsonl_path} ({e.strerror or e}): its records after step "
                     f"{resume_step} stay beside the resumed run's; training goes on")
        self._jsonl = LineFile(self.jsonl_path, "metrics", warn) if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it pulls in tensorboard

            _quiet_tensorboard_writer_thread()
            try:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step)
            except Exception as e:  # noqa: BLE001 - as in log()
                self._tb_failed(e)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        # the wall clock (Unix seconds) of every record: loss against time, and the report's ETTR
        record = {"kind": kind, **record, "time": round(time.time(), 3)}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tb is not None:
            step = record["step"]
            try:
                for k, v in record.items():
                    if k in _NOT_SCALARS or isinstance(v, bool) or not isinstance(v, (int, float)):
                        continue
                    if math.isfinite(v):
                        self._tb.add_scalar(f"{kind}/{k}", v, step)
            except Exception as e:  # noqa: BLE001 - its writer thread failed (a full disk), and raises
                self._tb_failed(e)  # from then on: TensorBoard goes, training does not

    def _tb_failed(self, e: Exception) -> None:
        tb, self._tb = getattr(self, "_tb", None), None
        self._warn(f"tensorboard: cannot write {self.run_dir / 'tensorboard'} "
                   f"({getattr(e, 'strerror', None) or e}); "
                   "tensorboard is off for the rest of the run (metrics.jsonl has every record it can "
                   "write); training goes on")
        try:
            if tb is not None:
                tb.close()
        except Exception:  # noqa: BLE001 - it failed already, and said so
            pass

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            try:
                self._tb.flush()
                self._tb.close()
            except Exception as e:  # noqa: BLE001 - as in log()
                self._tb_failed(e)
            self._tb = None


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes from a thread of its own, whose OSError (a full disk) Python prints as a
    traceback; the writer raises it again at the next write, where the logger says it in one line."""
    hook = threading.excepthook
    if getattr(hook, "megascale", False):
        return

    def quiet(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        hook(args)

    quiet.megascale = True
    threading.excepthook = quiet


def truncate_after(path: Path, step: int) -> None:
    """Drop records logged after `step`: a resumed run re-does those steps and logs them again."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if rec.get("step", 0) <= step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))  # (a failed write leaves no part)


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash or a full disk (or the empty one after it)
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return str(v)
