"""What XTML rendering and parsing hand back: `Rendered` (ids, loss mask), `ValidationResult`, `XTMLParseError`
(with the token position) and the streaming events (`ChannelOpen` ... `MessageEnd`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any



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
