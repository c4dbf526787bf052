"""XTML, the K3 chat template (SPEC §1, report appendix F): render, parse, stream, validate.

XTML is XML whose angle brackets are special tokens. An element is

    <|open|>tag k1="v1" k2="v2"<|sep|>BODY<|close|>tag<|sep|>

and every message is one ``message`` element followed by ``<|end_of_msg|>``.
Attribute values escape ``"`` as ``\\"`` and, so that escaping round-trips, a
backslash as ``\\\\``; no other escape is valid.

Context order (SPEC §1.2):

1. global option messages (message index -1): ``tool-declare`` when ``tools``
   are given, then ``thinking-effort`` when an ``effort`` is given (think mode);
2. the input messages (index = position in ``messages``), possibly with an
   *input option message* announcing tools mid-session, written in the
   messages list as ``{"role": "system", "type": "tool-declare", "tools": [...]}``
   (OpenAI function specs; rendered with the same body as the global one);
3. one-shot option messages (index -1): ``tool-choice`` and ``response-format``,
   with our wording (`TOOL_CHOICE_*`, `RESPONSE_FORMAT_*` below);
4. the generation prefix (index ``len(messages)``), when asked for.

Ids are built segment by segment: every text run between special tokens is
encoded on its own with `k3post.tokenizer.encode_text`, which never yields a
special id, so no text (user, tool output, code in an argument) can forge
structure. `render_text` gives the same context as a string (special tokens
written literally), needs no tokenizer, and equals ``decode(render(...).ids)``.

Loss mask (SPEC §1.5): inside an assistant message, everything after its
generation prefix (``<|open|>message role="assistant"<|sep|>`` plus the first
channel header, ``<|open|>think<|sep|>`` or ``<|open|>response<|sep|>``) up to
and including ``<|end_of_msg|>`` is trainable, except JSON-fallback blocks
(``<|open|>json ...<|sep|>...<|close|>json<|sep|>``). Everything else is not.

Known limit of `XTML.extend` on plain ids: the message indices of the kept
prefix are recovered from the ids, and an input ``tool-declare`` placed as the
very first input message is indistinguishable there from the global one, so it
is given index -1.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from k3post.constants import EFFORTS
from k3post.tokenizer import PAD_TOKEN, SPECIAL_TOKENS, decode, encode_text, special_ids

__all__ = [
    "OPEN",
    "CLOSE",
    "SEP",
    "EOM",
    "EFFORTS",
    "MODES",
    "ARG_TYPES",
    "OPTION_TYPES",
    "TOOL_DECLARE_TEMPLATE",
    "THINKING_EFFORT_TEMPLATE",
    "TOOL_CHOICE_NONE",
    "TOOL_CHOICE_REQUIRED",
    "TOOL_CHOICE_FUNCTION",
    "RESPONSE_FORMAT_JSON_OBJECT",
    "RESPONSE_FORMAT_JSON_SCHEMA",
    "Rendered",
    "ValidationResult",
    "XTMLParseError",
    "ChannelOpen",
    "ChannelClose",
    "TextDelta",
    "ToolCallStart",
    "ToolCall",
    "MessageEnd",
    "Event",
    "StreamParser",
    "XTML",
    "render_text",
    "parse_tool_arguments",
    "escape_attr",
]

OPEN, CLOSE, SEP, EOM = SPECIAL_TOKENS
MODES: tuple[str, ...] = ("think", "instruct")
ARG_TYPES: tuple[str, ...] = ("string", "number", "boolean", "null", "object", "array")
OPTION_TYPES: tuple[str, ...] = ("tool-declare", "thinking-effort", "tool-choice", "response-format")
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
CHANNELS: tuple[str, ...] = ("think", "response", "tools")
KNOWN_TAGS: tuple[str, ...] = ("message", "think", "response", "tools", "call", "argument", "json")

TOOL_DECLARE_TEMPLATE = (
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
)
"""Body of a ``tool-declare`` message (exact, SPEC §1.2); ``{tools}`` is compact sorted JSON."""

THINKING_EFFORT_TEMPLATE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
"""Body of a ``thinking-effort`` message (exact, SPEC §1.2)."""

# One-shot option wording (ours: SPEC gives only the types). tool_choice "auto"
# and response_format {"type": "text"} are the default behaviour and render nothing.
TOOL_CHOICE_NONE = "Do not call any tool in this turn; answer in the response channel."
TOOL_CHOICE_REQUIRED = "You must call at least one tool in this turn."
TOOL_CHOICE_FUNCTION = "You must call the tool `{name}` in this turn."
RESPONSE_FORMAT_JSON_OBJECT = "Write the response channel as a single valid JSON object and nothing else."
RESPONSE_FORMAT_JSON_SCHEMA = (
    "Write the response channel as a single valid JSON value, and nothing else, that conforms "
    "to this JSON Schema:\n```json\n{schema}\n```"
)


# --------------------------------------------------------------------------- helpers


def escape_attr(value: str) -> str:
    """Escape an attribute value: backslash -> ``\\\\``, double quote -> ``\\"``."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _header(tag: str, attrs: Sequence[tuple[str, str]] = ()) -> str:
    """Header text ``tag k1="v1" ...`` (between ``<|open|>`` and ``<|sep|>``)."""
    return tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs)


def _compact_json(obj: Any) -> str:
    """Compact, key-sorted JSON with non-ASCII kept (SPEC §1.2 TOOLS)."""
    try:
        return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"value is not JSON-serialisable: {e}") from e


def _check_mode(mode: str) -> None:
    """ValueError unless mode is 'think' or 'instruct'."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _content_text(content: Any, where: str) -> str:
    """OpenAI ``content`` (None, str, or list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(
                    f"{where}: content part {j} must be {{'type': 'text', 'text': str}}, got {part!r}"
                )
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, a list of text parts or None, got {type(content).__name__}")


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


def _decode_arg(text: str, type_: str) -> Any:
    """Python value of an argument body; ValueError (with .pos where known) if invalid."""
    if type_ == "string":
        return text
    value = json.loads(text)
    ok = {
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }[type_]
    if not ok:
        raise ValueError(f"argument value {text!r} is not of type {type_}")
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
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call arguments are not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return value


# --------------------------------------------------------------------------- rendering


@dataclass
class _Piece:
    """One special token or text run of a rendered context."""

    special: bool
    value: str
    message: int
    train: bool


@dataclass
class _Builder:
    """Accumulates pieces; ``msg`` and ``train`` label everything appended."""

    pieces: list[_Piece] = field(default_factory=list)
    msg: int = -1
    train: bool = False

    def sp(self, token: str) -> None:
        self.pieces.append(_Piece(True, token, self.msg, self.train))

    def tx(self, text: str) -> None:
        if text:
            self.pieces.append(_Piece(False, text, self.msg, self.train))

    def open(self, tag: str, attrs: Sequence[tuple[str, str]] = ()) -> None:
        self.sp(OPEN)
        self.tx(_header(tag, attrs))
        self.sp(SEP)

    def close(self, tag: str) -> None:
        self.sp(CLOSE)
        self.tx(tag)
        self.sp(SEP)

    def text_message(self, attrs: Sequence[tuple[str, str]], body: str) -> None:
        self.open("message", attrs)
        self.tx(body)
        self.close("message")
        self.sp(EOM)


@dataclass
class _Binding:
    """Calls of the most recent assistant message, for binding tool results."""

    calls: list[tuple[str | None, str]] | None = None  # (call id, tool name)
    next_pos: int = 0


def _tool_declare_body(tools: Any, where: str) -> str:
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"{where}: tools must be a list of OpenAI function specs, got {type(tools).__name__}")
    return TOOL_DECLARE_TEMPLATE.format(tools=_compact_json(list(tools))).strip()


def _tool_choice_body(tool_choice: Any) -> str | None:
    if tool_choice is None or tool_choice == "auto":
        return None
    if tool_choice == "none":
        return TOOL_CHOICE_NONE
    if tool_choice == "required":
        return TOOL_CHOICE_REQUIRED
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return TOOL_CHOICE_FUNCTION.format(name=name)
    raise ValueError(
        "tool_choice must be None, 'auto', 'none', 'required' or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
    )


def _response_format_body(response_format: Any) -> str | None:
    if response_format is None:
        return None
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return RESPONSE_FORMAT_JSON_OBJECT
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if isinstance(schema, Mapping):
                return RESPONSE_FORMAT_JSON_SCHEMA.format(schema=_compact_json(schema)).strip()
            raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
    raise ValueError(
        "response_format must be None or {'type': 'text' | 'json_object' | 'json_schema', ...}, "
        f"got {response_format!r}"
    )


def _render_assistant(b: _Builder, m: Mapping[str, Any], i: int, mode: str, binding: _Binding) -> None:
    where = f"message {i} (assistant)"
    b.train = False
    b.open("message", [("role", "assistant")])
    b.open("think" if mode == "think" else "response")
    b.train = True
    if mode == "think":
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: reasoning_content must be a string or None")
        b.tx(reasoning or "")
        b.close("think")
        b.open("response")
    b.tx(_content_text(m.get("content"), where))
    b.close("response")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}: tool_calls must be a list")
    bound: list[tuple[str | None, str]] = []
    if calls:
        b.open("tools")
        for k, call in enumerate(calls, start=1):
            cw = f"{where}, tool call {k}"
            name, cid, args = _tool_call_parts(call, cw)
            bound.append((cid, name))
            b.open("call", [("tool", name), ("index", str(k))])
            fallback: str | None = None
            if isinstance(args, str):
                if args.strip() == "":
                    args = {}
                else:
                    try:
                        parsed = json.loads(args)
                    except json.JSONDecodeError:
                        parsed = None
                    if isinstance(parsed, dict):
                        args = parsed
                    else:
                        fallback = args
            elif not isinstance(args, Mapping):
                fallback = _arg_text(args, "array", cw) if args is not None else "null"
            if fallback is not None:
                b.train = False
                b.open("json", [("type", "object")])
                b.tx(fallback)
                b.close("json")
                b.train = True
            else:
                for key, value in args.items():
                    if not isinstance(key, str):
                        raise ValueError(f"{cw}: argument names must be strings, got {key!r}")
                    t = _arg_type(value, f"{cw}, argument {key!r}")
                    b.open("argument", [("key", key), ("type", t)])
                    b.tx(_arg_text(value, t, f"{cw}, argument {key!r}"))
                    b.close("argument")
            b.close("call")
        b.close("tools")
    b.close("message")
    b.sp(EOM)
    b.train = False
    binding.calls = bound
    binding.next_pos = 0


def _render_tool_result(b: _Builder, m: Mapping[str, Any], i: int, binding: _Binding) -> None:
    where = f"message {i} (tool)"
    calls = binding.calls
    name = m.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{where}: name must be a non-empty string")
    explicit = m.get("index")
    if explicit is not None:
        if not isinstance(explicit, int) or isinstance(explicit, bool) or explicit < 1:
            raise ValueError(f"{where}: index must be a positive int, got {explicit!r}")
        pos = explicit - 1
    elif m.get("tool_call_id") is not None:
        cid = m["tool_call_id"]
        ids = [c[0] for c in calls] if calls else []
        if cid not in ids:
            raise ValueError(
                f"{where}: tool_call_id {cid!r} matches no call of the preceding assistant message"
            )
        pos = ids.index(cid)
    else:
        pos = binding.next_pos
    if calls is None:
        if name is None or explicit is None:
            raise ValueError(
                f"{where}: no preceding assistant message with tool calls; give both 'name' and 'index'"
            )
    else:
        if pos >= len(calls):
            raise ValueError(
                f"{where}: result for call {pos + 1} but the preceding assistant message has "
                f"{len(calls)} call(s)"
            )
        if pos < binding.next_pos:
            raise ValueError(
                f"{where}: tool results must follow the order of their calls (call {pos + 1} "
                f"after call {binding.next_pos})"
            )
        if name is not None and name != calls[pos][1]:
            raise ValueError(f"{where}: name {name!r} does not match call {pos + 1} ({calls[pos][1]!r})")
        name = calls[pos][1]
    binding.next_pos = pos + 1
    assert name is not None
    b.text_message(
        [("role", "tool"), ("tool", name), ("index", str(pos + 1))],
        _content_text(m.get("content"), where),
    )


def _render_input(
    b: _Builder,
    messages: Sequence[Any],
    *,
    mode: str,
    start_index: int,
    binding: _Binding,
) -> None:
    """Append the input messages (zone 2) to ``b``."""
    for j, m in enumerate(messages):
        i = start_index + j
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict, got {type(m).__name__}")
        role = m.get("role")
        b.msg = i
        b.train = False
        if role == "assistant":
            _render_assistant(b, m, i, mode, binding)
        elif role == "tool":
            _render_tool_result(b, m, i, binding)
        elif role in ("system", "user"):
            where = f"message {i} ({role})"
            mtype = m.get("type")
            if mtype is not None:
                if role != "system" or mtype != "tool-declare":
                    raise ValueError(
                        f"{where}: the only input option message is "
                        f"{{'role': 'system', 'type': 'tool-declare', 'tools': [...]}}, got type {mtype!r}"
                    )
                if "tools" not in m:
                    raise ValueError(f"{where}: a tool-declare message needs a 'tools' list")
                b.text_message([("role", "system"), ("type", "tool-declare")], _tool_declare_body(m["tools"], where))
                continue
            attrs = [("role", role)]
            name = m.get("name")
            if name is not None:
                if not isinstance(name, str):
                    raise ValueError(f"{where}: name must be a string")
                attrs.append(("name", name))
            b.text_message(attrs, _content_text(m.get("content"), where))
        else:
            raise ValueError(f"message {i}: unknown role {role!r} (expected one of {ROLES})")


def _build(
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None,
    effort: str | None,
    mode: str,
    add_generation_prompt: bool,
    tool_choice: Any,
    response_format: Any,
) -> _Builder:
    """Pieces of a full context (all four zones)."""
    _check_mode(mode)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of OpenAI chat messages")
    if effort is not None:
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {EFFORTS} or None, got {effort!r}")
        if mode != "think":
            raise ValueError(f"effort={effort!r} needs mode='think' (thinking effort has no meaning in instruct mode)")
    b = _Builder()
    if tools:
        b.text_message([("role", "system"), ("type", "tool-declare")], _tool_declare_body(tools, "tools"))
    if effort is not None:
        b.text_message(
            [("role", "system"), ("type", "thinking-effort")], THINKING_EFFORT_TEMPLATE.format(effort=effort).strip()
        )
    _render_input(b, messages, mode=mode, start_index=0, binding=_Binding())
    _append_one_shot(b, tool_choice, response_format)
    if add_generation_prompt:
        _append_generation_prefix(b, len(messages), mode)
    return b


def _append_one_shot(b: _Builder, tool_choice: Any, response_format: Any) -> None:
    b.msg, b.train = -1, False
    body = _tool_choice_body(tool_choice)
    if body is not None:
        b.text_message([("role", "system"), ("type", "tool-choice")], body.strip())
    body = _response_format_body(response_format)
    if body is not None:
        b.text_message([("role", "system"), ("type", "response-format")], body.strip())


def _append_generation_prefix(b: _Builder, index: int, mode: str) -> None:
    b.msg, b.train = index, False
    b.open("message", [("role", "assistant")])
    b.open("think" if mode == "think" else "response")


def render_text(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    effort: str | None = None,
    mode: str = "think",
    add_generation_prompt: bool = False,
    tool_choice: Any = None,
    response_format: Any = None,
) -> str:
    """The XTML context as a string, special tokens written literally (no tokenizer needed).

    Args are those of `XTML.render`. Note the string form is ambiguous where text
    spells a special token; the id form (`XTML.render`) is not.
    """
    b = _build(
        messages,
        tools=tools,
        effort=effort,
        mode=mode,
        add_generation_prompt=add_generation_prompt,
        tool_choice=tool_choice,
        response_format=response_format,
    )
    return "".join(p.value for p in b.pieces)


# --------------------------------------------------------------------------- results and events


@dataclass
class Rendered:
    """Token ids of a context with per-token labels.

    Attributes:
        ids: token ids.
        message_index: per token, the index in ``messages`` of the message it
            belongs to; -1 for global and one-shot option messages;
            ``len(messages)`` for the generation prefix (and a completion after it).
        loss_mask: per token, True when it is a model-produced assistant token (SPEC §1.5).
    """

    ids: list[int]
    message_index: list[int]
    loss_mask: list[bool]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ValidationResult:
    """Outcome of `XTML.validate`: ``position`` is the first malformed token (None when ok)."""

    ok: bool
    position: int | None
    message: str


class XTMLParseError(ValueError):
    """Malformed XTML at token ``position`` (``len(ids)`` for a premature end)."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"token {position}: {message}")
        self.position = position
        self.message = message


@dataclass(frozen=True)
class ChannelOpen:
    """A channel (``think``, ``response`` or ``tools``) of the assistant message opened."""

    channel: str


@dataclass(frozen=True)
class ChannelClose:
    """A channel closed; ``text`` is its whole decoded body (empty for ``tools``)."""

    channel: str
    text: str


@dataclass(frozen=True)
class TextDelta:
    """New complete characters of the ``think`` or ``response`` channel."""

    channel: str
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call header arrived: its 1-based ``index`` and tool ``name``."""

    index: int
    name: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call (on ``<|close|>call<|sep|>``).

    ``arguments`` holds the typed values (None for a JSON-fallback call, whose raw
    body is in ``call["function"]["arguments"]``); ``call`` is the OpenAI dict.
    """

    index: int
    name: str
    arguments: dict[str, Any] | None
    call: dict[str, Any]


@dataclass(frozen=True)
class MessageEnd:
    """``<|end_of_msg|>`` arrived; ``message`` is the parsed assistant message."""

    message: dict[str, Any]


Event = ChannelOpen | ChannelClose | TextDelta | ToolCallStart | ToolCall | MessageEnd


# --------------------------------------------------------------------------- parsing machinery


class _HeaderError(Exception):
    def __init__(self, offset: int, message: str) -> None:
        super().__init__(message)
        self.offset = offset
        self.message = message


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _parse_header(text: str) -> tuple[str, dict[str, str], dict[str, int]]:
    """(tag, attrs, attr char offsets) of header text; _HeaderError(offset, msg) if malformed."""
    m = _NAME.match(text)
    if not m:
        raise _HeaderError(0, f"missing or invalid tag name in header {text!r}")
    tag = m.group()
    i = m.end()
    attrs: dict[str, str] = {}
    offsets: dict[str, int] = {}
    while i < len(text):
        if text[i] != " ":
            raise _HeaderError(i, f"bad attribute syntax in header {text!r}: expected a space")
        i += 1
        start = i
        m = _NAME.match(text, i)
        if not m:
            raise _HeaderError(i, f"bad attribute syntax in header {text!r}: invalid attribute name")
        key = m.group()
        i = m.end()
        if text[i : i + 2] != '="':
            raise _HeaderError(i, f'bad attribute syntax in header {text!r}: expected =" after {key}')
        i += 2
        buf: list[str] = []
        while True:
            if i >= len(text):
                raise _HeaderError(start, f"bad attribute syntax in header {text!r}: unterminated value of {key}")
            c = text[i]
            if c == "\\":
                if i + 1 < len(text) and text[i + 1] in '"\\':
                    buf.append(text[i + 1])
                    i += 2
                    continue
                raise _HeaderError(i, f"bad attribute syntax in header {text!r}: invalid escape")
            if c == '"':
                i += 1
                break
            buf.append(c)
            i += 1
        if key in attrs:
            raise _HeaderError(start, f"duplicate attribute {key!r}")
        attrs[key] = "".join(buf)
        offsets[key] = start
    return tag, attrs, offsets


class _TextStream:
    """Incremental decoder: emits only complete characters (multi-byte safe)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.emitted: list[str] = []

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        prefix_text = decode(self.tokenizer, self.ids[self.prefix : self.read])
        new_text = decode(self.tokenizer, self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.emitted.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        full = decode(self.tokenizer, self.ids)
        done = "".join(self.emitted)
        delta = full[len(done) :] if full.startswith(done) else ""
        if delta:
            self.emitted.append(delta)
        return delta


@dataclass
class _Frame:
    """An open element."""

    tag: str
    attrs: dict[str, str]
    pos: int
    text_ids: list[int] = field(default_factory=list)
    text_pos: int = -1
    children: list[str] = field(default_factory=list)
    stream: _TextStream | None = None


_TEXT_ONLY = ("think", "response", "argument", "json")
_ALLOWED_CHILDREN: dict[str, tuple[str, ...]] = {
    "#root": ("message",),
    "tools": ("call",),
    "call": ("argument", "json"),
}


class _Machine:
    """Token-at-a-time XTML checker and assistant-message builder.

    ``context=True``: a sequence of messages (any roles). ``context=False``: one
    assistant message, possibly starting without its header (inside the first
    channel of ``mode``) or at channel level.
    """

    def __init__(self, x: "XTML", *, context: bool, mode: str, stream: bool, after_prefix: bool = False) -> None:
        _check_mode(mode)
        self.x = x
        self.context = context
        self.mode = mode
        self.streaming = stream
        self.after_prefix = after_prefix  # a completion sampled after the generation prefix: its channel is open
        self.pos = 0
        self.state = "body" if context else "start"
        self.stack: list[_Frame] = [_Frame("#root", {}, -1)]
        self.hdr_ids: list[int] = []
        self.hdr_pos = 0
        self.start_header = False
        self.error: XTMLParseError | None = None
        # the assistant message being built (reset when one opens)
        self.reasoning: str | None = None
        self.content: str = ""
        self.calls: list[dict[str, Any]] = []
        self.call_args: dict[str, Any] = {}
        self.call_raw: str | None = None
        # binding of tool results (context mode)
        self.last_calls: list[str] | None = None
        self.last_result = 0

    # ------------------------------------------------------------------ state
    def _reset_message(self) -> None:
        """Start a new assistant message."""
        self.reasoning = None
        self.content = ""
        self.calls = []
        self.call_args = {}
        self.call_raw = None

    def message(self) -> dict[str, Any]:
        """The assistant message parsed so far (open channels included as they stand)."""
        reasoning, content = self.reasoning, self.content
        for f in self.stack:
            if f.tag == "think":
                reasoning = decode(self.x.tokenizer, f.text_ids)
            elif f.tag == "response":
                content = decode(self.x.tokenizer, f.text_ids)
        return {
            "role": "assistant",
            "reasoning_content": reasoning,
            "content": content,
            "tool_calls": [dict(c) for c in self.calls],
        }

    def _fail(self, pos: int, message: str) -> XTMLParseError:
        self.error = XTMLParseError(pos, message)
        return self.error

    def _char_pos(self, ids: list[int], first: int, offset: int) -> int:
        """Position of the token of ``ids`` (starting at ``first``) holding char ``offset``."""
        for k in range(1, len(ids) + 1):
            if len(decode(self.x.tokenizer, ids[:k])) > offset:
                return first + k - 1
        return first + max(len(ids) - 1, 0)

    # ------------------------------------------------------------------ feeding
    def feed(self, tid: int) -> list[Event]:
        """Consume one token; return the events it completes (XTMLParseError if malformed)."""
        if self.error is not None:
            raise self.error
        pos = self.pos
        self.pos += 1
        kind = self.x._kind.get(int(tid))
        events: list[Event] = []
        if kind == PAD_TOKEN:
            if self.state == "done":
                return events
            raise self._fail(pos, "pad token inside the sequence")
        st = self.state
        if st == "start":
            self.state = "body"
            if kind == OPEN and not self.after_prefix:
                self.start_header = True
            else:
                self._push_implicit(events, pos, channel=True)
            return events + self._feed_body(int(tid), kind, pos)
        if st in ("open_hdr", "close_hdr"):
            if kind is None:
                self.hdr_ids.append(int(tid))
                return events
            if kind != SEP:
                raise self._fail(pos, f"header not terminated by {SEP} (got {kind})")
            if st == "open_hdr":
                self._finish_open(events, pos)
            else:
                self._finish_close(events, pos)
            return events
        if st == "need_eom":
            if kind != EOM:
                raise self._fail(pos, f"expected {EOM} after the closed message")
            self.state = "body" if self.context else "done"
            msg = self.message()
            events.append(MessageEnd(msg))
            return events
        if st == "done":
            raise self._fail(pos, f"content after {EOM}")
        return self._feed_body(int(tid), kind, pos)

    def _push_implicit(self, events: list[Event], pos: int, *, channel: bool) -> None:
        self.stack.append(_Frame("message", {"role": "assistant"}, pos))
        self.stack[0].children.append("message")
        self._reset_message()
        if channel:
            ch = "think" if self.mode == "think" else "response"
            self._open_frame(events, _Frame(ch, {}, pos))

    def _open_frame(self, events: list[Event], frame: _Frame) -> None:
        parent = self.stack[-1]
        parent.children.append(frame.tag)
        if frame.tag in ("think", "response") and self.streaming:
            frame.stream = _TextStream(self.x.tokenizer)
        self.stack.append(frame)
        if frame.tag in CHANNELS and parent.tag == "message":
            events.append(ChannelOpen(frame.tag))

    def _feed_body(self, tid: int, kind: str | None, pos: int) -> list[Event]:
        events: list[Event] = []
        top = self.stack[-1]
        if kind is None:
            text_ok = top.tag in _TEXT_ONLY or (top.tag == "message" and top.attrs.get("role") != "assistant")
            if not text_ok:
                where = "outside any element" if top.tag == "#root" else f"directly inside <{top.tag}>"
                raise self._fail(pos, f"text {where}")
            if not top.text_ids:
                top.text_pos = pos
            top.text_ids.append(tid)
            if top.stream is not None:
                delta = top.stream.push(tid)
                if delta:
                    events.append(TextDelta(top.tag, delta))
            return events
        if kind == OPEN:
            self.state = "open_hdr"
            self.hdr_pos = pos
            self.hdr_ids = []
            return events
        if kind == CLOSE:
            if top.tag == "#root":
                raise self._fail(pos, "close tag with no open element")
            self.state = "close_hdr"
            self.hdr_pos = pos
            self.hdr_ids = []
            return events
        if kind == SEP:
            raise self._fail(pos, f"{SEP} outside a header")
        assert kind == EOM
        if top.tag == "#root":
            raise self._fail(pos, f"{EOM} without a message")
        raise self._fail(pos, f"{EOM} inside the open element <{top.tag}>")

    def _header_text(self, sep_pos: int) -> tuple[str, int]:
        """Decoded header text and the position of its first token (the sep if empty)."""
        first = self.hdr_pos + 1
        return decode(self.x.tokenizer, self.hdr_ids), (first if self.hdr_ids else sep_pos)

    def _finish_open(self, events: list[Event], sep_pos: int) -> None:
        self.state = "body"
        text, first = self._header_text(sep_pos)

        def at(offset: int) -> int:
            return self._char_pos(self.hdr_ids, first, offset) if self.hdr_ids else sep_pos

        try:
            tag, attrs, offs = _parse_header(text)
        except _HeaderError as e:
            raise self._fail(at(e.offset), e.message) from None
        if tag not in KNOWN_TAGS:
            raise self._fail(first, f"unknown tag {tag!r}")
        if self.start_header:
            self.start_header = False
            if tag in CHANNELS:
                self._push_implicit(events, self.hdr_pos, channel=False)
        parent = self.stack[-1]
        ptag = parent.tag
        if ptag == "message" and parent.attrs.get("role") == "assistant":
            allowed: tuple[str, ...] = CHANNELS
        elif ptag == "message" or ptag in _TEXT_ONLY:
            raise self._fail(self.hdr_pos, f"element <{tag}> not allowed inside <{ptag}> (text only)")
        else:
            allowed = _ALLOWED_CHILDREN[ptag]
        if tag not in allowed:
            where = "at top level" if ptag == "#root" else f"inside <{ptag}>"
            raise self._fail(first, f"element <{tag}> not allowed {where}")
        if ptag == "#root" and not self.context and parent.children:
            raise self._fail(self.hdr_pos, "a completion holds one message")

        def bad(key: str, msg: str) -> XTMLParseError:
            return self._fail(at(offs[key]) if key in offs else first, msg)

        def need(*keys: str) -> None:
            for k in keys:
                if k not in attrs:
                    raise self._fail(first, f"<{tag}> needs attribute {k!r}")

        def only(*keys: str) -> None:
            for k in attrs:
                if k not in keys:
                    raise bad(k, f"unexpected attribute {k!r} on <{tag}>")

        if tag == "message":
            need("role")
            role = attrs["role"]
            if role not in ROLES:
                raise bad("role", f"unknown role {role!r}")
            if not self.context and role != "assistant":
                raise bad("role", f"a completion must be an assistant message, got role {role!r}")
            if role == "assistant":
                only("role")
                self._reset_message()
            elif role == "user":
                only("role", "name")
            elif role == "system":
                only("role", "name", "type")
                if "type" in attrs and attrs["type"] not in OPTION_TYPES:
                    raise bad("type", f"unknown option type {attrs['type']!r}")
            else:
                need("tool", "index")
                only("role", "tool", "index")
                idx = attrs["index"]
                if not idx.isdigit() or int(idx) < 1:
                    raise bad("index", f"tool result index must be a positive integer, got {idx!r}")
                k = int(idx)
                if self.last_calls is not None:
                    if k > len(self.last_calls):
                        raise bad("index", f"tool result index {k} has no call in the preceding assistant message")
                    if k <= self.last_result:
                        raise bad("index", f"tool result index {k} out of call order")
                    if attrs["tool"] != self.last_calls[k - 1]:
                        want = self.last_calls[k - 1]
                        raise bad("tool", f"tool {attrs['tool']!r} does not match call {k} ({want!r})")
                self.last_result = k
        elif tag in CHANNELS:
            only()
            seen = [c for c in parent.children if c in CHANNELS]
            if tag in seen:
                raise self._fail(first, f"duplicate channel <{tag}>")
            if seen and CHANNELS.index(seen[-1]) > CHANNELS.index(tag):
                raise self._fail(first, f"channel <{tag}> after <{seen[-1]}>")
        elif tag == "call":
            need("tool", "index")
            only("tool", "index")
            if not attrs["tool"]:
                raise bad("tool", "empty tool name")
            expect = len(parent.children) + 1
            if attrs["index"] != str(expect):
                raise bad("index", f"call index {attrs['index']!r}, expected {expect}")
            self.call_args, self.call_raw = {}, None
            events.append(ToolCallStart(expect, attrs["tool"]))
        elif tag == "argument":
            need("key", "type")
            only("key", "type")
            if attrs["type"] not in ARG_TYPES:
                raise bad("type", f"unknown argument type {attrs['type']!r}")
            if "json" in parent.children:
                raise self._fail(self.hdr_pos, "argument after a json fallback block")
            if attrs["key"] in self.call_args:
                raise bad("key", f"duplicate argument {attrs['key']!r}")
        elif tag == "json":
            need("type")
            only("type")
            if attrs["type"] not in ARG_TYPES:
                raise bad("type", f"unknown json type {attrs['type']!r}")
            if parent.children:
                raise self._fail(self.hdr_pos, "a json fallback block must be the only child of <call>")
        self._open_frame(events, _Frame(tag, attrs, self.hdr_pos))

    def _finish_close(self, events: list[Event], sep_pos: int) -> None:
        self.state = "body"
        text, first = self._header_text(sep_pos)
        top = self.stack[-1]
        if text != top.tag:
            raise self._fail(first, f"mismatched close tag: expected {top.tag!r}, got {text!r}")
        body = decode(self.x.tokenizer, top.text_ids) if top.tag in _TEXT_ONLY else ""
        self.stack.pop()
        parent = self.stack[-1]
        tag = top.tag
        if tag in ("think", "response"):
            if top.stream is not None:
                delta = top.stream.flush()
                if delta:
                    events.append(TextDelta(tag, delta))
            if tag == "think":
                self.reasoning = body
            else:
                self.content = body
        elif tag == "argument":
            try:
                value = _decode_arg(body, top.attrs["type"])
            except json.JSONDecodeError as e:
                # an empty body points at the closing <|close|> (hdr_pos of this close header)
                p = self._char_pos(top.text_ids, top.text_pos, e.pos) if top.text_ids else self.hdr_pos
                msg = f"argument {top.attrs['key']!r}: invalid JSON for type {top.attrs['type']}: {e.msg}"
                raise self._fail(p, msg) from None
            except ValueError as e:
                p = top.text_pos if top.text_ids else self.hdr_pos
                raise self._fail(p, f"argument {top.attrs['key']!r}: {e}") from None
            self.call_args[top.attrs["key"]] = value
        elif tag == "json":
            self.call_raw = body
        elif tag == "call":
            index = int(top.attrs["index"])
            name = top.attrs["tool"]
            if self.call_raw is not None:
                arguments, typed = self.call_raw, None
            else:
                typed = dict(self.call_args)
                arguments = json.dumps(typed, ensure_ascii=False)
            call = {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}
            self.calls.append(call)
            events.append(ToolCall(index, name, typed, call))
        elif tag == "message":
            if top.attrs.get("role") == "assistant":
                self.last_calls = [c["function"]["name"] for c in self.calls]
                self.last_result = 0
            self.state = "need_eom"
        if tag in CHANNELS and parent.tag == "message":
            events.append(ChannelClose(tag, body))

    def finish(self, partial: bool = False) -> None:
        """Check the end of input; XTMLParseError at ``len(ids)`` if elements are left open."""
        if self.error is not None:
            raise self.error
        if partial or self.state in ("done", "need_eom"):
            return
        if self.state == "start":
            raise self._fail(self.pos, "empty completion")
        if self.state in ("open_hdr", "close_hdr"):
            raise self._fail(self.pos, "unexpected end of input inside a header")
        if len(self.stack) == 1:
            return
        # A context may end with a bare generation prefix.
        if (
            self.context
            and len(self.stack) == 3
            and self.stack[1].tag == "message"
            and self.stack[1].attrs.get("role") == "assistant"
            and self.stack[1].children == [self.stack[2].tag]
            and not self.stack[2].text_ids
        ):
            return
        raise self._fail(self.pos, f"unexpected end of input: <{self.stack[-1].tag}> not closed")


# --------------------------------------------------------------------------- the template


class StreamParser:
    """Incremental parser of one sampled assistant message (see `XTML.stream`)."""

    def __init__(self, x: "XTML", mode: str = "think") -> None:
        self._m = _Machine(x, context=False, mode=mode, stream=True, after_prefix=True)

    def feed(self, token_id: int) -> list[Event]:
        """Consume one token; return the events it completes. XTMLParseError if malformed."""
        return self._m.feed(token_id)

    def finish(self, partial: bool = False) -> dict[str, Any]:
        """End of stream: the parsed message (XTMLParseError if incomplete and not ``partial``)."""
        self._m.finish(partial)
        return self._m.message()

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message parsed so far."""
        return self._m.message()


class XTML:
    """XTML rendering and parsing bound to a tokenizer holding the XTML special tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        ids = special_ids(tokenizer)
        self.open_id, self.close_id, self.sep_id, self.eom_id = (ids[t] for t in SPECIAL_TOKENS)
        self.pad_id = ids[PAD_TOKEN]
        self._ids = ids
        self._kind: dict[int, str] = {v: k for k, v in ids.items()}

    # ------------------------------------------------------------------ rendering
    def _encode(self, b: _Builder) -> Rendered:
        ids: list[int] = []
        midx: list[int] = []
        mask: list[bool] = []
        for p in b.pieces:
            toks = [self._ids[p.value]] if p.special else encode_text(self.tokenizer, p.value)
            ids.extend(toks)
            midx.extend([p.message] * len(toks))
            mask.extend([p.train] * len(toks))
        return Rendered(ids, midx, mask)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        effort: str | None = None,
        mode: str = "think",
        add_generation_prompt: bool = False,
        tool_choice: Any = None,
        response_format: Any = None,
    ) -> Rendered:
        """Render a conversation to token ids with message indices and the loss mask.

        Args:
            messages: OpenAI chat messages. ``content`` is a string, None or a list
                of ``{"type": "text", "text": ...}`` parts; system/user may carry
                ``name``; assistant messages carry ``reasoning_content`` and
                ``tool_calls`` (``function.arguments`` a JSON string or a dict; an
                empty string means ``{}``; anything that is not a JSON object is
                written as a loss-masked JSON-fallback block). A tool result binds
                to a call of the preceding assistant message by ``index`` (1-based),
                else by ``tool_call_id``, else by position; results must follow
                call order; ``name``, if given, must match the call. The input
                option message ``{"role": "system", "type": "tool-declare",
                "tools": [...]}`` announces tools mid-session.
            tools: OpenAI function specs, declared in a global tool-declare
                message (None or an empty list: no declaration).
            effort: ``"low" | "high" | "max"`` thinking effort (think mode only).
            mode: ``"think"`` or ``"instruct"``.
            add_generation_prompt: append the generation prefix.
            tool_choice: OpenAI tool_choice (one-shot option).
            response_format: OpenAI response_format (one-shot option).
        """
        b = _build(
            messages,
            tools=tools,
            effort=effort,
            mode=mode,
            add_generation_prompt=add_generation_prompt,
            tool_choice=tool_choice,
            response_format=response_format,
        )
        return self._encode(b)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        effort: str | None = None,
        mode: str = "think",
        add_generation_prompt: bool = False,
        tool_choice: Any = None,
        response_format: Any = None,
    ) -> str:
        """Same as the module-level `render_text`."""
        return render_text(
            messages,
            tools=tools,
            effort=effort,
            mode=mode,
            add_generation_prompt=add_generation_prompt,
            tool_choice=tool_choice,
            response_format=response_format,
        )

    def generation_prefix(self, mode: str = "think") -> list[int]:
        """Ids of ``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`` (or ``response``)."""
        _check_mode(mode)
        b = _Builder()
        _append_generation_prefix(b, 0, mode)
        return self._encode(b).ids

    # ------------------------------------------------------------------ parsing
    def parse(
        self, ids: Sequence[int], *, mode: str = "think", partial: bool = False, after_prefix: bool = False
    ) -> dict[str, Any]:
        """Parse one assistant message from ids.

        Accepts a full message (with its header), a message body starting at a
        channel header, or a completion sampled after the generation prefix
        (starting inside ``think``, or ``response`` in instruct mode). With
        ``after_prefix=True`` the ids are taken as such a completion only: the
        channel the prefix opened is open, so a first ``<|open|>`` is a nested
        element (an error), exactly as the same tokens parse inside the rendered
        context (`extend`, `annotate`). The trailing ``<|end_of_msg|>`` is
        optional. With ``partial=True`` an unfinished message returns what has
        been parsed.

        Returns:
            ``{"role": "assistant", "reasoning_content": str | None, "content": str,
            "tool_calls": [{"id": "call_<i>", "type": "function",
            "function": {"name": str, "arguments": JSON str}}]}``; a JSON-fallback
            call keeps its raw body as ``arguments``.

        Raises:
            XTMLParseError: naming the first malformed token position.
        """
        m = _Machine(self, context=False, mode=mode, stream=False, after_prefix=after_prefix)
        for t in ids:
            m.feed(int(t))
        m.finish(partial)
        return m.message()

    def stream(self, mode: str = "think") -> StreamParser:
        """A `StreamParser` for a completion sampled after the generation prefix (as
        ``parse(..., after_prefix=True)``: the tokens parse as they will inside the context)."""
        return StreamParser(self, mode)

    def validate(self, ids: Sequence[int], *, mode: str = "think", partial: bool = False) -> ValidationResult:
        """Check ids and report the first malformed token.

        A sequence starting with a ``message`` header is checked as a context
        (any roles; it may end in a generation prefix); anything else as a
        completion (see `parse`). ``partial=True`` accepts a premature end.
        """
        ids = [int(t) for t in ids]
        context = False
        if ids and ids[0] == self.open_id:
            j = 1
            while j < len(ids) and ids[j] not in self._kind:
                j += 1
            context = re.match(r"message(\s|$)", decode(self.tokenizer, ids[1:j])) is not None
        m = _Machine(self, context=context, mode=mode, stream=False)
        try:
            for t in ids:
                m.feed(t)
            m.finish(partial)
        except XTMLParseError as e:
            return ValidationResult(False, e.position, e.message)
        return ValidationResult(True, None, "ok")

    # ------------------------------------------------------------------ multi-turn
    def _messages_of(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) spans of the messages in ids (split after each <|end_of_msg|>)."""
        spans: list[tuple[int, int]] = []
        start = 0
        for k, t in enumerate(ids):
            if t == self.eom_id:
                spans.append((start, k + 1))
                start = k + 1
        if start < len(ids):
            spans.append((start, len(ids)))
        return spans

    def annotate(self, ids: Sequence[int]) -> Rendered:
        """Recover message indices and the loss mask of a rendered (+ sampled) context.

        Same rules as `render`: option messages get -1 (a ``tool-declare`` after
        the first input message counts as an input message), assistant tokens
        after their first channel header are trainable, JSON-fallback blocks are not.
        """
        ids = [int(t) for t in ids]
        midx: list[int] = []
        mask: list[bool] = []
        count = 0
        seen_input = False
        for s, e in self._messages_of(ids):
            if ids[s] != self.open_id:
                raise ValueError(f"token {s}: expected {OPEN} at the start of a message")
            k = s + 1
            while k < e and ids[k] != self.sep_id:
                k += 1
            try:
                tag, attrs, _ = _parse_header(decode(self.tokenizer, ids[s + 1 : k]))
            except _HeaderError as err:
                raise ValueError(f"token {s}: bad message header: {err.message}") from None
            if tag != "message":
                raise ValueError(f"token {s}: expected a message element, got <{tag}>")
            mtype = attrs.get("type")
            if mtype in ("thinking-effort", "tool-choice", "response-format") or (
                mtype == "tool-declare" and not seen_input
            ):
                index = -1
            else:
                index, count, seen_input = count, count + 1, True
            midx.extend([index] * (e - s))
            mmask = [False] * (e - s)
            if attrs.get("role") == "assistant":
                first = k + 1  # first channel header starts here
                j = first
                while j < e and ids[j] != self.sep_id:
                    j += 1
                j += 1
                while j < e:
                    mmask[j - s] = True
                    if ids[j] == self.open_id:
                        h = j + 1
                        while h < e and ids[h] not in self._kind:
                            h += 1
                        if re.match(r"json(\s|$)", decode(self.tokenizer, ids[j + 1 : h])):
                            c = h
                            while c < e and ids[c] != self.close_id:
                                c += 1
                            while c < e and ids[c] != self.sep_id:
                                c += 1
                            for q in range(j, min(c + 1, e)):
                                mmask[q - s] = False
                            j = c + 1
                            continue
                    j += 1
            mask.extend(mmask)
        return Rendered(ids, midx, mask)

    def extend(
        self,
        ids: Sequence[int],
        new_messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        mode: str = "think",
    ) -> Rendered:
        """Append new messages to a context without re-rendering it.

        ``ids`` (prompt + sampled completion ending in ``<|end_of_msg|>``) are kept
        verbatim, even when the sample is not the canonical tokenization; their
        labels come from `annotate`. ``tools`` is shorthand for a leading input
        option message ``{"role": "system", "type": "tool-declare", "tools": tools}``.
        Tool results bind to the calls of the last assistant message in ``ids``
        (call ids are ``call_<index>``, as `parse` returns them).
        New messages get indices continuing those of ``ids``.
        """
        _check_mode(mode)
        ids = [int(t) for t in ids]
        if ids and ids[-1] != self.eom_id:
            raise ValueError(f"ids must end with {EOM} (a finished message) to be extended")
        base = self.annotate(ids)
        spans = self._messages_of(ids)
        start = 1 + max([i for i in base.message_index if i >= 0], default=-1)
        binding = _Binding()
        for s, e in spans:
            k = s + 1
            while k < e and ids[k] not in self._kind:
                k += 1
            try:
                _, attrs, _ = _parse_header(decode(self.tokenizer, ids[s + 1 : k]))
            except _HeaderError:
                continue
            if attrs.get("role") == "assistant":
                try:
                    msg = self.parse(ids[s:e], mode=mode)
                except XTMLParseError:
                    binding.calls, binding.next_pos = None, 0
                    continue
                binding.calls = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
                binding.next_pos = 0
            elif attrs.get("role") == "tool" and attrs.get("index", "").isdigit():
                binding.next_pos = max(binding.next_pos, int(attrs["index"]))
        msgs = list(new_messages)
        if tools:
            msgs.insert(0, {"role": "system", "type": "tool-declare", "tools": list(tools)})
        b = _Builder()
        _render_input(b, msgs, mode=mode, start_index=start, binding=binding)
        if add_generation_prompt:
            _append_generation_prefix(b, start + len(msgs), mode)
        tail = self._encode(b)
        return Rendered(
            base.ids + tail.ids, base.message_index + tail.message_index, base.loss_mask + tail.loss_mask
        )
