"""Tasks, verdicts and the verifier registry.

A `Task` is pure data (JSON-serialisable, hashable): what the model is asked
(prompt messages and the tools it is offered) plus what only the verifier may
see (``metadata``). It names its verifier by a registered string, so a task
written to disk by one process is verified by another.

A task family registers its verifier once, at import time::

    @register_verifier("kv.store")
    def verify_store(task: Task, final: FinalState) -> Verdict:
        want = task.metadata["expected"]
        ok = sum(final.state["store"].get(k) == v for k, v in want.items())
        return Verdict(ok / len(want), {"keys": ok / len(want)}, f"{ok}/{len(want)} keys right")

A verifier reads the **final environment state** (`FinalState`), never the
transcript: what the agent claims it did does not count. A plain final answer
or the arguments of a submit tool reach it as ``final.submission``, which is
part of that state (the thing submitted), not a claim about the state.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3post.constants import DOMAINS
from k3post.envs.tools import ToolSpec

__all__ = [
    "DOMAINS",
    "Task",
    "Verdict",
    "FinalState",
    "Verifier",
    "register_verifier",
    "get_verifier",
    "verifier_names",
    "run_verifier",
    "canonical_json",
]


def canonical_json(obj: Any) -> str:
    """Compact JSON with sorted keys, non-ASCII kept: the form hashed for identity."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _json_copy(obj: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(obj, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} must be JSON-serialisable: {e}") from e


@dataclass(frozen=True, eq=False)
class Task:
    """One task instance (immutable, JSON-serialisable, hashable by content).

    Attributes:
        id: unique id within its family (e.g. ``"kv-00017"``).
        domain: one of `DOMAINS`.
        family: the task family that generated it (e.g. ``"kv_store"``).
        messages: the prompt, OpenAI chat messages (system / user, possibly few-shot turns).
        tools: the tools offered to the model, as declarations (`ToolSpec` without handlers);
            the environment binds its handlers by name. Empty: the environment's own tool list.
        verifier: name of a verifier registered with `register_verifier`.
        metadata: JSON data for the environment and the verifier only (hidden from the model).
        group: task group for per-group harness sampling and memory; empty means ``family``.

    Treat the message dicts as read-only: equality and `__hash__` use the canonical JSON.
    """

    id: str
    domain: str
    family: str
    messages: tuple[dict[str, Any], ...]
    verifier: str
    tools: tuple[ToolSpec, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    group: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Task.id must be a non-empty string, got {self.id!r}")
        if self.domain not in DOMAINS:
            raise ValueError(f"task {self.id!r}: domain must be one of {DOMAINS}, got {self.domain!r}")
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"task {self.id!r}: family must be a non-empty string")
        if not isinstance(self.verifier, str) or not self.verifier:
            raise ValueError(f"task {self.id!r}: verifier must be a registered verifier name (non-empty string)")
        if isinstance(self.messages, (str, bytes, Mapping)) or not isinstance(self.messages, Sequence):
            raise ValueError(f"task {self.id!r}: messages must be a list of chat messages")
        msgs = _json_copy(list(self.messages), f"task {self.id!r}: messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"task {self.id!r}: message {i} must be a dict with role system/user/assistant/tool")
        object.__setattr__(self, "messages", tuple(msgs))
        tools = tuple(t if isinstance(t, ToolSpec) else ToolSpec.from_dict(t) for t in self.tools)
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"task {self.id!r}: duplicate tool names {sorted(n for n in names if names.count(n) > 1)}")
        object.__setattr__(self, "tools", tuple(ToolSpec(t.name, t.description, t.parameters, t.read_only) for t in tools))
        if not isinstance(self.metadata, Mapping):
            raise ValueError(f"task {self.id!r}: metadata must be a dict")
        object.__setattr__(self, "metadata", _json_copy(dict(self.metadata), f"task {self.id!r}: metadata"))
        if not isinstance(self.group, str):
            raise ValueError(f"task {self.id!r}: group must be a string")

    @property
    def task_group(self) -> str:
        """The group used for harness sampling and memory (``group`` or else ``family``)."""
        return self.group or self.family

    def prompt(self) -> list[dict[str, Any]]:
        """A fresh (deep-copied) list of the prompt messages."""
        return copy.deepcopy(list(self.messages))

    def to_dict(self) -> dict[str, Any]:
        """JSON form; `from_dict` inverts it."""
        return {
            "id": self.id,
            "domain": self.domain,
            "family": self.family,
            "group": self.group,
            "messages": copy.deepcopy(list(self.messages)),
            "tools": [t.to_dict() for t in self.tools],
            "verifier": self.verifier,
            "metadata": copy.deepcopy(dict(self.metadata)),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Task":
        """Build a task from `to_dict` output; unknown or missing keys are errors."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a task must be a dict, got {type(data).__name__}")
        allowed = {"id", "domain", "family", "group", "messages", "tools", "verifier", "metadata"}
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"task: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
        missing = {"id", "domain", "family", "messages", "verifier"} - set(data)
        if missing:
            raise ValueError(f"task: missing keys {sorted(missing)}")
        return cls(
            id=data["id"],
            domain=data["domain"],
            family=data["family"],
            messages=tuple(data["messages"]),
            verifier=data["verifier"],
            tools=tuple(ToolSpec.from_dict(t) for t in data.get("tools", ())),
            metadata=data.get("metadata", {}),
            group=data.get("group", ""),
        )

    def content_hash(self) -> str:
        """SHA-256 hex digest of the canonical JSON: a stable identity across processes."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Task):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return int(self.content_hash()[:16], 16)


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of a final state.

    Attributes:
        reward: scalar reward (finite; families usually keep it in [0, 1]).
        components: named partial scores that make up ``reward`` (for logging and analysis).
        diagnostics: human-readable explanation (never shown to the policy during the episode).
        weak_isolation: the verifier ran the policy's code in a sandbox without filesystem or network
            isolation (``sandbox.allow_weak_isolation``); kept in the JSON form only when true.
    """

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)
    diagnostics: str = ""
    weak_isolation: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"Verdict.reward must be a finite number, got {self.reward!r}")
        object.__setattr__(self, "reward", float(self.reward))
        comps = {}
        for k, v in dict(self.components).items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"Verdict.components must map str to numbers, got {k!r}: {v!r}")
            comps[k] = float(v)
        object.__setattr__(self, "components", comps)
        if not isinstance(self.diagnostics, str):
            raise ValueError("Verdict.diagnostics must be a string")

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        out = {"reward": self.reward, "components": dict(self.components), "diagnostics": self.diagnostics}
        if self.weak_isolation:
            out["weak_isolation"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verdict":
        """Inverse of `to_dict`."""
        return cls(
            data["reward"], data.get("components", {}), data.get("diagnostics", ""), bool(data.get("weak_isolation"))
        )


@dataclass
class FinalState:
    """What a verifier receives: the environment's final state.

    Attributes:
        state: the environment's state object (for `ToolEnvironment`, the object its tools mutate).
        submission: what the agent submitted: the arguments of the submit tool, or the text of a
            final answer given without tool calls; None if nothing was submitted.
        truncated: the episode hit a limit (turns, tokens, wall time) before finishing.
        truncation: which limit (``"max_turns"``, ``"max_tokens"``, ``"max_wall_time"``) or None.
    """

    state: Any
    submission: Any = None
    truncated: bool = False
    truncation: str | None = None


Verifier = Callable[[Task, FinalState], "Verdict | float | bool"]
"""``verifier(task, final_state) -> Verdict`` (a bare number or bool is taken as the reward)."""

_VERIFIERS: dict[str, Verifier] = {}


def register_verifier(name: str, fn: Verifier | None = None, *, overwrite: bool = False) -> Any:
    """Register ``fn`` under ``name``; usable as ``@register_verifier("family.check")``.

    Re-registering the same function (same module and qualified name, e.g. on re-import)
    is allowed; a different function under a taken name is a ValueError unless ``overwrite``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("verifier name must be a non-empty string")

    def deco(f: Verifier) -> Verifier:
        if not callable(f):
            raise ValueError(f"verifier {name!r} must be callable")
        old = _VERIFIERS.get(name)
        same = old is not None and (
            getattr(old, "__module__", None),
            getattr(old, "__qualname__", None),
        ) == (getattr(f, "__module__", None), getattr(f, "__qualname__", None))
        if old is not None and old is not f and not same and not overwrite:
            raise ValueError(f"a different verifier is already registered as {name!r} (pass overwrite=True to replace it)")
        _VERIFIERS[name] = f
        return f

    return deco(fn) if fn is not None else deco


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return _VERIFIERS[name]
    except KeyError:
        known = ", ".join(sorted(_VERIFIERS)) or "(none; import the task family that registers it)"
        raise ValueError(f"unknown verifier {name!r}; registered verifiers: {known}") from None


def verifier_names() -> list[str]:
    """Names of all registered verifiers, sorted."""
    return sorted(_VERIFIERS)


def run_verifier(task: Task, final: FinalState) -> Verdict:
    """Look up ``task.verifier``, call it on ``final`` and normalise the result to a `Verdict`."""
    out = get_verifier(task.verifier)(task, final)
    if isinstance(out, Verdict):
        return out
    if isinstance(out, (bool, int, float)):
        return Verdict(float(out))
    raise ValueError(f"verifier {task.verifier!r} returned {type(out).__name__}; expected a Verdict or a number")

