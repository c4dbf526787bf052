"""What goes wrong, and where the user reads about it.

* `UserError`: input the user can fix (a config key, a line of a data file, a path), raised by the code
  that validated it. The CLI prints its message alone and exits 2.
* `StepFailed`: a training stage raised in one of its steps; it names the stage and the step, the cause is
  chained. Anything that is not a `UserError` is a failure of k3post (or of an environment): the CLI prints
  one line and where the full traceback was written, and exits 1.
* The run log: `attach_run_log(run)` copies the process's log records into ``<run>/k3post.log``; a
  traceback the CLI reports goes there too (`write_traceback`), else into a file in the temp folder.

Shape legend: none.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["UserError", "StepFailed", "user_input", "attach_run_log", "detach_run_log", "write_traceback", "RUN_LOG"]

RUN_LOG = "k3post.log"
"""The log file of a run folder."""

_run_log: Path | None = None


class UserError(ValueError):
    """Invalid input the user can fix; the message names the file, line, key or path."""


class StepFailed(RuntimeError):
    """A training stage raised during one of its steps (the cause is chained)."""

    def __init__(self, stage: str, step: int, cause: BaseException) -> None:
        super().__init__(f"{stage}: step {step} failed: {type(cause).__name__}: {cause}")
        self.stage, self.step = stage, step


@contextmanager
def user_input() -> Iterator[None]:
    """A ValueError raised inside is the validated input's fault: it is re-raised as a `UserError`
    (same message, the original chained). Wrap only code whose job is checking the user's input."""
    try:
        yield
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from e


def attach_run_log(run: str | Path) -> Path:
    """Log records of this process (level INFO and up) also go to ``<run>/k3post.log`` (appended); the
    CLI writes the traceback of a failure there. Returns the file's path. Idempotent per path."""
    global _run_log
    path = Path(run) / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve() for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        # one INFO line per HTTP request (engine servers, endpoints) would drown the run log
        logging.getLogger("httpx").setLevel(logging.WARNING)
    _run_log = path
    return path


def detach_run_log() -> None:
    """Stop copying log records to the run log attached by `attach_run_log` (the CLI does this when a
    command ends, so a later command in the same process logs to its own run)."""
    global _run_log
    if _run_log is None:
        return
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == _run_log.resolve()]:
        root.removeHandler(h)
        h.close()
    _run_log = None


def write_traceback(exc: BaseException, argv: Sequence[str] | None = None) -> Path:
    """Append the full traceback of ``exc`` (with the command line ``argv``, default ``sys.argv[1:]``, and
    the time) to the run log, or to a new file in the temp folder when no run log is attached; returns the
    file's path."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    args = " ".join(sys.argv[1:] if argv is None else argv)
    header = f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} k3post {args} (pid {os.getpid()})\n"
    path = _run_log
    if path is None:
        fd, name = tempfile.mkstemp(prefix="k3post-error-", suffix=".log")
        os.close(fd)
        path = Path(name)
    with open(path, "a", encoding="utf-8") as f:
        f.write(header + text)
    return path
