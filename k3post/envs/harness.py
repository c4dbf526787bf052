"""The white-box harness (report §4.2, SPEC §3.5): what sits between a policy and an environment.

A harness is a composition of six modules, each a small frozen config:

==================  ========================================================================
module              what it changes
==================  ========================================================================
tool_interface      the names, argument names and descriptions under which the env's tools
                    are presented (`ToolInterfaceConfig`); calls are mapped back to the
                    env's canonical tools.
system_prompt       a system-prompt text prepended to the task's prompt (`SystemPromptConfig`).
context             what part of the transcript the policy sees each turn
                    (`ContextConfig`): everything, a sliding window of the last N turns,
                    old tool results masked by a placeholder, or old turns replaced by a
                    summary once the transcript is over a token budget.
skills              markdown skills announced in the system prompt and loaded on demand with
                    a ``load_skill`` tool; a skill may unlock env tools, which are then
                    declared with an XTML input option message
                    ``{"role": "system", "type": "tool-declare", "tools": [...]}`` (`SkillsConfig`).
memory              a ``notes`` tool whose text persists across the episodes of a task group
                    (`MemoryConfig`, `MemoryStore`, optionally a JSON file).
subagents           a ``delegate`` tool that runs a nested episode on the same env state with
                    its own harness and policy and returns its final answer (`SubagentConfig`).
==================  ========================================================================

`HarnessConfig` bundles one config per module; `Harness(config)` is reusable
across episodes and `Harness.apply(task, env, policy)` gives the per-episode
`AppliedHarness` that `k3post.envs.episode.EpisodeRunner` drives. `HarnessSampler`
draws a `HarnessConfig` per episode from per-task-group weights over named
variants (`HarnessSpace`), deterministically from (seed, task, episode index), so
a policy does not overfit one harness.

"Turn" below means an assistant message with the tool results and user messages
that follow it; the *preamble* (everything before the first assistant message)
is always kept. The configs live in `k3post.envs.harness_config` (all importable from here).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from k3post.envs.env import Environment, EpisodeLimits, StepResult, count_tokens
from k3post.envs.harness_config import (
    MODULES,
    SYSTEM_PROMPT_PRESETS,
    ContextConfig,
    HarnessConfig,
    HarnessSpace,
    MemoryConfig,
    SkillConfig,
    SkillsConfig,
    SubagentConfig,
    SystemPromptConfig,
    ToolInterfaceConfig,
    load_skill_file,
    load_skills_dir,
)
from k3post.envs.task import Task
from k3post.envs.tools import (
    ToolContext,
    ToolSpec,
    call_tool,
    parse_arguments,
    tool_call_parts,
    tool_message,
    validate_arguments,
)
from k3post.io import atomic_write

__all__ = [
    "MODULES",
    "SYSTEM_PROMPT_PRESETS",
    "ToolInterfaceConfig",
    "SystemPromptConfig",
    "ContextConfig",
    "SkillConfig",
    "SkillsConfig",
    "MemoryConfig",
    "SubagentConfig",
    "HarnessConfig",
    "HarnessSpace",
    "HarnessSampler",
    "Harness",
    "AppliedHarness",
    "HarnessStep",
    "MemoryStore",
    "ToolAliaser",
    "Summarizer",
    "SUMMARIZERS",
    "register_summarizer",
    "extractive_summary",
    "apply_context",
    "load_skill_file",
    "load_skills_dir",
]

# --------------------------------------------------------------------------- sampling


class HarnessSampler:
    """Draws a `HarnessConfig` per episode from a `HarnessSpace`.

    The draw is a pure function of (seed, task group, task id, episode index), so it
    does not depend on the order episodes are sampled in, and a resumed run draws the
    same harnesses.
    """

    def __init__(self, space: HarnessSpace, seed: int = 0) -> None:
        """Args: space: the variants and weights; seed: the sampler seed."""
        if not isinstance(space, HarnessSpace):
            raise ValueError(f"space must be a HarnessSpace, got {type(space).__name__}")
        self.space = space
        self.seed = seed
        self._stores: dict[str | None, MemoryStore] = {}

    def variants(self, task: Task, episode: int = 0) -> dict[str, str]:
        """The variant name drawn for each module."""
        key = f"{self.seed}\0{task.task_group}\0{task.id}\0{episode}".encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
        groups = self.space.groups
        chosen: dict[str, str] = {}
        for module in MODULES:
            weights = (groups.get(task.task_group) or {}).get(module) or (groups.get("*") or {}).get(module)
            if not weights:
                chosen[module] = "default"
                continue
            names = sorted(weights)
            total = sum(weights[n] for n in names)
            x = rng.random() * total
            pick = names[-1]
            for n in names:
                x -= weights[n]
                if x < 0 and weights[n] > 0:
                    pick = n
                    break
            chosen[module] = pick
        return chosen

    def sample(self, task: Task, episode: int = 0) -> HarnessConfig:
        """The `HarnessConfig` for episode ``episode`` of ``task``."""
        chosen = self.variants(task, episode)
        parts = {m: getattr(self.space, m)[v] for m, v in chosen.items()}
        name = ",".join(f"{m}={v}" for m, v in chosen.items())
        return HarnessConfig(name=name, **parts)

    def harness(self, task: Task, episode: int = 0, *, subagent_policy: Callable[..., Any] | None = None) -> "Harness":
        """A `Harness` for this episode; memory stores are shared across episodes (one per path)."""
        cfg = self.sample(task, episode)
        store = None
        if cfg.memory.enabled:
            store = self._stores.get(cfg.memory.path)
            if store is None:
                store = self._stores[cfg.memory.path] = MemoryStore(cfg.memory.path)
        return Harness(cfg, memory=store, subagent_policy=subagent_policy)


# --------------------------------------------------------------------------- memory


class MemoryStore:
    """Notes keyed by task group, in memory or in a JSON file (``{group: text}``).

    With a path, every read reloads the file and every write is a locked
    read-modify-write followed by an atomic replace, so concurrent episodes in other
    processes see each other's notes.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        """Args: path: the JSON file (created on first write), or None for an in-memory store."""
        self.path = Path(path) if path is not None else None
        self._data: dict[str, str] = {}
        if self.path is not None:
            self._data = self._read()

    def _read(self) -> dict[str, str]:
        assert self.path is not None
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"memory file {self.path} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"memory file {self.path} must hold a JSON object of strings")
        return data

    def get(self, group: str) -> str:
        """The notes of ``group`` ("" if none)."""
        if self.path is not None:
            self._data = self._read()
        return self._data.get(group, "")

    def set(self, group: str, text: str) -> None:
        """Replace the notes of ``group``."""
        if self.path is None:
            self._data[group] = text
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):
            self._data = self._read()
            self._data[group] = text
            atomic_write(self.path, json.dumps(self._data, ensure_ascii=False, sort_keys=True, indent=1))

    def groups(self) -> list[str]:
        """Groups with notes."""
        if self.path is not None:
            self._data = self._read()
        return sorted(self._data)


# --------------------------------------------------------------------------- context management

Summarizer = Callable[[list[dict[str, Any]]], str]
"""``summarizer(messages) -> text``: a summary of the turns being dropped."""


def _first_line(text: Any, limit: int) -> str:
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    line = next((ln.strip() for ln in s.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def extractive_summary(messages: list[dict[str, Any]], max_chars: int = 100) -> str:
    """A deterministic extractive summary: one line per call, result and message.

    Each assistant tool call becomes ``- called NAME(ARGS)``, each tool result
    ``  -> FIRST LINE``, each other message ``- ROLE: FIRST LINE`` (lines cut to
    ``max_chars``).
    """
    lines: list[str] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            if isinstance(m.get("content"), str) and m["content"].strip():
                lines.append(f"- assistant: {_first_line(m['content'], max_chars)}")
            for c in m.get("tool_calls") or []:
                try:
                    name, _, raw = tool_call_parts(c)
                except ValueError:
                    continue
                args = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, sort_keys=True)
                lines.append(f"- called {name}({_first_line(args, max_chars)})")
        elif role == "tool":
            lines.append(f"  -> {_first_line(m.get('content', ''), max_chars)}")
        elif role in ("user", "system") and m.get("type") is None:
            lines.append(f"- {role}: {_first_line(m.get('content', ''), max_chars)}")
    return "\n".join(lines)


SUMMARIZERS: dict[str, Summarizer] = {"extractive": extractive_summary}
"""Summarisers by name (`ContextConfig.summarizer`)."""


def register_summarizer(name: str, fn: Summarizer) -> None:
    """Register a summariser under ``name`` (e.g. one that calls a model)."""
    if not isinstance(name, str) or not name or not callable(fn):
        raise ValueError("register_summarizer needs a non-empty name and a callable")
    SUMMARIZERS[name] = fn


def _is_declare(m: Mapping[str, Any]) -> bool:
    from k3post.xtml import is_tool_declaration  # here: the envs import no tokenizer stack

    return is_tool_declaration(m)


def _split_turns(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    preamble: list[dict[str, Any]] = []
    turns: list[list[dict[str, Any]]] = []
    for m in messages:
        if m.get("role") == "assistant":
            turns.append([m])
        elif turns:
            turns[-1].append(m)
        else:
            preamble.append(m)
    return preamble, turns


def apply_context(
    messages: Sequence[dict[str, Any]],
    config: ContextConfig,
    summarizer: Summarizer | None = None,
) -> list[dict[str, Any]]:
    """The view of ``messages`` under ``config`` (a new list; the input is not modified)."""
    preamble, turns = _split_turns(copy.deepcopy(list(messages)))
    hoisted: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    n = config.mask_after_turns
    if n is not None:
        old = turns[: len(turns) - n] if n > 0 else turns
        for turn in old:
            for m in turn:
                if m.get("role") == "tool":
                    m["content"] = config.placeholder
    limit = config.summarize_over_tokens
    if limit is not None and sum(count_tokens(m) for m in preamble + [x for t in turns for x in t]) > limit:
        k = config.summary_keep_turns
        cut = max(len(turns) - k, 0)
        dropped = [m for t in turns[:cut] for m in t]
        if dropped:
            fn = summarizer or SUMMARIZERS[config.summarizer]
            hoisted += [m for m in dropped if _is_declare(m)]
            summary = fn([m for m in dropped if not _is_declare(m)])
            notes.append({"role": "system", "content": f"Summary of the {cut} earlier turn(s):\n{summary}"})
            turns = turns[cut:]
    w = config.window_turns
    if w is not None and len(turns) > w:
        cut = len(turns) - w
        hoisted += [m for t in turns[:cut] for m in t if _is_declare(m)]
        notes.append({"role": "system", "content": f"[{cut} earlier turn(s) omitted]"})
        turns = turns[cut:]
    return preamble + hoisted + notes + [m for t in turns for m in t]


# --------------------------------------------------------------------------- tool interface


class ToolAliaser:
    """Maps canonical tool / argument names to presented ones and back (`ToolInterfaceConfig`)."""

    def __init__(self, config: ToolInterfaceConfig, canonical: Sequence[str]) -> None:
        """Args: config: the tool interface; canonical: every canonical tool name in play."""
        self.config = config
        self.to_presented: dict[str, str] = {}
        for c in canonical:
            self.to_presented[c] = config.names.get(c, config.prefix + c)
        self.to_canonical: dict[str, str] = {}
        for c, p in self.to_presented.items():
            if p in self.to_canonical:
                raise ValueError(f"tool interface: tools {self.to_canonical[p]!r} and {c!r} are both presented as {p!r}")
            self.to_canonical[p] = c
        for c, amap in config.arguments.items():
            if len(set(amap.values())) != len(amap):
                raise ValueError(f"tool interface: two arguments of {c!r} are presented under the same name")

    def name(self, canonical: str) -> str:
        """Presented name of a canonical tool."""
        return self.to_presented.get(canonical, canonical)

    def canonical(self, presented: str) -> str | None:
        """Canonical name of a presented tool name, or None if no tool is presented so."""
        return self.to_canonical.get(presented)

    def spec(self, spec: ToolSpec) -> ToolSpec:
        """The presented form of a canonical spec (renamed tool and arguments, new description)."""
        amap = dict(self.config.arguments.get(spec.name, {}))
        params = copy.deepcopy(dict(spec.parameters))
        props = params.get("properties")
        if isinstance(props, dict) and amap:
            params["properties"] = {amap.get(k, k): v for k, v in props.items()}
        if isinstance(params.get("required"), list) and amap:
            params["required"] = [amap.get(k, k) for k in params["required"]]
        desc = self.config.descriptions.get(spec.name, spec.description)
        return ToolSpec(self.name(spec.name), desc, params, spec.read_only, spec.handler)

    def args_to_canonical(self, canonical: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Presented argument names → canonical ones (unknown names pass through)."""
        back = {p: c for c, p in self.config.arguments.get(canonical, {}).items()}
        return {back.get(k, k): v for k, v in args.items()}

    def args_to_presented(self, canonical: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Canonical argument names → presented ones."""
        fwd = self.config.arguments.get(canonical, {})
        return {fwd.get(k, k): v for k, v in args.items()}


# --------------------------------------------------------------------------- harness


@dataclass
class HarnessStep:
    """One turn through the harness.

    Attributes:
        reply: the assistant message as recorded in the transcript (call ids filled in).
        messages: messages that follow it (tool results in call order, env user turns,
            tool-declare messages for tools a skill unlocked), in presented names.
        result: the environment's `StepResult`.
        info: harness-side details: per call where it went, skills loaded, sub-agent episodes.
    """

    reply: dict[str, Any]
    messages: list[dict[str, Any]]
    result: StepResult
    info: dict[str, Any]


class Harness:
    """A harness configuration with its resources (skills, memory store, summariser).

    Reusable across episodes; `apply` gives the per-episode `AppliedHarness`.
    """

    def __init__(
        self,
        config: HarnessConfig | None = None,
        *,
        memory: MemoryStore | None = None,
        summarizer: Summarizer | None = None,
        subagent_policy: Callable[..., Any] | None = None,
        depth: int = 0,
    ) -> None:
        """Args:
            config: the configuration (default: the identity harness).
            memory: the notes store (default: one opened from ``config.memory.path``, or in memory).
            summarizer: overrides ``config.context.summarizer``.
            subagent_policy: policy of sub-agents (default: the episode's policy).
            depth: nesting depth (0 for a top-level agent).
        """
        self.config = config or HarnessConfig()
        if not isinstance(self.config, HarnessConfig):
            raise ValueError(f"config must be a HarnessConfig, got {type(self.config).__name__}")
        if summarizer is None and self.config.context.summarizer not in SUMMARIZERS:
            raise ValueError(
                f"unknown summarizer {self.config.context.summarizer!r}; registered: {sorted(SUMMARIZERS)}"
            )
        self.summarizer = summarizer or SUMMARIZERS[self.config.context.summarizer]
        skills: dict[str, SkillConfig] = {}
        if self.config.skills.enabled:
            found = list(load_skills_dir(self.config.skills.directory)) if self.config.skills.directory else []
            for s in found + list(self.config.skills.skills):
                if s.name in skills:
                    raise ValueError(f"two skills are named {s.name!r}")
                skills[s.name] = s
        self.skills = skills
        self.memory = memory if memory is not None else (MemoryStore(self.config.memory.path) if self.config.memory.enabled else None)
        self.subagent_policy = subagent_policy
        self.depth = depth

    def apply(self, task: Task, env: Environment, policy: Callable[..., Any] | None = None,
              run_episode: Callable[..., Any] | None = None) -> "AppliedHarness":
        """The harness for one episode of ``task`` on ``env`` (call after ``env.reset``). ``run_episode``: the
        coroutine function that runs a sub-agent's episode (`k3post.envs.episode.run_episode`, which the episode
        runner passes in: the harness sits below the runner and does not import it); without it a delegation is
        refused with an error the policy sees."""
        return AppliedHarness(self, task, env, policy, run_episode)


_SKILL_TOOL = "load_skill"
_NOTES_TOOL = "notes"
_DELEGATE_TOOL = "delegate"


class AppliedHarness:
    """A harness applied to one episode: presented tools, the policy's view, call routing."""

    def __init__(self, harness: Harness, task: Task, env: Environment, policy: Callable[..., Any] | None,
                 run_episode: Callable[..., Any] | None = None) -> None:
        """Build the presented tool set; see `Harness.apply`."""
        self.harness = harness
        self._run_episode = run_episode
        self.cfg = harness.config
        self.task = task
        self.env = env
        self.policy = policy
        self.env_tools: dict[str, ToolSpec] = {t.name: t for t in env.tool_specs()}
        gated = {t for s in harness.skills.values() for t in s.tools if t in self.env_tools}
        self.offered: list[str] = [n for n in self.env_tools if n not in gated]
        self.loaded_skills: list[str] = []
        self.delegations = 0
        self._declare: list[str] = []
        self._subagent_episodes: list[dict[str, Any]] = []
        self._skills_loaded_now: list[str] = []
        local: list[ToolSpec] = []
        if harness.skills:
            local.append(
                ToolSpec(
                    _SKILL_TOOL,
                    "Load a skill: returns its instructions and makes the tools it describes available.",
                    {
                        "type": "object",
                        "properties": {"name": {"type": "string", "enum": sorted(harness.skills), "description": "the skill to load"}},
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                    read_only=True,
                    handler=self._load_skill,
                )
            )
        if harness.memory is not None:
            local.append(
                ToolSpec(
                    _NOTES_TOOL,
                    "Your persistent notes for this kind of task, kept across episodes. "
                    "action='read' returns them, 'write' replaces them with text, 'append' adds text.",
                    {
                        "type": "object",
                        "properties": {
                            "action": {"type": "string", "enum": ["read", "write", "append"]},
                            "text": {"type": "string"},
                        },
                        "required": ["action"],
                        "additionalProperties": False,
                    },
                    handler=self._notes,
                )
            )
        sub = self.cfg.subagents
        if sub.enabled and harness.depth < sub.max_depth and type(env).subagent_env is not Environment.subagent_env:
            local.append(
                ToolSpec(
                    _DELEGATE_TOOL,
                    "Delegate a self-contained subtask to a sub-agent that can use the same tools; "
                    "returns the sub-agent's final answer.",
                    {
                        "type": "object",
                        "properties": {"task": {"type": "string", "description": "complete instructions for the sub-agent"}},
                        "required": ["task"],
                        "additionalProperties": False,
                    },
                    handler=self._delegate,
                )
            )
        self.local: dict[str, ToolSpec] = {t.name: t for t in local}
        clash = sorted(set(self.local) & set(self.env_tools))
        if clash:
            raise ValueError(f"environment tools {clash} clash with harness tools; rename them with the tool interface")
        self.alias = ToolAliaser(self.cfg.tool_interface, list(self.env_tools) + list(self.local))
        self.presented: dict[str, ToolSpec] = {n: self.alias.spec(t) for n, t in {**self.env_tools, **self.local}.items()}
        self.tools: list[dict[str, Any]] = [self.presented[n].to_openai() for n in self.offered + list(self.local)]

    # ------------------------------------------------------------------ messages

    def _system_text(self) -> str:
        parts: list[str] = []
        sp = self.cfg.system_prompt
        base = SYSTEM_PROMPT_PRESETS[sp.preset] if sp.preset else ""
        for t in (base, sp.text):
            if t:
                parts.append(t.replace("{task_group}", self.task.task_group))
        if self.harness.skills:
            lines = [f"- {s.name}: {s.description}" for s in self.harness.skills.values()]
            parts.append(
                f"Skills are available. Load one with the `{self.alias.name(_SKILL_TOOL)}` tool before relying on it:\n"
                + "\n".join(lines)
            )
        if self.harness.memory is not None:
            text = f"You keep persistent notes across tasks of this kind with the `{self.alias.name(_NOTES_TOOL)}` tool."
            if self.cfg.memory.inject:
                notes = self.harness.memory.get(self.task.task_group)
                text += "\nYour current notes:\n" + (notes or "(empty)")
            parts.append(text)
        if _DELEGATE_TOOL in self.local:
            parts.append(f"You can hand self-contained subtasks to a sub-agent with `{self.alias.name(_DELEGATE_TOOL)}`.")
        return "\n\n".join(parts)

    def present_message(self, m: Mapping[str, Any]) -> dict[str, Any]:
        """A canonical message (tool calls, tool results) in presented names."""
        out = copy.deepcopy(dict(m))
        if out.get("role") == "assistant" and out.get("tool_calls"):
            calls = []
            for c in out["tool_calls"]:
                name, cid, raw = tool_call_parts(c)
                try:
                    args: Any = self.alias.args_to_presented(name, parse_arguments(raw))
                except ValueError:
                    args = raw
                fn = {"name": self.alias.name(name), "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}
                calls.append({"id": cid, "type": "function", "function": fn})
            out["tool_calls"] = calls
        if out.get("role") == "tool" and isinstance(out.get("name"), str):
            out["name"] = self.alias.name(out["name"])
        return out

    def initial_messages(self, env_messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The transcript's start: the harness system prompt merged with the task's, names presented."""
        msgs = [self.present_message(m) for m in env_messages]
        text = self._system_text()
        if text:
            if msgs and msgs[0].get("role") == "system" and msgs[0].get("type") is None and isinstance(msgs[0].get("content"), str):
                msgs[0]["content"] = text + "\n\n" + msgs[0]["content"]
            else:
                msgs.insert(0, {"role": "system", "content": text})
        return msgs

    def view(self, history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the policy sees this turn (context management applied)."""
        c = self.cfg.context
        if c.mask_after_turns is None and c.summarize_over_tokens is None and c.window_turns is None:
            return list(history)
        return apply_context(history, c, self.harness.summarizer)

    # ------------------------------------------------------------------ calls

    def _available(self) -> list[str]:
        return sorted(self.alias.name(n) for n in self.offered + list(self.local))

    def _route(self, call: dict[str, Any]) -> tuple[str, Any, str | None]:
        """``(route, payload, error kind)`` for one presented call: route ``"env"`` or ``"local"``
        with the canonical call, or ``"error"`` with the error observation."""
        name, cid, raw = tool_call_parts(call)
        canon = self.alias.canonical(name)
        if canon is None or (canon not in self.local and canon not in self.offered):
            msg = f"Error: unknown tool {name!r}. Available tools: {', '.join(self._available())}."
            return "error", tool_message(cid, name, msg), "unknown_tool"
        try:
            args = parse_arguments(raw)
        except ValueError as e:
            return "error", tool_message(cid, name, f"Error: tool {name!r}: {e}."), "bad_arguments"
        reason = validate_arguments(self.presented[canon], args)
        if reason is not None:
            return "error", tool_message(cid, name, f"Error: invalid arguments for tool {name!r}: {reason}."), "schema"
        cargs = self.alias.args_to_canonical(canon, args)
        ccall = {"id": cid, "type": "function", "function": {"name": canon, "arguments": json.dumps(cargs, ensure_ascii=False)}}
        return ("local" if canon in self.local else "env"), ccall, None

    async def step(self, reply: dict[str, Any], turn: int) -> HarnessStep:
        """Route one assistant message: env calls to the env (one `Environment.step`), harness
        calls to the harness tools, bad calls to error observations; results in call order."""
        reply = copy.deepcopy(reply)
        reply.setdefault("role", "assistant")
        raw_calls = reply.get("tool_calls") or []
        if not isinstance(raw_calls, (list, tuple)):
            raise ValueError("assistant message: tool_calls must be a list")
        calls: list[dict[str, Any]] = []
        for i, c in enumerate(raw_calls):
            c = dict(c) if isinstance(c, Mapping) else {"function": {}}
            if not isinstance(c.get("id"), str) or not c["id"]:
                c["id"] = f"call_{turn}_{i}"
            c.setdefault("type", "function")
            calls.append(c)
        if calls:
            reply["tool_calls"] = calls
        else:
            reply.pop("tool_calls", None)
        routes: list[tuple[str, Any, str | None]] = []
        for c in calls:
            try:
                routes.append(self._route(c))
            except ValueError as e:
                routes.append(("error", tool_message(c["id"], "unknown", f"Error: malformed tool call: {e}."), "unknown_tool"))
        env_calls = [r[1] for r in routes if r[0] == "env"]
        env_msg = {k: copy.deepcopy(v) for k, v in reply.items() if k not in ("tool_calls", "num_tokens")}
        env_msg["num_tokens"] = self.env.count_tokens(reply)
        if env_calls:
            env_msg["tool_calls"] = env_calls
        result = await self.env.step(env_msg, external_calls=len(calls) - len(env_calls))
        by_id = {m.get("tool_call_id"): m for m in result.messages if m.get("role") == "tool"}
        env_errors = {env_calls[e["call"]]["id"]: e["kind"] for e in result.info.get("tool_errors", []) if "call" in e}
        others = [self.present_message(m) for m in result.messages if m.get("role") != "tool"]
        self._subagent_episodes, self._skills_loaded_now = [], []
        out: list[dict[str, Any]] = []
        where: list[dict[str, Any]] = []
        ctx = ToolContext(None, self.task, self.env, "")
        for (kind, payload, error), c in zip(routes, calls):
            presented = (c.get("function") or {}).get("name")
            if kind == "error":
                out.append(payload)
            elif kind == "env":
                m = by_id.get(payload["id"])
                assert m is not None, f"environment returned no result for call {payload['id']!r}"
                out.append(self.present_message(m))
                error = env_errors.get(payload["id"])
            else:
                outcome = await call_tool(payload, self.local, ctx)
                out.append(self.present_message(outcome.message))
                error = outcome.error
            where.append({"tool": presented, "route": kind, "error": error})
        out += others
        if self._declare:
            out.append({"role": "system", "type": "tool-declare", "tools": [self.presented[n].to_openai() for n in self._declare]})
            self._declare = []
        info: dict[str, Any] = {"calls": where, "tool_errors": sum(w["error"] is not None for w in where)}
        if self._skills_loaded_now:
            info["skills_loaded"] = list(self._skills_loaded_now)
        if self._subagent_episodes:
            info["subagent_episodes"] = list(self._subagent_episodes)
        return HarnessStep(reply, out, result, info)

    # ------------------------------------------------------------------ harness tools

    def _load_skill(self, ctx: ToolContext, name: str) -> str:
        skill = self.harness.skills[name]
        if name in self.loaded_skills:
            return f"Skill {name!r} is already loaded.\n\n{skill.body}"
        self.loaded_skills.append(name)
        self._skills_loaded_now.append(name)
        new = [t for t in skill.tools if t in self.env_tools and t not in self.offered]
        self.offered.extend(new)
        self._declare.extend(new)
        text = f"# Skill: {name}\n\n{skill.body}"
        if new:
            text += "\n\nTools now available: " + ", ".join(self.alias.name(t) for t in new) + "."
        return text

    def _notes(self, ctx: ToolContext, action: str, text: str = "") -> str:
        store = self.harness.memory
        assert store is not None
        group = self.task.task_group
        if action == "read":
            return store.get(group) or "(no notes yet)"
        new = text if action == "write" else (store.get(group) + ("\n" if store.get(group) else "") + text)
        if len(new) > self.cfg.memory.max_chars:
            raise ValueError(f"notes would be {len(new)} characters; the limit is {self.cfg.memory.max_chars}")
        store.set(group, new)
        return f"Notes saved ({len(new)} characters)."

    async def _delegate(self, ctx: ToolContext, task: str) -> str:
        run_episode = self._run_episode
        if run_episode is None:
            raise ValueError("sub-agents need the episode runner (Harness.apply(..., run_episode=...))")
        sub = self.cfg.subagents
        policy = self.harness.subagent_policy or self.policy
        if policy is None:
            raise ValueError("no policy is available to run a sub-agent")
        env = self.env.subagent_env(EpisodeLimits(max_turns=sub.max_turns), read_only=sub.read_only)
        if env is None:
            raise ValueError("this environment does not support sub-agents")
        self.delegations += 1
        sub_task = Task(
            id=f"{self.task.id}/sub{self.delegations}",
            domain=self.task.domain,
            family=self.task.family,
            messages=({"role": "user", "content": task},),
            verifier=self.task.verifier,
            metadata=self.task.metadata,
            group=self.task.group,
        )
        harness = Harness(sub.harness or HarnessConfig(), summarizer=self.harness.summarizer,
                          subagent_policy=self.harness.subagent_policy, depth=self.harness.depth + 1)
        ep = await run_episode(policy, env, sub_task, harness, verify=False)
        self._subagent_episodes.append(ep.to_dict())
        answer = ep.final_answer or ""
        if ep.truncated:
            return f"The sub-agent stopped ({ep.truncation}) after {ep.turns} turns without finishing. Last message: {answer}"
        return answer

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """JSON-able per-episode harness state (offered tools, loaded skills, delegation count)."""
        return {"offered": list(self.offered), "loaded_skills": list(self.loaded_skills), "delegations": self.delegations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output."""
        unknown = [n for n in state["offered"] if n not in self.env_tools]
        if unknown:
            raise ValueError(f"harness state offers tools {unknown} that the environment does not have")
        self.offered = list(state["offered"])
        self.loaded_skills = list(state["loaded_skills"])
        self.delegations = int(state["delegations"])
