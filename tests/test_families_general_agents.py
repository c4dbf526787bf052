"""The general and agents task families: generators, reference solvers, verifiers, wrong policies, CLI.

Measured claims (issue): the reference solver scores 1.0 on 100 seeded tasks of every family at every
effort; every wrong or hacky policy scores 0; generation is a pure function of the seed; reasoning
length is ordered max >= high >= low; trajectories render to valid XTML.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from k3post.envs import Task, run_episode_sync
from k3post.envs.env import count_tokens
from k3post.envs.episode import resume_episode_sync
from k3post.envs.families import registry
from k3post.envs.families.agents import family as agents
from k3post.envs.families.general import family as general
from k3post.envs.families.agents.apps import APP_TOOLS
from k3post.envs.families.cli import add_tasks_parser, list_text, sample_text
from k3post.envs.families.common import EFFORTS, FamilyBase, normalize_answer
from k3post.envs.families.general.family import evaluate_expression, writing_format_check
from k3post.envs.families.kg import bm25_search
from k3post.envs.task import FinalState, run_verifier
from k3post.xtml import XTML

FAMILIES: list[FamilyBase] = [general.ARITHMETIC, general.FAITHFULNESS, general.WRITING, agents.SEARCH, agents.ASSISTANT]
IDS = [f.name for f in FAMILIES]


def _tasks(fam: FamilyBase, n: int, seed: int) -> list[Task]:
    """``n`` tasks spread over the family's difficulties."""
    per = -(-n // fam.max_difficulty)
    out: list[Task] = []
    for d in range(1, fam.max_difficulty + 1):
        out += fam.generate(per, seed=seed, difficulty=d)
    return out[:n]


def _run(fam: FamilyBase, task: Task, policy: Any) -> Any:
    return run_episode_sync(policy, fam.make_env(task), task)


def _think_tokens(ep: Any) -> int:
    return sum(len((m.get("reasoning_content") or "").split()) for m in ep.messages if m["role"] == "assistant")


# --------------------------------------------------------------------------- registry and generation


def test_families_registered() -> None:
    for fam in FAMILIES:
        assert registry._FAMILIES[fam.name] is fam
        assert isinstance(fam, registry.TaskFamily)
        assert fam.name.split(".")[0] == fam.domain
    assert {f.name for f in FAMILIES if f.domain == "general"} == {"general.arithmetic", "general.faithfulness", "general.writing"}
    assert {f.name for f in FAMILIES if f.domain == "agents"} == {"agents.search", "agents.assistant"}
    assert [f.verifiable for f in FAMILIES] == [True, True, False, True, True]


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_generation_deterministic_and_distinct(fam: FamilyBase) -> None:
    for d in range(1, fam.max_difficulty + 1):
        a = fam.generate(30, seed=7, difficulty=d)
        b = fam.generate(30, seed=7, difficulty=d)
        assert a == b and [t.content_hash() for t in a] == [t.content_hash() for t in b]
        assert len({t.id for t in a}) == 30
        assert len({t.content_hash() for t in a}) == 30
        c = fam.generate(30, seed=8, difficulty=d)
        assert {t.content_hash() for t in a}.isdisjoint({t.content_hash() for t in c})
        for t in a:
            assert t.family == fam.name and t.verifier == fam.name and t.domain == fam.domain
            assert Task.from_dict(t.to_dict()) == t
    assert fam.generate(0, seed=1) == []


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_bad_arguments_are_value_errors(fam: FamilyBase) -> None:
    with pytest.raises(ValueError, match="difficulty"):
        fam.generate(1, seed=0, difficulty=fam.max_difficulty + 1)
    with pytest.raises(ValueError, match="difficulty"):
        fam.generate(1, seed=0, difficulty=0)
    with pytest.raises(ValueError, match="n must"):
        fam.generate(-1, seed=0)
    task = fam.generate(1, seed=0)[0]
    with pytest.raises(ValueError, match="effort"):
        fam.reference_policy(task, "medium")
    other = next(f for f in FAMILIES if f is not fam).generate(1, seed=0)[0]
    with pytest.raises(ValueError, match="belongs to family"):
        fam.make_env(other)


# --------------------------------------------------------------------------- the measured claims


@pytest.mark.parametrize("effort", EFFORTS)
@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_reference_solver_scores_one_on_100_tasks(fam: FamilyBase, effort: str) -> None:
    tasks = _tasks(fam, 100, seed=2026)
    assert len(tasks) == 100
    bad = []
    for t in tasks:
        ep = _run(fam, t, fam.reference_policy(t, effort))
        if ep.reward != 1.0 or ep.truncated:
            bad.append((t.id, ep.verdict))
    assert not bad, bad[:3]


_COMMON_WRONG = {"empty", "copied_prompt", "claims_success"}
_FAMILY_WRONG = {
    "general.arithmetic": {"off_by_one", "answer_in_think_only", "number_spray"},
    "general.faithfulness": {"hedged"},
    "general.writing": {"keywords_only", "one_sentence", "feature_left_out"},
    "agents.search": {"guess_without_search", "first_hop_only", "all_candidates", "empty_submit"},
    "agents.assistant": {"expected_words_only", "action_without_reply", "wrong_recipient", "collateral_cancel"},
}


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_wrong_and_hacky_policies_score_zero(fam: FamilyBase) -> None:
    seen: set[str] = set()
    for t in _tasks(fam, 24, seed=99):
        policies = fam.wrong_policies(t)
        assert _COMMON_WRONG | _FAMILY_WRONG[fam.name] <= set(policies)
        seen |= set(policies)
        for name, pol in policies.items():
            ep = _run(fam, t, pol)
            assert ep.reward == 0.0, (name, t.id, ep.verdict)
    if fam is agents.ASSISTANT:  # every request kind was exercised
        assert {"reply_without_action", "wrong_meeting", "clashing_slot", "wrong_value"} <= seen
    if fam is general.FAITHFULNESS:
        assert {"hallucinated", "wrongly_not_stated", "whole_sentence"} <= seen
        assert any(s.startswith("distractor_") for s in seen)


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_effort_orders_reasoning_length(fam: FamilyBase) -> None:
    totals = {e: 0 for e in EFFORTS}
    for t in _tasks(fam, 12, seed=5):
        think = {e: _think_tokens(_run(fam, t, fam.reference_policy(t, e))) for e in EFFORTS}
        out = {e: sum(count_tokens(m) for m in _run(fam, t, fam.reference_policy(t, e)).messages if m["role"] == "assistant") for e in EFFORTS}
        assert think["max"] >= think["high"] >= think["low"] == 0, (t.id, think)
        assert out["max"] >= out["high"] >= out["low"], (t.id, out)
        for e in EFFORTS:
            totals[e] += think[e]
    assert totals["max"] > totals["high"] > totals["low"]
    # sized against the real budgets (synthesis budgets, sft.max_len, the per-turn rl.rollout.max_tokens) in tokens:
    # tests/test_reference_effort_levels.py


# --------------------------------------------------------------------------- honest traces


def test_arithmetic_trace_steps_are_the_real_steps() -> None:
    step = re.compile(r"^(-?\d+) ([-+*]) (-?\d+) = (-?\d+)")
    for t in _tasks(general.ARITHMETIC, 40, seed=11):
        trace = general.ARITHMETIC.reasoning(t, "max").splitlines()
        assert trace[-1] == f"so {t.metadata['answer']}"
        assert len(trace) - 1 == sum(1 for tok in t.metadata["tokens"] if tok in ("+", "-", "*"))
        for line in trace[:-1]:
            a, op, b, r = step.match(line).groups()  # type: ignore[union-attr]
            assert int(r) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert len(general.ARITHMETIC.reasoning(t, "high").splitlines()) <= len(trace) - 1


def test_search_trace_quotes_only_what_was_opened() -> None:
    quote = re.compile(r"(d\d\d) says: (.+?\.) So")
    for t in _tasks(agents.SEARCH, 20, seed=12):
        ep = _run(agents.SEARCH, t, agents.SEARCH.reference_policy(t, "max"))
        seen = ""
        for m in ep.messages:
            if m["role"] == "tool":
                seen += m["content"] + "\n"
            if m["role"] == "assistant":
                for did, sent in quote.findall(m["reasoning_content"]):
                    assert sent in seen and did in seen, (t.id, sent)
        assert ep.verdict is not None and ep.verdict.components["path_docs_opened"] == 1.0
        assert len(t.metadata["relations"]) >= 2


def test_faithfulness_answers_come_from_the_context() -> None:
    for t in _tasks(general.FAITHFULNESS, 60, seed=13):
        ans = t.metadata["answers"][0]
        ctx = t.messages[0]["content"].split("Context: ", 1)[1].split("\n\nQuestion:", 1)[0]
        if ans == "not stated":
            assert t.metadata["attribute"] not in t.metadata["facts"][t.metadata["entity"]]
        else:
            assert ans in ctx


def test_assistant_move_reasoning_names_the_real_clash() -> None:
    for t in agents.ASSISTANT.generate(40, seed=14, difficulty=2):
        info = t.metadata["info"]
        if "rejected" not in info:
            continue
        ep = _run(agents.ASSISTANT, t, agents.ASSISTANT.reference_policy(t, "max"))
        act = next(m for m in ep.messages if m["role"] == "assistant" and any(
            c["function"]["name"] == "calendar_move" for c in m.get("tool_calls") or []))["reasoning_content"]
        clash_id, clash_title = re.search(r"clashes with (e\d+) (.+?) \(", act).groups()  # type: ignore[union-attr]
        listed = "\n".join(m["content"] for m in ep.messages if m["role"] == "tool")
        assert f"{clash_id} | " in listed and f"| {clash_title} |" in listed and info["date"] in listed


# --------------------------------------------------------------------------- golden checks of the parts


def test_evaluate_expression_golden() -> None:
    assert evaluate_expression([2, "+", 3, "*", 4]) == 14  # 3*4 = 12 first, then 2 + 12
    assert evaluate_expression(["(", 2, "+", 3, ")", "*", 4]) == 20  # bracket: 5, then 5*4
    assert evaluate_expression([9, "-", 4, "-", 2]) == 3  # left to right: (9-4)-2
    assert evaluate_expression([1, "-", 2, "*", 3, "+", 4]) == -1  # 2*3 = 6; 1-6 = -5; -5+4 = -1


def test_normalize_answer_golden() -> None:
    assert normalize_answer("  The Vel River. ") == "vel river"
    assert normalize_answer("12,400") == "12400"
    assert normalize_answer("Not stated.") == "not stated"
    assert normalize_answer(None) == ""


def test_writing_format_gate_golden() -> None:
    prompt = "Write a two-sentence product blurb for the Lumo Kettle, an electric kettle. Mention auto shut-off."
    good = "Meet the Lumo Kettle, an electric kettle built for busy mornings. Auto shut-off makes every cup simple."
    assert all(v == 1.0 for v in writing_format_check(good, "Lumo Kettle", "auto shut-off", prompt).values())
    copied = writing_format_check(prompt, "Lumo Kettle", "auto shut-off", prompt)
    assert copied["two_sentences"] == copied["names_product"] == copied["mentions_feature"] == 1.0
    assert copied["original"] == 0.0  # a copied prompt passes every other check, so this one matters
    assert writing_format_check("Lumo Kettle. Auto shut-off.", "Lumo Kettle", "auto shut-off", prompt)["length"] == 0.0


def test_writing_verdict_says_it_needs_the_grm() -> None:
    t = general.WRITING.generate(1, seed=0)[0]
    ep = _run(general.WRITING, t, general.WRITING.reference_policy(t, "max"))
    assert ep.reward == 1.0 and "GRM" in ep.verdict.diagnostics and ep.verdict.components["format"] == 1.0


def test_bm25_ranks_the_entity_page_first() -> None:
    docs = {
        "d01": {"entity": "a", "title": "Korvath", "text": "Korvath is a city in Zemia."},
        "d02": {"entity": "b", "title": "Ilsa Varn", "text": "Ilsa Varn was born in Korvath. Ilsa Varn works at Brin Labs."},
        "d03": {"entity": "c", "title": "Brin Labs", "text": "Brin Labs is headquartered in Korvath."},
    }
    assert [d for d, _ in bm25_search(docs, "Korvath")][0] == "d01"
    assert [d for d, _ in bm25_search(docs, "Ilsa Varn", k=1)] == ["d02"]
    assert bm25_search(docs, "nothing matches") == []
    with pytest.raises(ValueError, match="no words"):
        bm25_search(docs, "  ?! ")


def test_assistant_verifier_reads_only_the_final_state() -> None:
    t = next(x for x in agents.ASSISTANT.generate(30, seed=3, difficulty=1) if x.metadata["info"]["kind"] == "move")
    m = t.metadata
    state = {**m["state"], "calendar": [dict(e) for e in m["expected_calendar"]], "mail": {"inbox": m["state"]["mail"]["inbox"], "sent": []}}
    info = m["info"]
    state["mail"]["sent"].append({"to": m["reply_to"], "subject": "Re", "body": f"Moved to {info['date']} at {info['start']}."})
    assert run_verifier(t, FinalState(state, None)).reward == 1.0
    assert run_verifier(t, FinalState(state, "I did nothing")).reward == 1.0  # claims are never read
    other = next(e for e in state["calendar"] if e["id"] != info["event"])
    other["start"] = "08:00"
    v = run_verifier(t, FinalState(state, None))
    assert v.reward == 0.0 and v.components["calendar"] == 0.0 and v.components["reply"] == 1.0


def test_tool_errors_become_observations() -> None:
    t = agents.SEARCH.generate(1, seed=0)[0]
    bad_open = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "open", "arguments": '{"doc_id": "d99"}'}}]}]
    ep = run_episode_sync(lambda msgs, tools: bad_open[0] if len(msgs) < 3 else {"role": "assistant", "content": "x"}, agents.SEARCH.make_env(t), t)
    assert ep.messages[3]["content"].startswith("Error:") and "d99" in ep.messages[3]["content"]
    t2 = agents.ASSISTANT.generate(1, seed=0)[0]
    call = {"id": "c", "type": "function", "function": {"name": "calendar_move", "arguments": '{"event_id": "e1", "date": "2026-03-05", "start": "3pm"}'}}
    ep = run_episode_sync(lambda msgs, tools: {"role": "assistant", "content": "", "tool_calls": [call]} if len(msgs) < 4 else {"role": "assistant", "content": "x"}, agents.ASSISTANT.make_env(t2), t2)
    assert ep.messages[3]["content"].startswith("Error:") and "HH:MM" in ep.messages[3]["content"]
    assert {s.name for s in APP_TOOLS if s.read_only} == {"mail_inbox", "mail_read", "calendar_list", "docs_list", "docs_read"}


def test_reference_policy_resumes_after_pause() -> None:
    for fam in (agents.SEARCH, agents.ASSISTANT):
        t = fam.generate(1, seed=21, difficulty=2)[0]
        pol = fam.reference_policy(t, "high")
        paused = run_episode_sync(pol, fam.make_env(t), t, pause_after=2)
        assert paused.paused
        done = resume_episode_sync(pol, fam.make_env(t), paused.checkpoint)
        assert done.reward == 1.0


# --------------------------------------------------------------------------- XTML


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_trajectories_render_to_valid_xtml(fam: FamilyBase, xtml_tokenizer: Any) -> None:
    x = XTML(xtml_tokenizer)
    for t in _tasks(fam, 3, seed=31):
        for e in EFFORTS:
            ep = _run(fam, t, fam.reference_policy(t, e))
            r = x.render(ep.messages, tools=ep.tools or None, effort=e)
            v = x.validate(r.ids)
            assert v.ok, (t.id, e, v)
            assert any(r.loss_mask)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3post")
    add_tasks_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    ns = _parser().parse_args(["tasks", "list"])
    assert ns.fn(ns) == 0
    out = capsys.readouterr().out
    for fam in FAMILIES:
        assert fam.name in out and fam.description in out
    assert out.index("general (") < out.index("general.arithmetic") and out.index("agents (") < out.index("agents.search")
    assert "[GRM]" in out.split("general.writing", 1)[1].splitlines()[0]
    only = list_text("agents")
    assert "agents.search" in only and "general.arithmetic" not in only
    with pytest.raises(ValueError, match="unknown domain"):
        list_text("physics")


def test_cli_sample(capsys: pytest.CaptureFixture[str]) -> None:
    ns = _parser().parse_args(["tasks", "sample", "agents.assistant", "--seed", "3", "--effort", "high"])
    assert ns.fn(ns) == 0
    out = capsys.readouterr().out
    assert "## task (XTML" in out and '<|open|>message role="system" type="tool-declare"<|sep|>' in out
    assert "thinking_effort=high" in out and "reward 1" in out and "mail_send" in out
    assert sample_text("general.arithmetic", seed=1, effort="low") != sample_text("general.arithmetic", seed=2, effort="low")
    with pytest.raises(ValueError, match="unknown task family 'agents.serch'.*did you mean 'agents.search'"):
        sample_text("agents.serch")
    with pytest.raises(ValueError, match="unknown effort"):
        sample_text("agents.search", effort="medium")
    with pytest.raises(SystemExit):
        _parser().parse_args(["tasks", "sample", "agents.search", "--effort", "medium"])
