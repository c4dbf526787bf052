"""bench/routing_replay.py compares like with like: every condition samples the same requests, the trainer passes
with and without replay see the same sequences, and the prompts are the demo's (an XTML header with the effort,
ending where the model starts sampling)."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prompts_end_where_sampling_starts(xtml_tokenizer):
    bench = load_bench("routing_replay")
    prompts = bench._prompts(xtml_tokenizer, 2)
    assert len(prompts) == 2 and all(len(p) > 10 for p in prompts)
    reqs = bench._requests(prompts, 3, 8)
    assert [r.prompt_ids for r in reqs] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert len({r.sampling.seed for r in reqs}) == 6


def test_runs_every_condition_and_reports_the_cost(capsys):
    res = load_bench("routing_replay").main(["--prompts", "2", "--k", "2", "--max-tokens", "8", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res  # the last line a reader parses
    for cond in ("demo", "qat_fast", "bf16", "batch1"):
        row = res[cond]
        assert row["positions"] >= row["sampled_tokens"] > 0 and 0.0 <= row["mismatch_off"] <= 1.0, (cond, row)
        assert row["gap_max_off"] >= row["gap_mean_off"] >= 0.0
    assert res["demo"]["mismatch_off"] <= 0.05  # one engine, one op order, fp32: only last-bit ties may flip
    assert res["engine_record_over_plain"] > 0 and res["trainer_replay_over_own"] > 0
