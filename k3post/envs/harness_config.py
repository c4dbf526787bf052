"""The harness's configuration (`k3post.envs.harness`): one frozen config per module (`ToolInterfaceConfig`,
`SystemPromptConfig`, `ContextConfig`, `SkillsConfig` with its `SkillConfig` files, `MemoryConfig`,
`SubagentConfig`), `HarnessConfig` that bundles them, read from nested dicts with errors naming the key, and
`HarnessSampler`, which draws a config per episode from named variants (`HarnessSpace`).

Shape legend: none.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
