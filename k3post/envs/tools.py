"""Tools an environment offers to the model: `ToolSpec` and safe tool-call dispatch.

A `ToolSpec` is one function the model may call: a name, a description, a JSON
Schema for its arguments, a read-only flag and (optionally) a Python handler.
It renders to the three formats the pipeline meets:

* `to_openai()`  - ``{"type": "function", "function": {"name", "description", "parameters"}}``,
  which is also the entry of an XTML ``tool-declare`` list (SPEC §1.2);
* `to_mcp()`     - an MCP tool, ``{"name", "description", "inputSchema", "annotations"}``;
* `to_dict()`    - our JSON form (the OpenAI fields plus ``read_only``), used inside `Task`.

`call_tool` turns one OpenAI tool call into one ``role="tool"`` message. Every
failure the model can cause (unknown tool, arguments that are not a JSON object,
a schema violation, an exception in the handler) becomes an error observation,
``"Error: ..."``, returned to the model; it never raises, except for a
`k3post.errors.InfrastructureError` in the handler (not the call's fault), which propagates.

Handlers receive a `ToolContext` first (the per-episode state, the task, the
environment, the call id) and the validated arguments as keyword arguments:

    def set_value(ctx: ToolContext, key: str, value: str) -> str:
        ctx.state["store"][key] = value
        return "ok"

A handler may be ``async``. It returns a string (sent as is) or any JSON value
(sent as compact JSON).
"""

from __future__ import annotations

import copy
import inspect
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jsonschema

from k3post.errors import infra_kind

if TYPE_CHECKING:
    from k3post.envs.task import Task

__all__ = [
    "ToolContext",
    "ToolHandler",
    "ToolSpec",
    "ToolCallOutcome",
    "TOOL_NAME_RE",
    "call_tool",
    "openai_tools",
    "parse_arguments",
    "tool_call_parts",
    "tool_message",
    "validate_arguments",
]

TOOL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")
"""Valid tool names: what OpenAI, MCP and XTML attribute values all accept."""

ToolHandler = Callable[..., Any]
"""``handler(ctx: ToolContext, **arguments) -> str | JSON value`` (or an awaitable of one)."""


@dataclass
class ToolContext:
    """What a tool handler sees besides its arguments.

    Attributes:
        state: the environment's per-episode state object (mutable; the verifier reads it).
        task: the task of the episode.
        env: the environment running the episode (e.g. to reach a sandbox it owns).
        call_id: the OpenAI ``tool_call_id`` of this call.
    """

    state: Any
    task: "Task | None" = None
    env: Any = None
    call_id: str = ""


def _check_schema(name: str, schema: Mapping[str, Any]) -> None:
    if not isinstance(schema, Mapping):
        raise ValueError(f"tool {name!r}: parameters must be a JSON Schema object (a dict), got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"tool {name!r}: parameters schema must have type 'object', got {schema.get('type')!r}")
    try:
        canonical = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool {name!r}: parameters schema is not JSON-serialisable: {e}") from e
    error = _schema_error(canonical)
    if error is not None:
        raise ValueError(f"tool {name!r}: parameters is not a valid JSON Schema: {error}")


@functools.lru_cache(maxsize=4096)
def _schema_error(canonical_schema: str) -> str | None:
    """The meta-schema check of one schema (cached: envs rebuild the same ToolSpecs every episode)."""
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(canonical_schema))
    except jsonschema.SchemaError as e:
        return e.message
    return None


@dataclass(frozen=True, eq=False)
class ToolSpec:
    """One tool: name, description, JSON-Schema parameters, read-only flag, optional handler.

    Equality and hashing use the JSON form (`to_dict`); the handler is not part of it.

    Attributes:
        name: tool name (``[A-Za-z_][A-Za-z0-9_.-]*``, at most 64 characters).
        description: what the tool does, shown to the model.
        parameters: JSON Schema (type ``object``) of the arguments.
        read_only: True when the tool never changes the environment state (sub-agents
            and parallel executors may rely on it).
        handler: ``handler(ctx, **arguments)``; None for a declaration only (e.g. inside a `Task`);
            attach one with `bind`.
    """

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    read_only: bool = False
    handler: ToolHandler | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME_RE.match(self.name):
            raise ValueError(
                f"invalid tool name {self.name!r}: use letters, digits, '_', '.', '-' "
                "(starting with a letter or '_'), at most 64 characters"
            )
        if not isinstance(self.description, str):
            raise ValueError(f"tool {self.name!r}: description must be a string")
        _check_schema(self.name, self.parameters)
        object.__setattr__(self, "parameters", copy.deepcopy(dict(self.parameters)))
        if not isinstance(self.read_only, bool):
            raise ValueError(f"tool {self.name!r}: read_only must be a bool")
        if self.handler is not None and not callable(self.handler):
            raise ValueError(f"tool {self.name!r}: handler must be callable")

    def bind(self, handler: ToolHandler) -> "ToolSpec":
        """A copy of this spec with ``handler`` attached."""
        return ToolSpec(self.name, self.description, self.parameters, self.read_only, handler)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI function format, also the XTML ``tool-declare`` list entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(dict(self.parameters)),
            },
        }

    def to_mcp(self) -> dict[str, Any]:
        """MCP tool format: ``name``, ``description``, ``inputSchema`` and ``annotations.readOnlyHint``."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": copy.deepcopy(dict(self.parameters)),
            "annotations": {"readOnlyHint": self.read_only},
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON form: name, description, parameters, read_only (no handler)."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": copy.deepcopy(dict(self.parameters)),
            "read_only": self.read_only,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ToolSpec":
        """Inverse of `to_dict`; also accepts the OpenAI function format and the MCP format."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a tool spec must be a dict, got {type(data).__name__}")
        if data.get("type") == "function" and isinstance(data.get("function"), Mapping):
            fn = data["function"]
            return cls(fn.get("name", ""), fn.get("description", ""), fn.get("parameters", {"type": "object"}))
        if "inputSchema" in data:
            ann = data.get("annotations") or {}
            return cls(data.get("name", ""), data.get("description", ""), data["inputSchema"], bool(ann.get("readOnlyHint", False)))
        unknown = set(data) - {"name", "description", "parameters", "read_only"}
        if unknown:
            raise ValueError(f"tool spec: unknown keys {sorted(unknown)}")
        if "name" not in data:
            raise ValueError("tool spec: missing 'name'")
        return cls(
            data["name"],
            data.get("description", ""),
            data.get("parameters", {"type": "object", "properties": {}}),
            data.get("read_only", False),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolSpec):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))


# --------------------------------------------------------------------------- call helpers


def tool_call_parts(call: Any) -> tuple[str, str, Any]:
    """``(name, call_id, raw_arguments)`` of an OpenAI tool call; ValueError if it has no name."""
    if not isinstance(call, Mapping):
        raise ValueError(f"a tool call must be a dict, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise ValueError("a tool call's 'function' must be a dict")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call has no function name")
    cid = call.get("id")
    return name, cid if isinstance(cid, str) else "", fn.get("arguments", {})


def parse_arguments(raw: Any) -> dict[str, Any]:
    """Arguments of a call as a dict: a dict is copied, a string is parsed as a JSON object.

    Raises ValueError with a model-readable message otherwise.
    """
    if isinstance(raw, Mapping):
        return copy.deepcopy(dict(raw))
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise ValueError(f"arguments must be a JSON object, got {type(raw).__name__}")
    if raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"arguments are not valid JSON ({e.msg} at position {e.pos})") from e
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object, got a JSON {type(value).__name__}")
    return value


def validate_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> str | None:
    """None when ``arguments`` satisfy ``spec.parameters``, else a readable reason."""
    validator = jsonschema.Draft202012Validator(dict(spec.parameters))
    errors = sorted(validator.iter_errors(dict(arguments)), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    e = errors[0]
    where = "/".join(str(p) for p in e.absolute_path)
    return f"{e.message}" + (f" (at '{where}')" if where else "")


def tool_message(call_id: str, name: str, content: str) -> dict[str, Any]:
    """An OpenAI ``role="tool"`` message answering call ``call_id`` of tool ``name``."""
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError):
        return str(value)


@dataclass
class ToolCallOutcome:
    """The result of one call: the tool message for the model plus bookkeeping.

    Attributes:
        message: the ``role="tool"`` message.
        name: the tool name as called.
        arguments: the parsed arguments (None if they could not be parsed).
        error: None on success, else the error kind: ``unknown_tool``, ``bad_arguments``,
            ``schema``, ``handler``.
    """

    message: dict[str, Any]
    name: str
    arguments: dict[str, Any] | None
    error: str | None = None


async def call_tool(
    call: Mapping[str, Any],
    tools: Mapping[str, ToolSpec],
    ctx: ToolContext,
) -> ToolCallOutcome:
    """Validate and execute one OpenAI tool call against ``tools`` (name → bound spec).

    Never raises for anything the model controls: errors come back as a tool message
    whose content starts with ``"Error:"``. An `k3post.errors.InfrastructureError` in the handler
    (the sandbox, the browser gone) propagates: the episode ends "infra" (`k3post.rollout.agent_loop`).
    """
    try:
        name, cid, raw = tool_call_parts(call)
    except ValueError as e:
        cid = call.get("id", "") if isinstance(call, Mapping) else ""
        return ToolCallOutcome(tool_message(str(cid or ""), "unknown", f"Error: malformed tool call: {e}"), "", None, "unknown_tool")
    ctx = ToolContext(ctx.state, ctx.task, ctx.env, cid)
    spec = tools.get(name)
    if spec is None:
        avail = ", ".join(sorted(tools)) or "(none)"
        return ToolCallOutcome(
            tool_message(cid, name, f"Error: unknown tool {name!r}. Available tools: {avail}."), name, None, "unknown_tool"
        )
    try:
        args = parse_arguments(raw)
    except ValueError as e:
        return ToolCallOutcome(tool_message(cid, name, f"Error: tool {name!r}: {e}."), name, None, "bad_arguments")
    reason = validate_arguments(spec, args)
    if reason is not None:
        return ToolCallOutcome(
            tool_message(cid, name, f"Error: invalid arguments for tool {name!r}: {reason}."), name, args, "schema"
        )
    if spec.handler is None:
        return ToolCallOutcome(
            tool_message(cid, name, f"Error: tool {name!r} is declared but not implemented in this environment."),
            name,
            args,
            "handler",
        )
    try:
        out = spec.handler(ctx, **args)
        if inspect.isawaitable(out):
            out = await out
    except Exception as e:  # noqa: BLE001 - any handler failure is an observation for the model
        if infra_kind(e) is not None:  # the sandbox / browser / worker failed, not the call: the episode ends "infra"
            raise
        msg = str(e) or "(no message)"
        return ToolCallOutcome(
            tool_message(cid, name, f"Error: tool {name!r} failed: {type(e).__name__}: {msg}"), name, args, "handler"
        )
    return ToolCallOutcome(tool_message(cid, name, _to_text(out)), name, args, None)


def openai_tools(specs: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The OpenAI function format of each spec (the XTML tool-declare list)."""
    return [s.to_openai() for s in specs]

