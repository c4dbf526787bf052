"""XTML's vocabulary (SPEC §1): the structural tokens, modes, channels, option messages with the shipped
encoder's wording, and the helpers every part shares (attribute escaping, argument types, strict JSON,
`parse_tool_arguments`, `is_tool_declaration`). The package docstring (`k3post.xtml`) describes the format."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


from k3post.tokenizer import IMAGE_TOKEN, SPECIAL_TOKENS

OPEN, CLOSE, SEP, EOM = SPECIAL_TOKENS
MODES: tuple[str, ...] = ("think", "instruct")
ARG_TYPES: tuple[str, ...] = ("string", "number", "boolean", "null", "object", "array")
OPTION_TYPES: tuple[str, ...] = ("tool-declare", "thinking-effort", "tool-choice", "response-format")
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
CHANNELS: tuple[str, ...] = ("think", "response", "tools")
KNOWN_TAGS: tuple[str, ...] = ("message", "think", "response", "tools", "call", "argument", "json")

OMIT_EFFORT = "omit"
"""``effort=OMIT_EFFORT`` renders think mode without the thinking-effort message. The shipped encoder
always writes one in think mode; k3post uses this only for contexts no deployed model sees (MOPD teachers
that must not see the student's effort, SPEC §4)."""

TOOL_DECLARE_TEMPLATE = (
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
)
"""Body of the global ``tool-declare`` message (exact); ``{tools}`` is compact key-sorted JSON."""

TOOL_DECLARE_DYNAMIC_TEMPLATE = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
    "```json\n{tools}\n```"
)
"""Body of a mid-session ``tool-declare`` message (a system message carrying ``tools``), exact."""

THINKING_EFFORT_TEMPLATE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
"""Body of a ``thinking-effort`` message (exact, SPEC §1.2)."""

# One-shot option wording, as the shipped encoder writes it. tool_choice "auto" or a named function and
# response_format {"type": "text"} render nothing.
TOOL_CHOICE_REQUIRED = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
TOOL_CHOICE_NONE = "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
_RAW_JSON = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)
RESPONSE_FORMAT_JSON_OBJECT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
RESPONSE_FORMAT_JSON_SCHEMA = (
    "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON + "\n"
    "The JSON data must match the following schema:\n```json\n{schema}\n```"
)


# --------------------------------------------------------------------------- helpers


def escape_attr(value: str) -> str:
    """Escape an attribute value as the shipped encoder does: ``&`` -> ``&amp;``, ``"`` -> ``&quot;``."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _compact_json(obj: Any) -> str:
    """Compact, key-sorted JSON with non-ASCII kept (SPEC §1.2 TOOLS)."""
    try:
        return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"value is not JSON-serialisable: {e}") from e


def _shown(text: str, limit: int = 80) -> str:
    """repr of text for an error message, shortened in the middle past ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[: limit // 2]!r}...{text[-limit // 2 :]!r}"


def _check_mode(mode: str) -> None:
    """ValueError unless mode is 'think' or 'instruct'."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def is_tool_declaration(message: Any) -> bool:
    """True for an input option message announcing tools mid-session: a system message with a non-empty
    ``tools`` list (the shipped encoder's syntax; a ``"type": "tool-declare"`` key may be present too)."""
    return isinstance(message, Mapping) and message.get("role") == "system" and bool(message.get("tools"))


def _content_parts(content: Any, where: str) -> list[tuple[bool, str]]:
    """OpenAI ``content`` as segments ``(is_image, text)``: None -> none, a string -> one, a list -> one per
    part (a string, ``{"text": str}``, or an ``image`` / ``image_url`` part -> the image placeholder)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(False, content)]
    if isinstance(content, list):
        out: list[tuple[bool, str]] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append((False, part))
            elif isinstance(part, Mapping) and part.get("type") in ("image", "image_url"):
                out.append((True, IMAGE_TOKEN))
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append((False, part["text"]))
            else:
                raise ValueError(
                    f"{where}: content part {j} must be a text part {{'type': 'text', 'text': str}} or an "
                    f"image part {{'type': 'image_url', ...}}, got {part!r}"
                )
        return out
    raise ValueError(f"{where}: content must be a string, a list of content parts or None, got {type(content).__name__}")


def _arg_type(value: Any, where: str) -> str:
    """The XTML argument type of a Python value."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: non-finite number {value!r} is not valid JSON")
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ValueError(f"{where}: unsupported argument value type {type(value).__name__}")


def _arg_text(value: Any, type_: str, where: str) -> str:
    """Body of an argument element: strings raw, everything else JSON."""
    if type_ == "string":
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: argument value is not JSON-serialisable: {e}") from e


def _non_standard(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a JSON number")
    return value


def _strict_json(text: str) -> Any:
    """json.loads of model- or user-written text, by the JSON standard: NaN / Infinity (and 1e999) are a
    ValueError (the renderer refuses them, and json.dumps would write them back as invalid JSON), and so is nesting too
    deep for the parser (a RecursionError otherwise). A syntax error is a json.JSONDecodeError (a
    ValueError with ``.pos``)."""
    try:
        return json.loads(text, parse_constant=_non_standard, parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _decode_arg(text: str, type_: str) -> Any:
    """Python value of an argument body; ValueError (with .pos where known) if invalid."""
    if type_ == "string":
        return text
    value = _strict_json(text)
    ok = {
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }[type_]
    if not ok:
        raise ValueError(f"argument value {_shown(text)} is not of type {type_}")
    return value


def _tool_call_parts(call: Any, where: str) -> tuple[str, str | None, Any]:
    """(name, id, arguments) of an OpenAI tool call (nested ``function`` or flat)."""
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: a tool call must be a dict, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}: tool call 'function' must be a dict")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: tool call needs a non-empty string function name")
    cid = call.get("id")
    if cid is not None and not isinstance(cid, str):
        raise ValueError(f"{where}: tool call id must be a string")
    return name, cid, fn.get("arguments", {})


def parse_tool_arguments(call: Mapping[str, Any] | str) -> dict[str, Any]:
    """Arguments of an OpenAI tool call (or the arguments string itself) as a dict.

    Raises ValueError if the arguments are not a JSON object (a JSON-fallback call).
    """
    if isinstance(call, str):
        raw: Any = call
    else:
        fn = call.get("function", call)
        raw = fn.get("arguments", {}) if isinstance(fn, Mapping) else None
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, str):
        raise ValueError(f"tool call arguments must be a JSON string or a dict, got {type(raw).__name__}")
    if raw.strip() == "":
        return {}
    try:
        value = _strict_json(raw)
    except ValueError as e:
        raise ValueError(f"tool call arguments are not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return value
