"""Tests of the coding task families (coding.write_function, coding.bugfix).

Default run (about 30 s on 2 CPUs): 20 seeded tasks per family with the reference solver at
every effort level (efforts and difficulties cycle), every wrong / hacky policy on one task per
difficulty, generation invariants, pause / resume in a fresh process. The `slow` test runs the
full claim: 100 seeded tasks per family at each of the three effort levels score 1.0, and every
wrong policy scores 0 on 30 tasks per family.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from k3post.envs import FinalState, Task, count_tokens, run_episode_sync
from k3post.envs.families.coding.family import (
    BUGFIX,
    WRITE_FUNCTION,
    verify_bugfix,
    verify_write_function,
)
from k3post.envs.families.coding.problems import (
    FN_TEMPLATES,
    REPO_TEMPLATES,
    call_in_modules,
    decode_value,
    encode_value,
    load_modules,
)
from k3post.constants import EFFORTS
from k3post.envs.families.registry import TaskFamily
from k3post.envs.sandbox_tools import SandboxState
from k3post.xtml import render_text

FAMILIES = {"write_function": WRITE_FUNCTION, "bugfix": BUGFIX}


def _tasks(fam: Any, n: int, seed: int) -> list[Task]:
    """``n`` tasks with the difficulties 1, 2, 3 in turn."""
    per = [fam.generate(len(range(d - 1, n, 3)), seed=seed, difficulty=d) for d in (1, 2, 3)]
    out: list[Task] = []
    for i in range(n):
        out.append(per[i % 3][i // 3])
    return out


def _reward(fam: Any, task: Task, policy: Any) -> float:
    ep = run_episode_sync(policy, fam.make_env(task), task)
    assert ep.verdict is not None and not ep.truncated, ep.verdict
    return ep.verdict.reward


# --------------------------------------------------------------------------- encoding (hand-checked)


def test_typed_encoding_separates_what_equality_would_merge() -> None:
    class Liar(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    # True == 1 and (1, 2) == [1, 2] is False but 1 == 1.0: the encoding keeps types apart
    assert encode_value(True) == ["bool", True] != encode_value(1) == ["int", 1]
    assert encode_value((1, 2)) == ["tuple", [["int", 1], ["int", 2]]] != encode_value([1, 2])
    assert encode_value(1.0) == ["float", "1.0"] != encode_value(1)
    assert encode_value(Liar(3))[0] == "other"
    assert encode_value(["a", None]) == ["list", [["str", "a"], ["none", None]]]
    assert decode_value(encode_value([1, "x", [True]])) == [1, "x", [True]]


def test_function_templates_golden_values() -> None:
    # hand-derived: rle with separator "," of "aaab" is "3a" then "1b"
    for seed in range(200):
        prob = FN_TEMPLATES[2][4](random.Random(seed))
        if prob.params["sep"] == ",":
            break
    ns: dict[str, Any] = {}
    exec(prob.solution, ns)
    assert ns["rle"]("aaab") == "3a,1b" and ns["rle"]("") == ""
    # balanced: "([)]" is not properly nested, "([])" is
    for seed in range(200):
        prob = FN_TEMPLATES[3][1](random.Random(seed))
        if set(prob.params["pairs"]) == {"()", "[]"}:
            break
    ns = {}
    exec(prob.solution, ns)
    assert ns["balanced"]("([])x") is True and ns["balanced"]("([)]") is False and ns["balanced"]("(") is False


def test_every_function_template_runs_on_its_inputs() -> None:
    for level, templates in FN_TEMPLATES.items():
        for make in templates:
            for seed in range(5):
                rng = random.Random(seed)
                prob = make(rng)
                ns: dict[str, Any] = {}
                exec(prob.solution, ns)
                for args in [*prob.edge, *(prob.gen(rng) for _ in range(10))]:
                    out = encode_value(ns[prob.func](*args))
                    assert out[0] in ("int", "str", "bool", "list"), (prob.key, args, out)


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_generation_is_seeded_distinct_and_checks_its_arguments(name: str) -> None:
    fam = FAMILIES[name]
    assert isinstance(fam, TaskFamily) and fam.domain == "coding" and fam.verifiable
    a = fam.generate(12, seed=3, difficulty=2)
    b = fam.generate(12, seed=3, difficulty=2)
    c = fam.generate(12, seed=4, difficulty=2)
    assert a == b and a != c
    assert len({t.id for t in a}) == 12 and len({t.content_hash() for t in a}) == 12
    for t in a:
        assert t.family == fam.name and t.verifier == fam.name and t.domain == "coding"
        assert Task.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(ValueError, match="difficulty"):
        fam.generate(1, seed=0, difficulty=4)
    with pytest.raises(ValueError, match="n must be"):
        fam.generate(-1, seed=0)
    with pytest.raises(ValueError, match="effort"):
        fam.reference_policy(a[0], "medium")


def test_write_function_hidden_tests_stay_out_of_the_prompt() -> None:
    for t in WRITE_FUNCTION.generate(30, seed=0, difficulty=3):
        md = t.metadata
        prompt = t.messages[-1]["content"]
        assert md["reference"] not in prompt
        for c in md["public"]:
            assert f"{decode_value(c['expected'])!r}" in prompt
        public_args = [c["args"] for c in md["public"]]
        # hidden tests: edge cases + one public example + fresh inputs the prompt never shows
        fresh = [c for c in md["hidden"] if c["args"] not in public_args]
        hidden_args = [c["args"] for c in md["hidden"]]
        assert len(hidden_args) == len({json.dumps(a) for a in hidden_args}) >= 10 and len(fresh) >= 6


def test_bugfix_generation_injects_one_bug_that_a_visible_and_a_hidden_test_expose() -> None:
    covered: set[tuple[str, str]] = set()
    for d in (1, 2, 3):
        for t in BUGFIX.generate(40, seed=11, difficulty=d):
            md = t.metadata
            bug = md["bug"]
            tmpl = next(r for r in REPO_TEMPLATES if r.key == md["template"])
            correct = {p: s.format(**md["params"]) for p, s in tmpl.sources.items()}
            buggy = {p: s for p, s in md["files"].items() if p not in md["tests"]}
            changed = [p for p in correct if correct[p] != buggy[p]]
            assert changed == [bug["path"]]
            assert correct[bug["path"]].replace(bug["fixed"], bug["buggy"]) == buggy[bug["path"]]
            level = next(s.level for s in tmpl.sites if s.fixed.format(**md["params"]) == bug["fixed"])
            assert level == (1 if d == 1 else 2)
            if d == 3:
                assert {c["module"] for c in md["visible"]} == {md["top"]}
            good, bad = load_modules(correct), load_modules(buggy)
            for cases in (md["visible"], md["hidden"]):
                assert all(call_in_modules(good, c["module"], c["func"], c["args"]) == c["expected"] for c in cases)
                assert any(call_in_modules(bad, c["module"], c["func"], c["args"]) != c["expected"] for c in cases)
            assert not any(h["func"] == v["func"] and h["args"] == v["args"] for h in md["hidden"] for v in md["visible"])
            covered.add((md["template"], bug["fixed"].split("{")[0][:12]))
    assert len({k for k, _ in covered}) == len(REPO_TEMPLATES)


# --------------------------------------------------------------------------- tools and state


def test_bugfix_tools_show_the_failure_and_reject_bad_calls() -> None:
    task = BUGFIX.generate(1, seed=5, difficulty=1)[0]
    md = task.metadata
    test_path = next(iter(md["tests"]))

    def script(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        turn = sum(m["role"] == "assistant" for m in messages)
        calls = [
            [("run_tests", {}), ("edit_file", {"path": md["bug"]["path"], "old": "\n", "new": ""}),
             ("write_file", {"path": "../escape.py", "content": "x"}), ("read_file", {"path": "nope.py"})],
            [("edit_file", {"path": md["bug"]["path"], "old": md["bug"]["buggy"], "new": md["bug"]["fixed"]}),
             ("run_tests", {}), ("list_files", {})],
        ]
        if turn >= len(calls):
            return {"role": "assistant", "content": "done"}
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{turn}{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for k, (n, a) in enumerate(calls[turn])]}

    ep = run_episode_sync(script, BUGFIX.make_env(task), task)
    tool_out = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert "FAIL test_" in tool_out[0] and " 0 failed" not in tool_out[0]
    assert tool_out[1].startswith("Error:") and "exactly once" in tool_out[1]
    assert tool_out[2].startswith("Error:") and "traversal" in tool_out[2]
    assert tool_out[3].startswith("Error:")
    assert tool_out[4].startswith("Edited")
    assert tool_out[5].rstrip().endswith(" 0 failed") and "FAIL" not in tool_out[5]
    assert test_path in tool_out[6] and "__pycache__" not in tool_out[6]
    assert ep.reward == 1.0


def test_write_function_run_tests_reports_public_failures() -> None:
    task = WRITE_FUNCTION.generate(1, seed=2, difficulty=1)[0]
    func = task.metadata["func"]

    def script(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn == 0:
            calls = [("run_tests", {}), ("write_file", {"path": "solution.py", "content": f"def {func}(*a):\n    return None\n"}),
                     ("run_tests", {}), ("run_python", {"code": f"from solution import {func}\nprint('ran', {func}(0))"})]
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for k, (n, a) in enumerate(calls)]}
        return {"role": "assistant", "content": "done"}

    ep = run_episode_sync(script, WRITE_FUNCTION.make_env(task), task)
    out = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert "does not exist" in out[0]
    assert out[2].startswith("0/3 public examples passed") and "returned None" in out[2]
    assert "ran None" in out[3] and "exit code 0" in out[3]
    assert ep.reward == 0.0


def test_verifier_reads_the_files_not_the_transcript_and_restores_original_tests() -> None:
    wf = WRITE_FUNCTION.generate(1, seed=8, difficulty=2)[0]
    ref = {"solution.py": wf.metadata["reference"]}
    assert verify_write_function(wf, FinalState({"files": ref}, "I failed")).reward == 1.0
    assert verify_write_function(wf, FinalState({"files": {}}, "all tests passed")).reward == 0.0
    state = SandboxState(ref)
    assert verify_write_function(wf, FinalState(state)).reward == 1.0
    assert verify_write_function(wf, FinalState(state.to_json())).reward == 1.0
    state.close()
    with pytest.raises(ValueError, match="final state"):
        verify_write_function(wf, FinalState(["solution.py"]))

    bf = BUGFIX.generate(1, seed=8, difficulty=3)[0]
    md = bf.metadata
    fixed = dict(md["files"])
    fixed[md["bug"]["path"]] = fixed[md["bug"]["path"]].replace(md["bug"]["buggy"], md["bug"]["fixed"])
    assert verify_bugfix(bf, FinalState({"files": fixed})).reward == 1.0
    # a fix that also deletes or rewrites the tests still counts: the originals are restored
    no_tests = {p: t for p, t in fixed.items() if p not in md["tests"]}
    assert verify_bugfix(bf, FinalState({"files": no_tests})).reward == 1.0
    assert verify_bugfix(bf, FinalState({"files": md["files"]})).reward == 0.0


def test_pause_and_resume_in_a_fresh_process(tmp_path: Path) -> None:
    task = BUGFIX.generate(1, seed=21, difficulty=2)[0]
    policy = BUGFIX.reference_policy(task, "high")
    full = run_episode_sync(policy, BUGFIX.make_env(task), task)
    paused = run_episode_sync(policy, BUGFIX.make_env(task), task, pause_after=3)  # the edit is done
    assert paused.paused and paused.verdict is None
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps(paused.checkpoint))
    code = (
        "import json, sys\n"
        "from k3post.envs import resume_episode_sync\n"
        "from k3post.envs.families.coding.family import BUGFIX\n"
        "ck = json.load(open(sys.argv[1]))\n"
        "from k3post.envs import Task\n"
        "task = Task.from_dict(ck['env']['task'])\n"
        "ep = resume_episode_sync(BUGFIX.reference_policy(task, 'high'), BUGFIX.make_env(task), ck)\n"
        "print(json.dumps({'reward': ep.reward, 'messages': ep.messages}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["reward"] == 1.0 == full.reward
    assert resumed["messages"] == full.messages


# --------------------------------------------------------------------------- reference solvers and hacks


def _assistant_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(count_tokens(m) for m in messages if m["role"] == "assistant")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reference_trajectories_per_effort_are_honest_and_render(name: str) -> None:
    fam = FAMILIES[name]
    task = fam.generate(1, seed=13, difficulty=2)[0]
    eps = {e: run_episode_sync(fam.reference_policy(task, e), fam.make_env(task), task) for e in EFFORTS}
    assert all(ep.reward == 1.0 for ep in eps.values())
    reasoning = {e: " ".join(m.get("reasoning_content", "") for m in ep.messages if m["role"] == "assistant")
                 for e, ep in eps.items()}
    assert reasoning["low"].strip() == ""
    tokens = {e: _assistant_tokens(ep.messages) for e, ep in eps.items()}
    assert tokens["low"] < tokens["high"] < tokens["max"], tokens
    # the max reasoning quotes what the tools actually returned
    tool_text = "\n".join(m["content"] for m in eps["max"].messages if m["role"] == "tool")
    if name == "bugfix":
        first_fail = next(line for line in tool_text.splitlines() if line.startswith("FAIL "))
        assert first_fail in reasoning["max"] and task.metadata["bug"]["buggy"] in reasoning["max"]
    else:
        assert "3/3 public examples passed" in tool_text and "3/3 public examples passed" in reasoning["max"]
    for effort, ep in eps.items():
        text = render_text(ep.messages, tools=ep.tools, effort=effort)
        assert text.count('role="assistant"') == ep.turns and "call tool=" in text


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reference_solver_scores_1_on_20_seeded_tasks(name: str) -> None:
    fam = FAMILIES[name]
    tasks = _tasks(fam, 20, seed=0)
    jobs = [(t, EFFORTS[i % 3]) for i, t in enumerate(tasks)]
    with ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(lambda j: _reward(fam, j[0], fam.reference_policy(j[0], j[1])), jobs))
    assert rewards == [1.0] * 20


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_wrong_policy_scores_0(name: str) -> None:
    fam = FAMILIES[name]
    tasks = _tasks(fam, 3, seed=1)
    names = set(fam.wrong_policies(tasks[0]))
    expected = {"empty", "copied_prompt", "prints_all_tests_passed", "exit_at_import"}
    expected |= {"tests_deleted", "tests_assert_true", "conftest_skips_everything", "no_change_claims_fixed",
                 "hardcoded_visible_tests"} if name == "bugfix" else {"hardcoded_public_examples", "eq_always_true",
                                                                      "claims_without_file"}
    assert expected <= names
    jobs = [(t, n, p) for t in tasks for n, p in fam.wrong_policies(t).items()]
    with ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(lambda j: (j[0].id, j[1], _reward(fam, j[0], j[2])), jobs))
    assert [r for r in rewards if r[2] != 0.0] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reference_scores_1_on_100_tasks_at_every_effort_and_hacks_score_0(name: str) -> None:
    fam = FAMILIES[name]
    tasks = _tasks(fam, 100, seed=100)
    jobs = [(t, fam.reference_policy(t, e)) for t in tasks for e in EFFORTS]
    jobs += [(t, p) for t in tasks[:30] for p in fam.wrong_policies(t).values()]
    with ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(lambda j: _reward(fam, j[0], j[1]), jobs))
    assert rewards[: 300] == [1.0] * 300
    assert set(rewards[300:]) == {0.0}
