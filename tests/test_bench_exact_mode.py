"""bench/exact_mode.py measures what it says: the exact engine's gap to the trainer's exact recomputation is 0, the
exact engine decodes the same tokens alone as in a batch, and every cost is a ratio
of two arms run in the same process."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_reports_the_gap_invariance_and_costs(capsys):
    res = load_bench("exact_mode").main(["--prompts", "2", "--k", "2", "--max-tokens", "8", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res  # the last line a reader parses
    assert res["batch_invariant"] is True and res["sampled_tokens"] > 0
    assert res["gap_exact_max"] == 0.0 and res["gap_exact_mean"] == 0.0
    assert res["gap_default_max"] >= res["gap_default_mean"] >= 0.0
    for key in ("engine_exact_over_default", "trainer_exact_over_default", "decode_exact_over_lean_b1",
                "decode_exact_over_lean_b32"):
        assert res[key] > 0 and res[f"{key}_n"] == 1.0, key
