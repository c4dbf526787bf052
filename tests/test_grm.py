"""The agentic GRM (SPEC §3.4): protocol enforcement, tournament win rates, length guard, backends.

The judge in most tests is `ScriptedJudge`, a deterministic *policy* that emits real tool calls
through `GRMJudgeEnv` (and, in one test, through a local OpenAI-compatible HTTP server): it reads
every candidate, writes the rubric variety (weight 2) / clarity (weight 1), scores variety =
min(10, ⌊distinct words / 2⌋) and clarity = 5, and records totals 2·variety + 5, one tool call per
turn. So a candidate with more distinct words (by pairs) wins; equal counts tie.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from k3post.envs.families.common import assistant, tool_call
from k3post.envs.families.general.family import WRITING
from k3post.envs.episode import run_episode_sync
from k3post.envs.task import FinalState
from k3post.rewards.grm import (
    SCORE_MAX,
    Candidate,
    EngineJudge,
    GRMJudge,
    GRMJudgeEnv,
    GroupGRM,
    PolicyJudge,
    estimate_l0,
    judge_task,
    judgement_check,
    length_guard,
    pairwise_preference,
    round_robin_pairs,
    run_judgements,
    tournament_rewards,
    trajectory_candidate,
    verify_judgement,
    win_rates,
)

PROMPT = "Describe a kettle in one sentence."


def distinct(text: str) -> int:
    return len(set(re.findall(r"[a-z0-9']+", text.lower())))


def words(n: int, tag: str = "w") -> str:
    """A text with exactly n distinct words."""
    return " ".join(f"{tag}{k}" for k in range(n))


class ScriptedJudge:
    """A deterministic judge program driven through the real env (see the module docstring).

    Args:
        flaw: a protocol step it gets wrong: ``skip_read`` (reads only the first candidate),
            ``skip_rubric``, ``skip_score``, ``bad_total`` (totals without the weights),
            ``no_scorepad`` (ends with a plain-text verdict).
        fail_first: the first ``fail_first`` episodes skip the rubric, later ones are correct.
        prefer_first: scores variety 10 for candidate A and 0 for the others (an order-biased judge).
        chatter: writes contradicting numbers in its content and reasoning on every turn.
    """

    def __init__(self, flaw: str | None = None, *, fail_first: int = 0, prefer_first: bool = False, chatter: bool = False) -> None:
        self.flaw = flaw
        self.fail_first = fail_first
        self.prefer_first = prefer_first
        self.chatter = chatter
        self.episodes = 0
        self.read: list[str] = []  # every response text read, over all episodes

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        k = sum(m["role"] == "assistant" for m in messages)
        user = next(m["content"] for m in messages if m["role"] == "user")
        labels = re.search(r"Candidates: ([A-H, ]+)\.", user).group(1).split(", ")
        if k == 0:
            self.episodes += 1
        flaw = "skip_rubric" if self.episodes <= self.fail_first else self.flaw
        texts = {}
        for m in messages:
            if m["role"] == "tool" and m["content"].startswith("{"):
                d = json.loads(m["content"])
                texts[d["candidate"]] = d["response"]
        read = labels[:1] if flaw == "skip_read" else labels
        steps = [("read", lab) for lab in read] + [("rubric", "")] + [("score", lab) for lab in labels] + [("scorepad", "")]
        if flaw == "skip_rubric":
            steps.remove(("rubric", ""))
        if flaw == "skip_score":
            steps = [s for s in steps if s[0] != "score"]
        step, lab = steps[min(k, len(steps) - 1)]
        say = "Clearly B wins: B 10, A 0." if self.chatter else ""
        think = "A scores 99 and B scores 1." if self.chatter else ""
        if step == "read":
            return assistant(say, think, [tool_call(f"c{k}", "read_candidate", {"id": lab})])
        if step == "rubric":
            crit = [{"name": "variety", "weight": 2}, {"name": "clarity", "weight": 1}]
            return assistant(say, think, [tool_call(f"c{k}", "write_rubric", {"criteria": crit})])
        variety = {x: self.variety(x, labels, texts) for x in labels}
        if step == "score":
            return assistant(say, think, [tool_call(f"c{k}", "score", {"candidate": lab, "scores": {"variety": variety[lab], "clarity": 5}})])
        self.read.extend(texts.values())
        totals = {x: (variety[x] if flaw == "bad_total" else 2 * variety[x]) + 5 for x in labels}
        if flaw == "no_scorepad":
            return assistant(" ".join(f"{x}: {t}" for x, t in totals.items()))
        return assistant(say + " Final: B=99 A=0." if self.chatter else "", think, [tool_call(f"c{k}", "scorepad", {"scores": totals})])

    def variety(self, lab: str, labels: list[str], texts: dict[str, str]) -> int:
        if self.prefer_first:
            return 10 if lab == labels[0] else 0
        return min(10, distinct(texts.get(lab, "")) // 2)


def judged(judge: ScriptedJudge, **kw: Any) -> PolicyJudge:
    return PolicyJudge(judge, **kw)


# =========================================================================== pure math


def test_length_guard_and_preference_golden() -> None:
    # L = 1.5 * 10 = 15: a length equal to L is not over
    assert length_guard(15, 14, 15.0) is None
    assert length_guard(16, 3, 15.0) == 0.0 and length_guard(3, 16, 15.0) == 1.0
    assert length_guard(16, 40, 15.0) == 0.5
    assert length_guard(1e9, 1, None) is None  # guard off
    # totals 13 vs 11: A wins; within tol 0.01 a tie; 11 vs 13: B wins
    assert pairwise_preference(13, 11) == 1.0 and pairwise_preference(11, 13) == 0.0
    assert pairwise_preference(13.0, 13.005) == 0.5 and pairwise_preference(13.0, 13.02) == 0.0


def test_win_rates_golden() -> None:
    # K=3; (0,1): 0 wins -> s=1; (0,2): tie -> 0.5; (1,2): 2 wins -> s=0.
    # r0 = (1 + 0.5)/2 = 0.75; r1 = (0 + 0)/2 = 0; r2 = (0.5 + 1)/2 = 0.75
    assert win_rates(3, [(0, 1, 1.0), (0, 2, 0.5), (1, 2, 0.0)]) == [0.75, 0.0, 0.75]
    # candidate 2 never compared: no information, 0.5
    assert win_rates(3, [(0, 1, 0.25)]) == [0.25, 0.75, 0.5]
    with pytest.raises(ValueError, match="distinct"):
        win_rates(2, [(1, 1, 0.5)])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        win_rates(2, [(0, 1, 1.5)])


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7])
def test_round_robin_pairs(k: int) -> None:
    every = round_robin_pairs(k, seed=k)
    assert sorted(every) == [(i, j) for i in range(k) for j in range(i + 1, k)]  # each pair exactly once
    n_rounds = k - 1 if k % 2 == 0 else k
    per_round = k // 2
    one = round_robin_pairs(k, 1, seed=3)
    assert len(one) == per_round and len({c for p in one for c in p}) == 2 * per_round  # one game each
    two = round_robin_pairs(k, min(2, n_rounds), seed=3)
    assert len(set(two)) == len(two)  # distinct pairs across rounds
    with pytest.raises(ValueError, match="rounds"):
        round_robin_pairs(k, n_rounds + 1)


def test_estimate_l0_is_the_median() -> None:
    assert estimate_l0([3, 1, 10]) == 3.0  # sorted 1, 3, 10
    assert estimate_l0([2, 4, 6, 100]) == 5.0  # (4 + 6) / 2: the runaway 100 does not move it
    with pytest.raises(ValueError, match="at least one"):
        estimate_l0([])
    with pytest.raises(ValueError, match=">= 0"):
        estimate_l0([1, -2])


# =========================================================================== the environment and protocol


def _step(env: GRMJudgeEnv, *calls: dict[str, Any], content: str = "") -> Any:
    return asyncio.run(env.step(assistant(content, "", list(calls))))


def test_env_refuses_out_of_order_steps_and_verifies_a_valid_judgement() -> None:
    task = judge_task(PROMPT, ["red kettle boils fast", Candidate("a kettle", {"notes.txt": "spec sheet"})])
    env = GRMJudgeEnv()
    msgs = asyncio.run(env.reset(task))
    assert "red kettle" not in json.dumps(msgs)  # candidates are reachable only through the tool
    assert [t.name for t in env.tool_specs()] == ["read_candidate", "write_rubric", "score", "scorepad"]
    rubric = {"criteria": [{"name": "variety", "weight": 2}, {"name": "clarity", "weight": 1}]}
    r = _step(env, tool_call("1", "write_rubric", rubric), tool_call("2", "score", {"candidate": "A", "scores": {"variety": 1}}),
              tool_call("3", "read_candidate", {"id": "C"}))
    assert [m["content"] for m in r.messages] == [
        "Error: tool 'write_rubric' failed: ValueError: protocol step 1 first: read every candidate before the rubric "
        "(not read: A, B)",
        "Error: tool 'score' failed: ValueError: read candidate A before scoring it",
        "Error: tool 'read_candidate' failed: ValueError: unknown candidate 'C'; the candidates are A, B",
    ]
    r = _step(env, tool_call("4", "read_candidate", {"id": "A"}), tool_call("5", "read_candidate", {"id": "B"}))
    assert json.loads(r.messages[1]["content"]) == {"candidate": "B", "response": "a kettle", "artifacts": {"notes.txt": "spec sheet"}}
    r = _step(env, tool_call("6", "score", {"candidate": "A", "scores": {"variety": 4}}), tool_call("7", "write_rubric", rubric),
              tool_call("8", "write_rubric", rubric), tool_call("9", "score", {"candidate": "A", "scores": {"taste": 4}}),
              tool_call("10", "score", {"candidate": "A", "scores": {"variety": 11}}))
    assert "write the rubric before scoring" in r.messages[0]["content"] and r.messages[1]["content"].startswith("Rubric recorded")
    assert "already written" in r.messages[2]["content"] and "not rubric criteria" in r.messages[3]["content"]
    assert "invalid arguments" in r.messages[4]["content"]  # 11 > SCORE_MAX: the schema refuses it
    # a resumable episode: the state is JSON and a fresh env continues it
    fresh = GRMJudgeEnv()
    fresh.load_state_dict(json.loads(json.dumps(env.state_dict())))
    env = fresh
    r = _step(env, tool_call("11", "score", {"candidate": "A", "scores": {"variety": 4, "clarity": 5}}),
              tool_call("12", "score", {"candidate": "B", "scores": {"variety": 2}}),
              tool_call("13", "score", {"candidate": "B", "scores": {"variety": 3}}))
    assert "Still to score: B:clarity" in r.messages[1]["content"] and "already scored" in r.messages[2]["content"]
    r = _step(env, tool_call("14", "score", {"candidate": "B", "scores": {"clarity": 7}}),
              tool_call("15", "scorepad", {"scores": {"A": 13, "B": 11}}), content="B is better, 20 to 1")
    assert r.done and env.state["log"] == [
        ["read", "A"], ["read", "B"], ["rubric", ["variety", "clarity"]], ["score", "A", ["clarity", "variety"]],
        ["score", "B", ["variety"]], ["score", "B", ["clarity"]], ["scorepad", ["A", "B"]],
    ]
    # A = 2*4 + 1*5 = 13, B = 2*2 + 1*7 = 11; max_total = 10 * (2 + 1) = 30; the text is ignored
    v = env.verify()
    assert v.reward == 1.0 and v.components == {"valid": 1.0, "total.A": 13.0, "total.B": 11.0, "max_total": 30.0}


def _state(read: list[str], rubric: Any, scores: dict[str, Any]) -> dict[str, Any]:
    return {"read": read, "rubric": rubric, "scores": scores, "log": []}


def test_judgement_check_reasons() -> None:
    rub = [{"name": "v", "weight": 2.0}, {"name": "c", "weight": 0.5}]
    full = {"A": {"v": 3.0, "c": 4.0}, "B": {"v": 1.0, "c": 0.0}}
    pad = {"scores": {"A": 8.0, "B": 2.0}}  # A = 2*3 + 0.5*4 = 8; B = 2*1 + 0 = 2
    ab = ["A", "B"]
    assert judgement_check(_state(ab, rub, full), pad, ab) is None
    assert judgement_check(_state(ab, rub, full), "A: 8, B: 2", ab)[0] == "no_scorepad"
    assert judgement_check(_state(["A"], rub, full), pad, ab)[0] == "unread"
    assert judgement_check(_state(ab, None, {}), pad, ab)[0] == "no_rubric"
    assert judgement_check(_state(ab, rub, {"A": full["A"], "B": {"v": 1.0}}), pad, ab) == ("unscored", "not scored: B:c")
    assert judgement_check(_state(ab, rub, full), {"scores": {"A": 8.0}}, ab)[0] == "scorepad_candidates"
    assert judgement_check(_state(ab, rub, full), {"scores": {"A": 8.0, "B": 2.02}}, ab)[0] == "inconsistent_total"
    assert judgement_check(_state(ab, rub, full), {"scores": {"A": 8.0, "B": 2.02}}, ab, tol=0.05) is None
    assert judgement_check(_state(ab, rub, full), {"scores": {"A": 8.0, "B": float("nan")}}, ab)[0] == "inconsistent_total"
    task = judge_task(PROMPT, ["x", "y"])
    v = verify_judgement(task, FinalState(_state(ab, rub, full), None, truncated=True, truncation="max_turns"))
    assert v.reward == 0.0 and v.diagnostics.startswith("truncated:")


# =========================================================================== tournaments


def test_k3_win_rates_by_hand() -> None:
    # distinct words 3 < 5 < 7: variety 1 < 2 < 3, totals 7 < 9 < 11; c0 loses both, c1 wins one of two, c2 wins both
    judge = ScriptedJudge()
    res = tournament_rewards([words(3), words(5), words(7)], judged(judge), prompt=PROMPT)
    assert res.rewards_K == [0.0, 0.5, 1.0]
    s = res.stats
    assert (s.comparisons, s.judgements, s.invalid, s.retried, s.forfeits, s.ties) == (3, 3, 0, 0, 0, 0)
    assert judge.episodes == 3 and all(c.decided_by == "judge" for c in res.comparisons)
    v = res.comparisons[0].verdicts[0]
    assert v["components"]["valid"] == 1.0 and v["components"]["max_total"] == 3 * SCORE_MAX


def test_k4_win_rates_with_a_tie_by_hand() -> None:
    # distinct words [4, 6, 6, 2], variety [2, 3, 3, 1]: (0,1)->1, (0,2)->2, (0,3)->0, (1,2) tie, (1,3)->1, (2,3)->2
    # r0 = 1/3, r1 = (1 + .5 + 1)/3 = 5/6, r2 = 5/6, r3 = 0
    for both in (False, True):
        res = tournament_rewards([words(4), words(6, "a"), words(6, "b"), words(2)], judged(ScriptedJudge()),
                                 prompt=PROMPT, both_orders=both, seed=7)
        assert res.rewards_K == pytest.approx([1 / 3, 5 / 6, 5 / 6, 0.0])
        assert res.stats.ties == 1 and res.stats.judgements == 6 * (2 if both else 1)


def test_order_bias_both_orders_cancels_random_order_does_not() -> None:
    cands = [words(3), words(5), words(7), words(9)]
    res = tournament_rewards(cands, judged(ScriptedJudge(prefer_first=True)), prompt=PROMPT, both_orders=True)
    # each pair: A wins as i (1), then A wins as j (0): s_ij = 1/2 everywhere
    assert res.rewards_K == [0.5] * 4 and res.stats.ties == 6 and res.stats.judgements == 12
    assert all(c.presentations == [[c.i, c.j], [c.j, c.i]] and c.outcomes == [1.0, 0.0] for c in res.comparisons)
    one = tournament_rewards(cands, judged(ScriptedJudge(prefer_first=True)), prompt=PROMPT, seed=1)
    # one order per pair, drawn with the seed: whoever is shown first wins
    for c in one.comparisons:
        assert c.score_i == (1.0 if c.presentations[0][0] == c.i else 0.0)
    firsts = [sum(c.presentations[0][0] == k for c in one.comparisons) for k in range(4)]
    assert one.rewards_K == [f / 3 for f in firsts] and sum(one.rewards_K) == pytest.approx(2.0)  # zero-sum


@pytest.mark.parametrize(
    "flaw,reason",
    [("skip_read", "unread"), ("skip_rubric", "no_rubric"), ("skip_score", "unscored"),
     ("bad_total", "inconsistent_total"), ("no_scorepad", "no_scorepad")],
)
def test_a_judge_that_skips_a_step_is_retried_then_tie(flaw: str, reason: str) -> None:
    judge = ScriptedJudge(flaw)
    res = tournament_rewards([words(3), words(5), words(7)], judged(judge), prompt=PROMPT, max_retries=2)
    assert res.rewards_K == [0.5, 0.5, 0.5]
    s = res.stats
    # 3 pairs x (1 + 2 retries) invalid judgements, each pair forfeited as a tie
    assert (s.judgements, s.invalid, s.retried, s.forfeits, s.ties) == (9, 9, 6, 3, 3)
    assert s.invalid_reasons == {reason: 9} and judge.episodes == 9
    assert all(c.verdicts == [None] and c.outcomes == [0.5] for c in res.comparisons)


def test_an_invalid_judgement_retried_valid_counts() -> None:
    judge = ScriptedJudge(fail_first=3)  # the first batch (one episode per pair) skips the rubric
    res = tournament_rewards([words(3), words(5), words(7)], judged(judge), prompt=PROMPT, max_retries=1)
    assert res.rewards_K == [0.0, 0.5, 1.0]
    s = res.stats
    assert (s.judgements, s.invalid, s.retried, s.forfeits, s.ties) == (6, 3, 3, 0, 0)
    none = tournament_rewards([words(3), words(5)], judged(ScriptedJudge(fail_first=1)), prompt=PROMPT, max_retries=0)
    assert none.rewards_K == [0.5, 0.5] and none.stats.forfeits == 1 and none.stats.retried == 0


def test_length_guard_decides_before_the_judge() -> None:
    # l0 = 10, sigma = 1.5: L = 15; lengths [8, 20, 12, 30]: 1 and 3 are over.
    # (0,1) 0 wins, (0,3) 0 wins, (1,2) 2 wins, (2,3) 2 wins: guard; (1,3) both over: tie;
    # (0,2) judged: 6 distinct words (variety 3) beat 4 (variety 2), so 0 wins.
    # r0 = 3/3 = 1; r1 = (0 + 0 + .5)/3 = 1/6; r2 = (0 + 1 + 1)/3 = 2/3; r3 = (0 + .5 + 0)/3 = 1/6
    cands = [Candidate(words(6, "x"), length=8), Candidate(words(9, "y"), length=20), Candidate(words(4, "z"), length=12),
             Candidate(words(10, "q"), length=30)]
    judge = ScriptedJudge()
    res = tournament_rewards(cands, judged(judge), prompt=PROMPT, sigma=1.5, l0=10)
    assert res.rewards_K == pytest.approx([1.0, 1 / 6, 2 / 3, 1 / 6])
    s = res.stats
    assert (s.comparisons, s.judgements, s.guard_losses, s.guard_ties, s.ties) == (6, 1, 4, 1, 1)
    assert judge.episodes == 1 and sorted(judge.read) == sorted([cands[0].text, cands[2].text])  # 1 and 3 never shown
    # without a length the word count is used: 12 words > 1.5 * 6 loses to 2 words, no judge call
    judge = ScriptedJudge()
    res = tournament_rewards([words(12), words(2)], judged(judge), prompt=PROMPT, l0=6)
    assert res.rewards_K == [0.0, 1.0] and judge.episodes == 0 and res.stats.guard_losses == 1


def test_free_text_with_numbers_does_not_change_rewards() -> None:
    cands = [words(3), words(5), words(7)]
    plain = tournament_rewards(cands, judged(ScriptedJudge()), prompt=PROMPT, seed=2)
    chatty_judge = ScriptedJudge(chatter=True)
    chatty = tournament_rewards(cands, judged(chatty_judge), prompt=PROMPT, seed=2)
    assert chatty.rewards_K == plain.rewards_K == [0.0, 0.5, 1.0]
    assert [c.verdicts for c in chatty.comparisons] == [c.verdicts for c in plain.comparisons]
    # the transcript does carry the contradicting numbers; only the scorepad reached the verdict
    ep = run_episode_sync(chatty_judge, GRMJudgeEnv(), judge_task(PROMPT, [words(3), words(7)]))
    last = ep.messages[-2]
    assert "B=99 A=0" in last["content"] and "A scores 99" in last["reasoning_content"]
    assert json.loads(last["tool_calls"][0]["function"]["arguments"]) == {"scores": {"A": 7, "B": 11}}
    assert (ep.verdict.components["total.A"], ep.verdict.components["total.B"]) == (7.0, 11.0)  # 2*1 + 5, 2*3 + 5


def test_rounds_and_the_writing_family() -> None:
    task = WRITING.generate(1, seed=3)[0]
    wrong = WRITING.wrong_turns(task)
    texts = [WRITING.blurb(task), wrong["keywords_only"][0]["content"], wrong["one_sentence"][0]["content"]]
    # the reference blurb has the most distinct words, keywords-only the fewest: variety 10, 3, 5
    assert [min(10, distinct(t) // 2) for t in texts] == [10, 3, 5]
    prompt = task.messages[-1]["content"]
    res = tournament_rewards(texts, judged(ScriptedJudge()), prompt=prompt)
    assert res.rewards_K == [1.0, 0.0, 0.5]
    # one circle-method round over K=4: two comparisons, each candidate in exactly one
    four = texts + [words(9)]
    one = tournament_rewards(four, judged(ScriptedJudge()), prompt=prompt, rounds=1, seed=5)
    assert one.stats.comparisons == 2 and sorted(k for c in one.comparisons for k in (c.i, c.j)) == [0, 1, 2, 3]
    assert sorted(one.rewards_K) == [0.0, 0.0, 1.0, 1.0]


def test_argument_errors() -> None:
    j = judged(ScriptedJudge())
    with pytest.raises(ValueError, match="at least one candidate"):
        tournament_rewards([], j, prompt=PROMPT)
    with pytest.raises(ValueError, match="l0"):
        tournament_rewards(["a"], j, prompt=PROMPT, l0=0)
    with pytest.raises(ValueError, match="sigma"):
        tournament_rewards(["a"], j, prompt=PROMPT, sigma=-1)
    with pytest.raises(ValueError, match="JudgeBackend"):
        tournament_rewards(["a"], ScriptedJudge(), prompt=PROMPT)  # a policy is not a backend
    with pytest.raises(ValueError, match="max_retries"):
        run_judgements(j, [], max_retries=-1)
    with pytest.raises(ValueError, match="request"):
        judge_task(" ", ["a"])
    with pytest.raises(ValueError, match="1..8 candidates"):
        judge_task(PROMPT, ["a"] * 9)
    with pytest.raises(ValueError, match="length"):
        Candidate("a", length=-1)
    with pytest.raises(ValueError, match="concurrency"):
        PolicyJudge(ScriptedJudge(), concurrency=0)


# =========================================================================== synth Judge adapter


def test_grm_judge_implements_the_synth_judge_protocol() -> None:
    from k3post.synth import synthesize
    from k3post.synth.verify import Judge, VerifyContext, judge_stage

    sample = synthesize(WRITING, effort="high", n=1, seed=0)[0]
    grm = GRMJudge(judged(ScriptedJudge()))
    assert isinstance(grm, Judge)
    res = grm.judge(sample)
    d = distinct(sample["messages"][-1]["content"])
    # one candidate: total = 2 * min(10, d // 2) + 5 out of max_total 10 * (2 + 1) = 30
    # the reference blurb has d = 19 distinct words: variety 9, total 23
    assert d == 19 and not res.uncertain and res.score == pytest.approx(23 / 30)
    assert judge_stage(sample, VerifyContext(judges={"general.writing": grm})).status == "keep"  # 23/30 >= 0.6
    bad = GRMJudge(judged(ScriptedJudge("skip_score")), max_retries=1).judge(sample)
    assert bad.uncertain and bad.score == 0.0 and "2 attempts: unscored, unscored" in bad.note


# =========================================================================== RL group scorer


def test_group_scorer_over_rollout_trajectories(xtml_tokenizer: Any) -> None:
    from k3post.rollout.trajectory import Group, Trajectory
    from k3post.xtml import OMIT_EFFORT, XTML

    x = XTML(xtml_tokenizer)
    task = WRITING.generate(1, seed=3)[0]
    prompt_ids = x.render(task.prompt(), mode="think", add_generation_prompt=True).ids
    n_prefix = len(x.generation_prefix())

    def traj(k: int, turn: list[int]) -> Trajectory:
        t = Trajectory(f"g0/s{k}", 0, k, 0, task.to_dict())
        t.append(prompt_ids)
        t.append(turn, logprobs=[0.0] * len(turn), versions=[0] * len(turn))
        return t

    texts = [words(3), words(7), words(5)]
    trajs = [traj(k, x.render([assistant(t, "some plan")], effort=OMIT_EFFORT).ids[n_prefix:]) for k, t in enumerate(texts)]
    # the response length does not depend on the reasoning: with an empty think channel the sampled
    # turn is <|close|> followed by exactly the response tokens
    lens = [len(x.render([assistant(t, "")], effort=OMIT_EFFORT).ids) - n_prefix - 1 for t in texts]
    cands = [trajectory_candidate(t, x) for t in trajs]
    assert [c.text for c in cands] == texts and [c.length for c in cands] == lens
    assert lens[1] > lens[2] > lens[0]
    scorer = GroupGRM(judged(ScriptedJudge()), x)
    group = Group(0, task.to_dict(), trajs)
    assert scorer(group) == [0.0, 1.0, 0.5]
    # ℓ0 of the family puts the 7-word answer over σ·ℓ0: it loses both by the guard, 5 words beat 3
    guarded = GroupGRM(judged(ScriptedJudge()), x, l0={task.family: (lens[1] + lens[2]) / 2 / 1.5})
    assert guarded(group) == [0.5, 0.0, 1.0] and guarded.last.stats.guard_losses == 2
    assert guarded(group) == [0.5, 0.0, 1.0] and (guarded.stats.comparisons, guarded.stats.judgements) == (6, 2)
    # a last turn that does not parse is an empty response
    assert trajectory_candidate(traj(3, [x.sep_id, x.sep_id, x.eom_id]), x).text == ""


# =========================================================================== backends


def test_openai_compatible_backend_against_a_local_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge behind a real HTTP endpoint on 127.0.0.1: the env-core tests' scripted chat server
    (`_ChatServer`), answering with the scripted judge instead of its kv solver."""
    import test_envs_core

    judge = ScriptedJudge()
    monkeypatch.setattr(test_envs_core, "kv_solver", judge)
    with test_envs_core._ChatServer() as srv:
        backend = PolicyJudge.from_url(srv.url, "judge-model", concurrency=2, retries=0)
        res = tournament_rewards([words(3), words(5), words(7)], backend, prompt=PROMPT)
    assert res.rewards_K == [0.0, 0.5, 1.0] and res.stats.invalid == 0
    assert len(srv.requests) == 3 * 6 and judge.episodes == 3  # 3 judgements of 6 turns (one call per turn)
    first = srv.requests[0]["body"]
    assert first["model"] == "judge-model" and first["messages"][0]["role"] == "system"
    assert [t["function"]["name"] for t in first["tools"]] == ["read_candidate", "write_rubric", "score", "scorepad"]


@pytest.mark.usefixtures("one_torch_thread")
def test_embedded_engine_backend_runs_end_to_end(xtml_tokenizer: Any, tmp_path: Path) -> None:
    """An untrained tiny checkpoint as the judge: its output is garbage, so every judgement is
    invalid (no verdict: malformed / cut at max_tokens, or no scorepad), retried, then a tie."""
    from k3post.models import build_tiny_moe, save_model
    from k3post.rollout.engine import SamplingParams

    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id)
    save_model(model, tmp_path / "judge", tok)
    backend = EngineJudge.from_checkpoint(tmp_path / "judge", max_batch_size=4, sampling=SamplingParams(max_tokens=12), seed=1)
    try:
        res = tournament_rewards([words(3), words(7)], backend, prompt=PROMPT, max_retries=1)
    finally:
        backend.close()
    assert res.rewards_K == [0.5, 0.5]
    s = res.stats
    assert (s.judgements, s.invalid, s.retried, s.forfeits, s.ties) == (2, 2, 1, 1, 1)
    assert sum(s.invalid_reasons.values()) == 2
    assert set(s.invalid_reasons) <= {"malformed", "length", "context", "no_scorepad", "truncated", "unread"}
    assert backend.batches == 2  # the first attempts in one batch, the retries in a second
