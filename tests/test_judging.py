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
        from k3post.rewards.judging import _judge_task

        task = _judge_task(p, True)
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
        from k3post.rewards.judging import _judge_task

        traj = Trajectory("t0", 0, 0, 0, _judge_task(p, first).to_dict())
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
