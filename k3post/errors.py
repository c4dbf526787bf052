"""What goes wrong, and where the user reads about it.

* `UserError`: input the user can fix (a config key, a line of a data file, a path), raised by the code
  that validated it. The CLI prints its message alone and exits 2.
* `StepFailed`: a training stage raised in one of its steps; it names the stage and the step, the cause is
  chained. Anything that is not a `UserError` is a failure of k3post (or of an environment): the CLI prints
  one line and where the full traceback was written, and exits 1.
* `InfrastructureError`: an environment worker, a sandbox, a browser or a judge failed (its ``kind``,
  one of `INFRA_KINDS`): not the policy's outcome. A rollout it ends is masked out of its group (never a
  reward) and counted; too many of them fail the run (`k3post.loop`, ``rl.infra_max_rate``).
  `infra_kind` finds one in an exception's cause chain.
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

__all__ = ["UserError", "StepFailed", "InfrastructureError", "JudgeUnavailableError", "INFRA_KINDS", "infra_kind", "user_input", "attach_run_log", "detach_run_log", "write_traceback", "RUN_LOG"]

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


INFRA_KINDS: tuple[str, ...] = ("env_lost", "sandbox", "browser", "judge")
"""What failed under an episode: ``env_lost`` its environment worker (lost past the retries from its saved
state), ``sandbox`` the sandbox that runs model-written code (no isolating backend, its launcher missing),
``browser`` the headless browser of ``coding.webdev``, ``judge`` the GRM judge (its transport: the server
unreachable, the connection lost after the retries)."""


class InfrastructureError(RuntimeError):
    """Infrastructure under an episode failed, not the policy: ``kind`` is one of `INFRA_KINDS`. Raised by
    harness code only (never built from text the policy's programs print), so a policy cannot forge one."""

    kind: str = "env_lost"

    def __init__(self, *args: object, kind: str | None = None) -> None:
        super().__init__(*args)
        if kind is not None:
            if kind not in INFRA_KINDS:
                raise ValueError(f"infrastructure kind must be one of {INFRA_KINDS}, got {kind!r}")
            self.kind = kind


class JudgeUnavailableError(InfrastructureError):
    """The GRM judge could not answer (transport failure after its retries): the group it was to score
    gets no reward."""

    kind = "judge"


def infra_kind(exc: BaseException | None) -> str | None:
    """The kind of the first `InfrastructureError` in ``exc`` and its causes / contexts, None when there is
    none (then the failure is the environment's or the policy's, not the infrastructure's)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, InfrastructureError):
            return exc.kind
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


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
