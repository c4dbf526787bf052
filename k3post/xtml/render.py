"""XTML rendering (SPEC §1.2, §1.5): messages, tools and options to the pieces of a context, its text
(`render_text`, `text_segments`) and, through `k3post.xtml.template.XTML.render`, its ids and loss mask."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


from k3post.constants import DEFAULT_EFFORT, EFFORTS
from k3post.xtml.format import (CLOSE, EOM, OMIT_EFFORT, OPEN, RESPONSE_FORMAT_JSON_OBJECT, RESPONSE_FORMAT_JSON_SCHEMA,
                                ROLES, SEP, THINKING_EFFORT_TEMPLATE, TOOL_CHOICE_NONE, TOOL_CHOICE_REQUIRED,
                                TOOL_DECLARE_DYNAMIC_TEMPLATE, TOOL_DECLARE_TEMPLATE, _arg_text, _arg_type, _check_mode,
                                _compact_json, _content_parts, _tool_call_parts, escape_attr, is_tool_declaration)

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
