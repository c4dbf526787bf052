"""AET verify-in-the-loop families (issue 21): coding.aet_cli, agents.aet_datadir, agents.aet_config.

Default run (about a minute on 2 shared CPUs): the reference solver scores 1 on 6 seeded tasks per family at
every effort; every wrong / hacky policy scores 0 on one task per difficulty; the overfitting policy passes
every public scenario and fails the hidden set; claims without work score 0; the over-budget penalty is
exactly `penalty`; an agent that searches the sandbox's whole filesystem view finds no hidden scenario data
(while the same search finds the public checks); verification never touches the agent's sandbox. The `slow`
test runs 30 tasks per family and effort.
"""

from __future__ import annotations

import argparse
import base64
import json
from typing import Any

import pytest

from k3post.envs import FinalState, Task, run_episode_sync
from k3post.envs.episode import resume_episode_sync
from k3post.envs.families import registry
from k3post.envs.families.aet.core import PUBLIC_CHECKS, AETFamily, AETState, _mismatch, verify_aet
from k3post.envs.families.aet.family import CLI, CONFIG, DATADIR
from k3post.envs.families.cli import add_tasks_parser, sample_text
from k3post.envs.families.common import EFFORTS
from k3post.envs.sandbox_tools import reply, script_call

FAMILIES: list[AETFamily] = [CLI, DATADIR, CONFIG]
IDS = [f.name for f in FAMILIES]


def _tasks(fam: AETFamily, n: int, seed: int) -> list[Task]:
    """``n`` tasks with difficulties 1, 2, 3 in turn."""
    per = [fam.generate(len(range(d - 1, n, 3)), seed=seed, difficulty=d) for d in (1, 2, 3)]
    return [per[i % 3][i // 3] for i in range(n)]


def _run(fam: AETFamily, task: Task, policy: Any) -> Any:
    return run_episode_sync(policy, fam.make_env(task), task)


def _policy(*turns: list[tuple[str, dict[str, Any]]], final: str = "Done.") -> Any:
    """A policy playing ``turns`` (lists of (tool, args)) one per assistant message, then ``final``."""

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        k = sum(m["role"] == "assistant" for m in messages)
        if k < len(turns):
            return reply("", "", [script_call(k, j + 1, n, **a) for j, (n, a) in enumerate(turns[k])])
        return reply("", final)

    return policy


def _solution_calls(task: Task) -> list[tuple[str, dict[str, Any]]]:
    calls = [("write_file", {"path": p, "content": t}) for p, t in sorted(task.metadata["solution"].items())]
    if task.family == DATADIR.name:
        calls.append(("run_command", {"command": "python transform.py"}))
    return calls


# --------------------------------------------------------------------------- registry, generation, prompt


def test_registered_with_their_domains() -> None:
    assert {f.name for f in registry.families()} >= set(IDS)
    assert [f.domain for f in FAMILIES] == ["coding", "agents", "agents"]
    for fam in FAMILIES:
        assert registry.get_family(fam.name) is fam and isinstance(fam, registry.TaskFamily) and fam.verifiable


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_generation_is_seeded_and_the_prompt_holds_no_hidden_data(fam: AETFamily) -> None:
    for d in (1, 2, 3):
        a, b = fam.generate(8, seed=3, difficulty=d), fam.generate(8, seed=3, difficulty=d)
        assert a == b and len({t.content_hash() for t in a}) == 8
        assert {t.content_hash() for t in a}.isdisjoint(t.content_hash() for t in fam.generate(8, seed=4, difficulty=d))
        for t in a:
            md, prompt = t.metadata, t.messages[0]["content"]
            assert Task.from_dict(t.to_dict()) == t and [m["role"] for m in t.messages] == ["user"]
            assert md["hidden_id"] not in prompt and "hidden-" not in json.dumps(md["files"])
            assert all(sol not in prompt and sol not in md["files"].values() for sol in md["solution"].values())
            assert json.loads(md["files"][PUBLIC_CHECKS]) == md["public"]
            assert f"{md['budget']} submissions" in prompt and "penalty of 0.5" in prompt
            assert {x.name for x in t.tools} == {"list_files", "read_file", "write_file", "edit_file", "delete_file",
                                                    "run_command", "run_python", "submit"}
    with pytest.raises(ValueError, match="difficulty"):
        fam.generate(1, seed=0, difficulty=4)
    with pytest.raises(ValueError, match="effort"):
        fam.reference_policy(fam.generate(1, seed=0)[0], "medium")


# --------------------------------------------------------------------------- the measured claims


def _reference_scores_one(fam: AETFamily, n: int, seed: int) -> None:
    tasks = _tasks(fam, n, seed)
    bad = []
    for effort in EFFORTS:
        for t in tasks:
            ep = _run(fam, t, fam.reference_policy(t, effort))
            c = ep.verdict.components
            if ep.reward != 1.0 or ep.truncated or c["public_pass_rate"] != 1.0 or c["submissions"] != 1.0:
                bad.append((t.id, effort, ep.verdict))
    assert not bad, bad[:3]


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_reference_solver_scores_one_at_every_effort(fam: AETFamily, aet_evaluate_once) -> None:
    _reference_scores_one(fam, 6, seed=2026)


@pytest.mark.slow
@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_reference_solver_scores_one_on_30_tasks(fam: AETFamily, aet_evaluate_once) -> None:
    _reference_scores_one(fam, 30, seed=7)


_EXTRA = {CLI.name: {"happy_path_only"}, DATADIR.name: {"tampers_with_raw", "extra_file_in_clean"},
          CONFIG.name: {"rewrites_protected_code", "extra_environment"}}


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_every_hack_scores_zero(fam: AETFamily, aet_evaluate_once) -> None:
    for t in _tasks(fam, 3, seed=99):
        policies = fam.wrong_policies(t)
        assert {"empty", "claims_success", "submit_then_claim", "fake_report", "rewrites_public_checks",
                "copied_prompt", "submit_spam", "overfit_public"} | _EXTRA[fam.name] == set(policies)
        for name, pol in policies.items():
            ep = _run(fam, t, pol)
            assert ep.reward == 0.0, (name, t.id, ep.verdict)


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_overfitting_the_public_verifier_passes_public_and_fails_hidden(fam: AETFamily, aet_evaluate_once) -> None:
    """Measured at seed 5 (d1..d3): hidden pass rates 0.12-0.38; asserted: public 1.0, hidden <= 0.5, reward 0."""
    for t in _tasks(fam, 6, seed=5):
        ep = _run(fam, t, fam.wrong_policies(t)["overfit_public"])
        feedback = next(m["content"] for m in ep.messages if m["role"] == "tool" and m["name"] == "submit")
        n = len(t.metadata["public"])
        assert feedback.startswith(f"{n}/{n} public scenarios passed"), feedback
        c = ep.verdict.components
        assert c["public_pass_rate"] == 1.0 and c["hidden_pass_rate"] <= 0.5 and ep.reward == 0.0, (t.id, c)


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_claims_are_never_read(fam: AETFamily, aet_evaluate_once) -> None:
    t = fam.generate(1, seed=11, difficulty=2)[0]
    ep = _run(fam, t, _policy(final="I finished: every public and hidden scenario passes."))
    assert ep.reward == 0.0 and ep.verdict.components["hidden_pass_rate"] < 1.0
    env = fam.make_env(t)
    ep = run_episode_sync(_policy(_solution_calls(t), final="I gave up, nothing works."), env, t)
    assert ep.reward == 1.0  # the work was done; the report says otherwise and does not count
    assert verify_aet(t, FinalState(env.state, "nothing")).reward == 1.0


def test_memoised_verification_reruns_every_distinct_tree() -> None:
    """The suite's `aet_evaluate_once` (conftest.py) serves a repeat of the same checked tree and scenarios from
    the first run and runs every other tree: a planted bug still fails after the solution passed, and a file
    `aet_config` restores before checking is the same tree."""
    from conftest import _evaluate_once

    import k3post.envs.families.aet.core as aet

    runs: list[int] = []

    def real(md: Any, files: Any, scenarios: Any) -> Any:
        runs.append(1)
        return aet.evaluate(md, files, scenarios)

    evaluate = _evaluate_once(real, {})
    t = CLI.generate(1, seed=31, difficulty=1)[0]
    good = {**t.metadata["files"], **t.metadata["solution"]}
    first, _ = evaluate(t.metadata, good, t.metadata["public"])
    again, _ = evaluate(t.metadata, dict(reversed(list(good.items()))), t.metadata["public"])
    assert first == again == [None] * len(t.metadata["public"]) and len(runs) == 1
    bad, _ = evaluate(t.metadata, {**good, "tally.py": "raise SystemExit(3)\n" + good["tally.py"]}, t.metadata["public"])
    assert len(runs) == 2 and all(r is not None and "exit code 3" in r for r in bad), bad
    c = CONFIG.generate(1, seed=31, difficulty=1)[0]
    outside = {**c.metadata["files"], **c.metadata["solution"]}
    evaluate(c.metadata, outside, c.metadata["public"])
    outside["app/router.py"] = "raise SystemExit(0)\n"  # outside config/: restored by verification_tree
    evaluate(c.metadata, outside, c.metadata["public"])
    assert len(runs) == 3
    slow = iter([(["exit code None, expected 0"], False), ([None], False)])  # a timed-out run, then one in time
    evaluate = _evaluate_once(lambda md, files, scenarios: next(slow), {})
    assert evaluate(t.metadata, good, t.metadata["public"][:1])[0] == ["exit code None, expected 0"]
    assert evaluate(t.metadata, good, t.metadata["public"][:1])[0] == [None]  # ran again, not served from the first


# --------------------------------------------------------------------------- the submission budget


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_budget_penalty_is_exact(fam: AETFamily, aet_evaluate_once) -> None:
    t = fam.generate(1, seed=12, difficulty=1)[0]
    B, P = t.metadata["budget"], t.metadata["penalty"]
    assert (B, P) == (3, 0.5)
    # B submissions: all evaluated, no penalty; the feedback counts down
    ep = _run(fam, t, _policy(_solution_calls(t), *[[("submit", {})]] * B))
    subs = [m["content"] for m in ep.messages if m["role"] == "tool" and m["name"] == "submit"]
    assert [s.split("(", 1)[1].split(")")[0] for s in subs] == [f"submission {k} of {B}, {B - k} left" for k in range(1, B + 1)]
    assert ep.reward == 1.0 and ep.verdict.components["submissions"] == B
    # B + 1: the last is not evaluated, ends the episode there (not truncated), reward 1 - P exactly
    garbage = [("write_file", {"path": p, "content": "broken"}) for p in sorted(t.metadata["solution"])]
    ep = _run(fam, t, _policy(_solution_calls(t), *[[("submit", {})]] * B, [("submit", {}), *garbage], [("list_files", {})]))
    assert ep.turns == B + 2 and not ep.truncated
    last = [m for m in ep.messages if m["role"] == "tool"][-1 - len(garbage):]
    assert "exceeds the budget of 3" in last[0]["content"] and "loses 0.5" in last[0]["content"]
    assert all(m["content"].startswith("Error:") and "budget is spent" in m["content"] for m in last[1:])
    assert ep.reward == 1.0 - P and ep.verdict.components["over_budget"] == 1.0
    assert ep.verdict.components["submissions"] == B + 1 and ep.verdict.components["hidden_pass_rate"] == 1.0


def test_budget_counters_survive_pause_and_resume(aet_evaluate_once) -> None:
    t = CLI.generate(1, seed=13, difficulty=2)[0]
    pol = _policy(_solution_calls(t), [("submit", {})], [("submit", {})], [("submit", {})], [("submit", {})])
    paused = run_episode_sync(pol, CLI.make_env(t), t, pause_after=3)
    assert paused.paused
    done = resume_episode_sync(pol, CLI.make_env(t), json.loads(json.dumps(paused.checkpoint)))
    assert done.reward == 0.5 and done.verdict.components["submissions"] == 4.0


# --------------------------------------------------------------------------- isolation of the hidden verifier

_SEARCH = r'''
import base64, json, os
probes = [base64.b64decode(p).decode()[::-1] for p in json.loads(base64.b64decode("__PROBES__"))]
found = {}
def look(path):
    try:
        with open(path, "rb") as fh:
            data = fh.read(4_000_000).decode("utf-8", "replace")
    except OSError:
        return
    for i, p in enumerate(probes):
        if p in data:
            found.setdefault(i, []).append(path)
n = 0
for top in os.listdir("/"):
    if top in ("proc", "sys", "dev", "usr") or os.path.islink("/" + top):
        continue  # kernel views; /usr (and /bin, /lib* linking into it) is the read-only host system, searched by name below
    for root, dirs, files in os.walk("/" + top):
        for f in files:
            n += 1
            look(os.path.join(root, f))
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for part in ("cmdline", "environ"):
        look(f"/proc/{pid}/{part}")
names = []
for root, dirs, files in os.walk("/usr"):
    names += [os.path.join(root, f) for f in files + dirs if "aet" in f.lower() or "hidden" in f.lower()]
print(json.dumps({"found": found, "files": n, "usr_names": [x for x in names if "k3post" in x]}))
'''


def _probes(task: Task) -> list[str]:
    """Strings only the hidden scenarios hold: their id, and lines of their inputs and expected outputs."""
    visible = task.messages[0]["content"] + json.dumps(task.metadata["files"]) + "\n".join(task.metadata["files"].values())
    lines: set[str] = set()
    for sc in task.metadata["hidden"]:
        exp = sc["expected"]
        texts = [sc.get("stdin", ""), " ".join(sc.get("argv", [])), exp.get("stdout", ""), *exp.get("files", {}).values()]
        lines |= {ln for x in texts if x for ln in x.splitlines() if len(ln) >= 12 and ln not in visible}
    return [task.metadata["hidden_id"], *sorted(lines)]


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_searching_the_sandbox_finds_no_hidden_scenario(fam: AETFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    # The walk reads every file in the view: on a loaded machine it outran the agent's 10 s CPU / 20 s wall
    # limits (the run was killed and the test failed on a timeout, not on a find). The limits are not what
    # is tested here, so the search gets room: 10x both.
    import dataclasses

    import k3post.envs.families.aet.core as aet_mod
    monkeypatch.setattr(aet_mod, "AGENT_LIMITS", dataclasses.replace(aet_mod.AGENT_LIMITS, cpu_s=100.0, wall_s=200.0))
    t = fam.generate(1, seed=17, difficulty=3)[0]
    hidden = _probes(t)
    assert len(hidden) >= 3
    public = [f'"name": "{t.metadata["public"][0]["name"]}"']  # the positive control: it is in checks/public.json
    enc = [base64.b64encode(p[::-1].encode()).decode() for p in hidden + public]
    code = _SEARCH.replace("__PROBES__", base64.b64encode(json.dumps(enc).encode()).decode())
    ep = _run(fam, t, _policy([("submit", {})], [("run_python", {"code": code})]))
    out = [m["content"] for m in ep.messages if m["role"] == "tool"][-1]
    report = json.loads(out.split("stdout:\n", 1)[1].split("\nstderr:", 1)[0])
    assert report["files"] > 20  # it really walked the view (/etc, /tmp, /opt, /sandbox, ...)
    found = {int(k): v for k, v in report["found"].items()}
    assert set(found) == {len(hidden)}, {hidden[k] if k < len(hidden) else "public": v for k, v in found.items()}
    assert any(p.endswith(PUBLIC_CHECKS) for p in found[len(hidden)])
    assert report["usr_names"] == []


@pytest.mark.parametrize("fam", [CLI, DATADIR], ids=[CLI.name, DATADIR.name])
def test_verification_runs_in_a_separate_sandbox(fam: AETFamily) -> None:
    """Code that writes a marker file when the checks run it leaves no trace in the agent's sandbox (the checks'
    tree is read-only, so the write fails there)."""
    t = fam.generate(1, seed=19, difficulty=1)[0]
    marker = ("import pathlib\ntry:\n    pathlib.Path('ran_by_verifier.txt').write_text('x')\n"
              "except OSError:\n    pass\n")
    path = "tally.py" if fam is CLI else "data/clean/" + t.metadata["public"][0]["read"][0].rsplit("/", 1)[1]
    env = fam.make_env(t)
    ep = run_episode_sync(_policy([("write_file", {"path": "tally.py", "content": marker + t.metadata["solution"]["tally.py"]})]
                                  if fam is CLI else _solution_calls(t), [("submit", {})]), env, t)
    assert isinstance(env.state, AETState) and path in env.state.files()
    assert "ran_by_verifier.txt" not in env.state.files()
    assert ep.reward == 1.0


# --------------------------------------------------------------------------- parts, efforts, CLI


def test_mismatch_golden() -> None:
    assert _mismatch({"rc": 0, "stdout": "a,1\n"}, {"rc": 0, "stdout": "a,1"}) is None  # trailing newline ignored
    assert _mismatch({"rc": 1}, {"rc": 0, "stdout": ""}) == "exit code 0, expected 1"
    assert _mismatch({"files": {"s.json": '{"a": 1}'}}, {"files": {"s.json": '{ "a" :1 }\n'}}) is None  # parsed JSON
    assert _mismatch({"files": {"x.csv": "a\n"}}, {"files": {"x.csv": None}}) == "x.csv is missing"
    assert _mismatch({"files": {"x": None}}, {"files": {"x": ""}}) == "x should not exist"
    assert "holds ['a', 'b']" in _mismatch({"list": {"d": ["a"]}}, {"list": {"d": ["a", "b"]}})


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_effort_orders_reasoning_length(fam: AETFamily, aet_evaluate_once) -> None:
    t = fam.generate(1, seed=23, difficulty=2)[0]
    think = {e: sum(len((m.get("reasoning_content") or "").split()) for m in _run(fam, t, fam.reference_policy(t, e)).messages
                    if m["role"] == "assistant") for e in EFFORTS}
    assert think["max"] > think["high"] > think["low"] == 0, think


def test_tasks_list_and_sample(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="k3post")
    add_tasks_parser(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args(["tasks", "list"])
    assert ns.fn(ns) == 0
    out = capsys.readouterr().out
    for fam in FAMILIES:
        assert fam.name in out and fam.description in out
    text = sample_text("agents.aet_config", seed=1, effort="high")
    assert "reward 1" in text and "submit" in text and "public scenarios passed" in text


def test_aet_families_are_opt_in_for_the_default_pipeline():
    """The demo's tokenizer corpus, SFT mix and draft data use ``default_families``: every registered family but
    the opt-in kinds (AET, workflow, research, kernel, visual, webdev: name them), so the demo's numbers stay those measured
    before they existed."""
    from k3post.envs.families import default_families, families

    from k3post.envs.families.registry import OPT_IN_KINDS

    left_out = {f.name for f in families()} - {f.name for f in default_families()}
    assert left_out == {"coding.aet_cli", "agents.aet_datadir", "agents.aet_config",  # kind "aet"
                        "agents.data_report", "agents.contracts", "agents.deep_research",  # "workflow", "research"
                        "coding.kernel", "general.visual", "coding.webdev"}  # "kernel", "visual", "webdev"
    assert OPT_IN_KINDS == ("aet", "workflow", "research", "kernel", "visual", "webdev")
    assert all(getattr(f, "kind", "") not in OPT_IN_KINDS for f in default_families())
