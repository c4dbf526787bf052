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
is always kept.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from k3post.envs.env import Environment, EpisodeLimits, StepResult, count_tokens
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

MODULES: tuple[str, ...] = ("tool_interface", "system_prompt", "context", "skills", "memory", "subagents")
"""The harness modules, in the order `HarnessSampler` draws them."""

SYSTEM_PROMPT_PRESETS: dict[str, str] = {
    "none": "",
    "concise": "You are an agent. Use the tools to complete the task, then give a short final answer.",
    "careful": (
        "You are a careful autonomous agent working in a tool environment. Plan before acting, "
        "check the result of every tool call, and only finish when the task is verifiably done. "
        "Your work is judged by the final state of the environment, not by what you claim."
    ),
}
"""Named system-prompt texts a `SystemPromptConfig` can refer to with ``preset``."""


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class ToolInterfaceConfig:
    """How the env's tools are presented (the same tools under other names / schemas).

    Attributes:
        names: canonical tool name → presented name.
        arguments: canonical tool name → {canonical argument name → presented name}
            (top-level properties only).
        descriptions: canonical tool name → presented description.
        prefix: prepended to every tool name not listed in ``names`` (e.g. ``"fn_"``).
    """

    names: Mapping[str, str] = field(default_factory=dict)
    arguments: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    descriptions: Mapping[str, str] = field(default_factory=dict)
    prefix: str = ""


@dataclass(frozen=True)
class SystemPromptConfig:
    """The harness system prompt: ``SYSTEM_PROMPT_PRESETS[preset]`` then ``text`` (``{task_group}`` is filled in).

    Attributes:
        preset: a key of `SYSTEM_PROMPT_PRESETS`, or None.
        text: extra text.
    """

    preset: str | None = None
    text: str = ""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in SYSTEM_PROMPT_PRESETS:
            raise ValueError(f"unknown system prompt preset {self.preset!r}; known: {sorted(SYSTEM_PROMPT_PRESETS)}")


@dataclass(frozen=True)
class ContextConfig:
    """Context management: which part of the transcript the policy sees. All off by default.

    Applied in this order: observation masking, summarisation, sliding window.

    Attributes:
        mask_after_turns: keep tool results of the last N turns; older ones become ``placeholder``.
        placeholder: text replacing a masked tool result.
        summarize_over_tokens: when the transcript exceeds this many tokens (`count_tokens`),
            all turns but the last ``summary_keep_turns`` are replaced by one system message
            holding ``summarizer``'s summary of them.
        summary_keep_turns: turns kept verbatim after summarising.
        summarizer: name of a registered summariser (`SUMMARIZERS`); `Harness` also takes a callable.
        window_turns: keep only the last N turns (a system note says how many were left out).

    Tool-declare messages of dropped turns are always kept (moved before the kept turns).
    """

    mask_after_turns: int | None = None
    placeholder: str = "[tool output omitted to save context]"
    summarize_over_tokens: int | None = None
    summary_keep_turns: int = 2
    summarizer: str = "extractive"
    window_turns: int | None = None

    def __post_init__(self) -> None:
        for name in ("mask_after_turns", "summarize_over_tokens", "window_turns", "summary_keep_turns"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"ContextConfig.{name} must be a non-negative int{' or None' if name != 'summary_keep_turns' else ''}, got {v!r}")
        if self.window_turns == 0:
            raise ValueError("ContextConfig.window_turns must be at least 1 (the policy must see its last turn)")


@dataclass(frozen=True)
class SkillConfig:
    """One skill: a markdown document, loaded on demand, possibly unlocking env tools.

    Attributes:
        name: the skill name (what ``load_skill`` takes).
        description: one line, announced in the system prompt.
        body: the markdown returned by ``load_skill``.
        tools: canonical env tool names withheld until the skill is loaded.
    """

    name: str
    description: str
    body: str = ""
    tools: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9_.\-]+$", self.name):
            raise ValueError(f"skill name must be letters, digits, '_', '.', '-', got {self.name!r}")
        object.__setattr__(self, "tools", tuple(self.tools))


@dataclass(frozen=True)
class SkillsConfig:
    """Skills module.

    Attributes:
        enabled: offer ``load_skill`` and announce the skills.
        directory: a folder of ``*.md`` skill files (`load_skill_file` format), or None.
        skills: skills given inline (added to those of ``directory``).
    """

    enabled: bool = False
    directory: str | None = None
    skills: tuple[SkillConfig, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "skills", tuple(self.skills))


@dataclass(frozen=True)
class MemoryConfig:
    """Memory module: a ``notes`` tool persisting per task group.

    Attributes:
        enabled: offer the ``notes`` tool.
        path: JSON file backing the store (shared by processes, guarded by a file lock); None
            keeps the notes in the `Harness` object's memory.
        inject: also show the current notes in the system prompt.
        max_chars: longest notes text accepted.
    """

    enabled: bool = False
    path: str | None = None
    inject: bool = False
    max_chars: int = 8000


@dataclass(frozen=True)
class SubagentConfig:
    """Sub-agent module: a ``delegate`` tool running a nested episode on the same env state.

    Attributes:
        enabled: offer ``delegate``.
        max_turns: turn limit of a sub-agent episode.
        read_only: the sub-agent only gets the env's read-only tools.
        max_depth: nesting depth up to which ``delegate`` is offered (1: only the top agent delegates).
        harness: the sub-agent's harness (default: identity).
    """

    enabled: bool = False
    max_turns: int = 8
    read_only: bool = False
    max_depth: int = 1
    harness: "HarnessConfig | None" = None


@dataclass(frozen=True)
class HarnessConfig:
    """One harness: a config per module plus a name (for logs)."""

    name: str = "default"
    tool_interface: ToolInterfaceConfig = field(default_factory=ToolInterfaceConfig)
    system_prompt: SystemPromptConfig = field(default_factory=SystemPromptConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    skills: SkillsConfig = field(default_factory=SkillsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    subagents: SubagentConfig = field(default_factory=SubagentConfig)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (`from_dict` inverts it)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HarnessConfig":
        """Build from a (partial) dict; an unknown key is a ValueError naming it."""
        return _from_dict(cls, data, "harness")


def _from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from nested dicts, checking keys and nested dataclass types."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key '{where}.{unknown[0]}' (valid keys: {sorted(names)})")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        kwargs[key] = _convert(hints[key], value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from e


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if dataclasses.is_dataclass(a):
                return _from_dict(a, value, where)
        return value
    if origin is tuple and args and dataclasses.is_dataclass(args[0]):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_from_dict(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(value)
    return value


@dataclass(frozen=True)
class HarnessSpace:
    """Named variants per module and per-task-group weights over them (the sampler's config).

    Attributes:
        tool_interface ... subagents: variant name → module config; each module has a
            ``"default"`` variant (the identity config) unless overridden.
        groups: task group → module → {variant name → weight}. Group ``"*"`` applies to
            groups not listed; a module without weights uses its ``"default"`` variant.
    """

    tool_interface: Mapping[str, ToolInterfaceConfig] = field(default_factory=dict)
    system_prompt: Mapping[str, SystemPromptConfig] = field(default_factory=dict)
    context: Mapping[str, ContextConfig] = field(default_factory=dict)
    skills: Mapping[str, SkillsConfig] = field(default_factory=dict)
    memory: Mapping[str, MemoryConfig] = field(default_factory=dict)
    subagents: Mapping[str, SubagentConfig] = field(default_factory=dict)
    groups: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(HarnessConfig)
        for module in MODULES:
            variants = dict(getattr(self, module))
            cls = hints[module]
            for vname, cfg in variants.items():
                if not isinstance(cfg, cls):
                    raise ValueError(f"HarnessSpace.{module}[{vname!r}] must be a {cls.__name__}, got {type(cfg).__name__}")
            variants.setdefault("default", cls())
            object.__setattr__(self, module, variants)
        for group, modules in self.groups.items():
            for module, weights in modules.items():
                if module not in MODULES:
                    raise ValueError(f"HarnessSpace.groups[{group!r}]: unknown module {module!r} (modules: {MODULES})")
                variants = getattr(self, module)
                if not weights:
                    raise ValueError(f"HarnessSpace.groups[{group!r}][{module!r}]: no variants given")
                for vname, w in weights.items():
                    if vname not in variants:
                        raise ValueError(
                            f"HarnessSpace.groups[{group!r}][{module!r}]: unknown variant {vname!r} "
                            f"(known: {sorted(variants)})"
                        )
                    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                        raise ValueError(f"HarnessSpace.groups[{group!r}][{module!r}][{vname!r}]: weight must be >= 0, got {w!r}")
                if sum(weights.values()) <= 0:
                    raise ValueError(f"HarnessSpace.groups[{group!r}][{module!r}]: weights sum to 0")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HarnessSpace":
        """Build from nested dicts (e.g. a YAML section); unknown keys are errors."""
        if not isinstance(data, Mapping):
            raise ValueError("harness space: expected a mapping")
        allowed = set(MODULES) | {"groups"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"harness space: unknown key {unknown[0]!r} (valid keys: {sorted(allowed)})")
        hints = typing.get_type_hints(HarnessConfig)
        kwargs: dict[str, Any] = {"groups": data.get("groups", {})}
        for module in MODULES:
            kwargs[module] = {
                name: _from_dict(hints[module], cfg, f"harness_space.{module}.{name}")
                for name, cfg in (data.get(module) or {}).items()
            }
        return cls(**kwargs)


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


# --------------------------------------------------------------------------- skills


def load_skill_file(path: str | os.PathLike[str]) -> SkillConfig:
    """Read a markdown skill file.

    Optional front matter between ``---`` lines gives ``name``, ``description`` and
    ``tools`` (comma-separated canonical tool names); the rest is the body. Without a
    name the file stem is used, without a description the body's first non-empty line.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"skill file not found: {p}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not valid UTF-8 at byte {e.start}") from None
    meta: dict[str, str] = {}
    body = text
    if text.startswith("---"):
        end = text.find("\n---", 3)
        if end < 0:
            raise ValueError(f"{p}: front matter opened with '---' is never closed")
        for line in text[3:end].strip().splitlines():
            if not line.strip():
                continue
            if ":" not in line:
                raise ValueError(f"{p}: front matter line {line!r} is not 'key: value'")
            k, v = line.split(":", 1)
            meta[k.strip()] = v.strip()
        body = text[end + 4 :].lstrip("\n")
        unknown = set(meta) - {"name", "description", "tools"}
        if unknown:
            raise ValueError(f"{p}: unknown front matter keys {sorted(unknown)} (valid: name, description, tools)")
    first = next((ln.strip().lstrip("#").strip() for ln in body.splitlines() if ln.strip()), "")
    tools = tuple(t.strip() for t in meta.get("tools", "").split(",") if t.strip())
    return SkillConfig(meta.get("name", p.stem), meta.get("description", first), body.strip(), tools)


def load_skills_dir(directory: str | os.PathLike[str]) -> list[SkillConfig]:
    """All ``*.md`` skills of a folder, sorted by file name."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"skills directory not found: {d}")
    return [load_skill_file(p) for p in sorted(d.glob("*.md"))]


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
