"""XTML parsing: one state machine over token ids for whole contexts, one assistant message and the streaming
parser (`StreamParser`, events as tokens arrive), with errors that name the token position."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from k3post.tokenizer import PAD_TOKEN, decode
from k3post.xtml.events import (ChannelClose, ChannelOpen, Event, MessageEnd, TextDelta, ToolCall, ToolCallStart,
                                XTMLParseError)
from k3post.xtml.format import (ARG_TYPES, CHANNELS, CLOSE, EOM, KNOWN_TAGS, OPEN, OPTION_TYPES, ROLES, SEP, _check_mode,
                                _decode_arg, _shown)

if TYPE_CHECKING:
    from k3post.xtml.template import XTML

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
