"""Metrics sinks: a JSONL file and TensorBoard events in the run directory.

Every record is a flat dict with a `step`. The JSONL file is the machine-readable truth
(one JSON object per line, flushed per record so a crash loses at most the line being
written); TensorBoard gets the numeric fields as scalars under `<kind>/<name>`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: str | Path, jsonl: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            truncate_after(self.jsonl_path, resume_step)
        self._jsonl = open(self.jsonl_path, "a") if jsonl else None  # noqa: SIM115 - lives with the logger
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it pulls in tensorboard

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        record = {"kind": kind, **record}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k in ("kind", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                if math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


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
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return str(v)
