"""Core environment API: ToolSpec, Task, verifiers, ToolEnvironment, episodes, pause/resume, OpenAIPolicy, GymEnv.

The example environment here is a key-value store with get / set / delete / submit
tools; its verifier reads the final store and the submission. `kv_solver` is a
scripted policy that reads the tool names and argument names it is offered (by
their descriptions) and derives its progress from the messages it sees, so it
also works under the harness (tests/test_harness.py imports these helpers).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chat_stub import ChatStub

from k3post.envs import (
    Environment,
    EpisodeLimits,
    EpisodeRunner,
    FinalState,
    GymEnv,
    OpenAIPolicy,
    Task,
    ToolContext,
    ToolEnvironment,
    ToolSpec,
    Verdict,
    call_tool,
    get_verifier,
    offered_tools,
    register_verifier,
    resume_episode_sync,
    run_episode_sync,
)
from k3post.envs.episode import to_openai_chat
from k3post.envs.task import run_verifier

# --------------------------------------------------------------------------- the example environment


def _kv_get(ctx: ToolContext, key: str) -> str:
    store = ctx.state["store"]
    if key not in store:
        raise KeyError(f"no key {key!r}")
    return store[key]


def _kv_set(ctx: ToolContext, key: str, value: str) -> str:
    ctx.state["store"][key] = value
    return "ok"


def _kv_delete(ctx: ToolContext, key: str) -> str:
    del ctx.state["store"][key]
    return "deleted"


def _key_schema() -> dict[str, Any]:
    return {"type": "string", "description": "the key", "minLength": 1}


KV_TOOLS = [
    ToolSpec(
        "get",
        "Read the value stored under a key.",
        {"type": "object", "properties": {"key": _key_schema()}, "required": ["key"], "additionalProperties": False},
        read_only=True,
        handler=_kv_get,
    ),
    ToolSpec(
        "set",
        "Write a value under a key.",
        {
            "type": "object",
            "properties": {"key": _key_schema(), "value": {"type": "string", "description": "the value"}},
            "required": ["key", "value"],
            "additionalProperties": False,
        },
        handler=_kv_set,
    ),
    ToolSpec(
        "delete",
        "Delete a key.",
        {"type": "object", "properties": {"key": _key_schema()}, "required": ["key"], "additionalProperties": False},
        handler=_kv_delete,
    ),
    ToolSpec(
        "submit",
        "Submit the final answer.",
        {"type": "object", "properties": {"answer": {"type": "string", "description": "the answer"}}, "required": ["answer"]},
    ),
]


def make_kv_env(limits: EpisodeLimits | None = None) -> ToolEnvironment:
    """A fresh key-value environment (submit tool ``submit``)."""
    return ToolEnvironment(
        KV_TOOLS,
        initial_state=lambda task: {"store": dict(task.metadata["initial"])},
        submit_tool="submit",
        limits=limits or EpisodeLimits(max_turns=20),
    )


@register_verifier("test.kv")
def verify_kv(task: Task, final: FinalState) -> Verdict:
    """Writes present, deletions done, submitted answer equal to the initial value of the read key."""
    meta = task.metadata
    store = final.state["store"]
    writes = sum(store.get(k) == v for k, v in meta["writes"].items()) / len(meta["writes"])
    deletes = sum(k not in store for k in meta["delete"]) / max(len(meta["delete"]), 1)
    sub = final.submission
    answer = float(isinstance(sub, dict) and sub.get("answer") == meta["initial"][meta["read"]])
    comps = {"writes": writes, "deletes": deletes, "answer": answer}
    return Verdict(sum(comps.values()) / 3, comps, f"store={store} submission={sub!r}")


def kv_task(i: int = 0, group: str = "") -> Task:
    """Task i: three writes, one deletion, one read whose value must be submitted."""
    writes = {f"k{i}a": str(i + 1), f"k{i}b": str(i + 2), f"k{i}c": str(i + 3)}
    plan = {"writes": writes, "delete": ["tmp"], "read": "x"}
    return Task(
        id=f"kv-{i:03d}",
        domain="agents",
        family="kv",
        group=group,
        messages=(
            {"role": "system", "content": "You operate a key-value store."},
            {"role": "user", "content": "Do the following, then submit the value of the read key.\nPLAN: " + json.dumps(plan)},
        ),
        verifier="test.kv",
        metadata={"initial": {"x": f"seven-{i}", "tmp": "junk"}, **plan},
    )


# --------------------------------------------------------------------------- the scripted solver

_ROLES = {"read the value": "get", "write a value": "set", "delete a key": "delete", "submit the final": "submit", "load a skill": "load_skill"}


def _tool_roles(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role → {"name": presented name, "args": {role_of_arg: presented arg name}, "enum": ...} from the offered tools."""
    out: dict[str, dict[str, Any]] = {}
    for t in offered_tools(messages, tools):
        fn = t["function"]
        desc = fn["description"].lower()
        role = next((r for k, r in _ROLES.items() if desc.startswith(k)), None)
        if role is None:
            continue
        args = {}
        for pname, pschema in fn["parameters"].get("properties", {}).items():
            pdesc = pschema.get("description", "")
            arole = {"the key": "key", "the value": "value", "the answer": "answer", "the skill to load": "name"}.get(pdesc)
            if arole:
                args[arole] = pname
                if "enum" in pschema:
                    out.setdefault("_enum", {})[role] = pschema["enum"]
        out[role] = {"name": fn["name"], "args": args}
    return out


def _plan_steps(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    text = next(m["content"] for m in messages if m["role"] == "user" and "PLAN: " in m["content"])
    plan = json.loads(text.split("PLAN: ", 1)[1])
    steps = [("set", {"key": k, "value": v}) for k, v in plan["writes"].items()]
    steps += [("delete", {"key": k}) for k in plan["delete"]]
    steps += [("get", {"key": plan["read"]})]
    return steps


def kv_solver(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Scripted policy: next plan step from the last plan call visible in ``messages``."""
    roles = _tool_roles(messages, tools)
    by_name = {v["name"]: (r, v) for r, v in roles.items() if not r.startswith("_")}
    steps = _plan_steps(messages)
    done_upto, last_result = -1, None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            continue
        for call in reversed(m["tool_calls"]):
            name = call["function"]["name"]
            if name not in by_name or by_name[name][0] not in ("get", "set", "delete"):
                continue
            role, spec = by_name[name]
            args = json.loads(call["function"]["arguments"])
            canon = {a: args[p] for a, p in spec["args"].items() if p in args}
            for k, (srole, sargs) in enumerate(steps):
                if srole == role and all(canon.get(a) == v for a, v in sargs.items()):
                    done_upto = k
                    last_result = next(
                        (r["content"] for r in messages[i + 1 :] if r["role"] == "tool" and r.get("tool_call_id") == call["id"]),
                        None,
                    )
                    break
            if done_upto >= 0:
                break
        if done_upto >= 0:
            break
    if done_upto == len(steps) - 1:
        sub = roles["submit"]
        return _call(sub["name"], {sub["args"]["answer"]: last_result}, content="Submitting.")
    role, sargs = steps[done_upto + 1]
    if role not in roles:
        loader = roles["load_skill"]
        loaded = {
            json.loads(c["function"]["arguments"]).get(loader["args"]["name"])
            for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or [] if c["function"]["name"] == loader["name"]
        }
        skills = roles["_enum"]["load_skill"]
        skill = next((s for s in skills if s not in loaded), skills[0])
        return _call(loader["name"], {loader["args"]["name"]: skill}, content=f"I need the {role} tool.")
    spec = roles[role]
    return _call(spec["name"], {spec["args"][a]: v for a, v in sargs.items()})


def _call(name: str, args: dict[str, Any], content: str = "") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": f"next: {name}",
        "tool_calls": [{"id": "", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}],
    }


def scripted(replies: list[dict[str, Any]]):
    """A policy returning ``replies`` in order (then a plain final answer)."""
    it = iter(replies)

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        return next(it, {"role": "assistant", "content": "done"})

    return policy


# --------------------------------------------------------------------------- ToolSpec and call_tool


def test_toolspec_formats_roundtrip_and_identity() -> None:
    spec = KV_TOOLS[1]
    assert spec.to_openai() == {
        "type": "function",
        "function": {"name": "set", "description": "Write a value under a key.", "parameters": spec.parameters},
    }
    mcp = spec.to_mcp()
    assert mcp["name"] == "set" and mcp["inputSchema"] == spec.parameters and mcp["annotations"] == {"readOnlyHint": False}
    assert KV_TOOLS[0].to_mcp()["annotations"] == {"readOnlyHint": True}
    assert ToolSpec.from_dict(spec.to_dict()) == spec
    assert ToolSpec.from_dict(spec.to_openai()) == spec  # read_only False both ways
    assert ToolSpec.from_dict(KV_TOOLS[0].to_mcp()) == KV_TOOLS[0]
    assert hash(ToolSpec.from_dict(spec.to_dict())) == hash(spec)  # the handler is not part of identity
    assert ToolSpec.from_dict(spec.to_dict()).handler is None
    with pytest.raises(ValueError, match="invalid tool name"):
        ToolSpec("has space", "x")
    with pytest.raises(ValueError, match="type 'object'"):
        ToolSpec("t", "x", {"type": "string"})
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        ToolSpec("t", "x", {"type": "object", "properties": {"a": {"type": 5}}})
    with pytest.raises(ValueError, match="unknown keys"):
        ToolSpec.from_dict({"name": "t", "descr": "typo"})


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_call_tool_turns_every_model_error_into_an_observation() -> None:
    tools = {t.name: t for t in KV_TOOLS}
    ctx = ToolContext({"store": {"a": "1"}})

    def call(name: str, args: Any, cid: str = "c1") -> Any:
        return _run(call_tool({"id": cid, "type": "function", "function": {"name": name, "arguments": args}}, tools, ctx))

    ok = call("get", '{"key": "a"}')
    assert ok.error is None and ok.message == {"role": "tool", "tool_call_id": "c1", "name": "get", "content": "1"}
    unknown = call("gett", "{}")
    assert unknown.error == "unknown_tool"
    assert unknown.message["content"] == "Error: unknown tool 'gett'. Available tools: delete, get, set, submit."
    bad_json = call("get", '{"key": ')
    assert bad_json.error == "bad_arguments" and bad_json.message["content"].startswith("Error: tool 'get': arguments are not valid JSON")
    not_obj = call("get", "[1, 2]")
    assert not_obj.error == "bad_arguments" and "must be a JSON object" in not_obj.message["content"]
    schema = call("set", {"key": "a"})
    assert schema.error == "schema"
    assert schema.message["content"] == "Error: invalid arguments for tool 'set': 'value' is a required property."
    wrong_type = call("set", {"key": "a", "value": 3})
    assert wrong_type.message["content"] == "Error: invalid arguments for tool 'set': 3 is not of type 'string' (at 'value')."
    extra = call("get", {"key": "a", "other": 1})
    assert extra.error == "schema" and "Additional properties" in extra.message["content"]
    boom = call("get", {"key": "missing"})
    assert boom.error == "handler" and boom.message["content"] == "Error: tool 'get' failed: KeyError: \"no key 'missing'\""
    malformed = _run(call_tool({"id": "z", "function": {}}, tools, ctx))
    assert malformed.error == "unknown_tool" and malformed.message["content"].startswith("Error: malformed tool call")
    assert ctx.state == {"store": {"a": "1"}}  # failed calls changed nothing


def test_call_tool_async_handler_and_json_results() -> None:
    async def stats(ctx: ToolContext, n: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"n": n, "sq": n * n, "ctx": ctx.call_id}

    spec = ToolSpec("stats", "s", {"type": "object", "properties": {"n": {"type": "integer"}}}, handler=stats)
    out = _run(call_tool({"id": "q", "function": {"name": "stats", "arguments": {"n": 3}}}, {"stats": spec}, ToolContext(None)))
    assert out.message["content"] == '{"ctx":"q","n":3,"sq":9}'


# --------------------------------------------------------------------------- Task and verifiers


def test_task_serialises_hashes_and_validates() -> None:
    t = kv_task(3)
    d = json.loads(json.dumps(t.to_dict()))
    t2 = Task.from_dict(d)
    assert t2 == t and hash(t2) == hash(t) and t2.content_hash() == t.content_hash()
    assert len({t, t2, kv_task(4)}) == 2
    with_tools = Task(id="w", domain="coding", family="f", messages=({"role": "user", "content": "hi"},), verifier="v", tools=(KV_TOOLS[0],))
    assert Task.from_dict(with_tools.to_dict()) == with_tools
    assert with_tools.tools[0].handler is None  # declarations only
    assert with_tools.task_group == "f" and kv_task(0, group="g").task_group == "g"
    with pytest.raises(ValueError, match="domain must be one of"):
        Task(id="a", domain="math", family="f", messages=(), verifier="v")
    with pytest.raises(ValueError, match="unknown keys"):
        Task.from_dict({**t.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        Task(id="a", domain="general", family="f", messages=(), verifier="v", metadata={"x": object()})
    with pytest.raises(ValueError, match="duplicate tool names"):
        Task(id="a", domain="general", family="f", messages=(), verifier="v", tools=(KV_TOOLS[0], KV_TOOLS[0]))


def test_verifier_registry() -> None:
    assert get_verifier("test.kv") is verify_kv
    register_verifier("test.kv", verify_kv)  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("test.kv", lambda task, final: 0.0)
    with pytest.raises(ValueError, match="unknown verifier 'nope'.*test.kv"):
        get_verifier("nope")
    register_verifier("test.number", lambda task, final: 0.25, overwrite=True)
    t = Task(id="n", domain="general", family="f", messages=(), verifier="test.number")
    assert run_verifier(t, FinalState(None)) == Verdict(0.25)
    with pytest.raises(ValueError, match="finite"):
        Verdict(float("nan"))


# --------------------------------------------------------------------------- episodes


def test_scripted_solver_solves_and_transcript_renders_in_xtml() -> None:
    env = make_kv_env()
    ep = run_episode_sync(kv_solver, env, kv_task(1))
    assert ep.verdict is not None and ep.verdict.reward == 1.0
    assert ep.verdict.components == {"writes": 1.0, "deletes": 1.0, "answer": 1.0}
    assert ep.turns == 6 and not ep.truncated and not ep.paused
    assert env.final_state().submission == {"answer": "seven-1"}
    assert ep.turn_info[-1]["env"]["end"] == "submit"
    from k3post.xtml import render_text  # imported here: the resume subprocess imports this module

    text = render_text(ep.messages, tools=ep.tools)
    assert text.count('role="tool"') == 6 and 'tool="submit"' in text


def test_verdict_comes_from_state_not_from_claims() -> None:
    liar = scripted([
        {"role": "assistant", "content": "I stored everything, deleted tmp, and x is seven-0.",
         "tool_calls": [{"id": "s", "function": {"name": "submit", "arguments": '{"answer": "wrong"}'}}]},
    ])
    ep = run_episode_sync(liar, make_kv_env(), kv_task(0))
    assert ep.verdict is not None and ep.verdict.components == {"writes": 0.0, "deletes": 0.0, "answer": 0.0}
    # a plain-text final answer is a submission of text, which this verifier rejects
    ep2 = run_episode_sync(scripted([{"role": "assistant", "content": "seven-0"}]), make_kv_env(), kv_task(0))
    assert ep2.turns == 1 and ep2.verdict is not None and ep2.verdict.reward == 0.0
    assert ep2.turn_info[0]["env"]["end"] == "answer"


def test_bad_calls_are_observations_and_the_episode_goes_on() -> None:
    policy = scripted([
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "nope", "arguments": "{}"}},
            {"id": "b", "function": {"name": "set", "arguments": "{not json"}},
            {"id": "c", "function": {"name": "set", "arguments": '{"key": "q"}'}},
            {"id": "d", "function": {"name": "get", "arguments": '{"key": "zz"}'}},
            {"id": "e", "function": {"name": "set", "arguments": '{"key": "q", "value": "1"}'}},
        ]},
    ])
    env = make_kv_env()
    ep = run_episode_sync(policy, env, kv_task(0))
    results = [m for m in ep.messages if m["role"] == "tool"]
    assert [r["tool_call_id"] for r in results] == ["a", "b", "c", "d", "e"]
    assert [r["content"].startswith("Error:") for r in results] == [True, True, True, True, False]
    calls = ep.turn_info[0]["harness"]["calls"]
    assert [c["error"] for c in calls] == ["unknown_tool", "bad_arguments", "schema", "handler", None]
    assert [c["route"] for c in calls] == ["error", "error", "error", "env", "env"]
    assert ep.turn_info[0]["harness"]["tool_errors"] == 4
    assert env.state["store"]["q"] == "1" and ep.turns == 2 and ep.final_answer == "done"


def test_limits_truncate_and_are_reported() -> None:
    looper = scripted([_call("get", {"key": "x"})] * 50)
    ep = run_episode_sync(looper, make_kv_env(EpisodeLimits(max_turns=3)), kv_task(0))
    assert ep.truncated and ep.truncation == "max_turns" and ep.turns == 3
    assert ep.verdict is not None and ep.turn_info[-1]["env"]["truncation"] == "max_turns"

    wordy = {"role": "assistant", "content": "word " * 40, "tool_calls": [{"id": "", "function": {"name": "get", "arguments": '{"key": "x"}'}}]}
    ep = run_episode_sync(scripted([wordy] * 10), make_kv_env(EpisodeLimits(max_turns=None, max_tokens=100)), kv_task(0))
    assert ep.truncation == "max_tokens" and ep.turns == 3  # 43 approx tokens per turn: 43, 86, 129 > 100

    counted = dict(wordy, num_tokens=60)
    ep = run_episode_sync(scripted([counted] * 10), make_kv_env(EpisodeLimits(max_turns=None, max_tokens=100)), kv_task(0))
    assert ep.truncation == "max_tokens" and ep.turns == 2  # the engine's count wins: 60, 120 > 100

    async def slow(messages: Any, tools: Any) -> dict[str, Any]:
        await asyncio.sleep(0.04)
        return _call("get", {"key": "x"})

    ep = run_episode_sync(slow, make_kv_env(EpisodeLimits(max_turns=None, max_wall_s=0.1)), kv_task(0))
    assert ep.truncation == "max_wall_time" and 1 <= ep.turns <= 3  # 3 on an idle machine: 0.04, 0.08, 0.12 > 0.1


def test_env_api_misuse_is_a_clear_error() -> None:
    env = make_kv_env()
    with pytest.raises(ValueError, match="before reset"):
        _run(env.step({"role": "assistant", "content": "x"}))
    with pytest.raises(ValueError, match="before reset"):
        env.verify()
    _run(env.reset(kv_task(0)))
    _run(env.step({"role": "assistant", "content": "x"}))
    with pytest.raises(ValueError, match="after the episode ended"):
        _run(env.step({"role": "assistant", "content": "y"}))
    with pytest.raises(ValueError, match="does not implement"):
        _run(env.reset(Task(id="t", domain="agents", family="f", messages=(), verifier="test.kv", tools=(ToolSpec("fly", "f"),))))
    with pytest.raises(ValueError, match="no handler"):
        ToolEnvironment([ToolSpec("x", "x")])
    runner = EpisodeRunner(make_kv_env())
    with pytest.raises(ValueError, match="before start"):
        runner.view()
    _run(runner.start(kv_task(0)))
    with pytest.raises(ValueError, match="takes an assistant message"):
        _run(runner.advance("hello"))  # type: ignore[arg-type]

    async def inside() -> None:
        with pytest.raises(ValueError, match="inside an event loop"):
            run_episode_sync(kv_solver, make_kv_env(), kv_task(0))

    _run(inside())


def test_end_on_text_false_nudges_instead_of_ending() -> None:
    env = ToolEnvironment(KV_TOOLS, initial_state=lambda t: {"store": dict(t.metadata["initial"])}, submit_tool="submit", end_on_text=False)
    policy = scripted([{"role": "assistant", "content": "hmm"}, _call("submit", {"answer": "seven-0"})])
    ep = run_episode_sync(policy, env, kv_task(0))
    assert [m["role"] for m in ep.messages[2:]] == ["assistant", "user", "assistant", "tool"]
    assert ep.messages[3]["content"].startswith("Continue working")
    assert ep.verdict is not None and ep.verdict.components["answer"] == 1.0


def test_task_tools_select_and_redescribe_env_tools() -> None:
    only = (ToolSpec("get", "Look up a key (custom wording).", KV_TOOLS[0].parameters, read_only=True),)
    task = Task(id="sel", domain="agents", family="kv", messages=kv_task(0).messages, verifier="test.kv",
                tools=only, metadata=kv_task(0).metadata)
    runner = EpisodeRunner(make_kv_env())
    _run(runner.start(task))
    _, tools = runner.view()
    assert [t["function"]["name"] for t in tools] == ["get", "submit"]  # the submit tool is always bound
    assert tools[0]["function"]["description"] == "Look up a key (custom wording)."


# --------------------------------------------------------------------------- pause / resume


def test_state_dict_roundtrip_in_process() -> None:
    env = make_kv_env()
    _run(env.reset(kv_task(2)))
    _run(env.step(_call("set", {"key": "n", "value": "v"})))
    sd = env.state_dict()
    assert json.loads(json.dumps(sd)) == sd
    fresh = make_kv_env()
    fresh.load_state_dict(sd)
    assert fresh.state == env.state and fresh.turns == 1 and fresh.task == env.task
    assert fresh.state is not env.state
    with pytest.raises(ValueError, match="cannot load into"):
        class Other(ToolEnvironment):
            pass

        Other(KV_TOOLS, submit_tool="submit").load_state_dict(sd)


class TallyState:
    """A state object that is not JSON: needs dump_state / load_state (as a Sandbox would)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n


def test_non_json_state_needs_dump_and_load() -> None:
    def bump(ctx: ToolContext) -> int:
        ctx.state.n += 1
        return ctx.state.n

    tools = [ToolSpec("bump", "Increment.", handler=bump)]
    plain = ToolEnvironment(tools, initial_state=lambda t: TallyState())
    _run(plain.reset(kv_task(0)))
    with pytest.raises(ValueError, match="not JSON-serialisable.*dump_state/load_state"):
        plain.state_dict()

    def make() -> ToolEnvironment:
        return ToolEnvironment(tools, initial_state=lambda t: TallyState(), dump_state=lambda c: {"n": c.n},
                               load_state=lambda d: TallyState(d["n"]))

    env = make()
    _run(env.reset(kv_task(0)))
    _run(env.step(_call("bump", {})))
    _run(env.step(_call("bump", {})))
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(env.state_dict())))
    result = _run(fresh.step(_call("bump", {})))
    assert result.messages[0]["content"] == "3" and fresh.turns == 3


def finish_from_checkpoint(path: str) -> None:
    """Subprocess entry point: resume the checkpoint in ``path`` and print the episode as JSON."""
    ckpt = json.loads(Path(path).read_text())
    ep = resume_episode_sync(kv_solver, make_kv_env(), ckpt)
    print(json.dumps(ep.to_dict()))


def test_pause_and_resume_in_a_fresh_process_gives_the_same_verdict(tmp_path: Path) -> None:
    task = kv_task(5)
    full = run_episode_sync(kv_solver, make_kv_env(), task)
    paused = run_episode_sync(kv_solver, make_kv_env(), task, pause_after=3)
    assert paused.paused and paused.verdict is None and paused.turns == 3
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps(paused.checkpoint))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_envs_core as t; "
        "t.finish_from_checkpoint(sys.argv[2])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(ckpt)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["verdict"] == full.verdict.to_dict() and resumed["verdict"]["reward"] == 1.0
    assert resumed["messages"] == full.messages
    assert resumed["turns"] == full.turns and resumed["checkpoint"] is None
    assert Task.from_dict(resumed["task"]).content_hash() == task.content_hash()


# --------------------------------------------------------------------------- OpenAI-compatible endpoint


def _ChatServer() -> ChatStub:
    """A tiny local OpenAI-compatible server: answers with the kv solver (HTTP 500 for model "broken")."""
    srv: ChatStub

    def reply(body: dict[str, Any]) -> tuple[int, Any]:
        if body["model"] == "broken":
            return 500, b"overloaded"
        out = kv_solver(body["messages"], body.get("tools", []))
        msg = {"role": "assistant", "content": out["content"], "reasoning_content": "thinking..."}
        msg["tool_calls"] = [dict(c, id=f"srv{len(srv.requests)}") for c in out["tool_calls"]]
        return 200, {"choices": [{"message": msg}], "usage": {"completion_tokens": 7}}

    srv = ChatStub(reply)
    return srv


def test_openai_policy_against_a_local_server() -> None:
    with _ChatServer() as srv:
        policy = OpenAIPolicy(srv.url, "tiny", api_key="sk-test", temperature=0.5)
        ep = run_episode_sync(policy, make_kv_env(), kv_task(7))
        assert ep.verdict is not None and ep.verdict.reward == 1.0
        first = srv.requests[0]
        assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test"
        assert first["body"]["model"] == "tiny" and first["body"]["temperature"] == 0.5
        assert [t["function"]["name"] for t in first["body"]["tools"]] == ["get", "set", "delete", "submit"]
        later = srv.requests[2]["body"]["messages"]
        assert all(isinstance(c["function"]["arguments"], str) for m in later if m["role"] == "assistant" for c in m["tool_calls"])
        assert all("reasoning_content" not in m for m in later)
        assert ep.messages[2]["reasoning_content"] == "thinking..." and ep.messages[2]["num_tokens"] == 7
        assert ep.messages[2]["tool_calls"][0]["id"] == "srv1"
        with pytest.raises(RuntimeError, match="HTTP 500: overloaded"):
            run_episode_sync(OpenAIPolicy(srv.url + "/v1/", "broken"), make_kv_env(), kv_task(0))
    with pytest.raises(ValueError, match="http"):
        OpenAIPolicy("localhost:8000", "m")


def test_to_openai_chat_folds_mid_session_tool_declares() -> None:
    extra = KV_TOOLS[2].to_openai()
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "reasoning_content": "r", "num_tokens": 3,
         "tool_calls": [{"id": "1", "function": {"name": "get", "arguments": {"key": "x"}}}]},
        {"role": "tool", "tool_call_id": "1", "name": "get", "content": "v"},
        {"role": "system", "type": "tool-declare", "tools": [extra]},
    ]
    out, tools = to_openai_chat(msgs, [KV_TOOLS[0].to_openai()])
    assert [t["function"]["name"] for t in tools] == ["get", "delete"]
    assert out == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get", "arguments": '{"key": "x"}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "v"},
    ]


# --------------------------------------------------------------------------- gym wrapper


def test_gym_wrapper_runs_an_episode_and_is_seeded() -> None:
    tasks = [kv_task(i) for i in range(5)]
    gym = GymEnv(make_kv_env(), tasks)
    try:
        obs, info = gym.reset(seed=11)
        first_id = info["task_id"]
        assert obs[-1]["role"] == "user" and [t["function"]["name"] for t in info["tools"]][-1] == "submit"
        rewards, terminated, truncated = [], False, False
        while not (terminated or truncated):
            obs, reward, terminated, truncated, info = gym.step(kv_solver(obs, info["tools"]))
            rewards.append(reward)
        assert rewards[:-1] == [0.0] * 5 and rewards[-1] == 1.0 and terminated and not truncated
        assert info["verdict"]["reward"] == 1.0
        with pytest.raises(ValueError, match="after the episode ended"):
            gym.step({"role": "assistant", "content": "x"})
        assert gym.reset(seed=11)[1]["task_id"] == first_id
        ids = {gym.reset()[1]["task_id"] for _ in range(20)}
        assert len(ids) > 1
    finally:
        gym.close()


def test_environment_base_requires_hooks() -> None:
    class Bare(Environment):
        pass

    with pytest.raises(NotImplementedError):
        _run(Bare().reset(kv_task(0)))
