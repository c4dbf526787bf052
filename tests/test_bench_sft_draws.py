"""`bench/sft_draws.py`: held-out pass per domain with the coding episodes' outcomes, on a tiny untrained model (no
model quality involved: the counts must add up, the caps must be the ones asked for, bad input must be named)."""

import json
from types import SimpleNamespace

import pytest

from k3post.recipes.commands import init_model
from tests.bench_module import load_bench

bench = load_bench("sft_draws")


def test_outcomes_name_why_an_episode_failed():
    def t(**kw):
        return SimpleNamespace(**{"reward": 0.0, "malformed": None, "finish": "answer", **kw})

    assert bench.outcome(t(reward=1.0)) == "pass"
    assert bench.outcome(t(reward=None, finish="length")) == "length"
    assert bench.outcome(t(malformed="bad call", finish="answer")) == "malformed"
    assert bench.outcome(t()) == "answer"
    assert bench.outcome(t(finish=None)) == "unknown"


def test_a_model_is_scored_on_each_domain_with_its_caps(tmp_path, capsys):
    model = init_model(tmp_path / "model", preset="tiny", vocab_size=300)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("data: {n_eval: 3}\nrl:\n  domain_overrides:\n"
                   "    coding: {eval_n: 2, eval_max_tokens: 8}\n    agents: {eval_n: 2, eval_max_tokens: 8}\n"
                   "    general: {eval_max_tokens: 6}\n")
    out = tmp_path / "draws.json"
    assert bench.main([str(model), "--config", str(cfg), "--coding-max-tokens", "12", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res
    row = res["models"][str(model)]
    assert [row[d]["n"] for d in ("coding", "agents", "general")] == [2, 2, 3]
    assert [row[d]["turn_cap"] for d in ("coding", "agents", "general")] == [12, 8, 6]
    for d in ("coding", "agents", "general"):
        assert sum(row[d]["outcomes"].values()) == row[d]["n"]
        assert row[d]["pass"] == row[d]["outcomes"].get("pass", 0) / row[d]["n"]
        lo, hi = row[d]["ci95"]
        assert 0 <= lo <= row[d]["pass"] + 1e-12 and row[d]["pass"] <= hi <= 1  # lo: Wilson at k = 0 is 0 up to rounding


def test_a_folder_without_a_model_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path)])
    assert f"{tmp_path}: no model folder" in capsys.readouterr().err
