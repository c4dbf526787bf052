"""XTML, the K3 chat template (SPEC §1, report appendix F): render, parse, stream, validate.

The authority is Moonshot's encoder as shipped (``encoding_k3.py``, vendored in vLLM as
``vllm/tokenizers/encoding_k3.py``): every conversation it accepts renders here to the same
text, cut into the same text segments (so any tokenizer gives the same ids). k3post adds the
loss mask, parsing, streaming, validation and extension; the intentional differences are listed
in ``docs/decisions.md`` ("XTML conformance with the shipped K3 encoder").

XTML is XML whose angle brackets are special tokens. An element is

    <|open|>tag k1="v1" k2="v2"<|sep|>BODY<|close|>tag<|sep|>

and every message is one ``message`` element followed by ``<|end_of_msg|>``.
Attribute values escape ``&`` as ``&amp;`` and ``"`` as ``&quot;`` (in that order);
no other entity is valid.

Context order (SPEC §1.2):

1. global option messages (message index -1): ``tool-declare`` when ``tools``
   are given, then ``thinking-effort`` in think mode (``effort`` None means
   `DEFAULT_EFFORT`, as the shipped encoder; `OMIT_EFFORT` leaves the message out,
   a k3post extension for effort-blind MOPD teachers);
2. the input messages (index = position in ``messages``). A system message that
   carries a non-empty ``tools`` list announces tools mid-session (an *input option
   message*, `is_tool_declaration`), rendered with the shipped "New Tools Available"
   body; its ``content`` is not rendered. ``developer`` messages render nothing, as
   in the shipped encoder (k3post warns). Tool results are re-sorted into call
   order by ``tool_call_id`` and numbered 1, 2, ... after each assistant message;
3. one-shot option messages (index -1): ``tool-choice`` (``required``, ``none``)
   and ``response-format`` (``json_object``, ``json_schema``), the shipped wording;
   a named-function ``tool_choice`` renders nothing, as shipped;
4. the generation prefix (index ``len(messages)``), when asked for.

Ids are built segment by segment, with the shipped encoder's segment boundaries
(a tag name, `` key``, ``="``, a value, ``"``; each content part): every text run
between special tokens is encoded on its own with `k3post.tokenizer.encode_text`,
which never yields a special id, so no text (user, tool output, code in an
argument) can forge structure. An image content part is the one special id
`IMAGE_TOKEN`. `render_text` gives the same context as a string (special tokens
written literally), needs no tokenizer, and equals ``decode(render(...).ids)``.

Loss mask (SPEC §1.5): inside an assistant message, everything after its
generation prefix (``<|open|>message role="assistant"<|sep|>`` plus the first
channel header, ``<|open|>think<|sep|>`` or ``<|open|>response<|sep|>``) up to
and including ``<|end_of_msg|>`` is trainable, except JSON-fallback blocks
(``<|open|>json ...<|sep|>...<|close|>json<|sep|>``). Everything else is not.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from k3post.constants import DEFAULT_EFFORT, EFFORTS
from k3post.tokenizer import IMAGE_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, decode, encode_text, special_ids

__all__ = [
    "OPEN",
    "CLOSE",
    "SEP",
    "EOM",
    "EFFORTS",
    "DEFAULT_EFFORT",
    "OMIT_EFFORT",
    "IMAGE_TOKEN",
    "MODES",
    "ARG_TYPES",
    "OPTION_TYPES",
    "TOOL_DECLARE_TEMPLATE",
    "TOOL_DECLARE_DYNAMIC_TEMPLATE",
    "THINKING_EFFORT_TEMPLATE",
    "TOOL_CHOICE_NONE",
    "TOOL_CHOICE_REQUIRED",
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
    "text_segments",
    "parse_tool_arguments",
    "escape_attr",
    "is_tool_declaration",
]

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

# --------------------------------------------------------------------------- rendering


@dataclass
class _Piece:
    """One special token or text segment of a rendered context."""

    special: bool
    value: str
    message: int
    train: bool


@dataclass
class _Builder:
    """Accumulates pieces; ``msg`` and ``train`` label everything appended.

    Text is appended in the shipped encoder's segments (each encoded on its own): a header is the tag
    name, then `` key``, ``="``, the escaped value and ``"`` per attribute."""

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
        self.tx(tag)
        for k, v in attrs:
            self.tx(f" {k}")
            self.tx('="')
            self.tx(escape_attr(v))
            self.tx('"')
        self.sp(SEP)

    def close(self, tag: str) -> None:
        self.sp(CLOSE)
        self.tx(tag)
        self.sp(SEP)

    def content(self, parts: Sequence[tuple[bool, str]]) -> None:
        for image, text in parts:
            if image:
                self.sp(text)
            else:
                self.tx(text)

    def text_message(self, attrs: Sequence[tuple[str, str]], parts: Sequence[tuple[bool, str]]) -> None:
        self.open("message", attrs)
        self.content(parts)
        self.close("message")
        self.sp(EOM)


@dataclass
class _Binding:
    """Calls of the most recent assistant message, for binding tool results."""

    calls: list[tuple[str | None, str | None]] | None = None  # (call id, tool name) per call, in order
    count: int = 0  # tool results rendered since that assistant message (the next result's index - 1)


def _tool_declare_body(tools: Any, where: str, *, dynamic: bool = False) -> str:
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"{where}: tools must be a list of OpenAI function specs, got {type(tools).__name__}")
    template = TOOL_DECLARE_DYNAMIC_TEMPLATE if dynamic else TOOL_DECLARE_TEMPLATE
    return template.format(tools=_compact_json(list(tools)))


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
            return None  # the shipped encoder writes no message for a named function
    raise ValueError(
        "tool_choice must be None, 'auto', 'none', 'required' or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
    )


def _response_schema(response_format: Mapping[str, Any]) -> Any:
    """The schema of a ``json_schema`` response format, found where the shipped encoder looks:
    ``json_schema.schema``, else ``json_schema.json_schema``, else ``json_schema`` itself (None: absent)."""
    spec = response_format.get("json_schema")
    if isinstance(spec, Mapping):
        return spec.get("schema", spec.get("json_schema", spec))
    return spec


def _response_format_body(response_format: Any) -> str | None:
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return RESPONSE_FORMAT_JSON_OBJECT
    if kind == "json_schema":
        schema = _response_schema(response_format) if isinstance(response_format, Mapping) else None
        return RESPONSE_FORMAT_JSON_SCHEMA.format(schema=_compact_json(schema))
    raise ValueError(
        "response_format must be None or {'type': 'text' | 'json_object' | 'json_schema', ...}, "
        f"got {response_format!r}"
    )


def _name_attr(m: Mapping[str, Any], role: str) -> list[tuple[str, str]]:
    """``[("role", role)]`` plus ``("name", ...)`` when the message has a non-empty name (as shipped)."""
    name = m.get("name")
    return [("role", role), ("name", str(name))] if name else [("role", role)]


def _render_assistant(b: _Builder, m: Mapping[str, Any], i: int, mode: str, binding: _Binding) -> None:
    where = f"message {i} (assistant)"
    b.train = False
    b.open("message", _name_attr(m, "assistant"))
    b.open("think" if mode == "think" else "response")
    b.train = True
    if mode == "think":
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None and str(reasoning).strip():  # whitespace only: an empty think channel
            b.tx(str(reasoning))
        b.close("think")
        b.open("response")
    b.content(_content_parts(m.get("content"), where))
    b.close("response")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}: tool_calls must be a list")
    bound: list[tuple[str | None, str | None]] = []
    if calls:
        b.open("tools")
        for k, call in enumerate(calls, start=1):
            cw = f"{where}, tool call {k}"
            name, cid, args = _tool_call_parts(call, cw)
            bound.append((cid, name))
            b.open("call", [("tool", name), ("index", str(k))])
            fallback: str | None = None
            if args is None:
                args = {}
            elif isinstance(args, str):
                if args.strip() == "":
                    args = {}
                else:
                    try:
                        parsed = json.loads(args)
                    except (ValueError, RecursionError):  # not JSON, an over-long integer, nested too deeply
                        parsed = None
                    if isinstance(parsed, dict):
                        args = parsed
                    else:
                        fallback = args
            elif not isinstance(args, Mapping):
                fallback = _arg_text(args, "array", cw)
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
    binding.count = 0


def _render_tool_result(b: _Builder, m: Mapping[str, Any], i: int, binding: _Binding, bound_name: str | None) -> None:
    """A tool result: ``index`` counts the results since the last assistant message (as shipped); the
    tool name is the call's its ``tool_call_id`` bound it to, else ``tool`` / ``name``, else the call at
    that count."""
    where = f"message {i} (tool)"
    binding.count += 1
    name = bound_name if bound_name is not None else m.get("tool", m.get("name"))
    calls = binding.calls
    if name is None and calls is not None and binding.count <= len(calls):
        name = calls[binding.count - 1][1]
    if name is None:
        raise ValueError(
            f"{where}: no tool name: give 'name', or a 'tool_call_id' of a call of the preceding assistant "
            f"message, or answer its calls in order (this is result {binding.count}"
            + (f" of {len(calls)} call(s))" if calls is not None else "; no assistant message with calls precedes it)")
        )
    b.text_message(
        [("role", "tool"), ("tool", str(name)), ("index", str(binding.count))],
        _content_parts(m.get("content"), where),
    )


def _call_positions(calls: Sequence[tuple[str | None, str | None]]) -> dict[str, tuple[int, str | None]]:
    """``str(call id) -> (1-based position, tool name)``; the first of duplicate ids wins."""
    out: dict[str, tuple[int, str | None]] = {}
    for pos, (cid, name) in enumerate(calls, start=1):
        if cid is not None:
            out.setdefault(str(cid), (pos, name))
    return out


def _raw_calls(m: Mapping[str, Any]) -> list[tuple[str | None, str | None]]:
    """(id, name) of each entry of an assistant message's ``tool_calls``, leniently (for binding only;
    rendering the message checks them)."""
    calls = m.get("tool_calls") or []
    out: list[tuple[str | None, str | None]] = []
    for call in calls if isinstance(calls, (list, tuple)) else []:
        if not isinstance(call, Mapping):
            out.append((None, None))
            continue
        fn = call.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else call.get("name")
        out.append((call.get("id"), name))
    return out


def _in_call_order(
    messages: Sequence[Any], start_index: int, calls: list[tuple[str | None, str | None]] | None
) -> list[tuple[int, Any, str | None]]:
    """``(index, message, bound tool name)`` in render order: each run of consecutive tool results whose
    ``tool_call_id`` (or ``id``) all match calls of the most recent assistant message is sorted into call
    order and takes those calls' names (the shipped encoder's re-sort); any other run stays as given."""
    out: list[tuple[int, Any, str | None]] = []
    positions = _call_positions(calls or [])
    j = 0
    while j < len(messages):
        m = messages[j]
        role = m.get("role") if isinstance(m, Mapping) else None
        if role != "tool":
            if role == "assistant":
                positions = _call_positions(_raw_calls(m))
            out.append((start_index + j, m, None))
            j += 1
            continue
        run: list[tuple[tuple[int, str | None] | None, int, Any]] = []
        while j < len(messages) and isinstance(messages[j], Mapping) and messages[j].get("role") == "tool":
            t = messages[j]
            cid = t.get("tool_call_id", t.get("id"))
            run.append((positions.get(str(cid)) if cid is not None else None, start_index + j, t))
            j += 1
        if any(match is None for match, _, _ in run):
            out.extend((i, t, None) for _, i, t in run)
        else:
            run.sort(key=lambda r: (r[0][0], r[1]))  # type: ignore[index]
            out.extend((i, t, match[1]) for match, i, t in run)  # type: ignore[index]
    return out


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
        if not isinstance(m, Mapping):
            raise ValueError(f"message {start_index + j} must be a dict, got {type(m).__name__}")
    for i, m, bound_name in _in_call_order(messages, start_index, binding.calls):
        role = m.get("role")
        b.msg = i
        b.train = False
        where = f"message {i} ({role})"
        if role == "assistant":
            _render_assistant(b, m, i, mode, binding)
        elif role == "tool":
            _render_tool_result(b, m, i, binding, bound_name)
        elif is_tool_declaration(m):
            b.text_message(
                [("role", "system"), ("type", "tool-declare")],
                [(False, _tool_declare_body(m["tools"], where, dynamic=True))],
            )
        elif role in ("system", "user"):
            b.text_message(_name_attr(m, role), _content_parts(m.get("content"), where))
        elif role == "developer":
            warnings.warn(
                f"{where}: the K3 encoder renders no 'developer' message; its content is not in the context "
                "(send it as role 'system' to keep it)",
                UserWarning,
                stacklevel=3,
            )
        else:
            raise ValueError(f"message {i}: unknown role {role!r} (expected one of {(*ROLES, 'developer')})")


def _effort_of(effort: str | None, mode: str) -> str | None:
    """The effort whose thinking-effort message a context gets: ``DEFAULT_EFFORT`` for None in think mode,
    None for `OMIT_EFFORT` or instruct mode; ValueError for anything else that is not an effort."""
    if mode != "think":
        if effort not in (None, OMIT_EFFORT):
            raise ValueError(f"effort={effort!r} needs mode='think' (thinking effort has no meaning in instruct mode)")
        return None
    if effort == OMIT_EFFORT:
        return None
    effort = DEFAULT_EFFORT if effort is None else effort
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {EFFORTS}, None (= {DEFAULT_EFFORT!r}) or OMIT_EFFORT, got {effort!r}")
    return effort


def _build(
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    effort: str | None = None,
    mode: str = "think",
    add_generation_prompt: bool = False,
    tool_choice: Any = None,
    response_format: Any = None,
) -> _Builder:
    """Pieces of a full context (all four zones)."""
    _check_mode(mode)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of OpenAI chat messages")
    effort = _effort_of(effort, mode)
    b = _Builder()
    if tools:
        b.text_message([("role", "system"), ("type", "tool-declare")], [(False, _tool_declare_body(tools, "tools"))])
    if effort is not None:
        b.text_message(
            [("role", "system"), ("type", "thinking-effort")], [(False, THINKING_EFFORT_TEMPLATE.format(effort=effort))]
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
        b.text_message([("role", "system"), ("type", "tool-choice")], [(False, body)])
    body = _response_format_body(response_format)
    if body is not None:
        b.text_message([("role", "system"), ("type", "response-format")], [(False, body)])


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


def text_segments(messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[str]:
    """The text segments of a context, in order: each is encoded on its own (`XTML.render`), so a tokenizer
    for XTML learns its merges from these (`k3post.tokenizer.train_tokenizer`). Keyword args are those
    of `render_text`."""
    return [p.value for p in _build(messages, **kwargs).pieces if not p.special]


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
_ENTITIES = {"&amp;": "&", "&quot;": '"'}


def _parse_header(text: str) -> tuple[str, dict[str, str], dict[str, int]]:
    """(tag, attrs, attr char offsets) of header text; _HeaderError(offset, msg) if malformed."""
    m = _NAME.match(text)
    if not m:
        raise _HeaderError(0, f"missing or invalid tag name in header {_shown(text)}")
    tag = m.group()
    i = m.end()
    attrs: dict[str, str] = {}
    offsets: dict[str, int] = {}
    while i < len(text):
        if text[i] != " ":
            raise _HeaderError(i, f"bad attribute syntax in header {_shown(text)}: expected a space")
        i += 1
        start = i
        m = _NAME.match(text, i)
        if not m:
            raise _HeaderError(i, f"bad attribute syntax in header {_shown(text)}: invalid attribute name")
        key = m.group()
        i = m.end()
        if text[i : i + 2] != '="':
            raise _HeaderError(i, f'bad attribute syntax in header {_shown(text)}: expected =" after {key}')
        i += 2
        buf: list[str] = []
        while True:
            if i >= len(text):
                raise _HeaderError(start, f"bad attribute syntax in header {_shown(text)}: unterminated value of {key}")
            c = text[i]
            if c == "&":
                entity = next((e for e in _ENTITIES if text.startswith(e, i)), None)
                if entity is None:
                    raise _HeaderError(i, f"bad attribute syntax in header {_shown(text)}: '&' must start &amp; or &quot;")
                buf.append(_ENTITIES[entity])
                i += len(entity)
                continue
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
    """Incremental decoder: emits only complete characters (multi-byte safe), in linear time.

    Text is held while it ends in U+FFFD (a character may still be completing). A character is at most
    4 bytes, so at most its last 3 bytes (3 tokens) can still change: when more than `_HOLD` tokens are
    held, everything but the last `_KEEP` is emitted, if decoding it apart gives the same text (so a run
    of bytes that never forms a character costs O(1) a token, not the whole run; issue 20).
    """

    _HOLD = 8
    _KEEP = 4

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.emitted: list[str] = []

    def _emit(self, delta: str, prefix: int, read: int) -> str:
        self.prefix, self.read = prefix, read
        self.emitted.append(delta)
        return delta

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        prefix_text = decode(self.tokenizer, self.ids[self.prefix : self.read])
        new_text = decode(self.tokenizer, self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            return self._emit(new_text[len(prefix_text) :], self.read, len(self.ids))
        cut = len(self.ids) - self._KEEP
        if cut - self.prefix > self._HOLD - self._KEEP and cut > self.read:
            head = decode(self.tokenizer, self.ids[self.prefix : cut])
            if head.startswith(prefix_text) and head + decode(self.tokenizer, self.ids[cut:]) == new_text:
                return self._emit(head[len(prefix_text) :], cut, cut)
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
        lo, hi = 1, len(ids)  # the decoded length grows with k: bisect (a long header stays O(n log n))
        if hi == 0 or len(decode(self.x.tokenizer, ids)) <= offset:
            return first + max(len(ids) - 1, 0)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(self.x.tokenizer, ids[:mid])) > offset:
                hi = mid
            else:
                lo = mid + 1
        return first + lo - 1

    # ------------------------------------------------------------------ feeding
    def feed(self, tid: int) -> list[Event]:
        """Consume one token; return the events it completes (XTMLParseError if malformed)."""
        if self.error is not None:
            raise self.error
        pos = self.pos
        self.pos += 1
        tid = int(tid)
        if not 0 <= tid < self.x.vocab_size:
            raise self._fail(pos, f"id {tid} is not a token of the tokenizer (vocabulary size {self.x.vocab_size})")
        kind = self.x._kind.get(tid)
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
            return events + self._feed_body(tid, kind, pos)
        if st in ("open_hdr", "close_hdr"):
            if kind is None:
                self.hdr_ids.append(tid)
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
        return self._feed_body(tid, kind, pos)

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
            raise self._fail(first, f"unknown tag {_shown(tag)}")
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
                only("role", "name")
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
                    # the encoder numbers the results after an assistant message 1, 2, ... (a result may
                    # skip a call); stricter than the encoder: no more results than calls, names of calls
                    if k != self.last_result + 1:
                        raise bad("index", f"tool result index {k}, expected {self.last_result + 1}")
                    if k > len(self.last_calls):
                        raise bad("index", f"tool result index {k} has no call in the preceding assistant message")
                    if attrs["tool"] not in self.last_calls:
                        raise bad("tool", f"tool {attrs['tool']!r} matches no call of the preceding assistant message")
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
            raise self._fail(first, f"mismatched close tag: expected {top.tag!r}, got {_shown(text)}")
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
        self.vocab_size = len(tokenizer)  # ids outside [0, vocab_size) are malformed input, not text
        ids = special_ids(tokenizer)
        self.open_id, self.close_id, self.sep_id, self.eom_id = (ids[t] for t in SPECIAL_TOKENS)
        self.pad_id = ids[PAD_TOKEN]
        self.image_id: int | None = ids.get(IMAGE_TOKEN)
        self._ids = ids
        # structure tokens, and the pad where it is an id of its own (an image id is text to the parser)
        self._kind: dict[int, str] = {ids[t]: t for t in SPECIAL_TOKENS}
        if self.pad_id not in self._kind:
            self._kind[self.pad_id] = PAD_TOKEN

    # ------------------------------------------------------------------ rendering
    def _encode(self, b: _Builder) -> Rendered:
        ids: list[int] = []
        midx: list[int] = []
        mask: list[bool] = []
        for p in b.pieces:
            if p.special and p.value not in self._ids:
                raise ValueError(
                    f"message {p.message}: an image content part needs the tokenizer to have the {p.value!r} token "
                    "(k3post.tokenizer.train_tokenizer gives it id 5; add it to a foreign tokenizer as a special token)"
                )
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
            messages: OpenAI chat messages, rendered as the shipped K3 encoder does.
                ``content`` is a string, None or a list of parts (``{"type": "text",
                "text": ...}``; ``image`` / ``image_url`` parts become `IMAGE_TOKEN`);
                system/user/assistant messages may carry ``name``; assistant messages
                carry ``reasoning_content`` (or ``reasoning``; whitespace only renders an
                empty think channel) and ``tool_calls`` (``function.arguments`` a JSON
                string, a dict or None; empty means ``{}``; anything that is not a JSON
                object is written as a loss-masked JSON-fallback block). Tool results
                after an assistant message are numbered 1, 2, ... (``index``); a run of
                results whose ``tool_call_id`` all match that message's calls is first
                sorted into call order and takes the calls' names; otherwise a result's
                name is its ``tool`` / ``name``, else that of the call at its number. A
                system message with a non-empty ``tools`` list announces tools
                mid-session (`is_tool_declaration`). ``developer`` messages render
                nothing (a warning says so).
            tools: OpenAI function specs, declared in a global tool-declare
                message (None or an empty list: no declaration).
            effort: ``"low" | "high" | "max"`` thinking effort (think mode only); None
                means `DEFAULT_EFFORT` in think mode; `OMIT_EFFORT` writes no message.
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
            while j < len(ids) and ids[j] not in self._kind and 0 <= ids[j] < self.vocab_size:
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

        Same rules as `render`: option messages get -1 (a mid-session ``tool-declare``,
        told apart by its body, is an input message), assistant tokens after their
        first channel header are trainable, JSON-fallback blocks are not. Messages
        are numbered in the order they appear, which is `render`'s numbering unless
        it dropped a ``developer`` message or re-sorted tool results.
        """
        ids = [int(t) for t in ids]
        bad = next((k for k, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token {bad}: id {ids[bad]} is not a token of the tokenizer (vocabulary size {self.vocab_size})")
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
            dynamic = mtype == "tool-declare" and decode(self.tokenizer, ids[k + 1 : e]).startswith(
                TOOL_DECLARE_DYNAMIC_TEMPLATE.split("\n", 1)[0]
            )
            if mtype in ("thinking-effort", "tool-choice", "response-format") or (
                mtype == "tool-declare" and not dynamic and not seen_input
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
        option message ``{"role": "system", "tools": tools}``.
        Tool results bind to the calls of the last assistant message in ``ids``
        (call ids are ``call_<index>``, as `parse` returns them) and are numbered on
        from the results already there; only the new results are re-sorted.
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
                    binding.calls, binding.count = None, 0
                    continue
                binding.calls = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
                binding.count = 0
            elif attrs.get("role") == "tool":
                binding.count += 1
        msgs = list(new_messages)
        if tools:
            msgs.insert(0, {"role": "system", "tools": list(tools)})
        b = _Builder()
        _render_input(b, msgs, mode=mode, start_index=start, binding=binding)
        if add_generation_prompt:
            _append_generation_prefix(b, start + len(msgs), mode)
        tail = self._encode(b)
        return Rendered(
            base.ids + tail.ids, base.message_index + tail.message_index, base.loss_mask + tail.loss_mask
        )
