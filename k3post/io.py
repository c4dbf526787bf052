"""Files the package writes and reads back: one atomic write, and JSONL read and append.

**The one rule for a whole-file write** (`atomic_write`; `write_jsonl` is it for JSONL rows): the bytes go to a
temporary file in the same folder (a rename never crosses file systems), the file is fsynced, `os.replace` puts it
in place, and the folder is fsynced (so the rename itself survives a power cut). A reader sees the old file or the
new one, never half of one; a write that fails removes its temporary file.

**JSONL.** An append of one line (``json.dumps(row) + "\\n"``, `append_jsonl`) that a SIGKILL interrupts can leave a
torn last line: a prefix of the row with no newline, possibly cut inside a multi-byte character. Such a line was
never committed (its writer died before finishing the append), so log readers leave it out (`iter_values`,
`read_values`) and the next writer, under the log's lock, cuts it off before appending (`repair_tail`); otherwise
the next row would be glued to it. A malformed line anywhere else, or a last line that ends in a newline, is an
error naming ``file:line`` (`MalformedLineError`). `read_jsonl` reads a data file (one JSON object per line, every
line whole) strictly.

    atomic_write(path, text)              # or bytes
    write_jsonl(path, rows)               # a whole data file, atomically
    rows = read_jsonl(path)               # a data file: every line an object, a bad line names file:line
    rows = read_values(path)              # a log: a torn last line left out (iter_values: one line at a time)
    with lock:
        append_jsonl(path, row)           # cuts a torn last line off first (repair_tail)

Only the standard library: every layer of the package may import this module.

Shape legend: none.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "MalformedLineError",
    "append_jsonl",
    "atomic_write",
    "fsync_path",
    "iter_values",
    "json_line",
    "read_jsonl",
    "read_values",
    "repair_tail",
    "write_jsonl",
]


# --------------------------------------------------------------------------- the atomic write


def fsync_path(path: str | Path) -> None:
    """fsync one file or folder (a folder: its entries, so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (str as UTF-8, or bytes) to ``path`` by the module's one rule: a temporary file in the same
    folder, fsynced, `os.replace` into place, the folder fsynced. The folder is created if missing. Returns
    ``path`` as a Path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(p.parent)
    return p


def _row(row: Any) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    """Write ``rows`` as JSONL (one ``json.dumps(row, ensure_ascii=False)`` a line) with `atomic_write`."""
    return atomic_write(path, "".join(_row(r) for r in rows))


# --------------------------------------------------------------------------- JSONL


class MalformedLineError(ValueError):
    """A JSONL line that is not one JSON value in UTF-8; the message names ``file:line``."""


def json_line(line: bytes, where: str) -> Any:
    """The JSON value of one JSONL line (bytes, so invalid UTF-8 is reported, not raised by the reader).

    Raises `MalformedLineError` naming ``where`` (``file:line``) for invalid UTF-8, malformed JSON, nesting
    too deep for the parser and integers too long to convert (Python's 4,300-digit limit)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedLineError(f"{where}: not valid UTF-8 at byte {e.start}") from None
    try:
        return json.loads(text.rstrip("\r\n"))  # the column of an error is then in the line, not after it
    except json.JSONDecodeError as e:
        raise MalformedLineError(f"{where}: malformed JSON at column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise MalformedLineError(f"{where}: malformed JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise MalformedLineError(f"{where}: malformed JSON: {e}") from None


def iter_values(path: str | Path) -> Iterator[Any]:
    """The JSON value of every non-blank line of the log ``path``, read one line at a time (nothing when it does
    not exist). A torn last line (module doc) is left out, with a warning; any other malformed line raises
    `MalformedLineError`."""
    p = Path(path)
    if not p.exists():
        return
    with p.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                value = json_line(line, f"{p}:{lineno}")
            except MalformedLineError as e:
                if line.endswith(b"\n"):  # written whole, so really malformed
                    raise
                log.warning("leaving out a torn last line, a write cut short (%s)", e)
                return
            yield value


def read_values(path: str | Path) -> list[Any]:
    """`iter_values` as a list ([] when ``path`` does not exist)."""
    return list(iter_values(path))


def read_jsonl(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The records (JSON objects) of the data file ``path``. A missing file, a malformed line or a line that is
    not an object is a ValueError naming ``path`` (and ``:line``), except a torn last line (a crash mid-write)
    when ``repair`` is set: it is dropped and the file truncated."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: file not found")
    out: list[dict[str, Any]] = []
    lines = p.read_bytes().split(b"\n")
    offset = 0
    for lineno, line in enumerate(lines, 1):
        start = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            rec = json_line(line, f"{p}:{lineno}")
        except MalformedLineError as e:
            # no trailing newline: the write was cut short (possibly inside a multi-byte character)
            if repair and lineno == len(lines):
                log.warning("dropping a torn last line (%s)", e)
                with p.open("r+b") as fh:
                    fh.truncate(start)
                break
            raise
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{lineno}: a record must be a JSON object, got {type(rec).__name__}")
        out.append(rec)
    return out


def repair_tail(path: str | Path) -> None:
    """Make ``path`` end at a line boundary before an append (call under the writers' lock): a torn last
    line is cut off; a last line that is one whole JSON value but lacks its newline gets it."""
    p = Path(path)
    if not p.exists():
        return
    with p.open("r+b") as fh:
        size = fh.seek(0, 2)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        start = data.rfind(b"\n") + 1
        try:
            json_line(data[start:], f"{p}:last line")
        except MalformedLineError as e:
            log.warning("cutting off a torn last line, a write cut short (%s)", e)
            fh.truncate(start)
        else:
            fh.seek(size)
            fh.write(b"\n")


def append_jsonl(path: str | Path, row: Mapping[str, Any] | Any, *, fsync: bool = True) -> None:
    """Append ``row`` as one JSONL line to the log ``path`` (call under the writers' lock): a torn last line is
    cut off first (`repair_tail`). With ``fsync`` (the default) the line is durable when this returns; a log
    appended to every step passes False and makes its rows durable in batches (`fsync_path`)."""
    repair_tail(path)
    with Path(path).open("a", encoding="utf-8") as fh:
        fh.write(_row(row))
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
