"""XTML, the K3 chat template (SPEC §1, report appendix F): render, parse, stream, validate.

The package: `format` (tokens, modes, option messages, shared helpers), `render` (messages to a context),
`events` (what rendering and parsing return), `parse` (the parser and the streaming parser), `template` (`XTML`,
bound to a tokenizer). Everything public is importable from ``k3post.xtml``.

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

from k3post.constants import DEFAULT_EFFORT, EFFORTS
from k3post.tokenizer import IMAGE_TOKEN
from k3post.xtml.events import (
    ChannelClose, ChannelOpen, Event, MessageEnd, Rendered, TextDelta, ToolCall, ToolCallStart, ValidationResult,
    XTMLParseError,
)
from k3post.xtml.format import (
    ARG_TYPES, CLOSE, EOM, MODES, OMIT_EFFORT, OPEN, OPTION_TYPES, RESPONSE_FORMAT_JSON_OBJECT,
    RESPONSE_FORMAT_JSON_SCHEMA, SEP, THINKING_EFFORT_TEMPLATE, TOOL_CHOICE_NONE, TOOL_CHOICE_REQUIRED,
    TOOL_DECLARE_DYNAMIC_TEMPLATE, TOOL_DECLARE_TEMPLATE, escape_attr, is_tool_declaration, parse_tool_arguments,
)
from k3post.xtml.parse import StreamParser
from k3post.xtml.render import render_text, text_segments
from k3post.xtml.template import XTML

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
