"""Professional workflows and deep research (issue 21): agents.data_report, agents.contracts, agents.deep_research.

Default run: the reference solver scores 1 at low / high / max on one task per difficulty of each family;
every wrong / hacky policy scores 0 on one task per difficulty (data_report: difficulties 1 and 3, its
episodes run pandas in the sandbox); golden tests of the span IoU, the summary's number rule and the
GRM-gated reward; `k3post tasks list/sample` shows the families; they are opt-in for the default pipeline.
The `slow` test runs 10 tasks per difficulty, family and effort.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from k3post.envs import FinalState, Task, run_episode_sync
from k3post.envs.families.aet.core import AETState
from k3post.envs.families.cli import list_text, sample_text
from k3post.envs.families.common import EFFORTS, scripted_policy
from k3post.envs.families.research.family import DEEP_RESEARCH, MIN_SEARCHES
from k3post.envs.families.workflows.family import (
    CONTRACTS,
    DATA_REPORT,
    SPAN_IOU,
    _numbers,
    span_iou,
    verify_contracts,
)
from k3post.rewards.grm.gated import judged_reward
from tests.test_grm import ScriptedJudge, judged

FAMILIES = [DATA_REPORT, CONTRACTS, DEEP_RESEARCH]
IDS = [f.name for f in FAMILIES]


def _run(fam: Any, task: Task, policy: Any) -> Any:
    return run_episode_sync(policy, fam.make_env(task), task)


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_reference_scores_one_at_every_effort(fam: Any) -> None:
    for d in (1, 2, 3):
        task = fam.generate(1, seed=7, difficulty=d)[0]
        lengths = []
        for effort in EFFORTS:
            ep = _run(fam, task, fam.reference_policy(task, effort))
            assert ep.reward == 1.0, (fam.name, d, effort, ep.verdict)
            lengths.append(sum(len(m.get("reasoning_content") or "") for m in ep.messages if m["role"] == "assistant"))
        assert lengths[0] < lengths[1] < lengths[2], lengths  # low < high < max reasoning


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_every_hack_scores_zero(fam: Any) -> None:
    seen: set[str] = set()
    for d in ((1, 3) if fam is DATA_REPORT else (1, 2, 3)):
        task = fam.generate(1, seed=11, difficulty=d)[0]
        for name, policy in fam.wrong_policies(task).items():
            ep = _run(fam, task, policy)
            assert ep.reward == 0.0, (fam.name, d, name, ep.verdict)
            seen.add(name)
    must = {"empty", "claims_success", "copied_prompt"}
    must |= {DATA_REPORT: {"fabricated_numbers", "invented_figure", "copied_question_summary", "lowest_q2_margin", "missing_column"},
             CONTRACTS: {"wrong_contract", "neighbour_clause", "paraphrased_quote", "whole_document", "partial_quote"},
             DEEP_RESEARCH: {"one_search", "cites_nonexistent", "cites_unread", "no_citations", "half_research"}}[fam]
    assert must <= seen, must - seen


# --------------------------------------------------------------------------- data report


def test_summary_numbers_rule_golden() -> None:
    # quarter names are not numbers; thousands separators are dropped; signs kept
    assert _numbers("Q1 to Q2: North fell -4.3 points, from 31.2% to 26.9%; revenue 952,500.") == [-4.3, 31.2, 26.9, 952500.0]


def test_data_report_verdict_reads_the_files_not_the_claims() -> None:
    task = DATA_REPORT.generate(1, seed=3, difficulty=2)[0]
    ep = _run(DATA_REPORT, task, DATA_REPORT.reference_policy(task, "low"))
    assert ep.reward == 1.0 and set(ep.verdict.components) == {"answer", "report", "chart", "summary_rules", "data_untouched"}
    # the same work, closed with "I failed", still scores 1: only the final files count
    turns = DATA_REPORT.reference_turns(task, "low")
    turns[-1] = {**turns[-1], "content": "I could not finish; nothing is written."}
    assert _run(DATA_REPORT, task, scripted_policy(turns)).reward == 1.0
    # tampering with the raw data fails even with correct deliverables
    turns.insert(-1, {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "write_file", "arguments": json.dumps({"path": sorted(task.metadata["files"])[0], "content": "x\n"})}}]})
    ep = _run(DATA_REPORT, task, scripted_policy(turns))
    assert ep.reward == 0.0 and ep.verdict.components["data_untouched"] == 0.0


def test_grm_scores_the_narrative_behind_the_rule_gate() -> None:
    task = DATA_REPORT.generate(1, seed=5, difficulty=1)[0]
    env = DATA_REPORT.make_env(task)
    ep = run_episode_sync(DATA_REPORT.reference_policy(task, "low"), env, task)
    assert ep.reward == 1.0
    final = FinalState(env.state)
    judge = ScriptedJudge()
    reward, verdict, q = judged_reward(task, final, judged(judge))
    # ScriptedJudge: rubric variety (weight 2), clarity (weight 1, always 5); variety = min(10, distinct words // 2);
    # the summary has >= 20 distinct words, so variety 10: total 2*10 + 5 = 25 of max 10 * 3 = 30
    assert verdict.reward == 1.0 and q == pytest.approx(25 / 30) and reward == pytest.approx(25 / 30)
    assert judge.read == [DATA_REPORT.summary(task)]  # the judge read the narrative
    # a failed gate is 0 and the judge is never asked
    env.state.sandbox.write_file("out/answer.json", json.dumps({"region": "Nowhere", "change_pp": 0}))
    judge2 = ScriptedJudge()
    assert judged_reward(task, FinalState(env.state), judged(judge2)) == (0.0, verify_data_report_of(task, env), None)
    assert judge2.episodes == 0
    # an invalid judgement (no scorepad) after the retries gives quality 0
    env.state.sandbox.write_file("out/answer.json", json.dumps({"region": task.metadata["worst"], "change_pp": task.metadata["margins"][task.metadata["worst"]]["change"]}))
    assert judged_reward(task, FinalState(env.state), judged(ScriptedJudge("no_scorepad")))[0::2] == (0.0, 0.0)
    env.state.close()
    # the hook is the family's: one without a candidate has its verifier for its whole reward
    with pytest.raises(ValueError, match="agents.contracts declares no GRM candidate"):
        judged_reward(CONTRACTS.generate(1, seed=5)[0], FinalState(env.state), judged(ScriptedJudge()))


def verify_data_report_of(task: Task, env: Any) -> Any:
    from k3post.envs.families.workflows.family import verify_data_report

    return verify_data_report(task, FinalState(env.state))


# --------------------------------------------------------------------------- contracts


def test_span_iou_golden() -> None:
    assert span_iou((0, 10), (0, 10)) == 1.0
    assert span_iou((0, 10), (5, 15)) == pytest.approx(5 / 15)  # overlap 5, union 15
    assert span_iou((0, 10), (10, 20)) == 0.0
    assert span_iou((2, 8), (0, 10)) == pytest.approx(6 / 10)  # a quote inside the clause: 6 of 10 chars -> exactly SPAN_IOU
    assert SPAN_IOU == 0.6


def test_contract_quote_with_heading_and_reflowed_whitespace_passes() -> None:
    task = CONTRACTS.generate(1, seed=2, difficulty=1)[0]
    m = task.metadata
    (did, key), = m["gold"]
    s, e = m["spans"][did][key]
    text = m["docs"][did]["text"]
    head_start = text.rfind("\n", 0, s) + 1  # the clause's "N. Heading. " prefix
    quote = "\n   ".join(text[head_start:e].split(" "))  # whitespace reflowed
    sub = {"answer": CONTRACTS._answer(task, [(did, key)]), "quotes": [{"doc_id": did, "text": quote}]}
    v = verify_contracts(task, FinalState({"read": [did]}, sub))
    assert v.reward == 1.0 and SPAN_IOU <= v.components["min_iou"] < 1.0
    bad = {**sub, "quotes": [{"doc_id": "c9", "text": quote}]}  # a non-existent document
    assert verify_contracts(task, FinalState({"read": []}, bad)).reward == 0.0


# --------------------------------------------------------------------------- deep research


def test_deep_research_needs_four_searches_and_cited_documents_that_were_read() -> None:
    for d in (1, 2):
        task = DEEP_RESEARCH.generate(1, seed=4, difficulty=d)[0]
        env = DEEP_RESEARCH.make_env(task)
        ep = run_episode_sync(DEEP_RESEARCH.reference_policy(task, "low"), env, task)
        support = {x for ds in task.metadata["path_docs"] for x in ds}
        assert ep.reward == 1.0 and len(support) == (4 if d == 1 else 6) >= MIN_SEARCHES
        assert len(env.state["searches"]) == len(support) and set(env.state["opened"]) == support
        # the same answer after 3 of the searches: the state has too few searches and unread cited documents
        few = DEEP_RESEARCH._research(task, "low")[:6] + [DEEP_RESEARCH._submit(DEEP_RESEARCH.answer_text(task))]
        v = _run(DEEP_RESEARCH, task, scripted_policy(few)).verdict
        assert v.reward == 0.0 and v.components["searches"] == 0.0 and v.components["read"] == 0.0
        assert v.components["facts"] == v.components["citations"] == v.components["verdict"] == 1.0


# --------------------------------------------------------------------------- integration


def test_tasks_list_and_sample() -> None:
    """`k3post tasks list` prints `list_text` (its parser is tested with the AET families); sample renders a solved task."""
    out = list_text("agents")
    assert all(fam.name in out and fam.description in out for fam in FAMILIES)
    for fam in (CONTRACTS, DEEP_RESEARCH):
        assert "reward 1" in sample_text(fam.name, seed=1, effort="high")


def test_workflow_and_research_families_are_opt_in() -> None:
    from k3post.envs.families import default_families, families

    names = {f.name for f in families()}
    assert set(IDS) <= names and not set(IDS) & {f.name for f in default_families()}
    # nor do their words reach the tokenizer's lexicon (the demo's tokenizer stays as measured)
    from k3post.envs.families import lexicon

    assert not {"Coastal", "Tamsev", "Pelwen", "Widgets"} & set(lexicon())
    assert {"Coastal", "Tamsev"} <= set(DATA_REPORT.lexicon()) | set(CONTRACTS.lexicon())


@pytest.mark.slow
@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_reference_and_hacks_on_many_tasks(fam: Any) -> None:
    for d in (1, 2, 3):
        for task in fam.generate(10, seed=100, difficulty=d):
            for effort in EFFORTS:
                assert _run(fam, task, fam.reference_policy(task, effort)).reward == 1.0, (task.id, effort)
            for name, policy in fam.wrong_policies(task).items():
                assert _run(fam, task, policy).reward == 0.0, (task.id, name)
