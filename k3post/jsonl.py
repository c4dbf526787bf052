"""JSONL lines as append-only logs write them, including the last line a kill cut short.

An append of one line (``json.dumps(row) + "\\n"``) that a SIGKILL interrupts can leave a torn last line: a
prefix of the row with no newline, possibly cut inside a multi-byte character. Such a line was never
committed (its writer died before finishing the append), so readers leave it out and the next writer, under
the log's lock, cuts it off before appending (`repair_tail`); otherwise the next row would be glued to it.
A malformed line anywhere else, or a last line that ends in a newline, is an error naming ``file:line``.

    rows = read_values(path)              # readers: tolerate a torn last line (iter_values: one line at a time)
    with lock:
        repair_tail(path)                 # writers: cut it off (or end a whole last row with its newline)
        append(path, row)

Shape legend: none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["MalformedLineError", "json_line", "iter_values", "read_values", "repair_tail"]


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
    """The JSON value of every non-blank line of ``path``, read one line at a time (nothing when it does not
    exist). A torn last line (module doc) is left out, with a warning; any other malformed line raises
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
