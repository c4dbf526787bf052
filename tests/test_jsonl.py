"""JSONL logs after a kill (issue 20): a torn last line is left out by readers and cut off before the next
append (`k3post.io`), in metrics.jsonl (`k3post.metrics`) as in the review decision log (tests/test_review.py).

Shape legend: none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3post.io import MalformedLineError, read_values, repair_tail
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


def test_a_stage_log_reads_its_stage_back_in_step_order_and_marks_missing_steps(tmp_path: Path, caplog) -> None:
    """`k3post.loop.StageLog`: one stage's rows (without the logger's stage / step / time), steps 1..steps only;
    `series` is NaN at a step without a row; a torn last row is left out like any reader's. `rollout_gap` of
    the rows by hand: (0.1·10 + 0.3·30) / 40 = 0.25, max 0.9. A resume whose file lacks rows names them."""
    import math

    from k3post.loop import StageLog, _check_rows, rollout_gap

    m = MetricsLogger(tmp_path, tensorboard=False)
    gap = {1: (0.1, 10.0, 0.5), 2: (0.3, 30.0, 0.9), 4: (0.0, 0.0, 0.0), 6: (9.0, 9.0, 9.0)}
    for step in (1, 2, 4, 6):
        mean, tokens, top = gap[step]
        m.log("rl", step, {"x": float(step), "train/rollout_gap_mean": mean, "train/rollout_gap_tokens": tokens,
                           "train/rollout_gap_max": top})
        m.log("other", step, {"x": -1.0})
    with m.path.open("ab") as fh:
        fh.write(b'{"stage": "rl", "step": 5, "x": 5.')  # a kill mid-append
    log = StageLog(m.path, "rl", 5)  # the run's final step is 5: step 6's row is not this run's
    assert [s for s, _ in log.items()] == [1, 2, 4]
    assert log.rows()[0] == {"x": 1.0, "train/rollout_gap_mean": 0.1, "train/rollout_gap_tokens": 10.0,
                             "train/rollout_gap_max": 0.5}
    xs = log.series("x")
    assert xs[:2] == [1.0, 2.0] and math.isnan(xs[2]) and xs[3] == 4.0 and math.isnan(xs[4]) and len(xs) == 5
    assert [r["x"] for r in log.tail(2)] == [2.0, 4.0]
    g = rollout_gap(log)
    assert g["mean"] == pytest.approx(0.25) and g["max"] == 0.9 and g["tokens"] == 40.0
    assert math.isnan(rollout_gap([])["mean"]) and math.isnan(rollout_gap([])["max"])
    # the gap of tokens sampled over older KV and of tokens older weights sampled, by hand: (0.2·3 + 0.8·1) / 4 = 0.35,
    # max 1.5; (0.4·2) / 2; steps without them (older rows) count nothing
    rows = [{"train/rollout_gap_stale_kv_mean": 0.2, "train/rollout_gap_stale_kv_tokens": 3.0,
             "train/rollout_gap_stale_kv_max": 1.5, "train/policy_moved_gap_mean": 0.4, "train/policy_moved_gap_tokens": 2.0},
            {"train/rollout_gap_stale_kv_mean": 0.8, "train/rollout_gap_stale_kv_tokens": 1.0,
             "train/rollout_gap_stale_kv_max": 0.8, "train/policy_moved_gap_mean": float("nan"),
             "train/policy_moved_gap_tokens": 0.0}, {"train/rollout_gap_mean": 0.1, "train/rollout_gap_tokens": 1.0}]
    g = rollout_gap(rows)
    assert g["stale_kv_mean"] == pytest.approx(0.35) and g["stale_kv_max"] == 1.5 and g["stale_kv_tokens"] == 4.0
    assert g["moved_mean"] == pytest.approx(0.4) and g["moved_tokens"] == 2.0 and g["mean"] == pytest.approx(0.1)
    assert rollout_gap(rows[2:]) == {"mean": 0.1, "max": 0.0, "tokens": 1.0, "stale_kv_tokens": 0.0, "moved_tokens": 0.0}
    # routes routed differently, by hand: (0.1·100 + 0.4·50) / 150 = 0.2; a row without routes counts nothing
    rows[0].update({"train/routing_known_tokens": 100.0, "train/routing_mismatch_frac": 0.1})
    rows[1].update({"train/routing_known_tokens": 50.0, "train/routing_mismatch_frac": 0.4})
    g = rollout_gap(rows)
    assert g["routing_positions"] == 150.0 and g["routing_mismatch_frac"] == pytest.approx(0.2)
    assert "routing_positions" not in rollout_gap(rows[2:])
    m.truncate("rl", 5)
    with caplog.at_level("WARNING", logger="k3post.loop"):
        _check_rows(m, "rl", 5, None)
    assert "has no rows for 2 of steps 1..5 (3, 5)" in caplog.text
