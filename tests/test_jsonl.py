"""JSONL logs after a kill (issue 20): a torn last line is left out by readers and cut off before the next
append (`k3post.jsonl`), in metrics.jsonl (`k3post.metrics`) as in the review decision log (tests/test_review.py).

Shape legend: none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3post.jsonl import MalformedLineError, read_values, repair_tail
from k3post.metrics import MetricsLogger, read_metrics


def _row(step: int) -> bytes:
    return (json.dumps({"stage": "rl", "step": step, "note": "é" * 3}, ensure_ascii=False) + "\n").encode()


@pytest.mark.parametrize("cut", [1, 9, 30, -2])  # inside the key, the value, inside "é" (2 bytes), all but "}\n"
def test_a_torn_last_line_is_left_out_then_cut_off(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "log.jsonl"
    whole = _row(1) + _row(2)
    p.write_bytes(whole + _row(3)[:cut])
    assert [r["step"] for r in read_values(p)] == [1, 2]
    repair_tail(p)
    assert p.read_bytes() == whole


def test_a_whole_last_row_without_its_newline_is_kept_and_ended(tmp_path: Path) -> None:
    p = tmp_path / "log.jsonl"
    p.write_bytes(_row(1) + _row(2)[:-1])
    assert [r["step"] for r in read_values(p)] == [1, 2]
    repair_tail(p)
    assert p.read_bytes() == _row(1) + _row(2)
    repair_tail(p)  # a file that ends at a line boundary (or is empty, or missing) is left alone
    assert p.read_bytes() == _row(1) + _row(2)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    repair_tail(tmp_path / "empty.jsonl")
    repair_tail(tmp_path / "missing.jsonl")
    assert read_values(tmp_path / "missing.jsonl") == [] and not (tmp_path / "missing.jsonl").exists()


def test_a_malformed_line_that_ends_in_a_newline_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "log.jsonl"
    p.write_bytes(_row(1) + _row(2)[:10] + b"\n" + _row(3))
    with pytest.raises(MalformedLineError, match=r"log.jsonl:2: malformed JSON at column"):
        read_values(p)
    p.write_bytes(_row(1) + b'{"bad": "\xff"}\n')
    with pytest.raises(MalformedLineError, match=r"log.jsonl:2: not valid UTF-8 at byte 9"):
        read_values(p)


def test_metrics_after_a_row_torn_by_a_kill(tmp_path: Path) -> None:
    """A kill inside `MetricsLogger.log`'s write: `read_metrics` leaves the torn row out, the resumed run's
    first `log` cuts it off (not glued to the new row), `truncate` keeps working."""
    m = MetricsLogger(tmp_path, tensorboard=False)
    m.log("rl", 1, {"reward": 0.5})
    m.log("rl", 2, {"reward": 0.25})
    whole = m.path.read_bytes()
    m.path.write_bytes(whole + b'{"stage": "rl", "step": 3, "rew')
    assert [r["step"] for r in read_metrics(m.path, "rl")] == [1, 2]
    m.truncate("rl", 1)  # the resume from the step-1 checkpoint
    assert [r["step"] for r in read_metrics(m.path)] == [1]
    m.path.write_bytes(m.path.read_bytes() + b'{"stage": "rl", "st')
    m.log("rl", 2, {"reward": 0.75})
    rows = read_metrics(m.path)
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.5), (2, 0.75)]
    assert m.path.read_bytes().count(b"\n") == 2
