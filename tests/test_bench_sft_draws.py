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
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res and res["split"] == "test"
    row = res["models"][str(model)]
    assert [row[d]["n"] for d in ("coding", "agents", "general")] == [2, 2, 3]
    assert [row[d]["turn_cap"] for d in ("coding", "agents", "general")] == [12, 8, 6]
    for d in ("coding", "agents", "general"):
        assert sum(row[d]["outcomes"].values()) == row[d]["n"]
        assert row[d]["pass"] == row[d]["outcomes"].get("pass", 0) / row[d]["n"]
        lo, hi = row[d]["ci95"]
        assert 0 <= lo <= row[d]["pass"] + 1e-12 and row[d]["pass"] <= hi <= 1  # lo: Wilson at k = 0 is 0 up to rounding
    # one domain, on the validation split
    assert bench.main([str(model), "--config", str(cfg), "--domains", "coding", "--split", "validation", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["split"] == "validation" and list(res["models"][str(model)]) == ["coding"]


def test_a_folder_without_a_model_or_a_bad_domain_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path)])
    assert f"{tmp_path}: no model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path), "--domains", "coding,maths"])
    assert "--domains: some of coding,agents,general, got 'coding,maths'" in capsys.readouterr().err


def test_the_validation_split_is_held_out_and_apart_from_the_test():
    """Validation tasks (for choosing a checkpoint) share no task with the test split or the training streams."""
    from k3post.envs.families.streams import eval_tasks, train_tasks

    def prompts(tasks):  # the task as the policy sees it (ids name their seed, so they differ trivially)
        return {t.messages[-1]["content"] for t in tasks}

    fams = ["coding.write_function", "agents.search"]
    val = eval_tasks(fams, 40, difficulty=1, split="validation")
    assert len(val) == len(prompts(val)) == 80
    assert not prompts(val) & prompts(eval_tasks(fams, 40, difficulty=1))
    assert not prompts(val) & prompts(train_tasks(fams, 200, difficulty=1, seed=0))
    with pytest.raises(ValueError, match="split is 'test' or 'validation'"):
        eval_tasks(fams, 1, difficulty=1, split="dev")
