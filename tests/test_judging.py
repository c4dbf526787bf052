"""The judge learns to judge (issue 31): reference pairs, scripted judge episodes as SFT data, the judge's
evaluation (k3post/rewards/judging.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from k3post.envs.families.common import assistant, tool_call
from k3post.rewards.grm import EngineJudge, GRMJudgeEnv, PolicyJudge, judgement_check
from k3post.rewards.judging import (
    JUDGED_FAMILIES,
    KINDS,
    RUBRICS,
    JudgePair,
    ScriptedJudge,
    criterion_scores,
    evaluate_judge,
    judge_episode,
    judge_pairs,
    judge_record,
    judge_sft_records,
    pair_prompts,
    pair_task,
    recipe_judge_pairs,
)


@pytest.fixture(scope="module")
def pairs() -> list[JudgePair]:
    return judge_pairs(24, seed=5)


def test_pairs_cover_both_families_and_every_applicable_kind(pairs: list[JudgePair]) -> None:
    fams = Counter(p.task.family for p in pairs)
    assert fams == {f: 12 for f in JUDGED_FAMILIES}
    kinds = {(p.task.family, p.kind) for p in pairs}
    assert {k for f, k in kinds if f == "general.writing"} == set(KINDS["general.writing"])
    # difficulty 1: one town, so no other town's value to distract with
    assert {k for f, k in kinds if f == "general.faithfulness"} == set(KINDS["general.faithfulness"]) - {"distractor"}
    assert judge_pairs(24, seed=5) == pairs  # a pure function of its arguments
    for p in pairs:
        hi, lo = (sum(w * criterion_scores(p.task, t)[0][c] for c, w in RUBRICS[p.task.family]) for t in (p.better, p.worse))
        assert hi > lo, (p.kind, p.better, p.worse)


def test_a_pair_the_rubric_cannot_rank_is_refused(pairs: list[JudgePair]) -> None:
    p = pairs[0]
    with pytest.raises(ValueError, match="does not rank the reference higher"):
        JudgePair(p.task, p.better, p.better, "same")


def test_held_out_pairs_are_disjoint_from_training(pairs: list[JudgePair]) -> None:
    held = judge_pairs(24, seed=6, exclude=pair_prompts(pairs))
    assert not pair_prompts(held) & pair_prompts(pairs)
    from k3post.config.data import DataConfig

    data = DataConfig(judge_tasks=10, judge_eval=10, family_tasks={"general.writing": 30, "general.faithfulness": 30})
    train, ev = recipe_judge_pairs(data, seed=0)
    assert len(train) == len(ev) == 10 and not pair_prompts(train) & pair_prompts(ev)
    from k3post.envs.families import get_family
    from k3post.envs.task import canonical_json

    sft = {canonical_json(list(t.messages)) for f in JUDGED_FAMILIES for t in get_family(f).generate(30, seed=0)}
    assert not pair_prompts(ev) & sft


def test_scripted_episodes_are_valid_and_prefer_the_reference_in_both_orders(pairs: list[JudgePair]) -> None:
    """The real env's verifier on every scripted episode: valid (judgement_check passes) and the reference's
    total higher, whether it is shown as A or as B."""
    for p in pairs:
        for first in (True, False):
            ep = judge_episode(p, first)
            env_state = ep.verdict.components
            assert ep.verdict.components["valid"] == 1.0
            better, worse = ("A", "B") if first else ("B", "A")
            assert env_state[f"total.{better}"] > env_state[f"total.{worse}"]
    recs = judge_sft_records(6, seed=1)
    assert len(recs) == 12 and Counter(r["better"] for r in recs) == {"A": 6, "B": 6}
    assert all(r["messages"][-1]["role"] == "assistant" and r["effort"] is None for r in recs)


def test_judgement_check_passes_on_the_replayed_scorepad(pairs: list[JudgePair]) -> None:
    """judgement_check on the state the scripted calls leave in a fresh env (valid rate 1.0 on the sample)."""
    import asyncio

    for p in pairs[:8]:
        rec = judge_record(p, True)
        env = GRMJudgeEnv()
        task = pair_task(p, True)
        asyncio.run(env.reset(task))
        for m in (m for m in rec["messages"] if m["role"] == "assistant"):
            res = asyncio.run(env.step(m))
        assert res.done and judgement_check(env.state, env.submission, ["A", "B"]) is None


def test_the_scripted_judge_reads_what_the_env_shows(pairs: list[JudgePair]) -> None:
    """Its scores come from the texts read_candidate returned: with the candidates swapped in the env (the
    task says A is the worse one) its totals follow the texts, not the label."""
    p = pairs[1]
    ep = judge_episode(p, better_first=False)
    assert ep.verdict.components["total.B"] > ep.verdict.components["total.A"]
    from k3post.envs.families import get_family

    with pytest.raises(ValueError, match="no judge rubric"):
        ScriptedJudge(get_family("general.arithmetic").generate(1, seed=0)[0])


# =========================================================================== XTML: the RL judge's rendering


def test_records_render_as_the_rl_judge_loop_builds_them(xtml_tokenizer: Any, pairs: list[JudgePair]) -> None:
    """The SFT rendering of a judge record is, token for token, the context the RL judge (`EngineJudge`'s
    AgentLoop: same tools, system prompt, effort) builds when the model samples the record's assistant turns;
    each turn parses back (the rollout's streaming parser) to the record's message, and the env's verdict is
    the scripted one's."""
    import json

    from scripted_engine import ScriptedEngine

    from k3post.data import render_record
    from k3post.rollout.engine import SamplingParams
    from k3post.rollout.trajectory import Trajectory
    from k3post.xtml import XTML

    x = XTML(xtml_tokenizer)
    for p, first in [(pairs[0], True), (pairs[1], False), (pairs[2], True)]:
        rec = judge_record(p, first)
        ids, mask = render_record(x, rec)

        def script(req: Any, ids: list[int] = ids, mask: list[bool] = mask) -> list[int]:
            k = len(req.prompt_ids)
            assert ids[:k] == list(req.prompt_ids), "the loop's context left the SFT rendering"
            end = k
            while end < len(ids) and mask[end]:
                end += 1
            return ids[k:end]

        # the RL judge's settings but the turn cap: this test's 400-token BPE spells a turn in ~2x the tokens of
        # the recipe's 2048-token one (where the longer turn is ~400 of EngineJudge's 512)
        judge = EngineJudge(ScriptedEngine(script, eom_id=x.eom_id), x, sampling=SamplingParams(max_tokens=2048))
        traj = Trajectory("t0", 0, 0, 0, pair_task(p, first).to_dict())
        (done,) = judge.loop.run([traj])
        assert done.token_ids == ids and done.trainable == mask
        assert done.verdict["components"]["valid"] == 1.0
        assert done.tools == rec["tools"]
        # each sampled turn parses (as the rollout parses it) to the record's assistant message
        turns = [m for m in rec["messages"] if m["role"] == "assistant"]
        starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        assert len(starts) == len(turns) == 2
        for s, m in zip(starts, turns):
            e = s
            while e < len(mask) and mask[e]:
                e += 1
            parser = x.stream("think")
            for t in ids[s:e]:
                parser.feed(t)
            got = parser.finish()
            assert got["reasoning_content"] == m["reasoning_content"] and (got.get("content") or "") == m["content"]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == \
                   [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]


# =========================================================================== evaluation


def _request(messages: list[dict[str, Any]]) -> str:
    user = next(m["content"] for m in messages if m["role"] == "user")
    return user.split("Request given to the candidates:\n", 1)[1].rsplit("\n\nCandidates:", 1)[0]


def correct_judge(pairs: list[JudgePair]):
    by_prompt = {p.prompt: p.task for p in pairs}
    return lambda messages, tools: ScriptedJudge(by_prompt[_request(messages)])(messages, tools)


def always_a(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Follows the protocol, ignores the content: A gets 10, B gets 0."""
    k = sum(m["role"] == "assistant" for m in messages)
    steps = [[("read_candidate", {"id": "A"}), ("read_candidate", {"id": "B"})],
             [("write_rubric", {"criteria": [{"name": "quality", "weight": 1}]})],
             [("score", {"candidate": "A", "scores": {"quality": 10}}), ("score", {"candidate": "B", "scores": {"quality": 0}})],
             [("scorepad", {"scores": {"A": 10, "B": 0}})]]
    return assistant("", "", [tool_call(f"c{i}", n, a) for i, (n, a) in enumerate(steps[k])])


def plain_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    return assistant("A is better.")


def test_evaluate_judge_correct_biased_and_malformed(pairs: list[JudgePair]) -> None:
    held = pairs[:10]
    good = evaluate_judge(PolicyJudge(correct_judge(held)), held)
    assert good["n"] == 20 and good["valid"]["rate"] == 1.0 and good["agreement"]["rate"] == 1.0
    assert good["picks_a"] == 10 and good["ties"] == 0 and good["by_family"]["general.writing"]["n"] == 10
    lo, hi = good["agreement"]["ci95"]
    assert 0.8 < lo < 1.0 and hi == 1.0  # Wilson interval of 20 / 20
    biased = evaluate_judge(PolicyJudge(always_a), held)
    assert biased["valid"]["rate"] == 1.0 and biased["agreement"]["rate"] == 0.5 and biased["picks_a"] == 20
    bad = evaluate_judge(PolicyJudge(plain_text), held)
    assert bad["valid"]["rate"] == 0.0 and bad["agreement"]["rate"] == 0.0 and bad["invalid_reasons"] == {"no_scorepad": 20}
    assert bad["agreement_valid"]["n"] == 0
    with pytest.raises(ValueError, match="at least one pair"):
        evaluate_judge(PolicyJudge(always_a), [])


# =========================================================================== the recipe's wiring


def test_recipe_sft_data_holds_the_judge_episodes(tmp_path: Any, xtml_tokenizer: Any) -> None:
    """`synthesize_sft_data` (demo, full recipe, `k3post sft`) appends data.judge_tasks pairs x 2 orders, and they
    load as SFT samples with trainable tokens."""
    from k3post.config import load_config
    from k3post.data import load_sft_jsonl
    from k3post.stages.sft_data import synthesize_sft_data
    from k3post.xtml import XTML

    cfg = load_config(None, ["data.n_train=2", "data.n_per_family=0", "data.family_tasks.coding.write_function=0", "data.family_tasks.agents.search=0", "data.judge_tasks=3",
                             "data.efforts=[low]", "data.effort_mix={}", "sft.max_len=8192"])
    got: dict[str, Any] = {}
    path = synthesize_sft_data(cfg, tmp_path, xtml_tokenizer, lambda **kw: got.update(kw))
    import json

    recs = [json.loads(line) for line in path.read_text().splitlines()]
    judge = [r for r in recs if r["family"] == "grm"]
    assert len(judge) == 6 and Counter(r["better"] for r in judge) == {"A": 3, "B": 3}
    assert got["synth"]["judge"]["records"] == 6 and got["synth"]["samples_by_family"]["grm"] == 6
    samples, stats = load_sft_jsonl(path, XTML(xtml_tokenizer), max_len=8192)
    assert stats.kept == len(recs) == 2 + 6
    # a record longer than sft.max_len is left out and counted, never a load error later
    cfg_short = load_config(None, ["data.judge_tasks=2", "sft.max_len=64"])
    from k3post.rewards.judging import recipe_judge_records

    kept, counts = recipe_judge_records(cfg_short, XTML(xtml_tokenizer))
    assert kept == [] and counts["too_long"] == 4


def test_recipe_sft_data_gives_a_family_its_own_efforts(tmp_path: Any, xtml_tokenizer: Any) -> None:
    """data.family_efforts: the named family's samples are at its efforts only; the others keep data.efforts."""
    import json

    from k3post.config import load_config
    from k3post.stages.sft_data import synthesize_sft_data

    cfg = load_config(None, ["data.n_train=2", "data.n_per_family=0", "data.family_tasks.coding.write_function=0",
                             "data.family_tasks.agents.search=3", "data.family_tasks.general.faithfulness=2",
                             "data.family_efforts.agents.search=[high, low]", "data.effort_mix={}", "sft.max_len=8192"])
    path = synthesize_sft_data(cfg, tmp_path, xtml_tokenizer)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    by = Counter((r["family"], r["effort"]) for r in recs)
    assert {e for f, e in by if f == "agents.search"} == {"high", "low"}
    assert by[("agents.search", "high")] == by[("agents.search", "low")] == 3
    assert {e for f, e in by if f == "general.faithfulness"} == {"max", "high", "low"}
    assert {e for f, e in by if f == "general.arithmetic"} == {"max", "high", "low"}
    # data.deal_efforts: the named family's tasks are dealt to its efforts (each solved once), the others untouched
    cfg = load_config(None, ["data.n_train=2", "data.n_per_family=0", "data.family_tasks.coding.write_function=6",
                             "data.family_tasks.agents.search=2", "data.deal_efforts=[coding.write_function]",
                             "data.effort_mix={}", "sft.max_len=8192"])
    recs = [json.loads(line) for line in synthesize_sft_data(cfg, tmp_path / "dealt", xtml_tokenizer).read_text().splitlines()]
    coding = [r for r in recs if r["family"] == "coding.write_function"]
    assert len(coding) == len({r["task_id"] for r in coding}) == 6
    assert Counter(r["effort"] for r in coding) == {"max": 2, "high": 2, "low": 2}
    assert Counter(r["family"] for r in recs)["agents.search"] == 2 * 2  # search at high and low (the default), not dealt


@pytest.mark.usefixtures("one_torch_thread")
def test_recipe_judge_evaluation_of_an_untrained_model(tmp_path: Any, xtml_tokenizer: Any) -> None:
    """The recipe's evaluation through the real EngineJudge: an untrained checkpoint never completes the
    protocol (valid 0 of 4), its metrics row is logged and the report shows the table."""
    import json

    from k3post.config import load_config
    from k3post.metrics import MetricsLogger
    from k3post.models import build_tiny_moe, save_model
    from k3post.recipes.report import write_report
    from k3post.rewards.judging import evaluate_recipe_judge, judge_eval_enabled

    tok = xtml_tokenizer
    save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id), tmp_path / "m", tok)
    cfg = load_config(None, ["data.judge_eval=2", "qat.enabled=false", "rl.rollout.slots=4"])
    assert not judge_eval_enabled(cfg)  # neither taught to judge nor RL's judge
    assert judge_eval_enabled(load_config(None, ["rl.judge=policy"])) and judge_eval_enabled(load_config(None, ["data.judge_tasks=1"]))
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    res = evaluate_recipe_judge(cfg, tmp_path / "m", metrics)
    metrics.close()
    assert res["n"] == 4 and res["valid"]["k"] == 0 and res["agreement"]["k"] == 0 and sum(res["invalid_reasons"].values()) == 4
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["stage"] == "judge/sft" and row["n"] == 4 and row["valid_rate"] == 0.0 and row["valid_hi"] > 0.4
    (tmp_path / "summary.json").write_text(json.dumps({"judge": res}))
    html = write_report(tmp_path).read_text()
    assert "GRM judge: the SFT model judging held-out pairs" in html and "0.000 [0.000, 0.490]" in html
    assert "The SFT data held no judge episodes." in html


def test_the_full_recipe_teaches_its_judge_and_the_demo_has_none() -> None:
    """configs/full.yaml rewards general.writing with the policy as judge, so its SFT data teaches judging and
    its SFT model is evaluated as the judge; configs/demo.yaml has no judge (no judge data, no evaluation)."""
    from pathlib import Path

    from k3post.config import load_config
    from k3post.rewards.judging import judge_eval_enabled

    root = Path(__file__).resolve().parents[1] / "configs"
    full = load_config(str(root / "full.yaml"), [])
    assert full.rl.judge == "policy" and full.data.judge_tasks > 0 and judge_eval_enabled(full)
    demo = load_config(str(root / "demo.yaml"), [])
    assert demo.rl.judge == "" and demo.data.judge_tasks == 0 and not judge_eval_enabled(demo)
    with pytest.raises(Exception, match="judge_tasks"):
        load_config(None, ["data.judge_tasks=-1"])


# =========================================================================== RL's judge gate


def test_gate_passes_a_judge_that_judges_and_fails_one_that_always_prefers_a(pairs: list[JudgePair]) -> None:
    """`gate_judge` on held-out pairs: the scripted correct judge agrees 1.0 and passes; an always-A judge agrees on
    exactly half (both orders) and fails a 0.6 threshold; `apply_judge_gate` then raises naming both ways out
    (fail, the default) or returns the failed result (format_gate), closing the judge either way."""
    from k3post.config.rl import RLConfig
    from k3post.rewards.judging import gate_judge, judge_pairs
    from k3post.rewards.judge import apply_judge_gate

    gate_pairs = judge_pairs(4, seed=0 + 3300, families=["general.writing"])
    good = gate_judge(PolicyJudge(correct_judge(gate_pairs)), ["general.writing"], n_pairs=4, min_agreement=0.6)
    assert good["passed"] and good["agreement"]["rate"] == 1.0 and good["n"] == 8 and good["families"] == ["general.writing"]
    # a verifiable-only or plugin family list without a rubric falls back to the rubric families
    assert gate_judge(PolicyJudge(always_a), ["plugin.unrubricked"], n_pairs=2, min_agreement=0.6)["families"] == list(JUDGED_FAMILIES)

    class Closing(PolicyJudge):
        closed = 0

        def close(self) -> None:
            Closing.closed += 1

    cfg = RLConfig(judge="policy", judge_min_agreement=0.6, judge_gate_pairs=4)
    with pytest.raises(ValueError, match=r"agrees with the known better answer on 4/8 = 0\.50.*rl\.judge_min_agreement 0\.6.*"
                                         r"data\.judge_tasks.*rl\.judge_fallback: format_gate"):
        apply_judge_gate(Closing(always_a), cfg, ["general.writing"])
    assert Closing.closed == 1
    fell = apply_judge_gate(Closing(always_a), RLConfig(judge="policy", judge_min_agreement=0.6, judge_gate_pairs=4,
                                                        judge_fallback="format_gate"), ["general.writing"])
    assert fell is not None and not fell["passed"] and fell["agreement"]["k"] == 4 and Closing.closed == 2
    passed = apply_judge_gate(Closing(correct_judge(gate_pairs)), cfg, ["general.writing"])
    assert passed is not None and passed["passed"] and Closing.closed == 2  # a judge that passes stays open
    assert apply_judge_gate(Closing(always_a), RLConfig(judge="policy"), ["general.writing"]) is None  # no gate: not measured
    with pytest.raises(ValueError, match="rl.judge_fallback must be one of"):
        RLConfig(judge_fallback="drop")


@pytest.mark.usefixtures("one_torch_thread")
def test_an_untrained_judge_fails_its_gate_closed_or_falls_back_to_the_verifier(tmp_path: Any, xtml_tokenizer: Any) -> None:
    """`build_group_scorer` through the real EngineJudge: an untrained checkpoint as rl.judge agrees on 0 of 2
    judgements; by default the domain's scorer is not built (the error names the gate); with
    rl.judge_fallback: format_gate the scorer rewards a writing group with its own verifier's rewards, and the
    experts' table and report show the gate."""
    import json

    from k3post.config.rl import RLConfig
    from k3post.config.rollout import RolloutConfig
    from k3post.models import build_tiny_moe, save_model
    from k3post.recipes.report import write_report
    from k3post.rewards.judge import VerifierScorer, build_group_scorer
    from k3post.rollout.trajectory import Group, Trajectory

    tok = xtml_tokenizer
    save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id), tmp_path / "m", tok)
    kw = dict(judge=str(tmp_path / "m"), judge_min_agreement=0.6, judge_gate_pairs=1,
              rollout=RolloutConfig(slots=2, max_tokens=16))
    with pytest.raises(ValueError, match=r"on 0/2 = 0\.00 .*valid 0/2"):
        build_group_scorer(RLConfig(**kw), tmp_path / "m", tok, ["general.writing"])
    scorer = build_group_scorer(RLConfig(**kw, judge_fallback="format_gate"), tmp_path / "m", tok,
                                ["general.arithmetic", "general.writing"])
    assert isinstance(scorer, VerifierScorer) and scorer.gate["agreement"]["k"] == 0 and not scorer.gate["passed"]
    task = {"id": "w", "family": "general.writing"}
    trajs = [Trajectory(traj_id=f"g0/s{i}", group_id=0, sample_index=i, seed=i, task=task, status="done", reward=r)
             for i, r in enumerate([1.0, 0.0, 1.0])]
    assert scorer(Group(group_id=0, task=task, trajectories=trajs)) == [1.0, 0.0, 1.0]
    scorer.close()
    (tmp_path / "experts").mkdir()
    (tmp_path / "experts" / "table.json").write_text(json.dumps({"experts": {}, "failed": {}, "judge_gate": {"general": scorer.gate}}))
    html = write_report(tmp_path).read_text()
    assert "RL&#x27;s judge gate" in html or "RL's judge gate" in html
    assert "their own verifier (rl.judge_fallback: format_gate)" in html
