"""Metrics sinks: one JSONL file per run (the source of truth for the report) plus TensorBoard."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock

from k3post.io import append_jsonl, fsync_path, iter_values, write_jsonl


class MetricsLogger:
    """Append `{"stage", "step", "time", **values}` rows to ``metrics.jsonl`` and mirror scalars to TensorBoard.

    On resume, `truncate(stage, step)` drops rows of that stage logged after the checkpoint's step so the
    file reads as one uninterrupted run. A row a kill cut short (a torn last line) is left out by readers
    and cut off before the next row is appended (`k3post.io`). `sync` makes the rows logged so far
    durable (a training loop calls it before each checkpoint: the file, not the checkpoint, holds the
    per-step rows, `k3post.loop.StageLog`).
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._lock = FileLock(str(self.dir / ".metrics.lock"))  # several processes may log into one run
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))

    def log(self, stage: str, step: int, values: Mapping[str, Any]) -> None:
        row = {"stage": stage, "step": step, "time": round(time.time(), 3), **values}
        with self._lock:
            append_jsonl(self.path, row, fsync=False)  # durable in batches: `sync`
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{stage}/{k}", v, step)

    def truncate(self, stage: str, after_step: int) -> None:
        """Remove `stage` rows with step > `after_step` (rewritten atomically)."""
        with self._lock:
            if self.path.exists():
                self._rewrite([r for r in iter_metrics(self.path)
                               if not (r.get("stage") == stage and r.get("step", 0) > after_step)])

    def replace_stage(self, stage: str, rows: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Replace every `stage` row by ``rows`` ((step, values) in step order, appended after the other
        stages' rows; no ``time``), rewritten atomically, without TensorBoard."""
        with self._lock:
            keep = [r for r in iter_metrics(self.path) if r.get("stage") != stage]
            self._rewrite(keep + [{"stage": stage, "step": step, **values} for step, values in rows])

    def sync(self) -> None:
        """fsync the rows logged so far (under the lock: no half-appended row is made durable mid-write)."""
        with self._lock:
            if self.path.exists():
                fsync_path(self.path)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        write_jsonl(self.path, rows)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path, stage: str | None = None) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file, optionally of one stage (a torn last row, cut short by a kill, is left
    out; any other malformed line is a `k3post.io.MalformedLineError` naming the file and line)."""
    return list(iter_metrics(path, stage))


def iter_metrics(path: str | Path, stage: str | None = None) -> Iterator[dict[str, Any]]:
    """`read_metrics`, one row at a time (a long run's file is not held in memory)."""
    return (r for r in iter_values(path) if stage is None or r.get("stage") == stage)
