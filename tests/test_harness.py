"""White-box harness: tool aliasing, system prompt, context management, skills, memory, sub-agents, sampling."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_envs_core import KV_TOOLS, kv_solver, kv_task, make_kv_env, scripted  # noqa: E402

from k3post.envs import (  # noqa: E402
    ContextConfig,
    EpisodeLimits,
    EpisodeRunner,
    Harness,
    HarnessConfig,
    HarnessSampler,
    HarnessSpace,
    MemoryConfig,
    MemoryStore,
    SkillConfig,
    SkillsConfig,
    SubagentConfig,
    SystemPromptConfig,
    ToolInterfaceConfig,
    resume_episode_sync,
    run_episode_sync,
)
from k3post.envs.harness import ToolAliaser, apply_context, extractive_summary, load_skill_file, load_skills_dir  # noqa: E402

KV_SKILL = SkillConfig("kv-admin", "Administrative operations on the store.", "Use the delete tool to remove a key.", ("delete",))

ALIASED = ToolInterfaceConfig(
    names={"get": "kv_read", "set": "kv_write", "submit": "finish"},
    arguments={"set": {"key": "k", "value": "v"}, "get": {"key": "k"}},
    prefix="fn_",
)

CONFIGS = {
    "identity": HarnessConfig(),
    "aliased+window": HarnessConfig(
        name="aliased+window",
        tool_interface=ALIASED,
        system_prompt=SystemPromptConfig(preset="careful"),
        context=ContextConfig(window_turns=2),
    ),
    "prefix+mask+skills": HarnessConfig(
        name="prefix+mask+skills",
        tool_interface=ToolInterfaceConfig(prefix="tool_"),
        context=ContextConfig(mask_after_turns=1),
        skills=SkillsConfig(enabled=True, skills=(KV_SKILL,)),
    ),
    "aliased+summary+skills": HarnessConfig(
        name="aliased+summary+skills",
        tool_interface=ALIASED,
        system_prompt=SystemPromptConfig(preset="concise", text="Task group: {task_group}."),
        context=ContextConfig(summarize_over_tokens=60, summary_keep_turns=1),
        skills=SkillsConfig(enabled=True, skills=(KV_SKILL,)),
    ),
}


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


# --------------------------------------------------------------------------- the acceptance test


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_scripted_solver_succeeds_under_different_harnesses(name: str) -> None:
    from k3post.xtml import render_text

    cfg = CONFIGS[name]
    for i in range(3):
        env = make_kv_env()
        ep = run_episode_sync(kv_solver, env, kv_task(i), Harness(cfg))
        assert ep.verdict is not None and ep.verdict.reward == 1.0, (name, ep.verdict)
        assert not ep.truncated and ep.harness == cfg.to_dict()
        presented = {t["function"]["name"] for t in ep.tools}
        render_text(ep.messages, tools=ep.tools)  # the transcript is valid XTML input
        if cfg.tool_interface == ALIASED:
            assert {"kv_read", "kv_write", "finish"} <= presented and "get" not in presented
            call_names = {c["function"]["name"] for m in ep.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])}
            assert "set" not in call_names and "kv_write" in call_names
            assert env.state["store"][f"k{i}a"] == str(i + 1)  # mapped back onto the canonical tool
        if cfg.skills.enabled:
            assert not any("delete" in n for n in presented)  # gated until the skill is loaded
            declares = [m for m in ep.messages if m.get("type") == "tool-declare"]
            assert len(declares) == 1 and declares[0]["tools"][0]["function"]["name"].endswith("delete")
            assert any(t.get("harness", {}).get("skills_loaded") == ["kv-admin"] for t in ep.turn_info)
            assert "kv-admin: Administrative operations" in ep.messages[0]["content"]
        if cfg.context != ContextConfig():
            assert any(t["view"] is not None for t in ep.turn_info)  # the policy saw a managed context
        else:
            assert all(t["view"] is None for t in ep.turn_info)
    if name == "aliased+summary+skills":
        assert ep.messages[0]["content"].startswith(
            "You are an agent. Use the tools to complete the task, then give a short final answer.\n\nTask group: kv."
        )
        assert ep.messages[0]["content"].endswith("You operate a key-value store.")


def test_harness_errors_speak_the_presented_interface() -> None:
    policy = scripted([
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "set", "arguments": '{"key": "q", "value": "1"}'}},
            {"id": "b", "function": {"name": "kv_write", "arguments": '{"key": "q", "value": "1"}'}},
            {"id": "c", "function": {"name": "kv_write", "arguments": '{"k": "q", "v": "1"}'}},
        ]},
    ])
    env = make_kv_env()
    ep = run_episode_sync(policy, env, kv_task(0), Harness(CONFIGS["aliased+window"]))
    a, b, c = [m for m in ep.messages if m["role"] == "tool"]
    assert a["content"] == "Error: unknown tool 'set'. Available tools: finish, fn_delete, kv_read, kv_write."
    assert b["content"] == "Error: invalid arguments for tool 'kv_write': 'k' is a required property."
    assert c == {"role": "tool", "tool_call_id": "c", "name": "kv_write", "content": "ok"}
    assert env.state["store"]["q"] == "1"


# --------------------------------------------------------------------------- modules


def test_tool_aliaser_maps_both_ways() -> None:
    al = ToolAliaser(ALIASED, ["get", "set", "delete", "submit"])
    spec = al.spec(KV_TOOLS[1])
    assert spec.name == "kv_write" and list(spec.parameters["properties"]) == ["k", "v"]
    assert spec.parameters["required"] == ["k", "v"] and spec.description == KV_TOOLS[1].description
    assert al.name("delete") == "fn_delete" and al.canonical("fn_delete") == "delete" and al.canonical("delete") is None
    assert al.args_to_canonical("set", {"k": "a", "v": "b"}) == {"key": "a", "value": "b"}
    assert al.args_to_presented("set", {"key": "a", "value": "b"}) == {"k": "a", "v": "b"}
    with pytest.raises(ValueError, match="both presented as 'x'"):
        ToolAliaser(ToolInterfaceConfig(names={"get": "x", "set": "x"}), ["get", "set"])


def _transcript() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"}]
    for i in range(4):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "function": {"name": "get", "arguments": f'{{"key": "k{i}"}}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "name": "get", "content": f"value {i}\nsecond line"})
        if i == 1:
            msgs.append({"role": "system", "type": "tool-declare", "tools": [KV_TOOLS[2].to_openai()]})
    return msgs


def test_context_strategies_golden() -> None:
    msgs = _transcript()
    assert apply_context(msgs, ContextConfig()) == msgs
    # masking: tool results older than the last 1 turn become the placeholder
    masked = apply_context(msgs, ContextConfig(mask_after_turns=1, placeholder="[gone]"))
    assert [m["content"] for m in masked if m["role"] == "tool"] == ["[gone]", "[gone]", "[gone]", "value 3\nsecond line"]
    assert msgs[3]["content"] == "value 0\nsecond line"  # the input is untouched
    # window: keep the last 2 turns, hoist the dropped turn's tool-declare, note the omission
    win = apply_context(msgs, ContextConfig(window_turns=2))
    assert [(m["role"], m.get("type"), m.get("tool_call_id")) for m in win] == [
        ("system", None, None), ("user", None, None), ("system", "tool-declare", None), ("system", None, None),
        ("assistant", None, None), ("tool", None, "c2"), ("assistant", None, None), ("tool", None, "c3"),
    ]
    assert win[3]["content"] == "[2 earlier turn(s) omitted]"
    # summary: only once over budget. Approx tokens (words): "sys" 1 + "do it" 2, then per turn
    # the call (name 1 + arguments 2) and its result ("value i / second line" 4): 3 + 4 * 7 = 31
    assert apply_context(msgs, ContextConfig(summarize_over_tokens=31, summary_keep_turns=1)) == msgs
    summ = apply_context(msgs, ContextConfig(summarize_over_tokens=30, summary_keep_turns=1))
    assert summ[3] == {
        "role": "system",
        "content": "Summary of the 3 earlier turn(s):\n"
        '- called get({"key": "k0"})\n  -> value 0\n'
        '- called get({"key": "k1"})\n  -> value 1\n'
        '- called get({"key": "k2"})\n  -> value 2',
    }
    assert summ[2]["type"] == "tool-declare" and [m["role"] for m in summ[4:]] == ["assistant", "tool"]
    custom = apply_context(msgs, ContextConfig(summarize_over_tokens=1, summary_keep_turns=0), summarizer=lambda ms: f"{len(ms)} msgs")
    assert custom[-1]["content"] == "Summary of the 4 earlier turn(s):\n8 msgs"


def test_extractive_summary_golden() -> None:
    msgs = [
        {"role": "user", "content": "\n  Find the file.\nMore."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "1", "function": {"name": "ls", "arguments": {"path": "/" * 20}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "a.txt b.txt"},
    ]
    # the arguments line is cut to 16 characters: 15 kept ('{"path": "' and 5 slashes) plus '…'
    assert extractive_summary(msgs, max_chars=16) == (
        "- user: Find the file.\n- assistant: Looking.\n- called ls({\"path\": \"/////…)\n  -> a.txt b.txt"
    )


def test_skill_files_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("---\nname: kv-admin\ndescription: Admin ops.\ntools: delete, purge\n---\n# Admin\nDelete with care.\n")
    (tmp_path / "a.md").write_text("# Searching well\nUse precise keywords.\n")
    skills = load_skills_dir(tmp_path)
    assert skills == [
        SkillConfig("a", "Searching well", "# Searching well\nUse precise keywords.", ()),
        SkillConfig("kv-admin", "Admin ops.", "# Admin\nDelete with care.", ("delete", "purge")),
    ]
    (tmp_path / "bad.md").write_text("---\nname: x\ncolour: red\n---\nbody")
    with pytest.raises(ValueError, match="unknown front matter keys"):
        load_skill_file(tmp_path / "bad.md")
    (tmp_path / "bad.md").unlink()
    cfg = HarnessConfig(skills=SkillsConfig(enabled=True, directory=str(tmp_path)))
    ep = run_episode_sync(kv_solver, make_kv_env(), kv_task(0), Harness(cfg))
    assert ep.verdict is not None and ep.verdict.reward == 1.0
    loads = [c for m in ep.messages if m["role"] == "assistant" for c in m.get("tool_calls", []) if c["function"]["name"] == "load_skill"]
    assert [json.loads(c["function"]["arguments"]) for c in loads] == [{"name": "a"}, {"name": "kv-admin"}]
    skill_results = [m["content"] for m in ep.messages if m["role"] == "tool" and m["name"] == "load_skill"]
    assert skill_results == [
        "# Skill: a\n\n# Searching well\nUse precise keywords.",
        "# Skill: kv-admin\n\n# Admin\nDelete with care.\n\nTools now available: delete.",
    ]


def test_memory_notes_persist_across_episodes_of_a_group(tmp_path: Path) -> None:
    path = tmp_path / "mem" / "notes.json"
    cfg = HarnessConfig(memory=MemoryConfig(enabled=True, path=str(path), inject=True))

    def note(action: str, text: str = "") -> dict[str, Any]:
        args = {"action": action, **({"text": text} if text else {})}
        return {"role": "assistant", "content": "", "tool_calls": [{"id": "", "function": {"name": "notes", "arguments": json.dumps(args)}}]}

    ep1 = run_episode_sync(scripted([note("read"), note("write", "x lives in the store"), note("append", "tmp is junk")]),
                           make_kv_env(), kv_task(0, group="g1"), Harness(cfg))
    results = [m["content"] for m in ep1.messages if m["role"] == "tool"]
    assert results == ["(no notes yet)", "Notes saved (20 characters).", "Notes saved (32 characters)."]
    assert json.loads(path.read_text()) == {"g1": "x lives in the store\ntmp is junk"}
    # a new Harness (as in another process) on another task of the same group sees the notes
    ep2 = run_episode_sync(scripted([note("read")]), make_kv_env(), kv_task(1, group="g1"), Harness(cfg))
    assert ep2.messages[0]["content"] == (
        "You keep persistent notes across tasks of this kind with the `notes` tool.\n"
        "Your current notes:\nx lives in the store\ntmp is junk\n\nYou operate a key-value store."
    )
    assert [m["content"] for m in ep2.messages if m["role"] == "tool"] == ["x lives in the store\ntmp is junk"]
    # another group has its own notes
    ep3 = run_episode_sync(scripted([note("read")]), make_kv_env(), kv_task(2, group="g2"), Harness(cfg))
    assert [m["content"] for m in ep3.messages if m["role"] == "tool"] == ["(no notes yet)"]
    # in-memory store shared by one Harness object across episodes
    h = Harness(HarnessConfig(memory=MemoryConfig(enabled=True, max_chars=10)))
    run_episode_sync(scripted([note("write", "short")]), make_kv_env(), kv_task(0), h)
    ep4 = run_episode_sync(scripted([note("read"), note("write", "far too long text")]), make_kv_env(), kv_task(1), h)
    assert [m["content"] for m in ep4.messages if m["role"] == "tool"] == [
        "short", "Error: tool 'notes' failed: ValueError: notes would be 17 characters; the limit is 10"]
    assert MemoryStore(path).groups() == ["g1"]


def test_subagent_delegation_runs_a_nested_episode_on_the_same_state() -> None:
    def main(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        names = [t["function"]["name"] for t in tools]
        assert "delegate" in names
        if not any(m["role"] == "tool" for m in messages):
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "d", "function": {"name": "delegate", "arguments": json.dumps({"task": "store sub=yes, then say what x is"})}}]}
        answer = [m for m in messages if m["role"] == "tool"][-1]["content"]
        return {"role": "assistant", "content": f"sub-agent said: {answer}"}

    def sub(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        names = {t["function"]["name"] for t in tools}
        assert "delegate" not in names and "submit" not in names and "set" in names
        assert messages[0] == {"role": "user", "content": "store sub=yes, then say what x is"}
        done = [m for m in messages if m["role"] == "tool"]
        if not done:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "function": {"name": "set", "arguments": '{"key": "sub", "value": "yes"}'}},
                {"id": "2", "function": {"name": "get", "arguments": '{"key": "x"}'}}]}
        return {"role": "assistant", "content": f"x is {done[-1]['content']}"}

    env = make_kv_env()
    cfg = HarnessConfig(subagents=SubagentConfig(enabled=True, max_turns=4))
    ep = run_episode_sync(main, env, kv_task(0), Harness(cfg, subagent_policy=sub))
    assert env.state["store"]["sub"] == "yes"  # the sub-agent changed the shared state
    assert ep.final_answer == "sub-agent said: x is seven-0"
    nested = ep.turn_info[0]["harness"]["subagent_episodes"]
    assert len(nested) == 1 and nested[0]["task"]["id"] == "kv-000/sub1" and nested[0]["verdict"] is None
    assert ep.turns == 2  # the nested turns are not the parent's
    # read-only sub-agents only get read-only tools; their write attempt is an error observation
    env2 = make_kv_env()
    ro = HarnessConfig(subagents=SubagentConfig(enabled=True, read_only=True))
    ep2 = run_episode_sync(main, env2, kv_task(0), Harness(ro, subagent_policy=lambda m, t: {"role": "assistant", "content": str(sorted(x["function"]["name"] for x in t))}))
    assert ep2.final_answer == "sub-agent said: ['get']" and "sub" not in env2.state["store"]


def test_a_harness_applied_without_the_episode_runner_refuses_to_delegate() -> None:
    """The harness sits below the episode runner (no import of it, issue 33 §circles): the runner hands it
    `run_episode`; applied without one, a delegation fails with an error naming what is missing instead of
    importing the runner behind the caller's back."""
    env = make_kv_env()
    task = kv_task(0)
    asyncio.run(env.reset(task))
    cfg = HarnessConfig(subagents=SubagentConfig(enabled=True, max_turns=2))
    applied = Harness(cfg, subagent_policy=kv_solver).apply(task, env, kv_solver)
    with pytest.raises(ValueError, match="sub-agents need the episode runner"):
        asyncio.run(applied._delegate(None, "say what x is"))  # type: ignore[arg-type]


def test_resume_with_harness_state_continues_exactly() -> None:
    cfg = CONFIGS["aliased+summary+skills"]
    full = run_episode_sync(kv_solver, make_kv_env(), kv_task(4), Harness(cfg))
    paused = run_episode_sync(kv_solver, make_kv_env(), kv_task(4), Harness(cfg), pause_after=5)
    ckpt = json.loads(json.dumps(paused.checkpoint))
    assert ckpt["harness"]["state"]["loaded_skills"] == ["kv-admin"]
    resumed = resume_episode_sync(kv_solver, make_kv_env(), ckpt)  # harness rebuilt from the saved config
    assert resumed.verdict == full.verdict and resumed.messages == full.messages
    assert resumed.turn_info == full.turn_info


# --------------------------------------------------------------------------- configs and sampling


def test_harness_config_dict_roundtrip_and_unknown_keys() -> None:
    for cfg in CONFIGS.values():
        assert HarnessConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    nested = HarnessConfig(subagents=SubagentConfig(enabled=True, harness=CONFIGS["aliased+window"]))
    assert HarnessConfig.from_dict(nested.to_dict()) == nested
    with pytest.raises(ValueError, match=r"unknown key 'harness.context.window'"):
        HarnessConfig.from_dict({"context": {"window": 3}})
    with pytest.raises(ValueError, match="unknown system prompt preset"):
        HarnessConfig.from_dict({"system_prompt": {"preset": "chatty"}})
    with pytest.raises(ValueError, match="window_turns must be at least 1"):
        ContextConfig(window_turns=0)
    with pytest.raises(ValueError, match="unknown summarizer"):
        Harness(HarnessConfig(context=ContextConfig(summarizer="llm")))


def _space() -> HarnessSpace:
    return HarnessSpace.from_dict({
        "tool_interface": {"aliased": {"names": {"get": "kv_read"}}, "prefixed": {"prefix": "t_"}},
        "context": {"window": {"window_turns": 2}, "mask": {"mask_after_turns": 1}},
        "skills": {"on": {"enabled": True, "skills": [{"name": "kv-admin", "description": "Admin.", "tools": ["delete"]}]}},
        "groups": {
            "kv": {"tool_interface": {"default": 1, "aliased": 1, "prefixed": 2}, "context": {"window": 1, "mask": 0}, "skills": {"on": 1}},
            "*": {"context": {"mask": 1}},
        },
    })


def test_harness_sampler_is_seeded_deterministic_and_weighted() -> None:
    sampler = HarnessSampler(_space(), seed=3)
    tasks = [kv_task(i) for i in range(200)]
    first = [sampler.variants(t, 0) for t in tasks]
    assert [HarnessSampler(_space(), seed=3).variants(t, 0) for t in reversed(tasks)] == first[::-1]  # order-free
    assert [sampler.variants(t, 1) for t in tasks] != first and [HarnessSampler(_space(), seed=4).variants(t, 0) for t in tasks] != first
    counts = Counter(v["tool_interface"] for v in first)
    assert set(counts) == {"default", "aliased", "prefixed"} and counts["prefixed"] > counts["aliased"]
    assert 70 <= counts["prefixed"] <= 130  # weight 2 of 4 over 200 draws
    assert {v["context"] for v in first} == {"window"}  # weight 0 is never drawn
    assert {v["skills"] for v in first} == {"on"} and {v["memory"] for v in first} == {"default"}
    other = sampler.variants(kv_task(0, group="other"), 0)
    assert other["context"] == "mask" and other["tool_interface"] == "default"  # the "*" group
    cfg = sampler.sample(tasks[0], 0)
    assert cfg.name == ",".join(f"{m}={v}" for m, v in first[0].items()) and cfg.skills.enabled
    with pytest.raises(ValueError, match="unknown variant 'big'"):
        HarnessSpace(groups={"kv": {"context": {"big": 1.0}}})
    with pytest.raises(ValueError, match="unknown module 'tools'"):
        HarnessSpace(groups={"kv": {"tools": {"default": 1.0}}})
    with pytest.raises(ValueError, match="weights sum to 0"):
        HarnessSpace(groups={"kv": {"context": {"default": 0}}})


def test_solver_succeeds_on_every_sampled_harness(tmp_path: Path) -> None:
    space = HarnessSpace(
        tool_interface={"aliased": ALIASED, "prefixed": ToolInterfaceConfig(prefix="t_")},
        context={"window": ContextConfig(window_turns=2), "mask": ContextConfig(mask_after_turns=1),
                 "summary": ContextConfig(summarize_over_tokens=80, summary_keep_turns=1)},
        skills={"on": SkillsConfig(enabled=True, skills=(KV_SKILL,))},
        memory={"file": MemoryConfig(enabled=True, path=str(tmp_path / "m.json"))},
        groups={"*": {"tool_interface": {"default": 1, "aliased": 1, "prefixed": 1},
                      "context": {"default": 1, "window": 1, "mask": 1, "summary": 1},
                      "skills": {"default": 1, "on": 1}, "memory": {"default": 1, "file": 1}}},
    )
    sampler = HarnessSampler(space, seed=0)
    names = set()
    for i in range(12):
        task = kv_task(i)
        h = sampler.harness(task, episode=0)
        names.add(h.config.name)
        ep = run_episode_sync(kv_solver, make_kv_env(EpisodeLimits(max_turns=12)), task, h)
        assert ep.verdict is not None and ep.verdict.reward == 1.0, h.config.name
    assert len(names) >= 6


def test_runner_view_is_what_the_policy_gets() -> None:
    runner = EpisodeRunner(make_kv_env(), harness=Harness(CONFIGS["aliased+window"]))
    _run(runner.start(kv_task(0)))
    for _ in range(4):
        msgs, tools = runner.view()
        _run(runner.advance(kv_solver(msgs, tools)))
    msgs, _ = runner.view()
    assert [m["role"] for m in msgs] == ["system", "user", "system", "assistant", "tool", "assistant", "tool"]
    assert msgs[2]["content"] == "[2 earlier turn(s) omitted]"
    assert runner.turn_info[-1]["view"] is not None and runner.turn_info[0]["view"] is None
