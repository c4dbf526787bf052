"""`k3post.io`: the one atomic write (temporary file in the same folder, fsync, os.replace, fsync of the folder)
and JSONL read / append; and no other module of the package writing files its own way (issue 33 §plugins).
The torn-line rules of the JSONL logs are in tests/test_jsonl.py, the strict reader's errors in
tests/test_malformed_inputs.py.

Shape legend: none.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from k3post import io as kio

ROOT = Path(__file__).resolve().parents[1] / "k3post"

#: the one writer allowed to replace files without `k3post.io`: the sandbox's own working directory, which is
#: thrown away with the sandbox (atomic for the sandboxed process that reads it, durability not wanted)
OWN_WRITERS = {"k3post/envs/sandbox/core.py": 1}


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record what `os.fsync` is called on: "file" or "dir"."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_atomic_write_replaces_whole_fsyncs_file_then_folder_and_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fsyncs(monkeypatch)
    p = tmp_path / "sub" / "state.json"
    assert kio.atomic_write(p, "é old") == p  # the folder is created
    assert kio.atomic_write(p, b"new bytes") == p
    assert p.read_bytes() == b"new bytes"
    assert seen == ["file", "dir", "file", "dir"]
    assert [x.name for x in p.parent.iterdir()] == ["state.json"]


def test_a_failed_atomic_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "state.json"
    kio.atomic_write(p, "old")

    def replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        kio.atomic_write(p, "new")
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["state.json"]


def test_write_jsonl_reads_back_and_append_cuts_a_torn_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "rows.jsonl"
    rows = [{"id": 1, "text": "é"}, {"id": 2, "text": "x"}]
    kio.write_jsonl(p, rows)
    assert p.read_text(encoding="utf-8") == '{"id": 1, "text": "é"}\n{"id": 2, "text": "x"}\n'
    assert kio.read_jsonl(p) == rows
    with p.open("ab") as fh:
        fh.write(b'{"id": 3, "te')  # a kill inside an append
    with pytest.raises(kio.MalformedLineError, match=r"rows.jsonl:3: malformed JSON"):
        kio.read_jsonl(p)
    assert kio.read_values(p) == rows  # a log reader leaves the torn line out
    seen = _fsyncs(monkeypatch)
    kio.append_jsonl(p, {"id": 3})
    kio.append_jsonl(p, {"id": 4}, fsync=False)
    assert kio.read_jsonl(p) == [*rows, {"id": 3}, {"id": 4}] and seen == ["file"]
    with pytest.raises(ValueError, match=r"missing.jsonl: file not found"):
        kio.read_jsonl(tmp_path / "missing.jsonl")


def _own_file_replacements(path: Path) -> list[int]:
    """Lines of ``path`` that fsync or replace a file themselves: ``os.fsync``, ``os.replace``, ``os.rename`` of a
    file, or ``<tmp>.replace(...)`` / ``<tmp>.rename(...)`` on a name holding ``tmp``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        owner = f.value.id if isinstance(f.value, ast.Name) else ""
        if owner == "os" and f.attr in ("fsync", "replace"):
            lines.append(node.lineno)
        elif f.attr == "replace" and "tmp" in owner.lower():
            lines.append(node.lineno)
    return lines


def test_no_module_writes_files_atomically_its_own_way() -> None:
    """Every whole-file write goes through `k3post.io.atomic_write` (one fsync rule); folder renames
    (checkpoints, exports) are not file writes and stay where they are."""
    found = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).as_posix()
        if rel == "k3post/io.py":
            continue
        hits = _own_file_replacements(p)
        if len(hits) != OWN_WRITERS.get(rel, 0):
            found[rel] = hits
    assert not found, f"write through k3post.io.atomic_write instead (file: lines): {found}"
