"""Mock personal-assistant apps (mail, calendar, docs) over one JSON state, exposed as tools.

State layout (all JSON)::

    {"user": {"name": "Alex Kim", "email": "alex@example.com"},
     "mail": {"inbox": [{"id", "from", "from_name", "subject", "body", "date"}], "sent": [{"to", "subject", "body"}]},
     "calendar": [{"id", "title", "date": "YYYY-MM-DD", "start": "HH:MM", "end": "HH:MM", "attendees": [...]}],
     "docs": [{"id", "title", "body"}]}

Tools (`APP_TOOLS`): ``mail_inbox``, ``mail_read``, ``mail_send``, ``calendar_list``,
``calendar_move``, ``calendar_cancel``, ``docs_list``, ``docs_read``. Read tools are marked
read-only. Handlers raise ValueError for bad ids / formats, which the environment turns into
``Error: ...`` observations for the model.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from k3post.envs.tools import ToolContext, ToolSpec

__all__ = ["APP_TOOLS", "event_line", "minutes", "hhmm", "weekday", "overlaps"]

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIME_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


def minutes(t: str) -> int:
    """``"HH:MM"`` → minutes since midnight."""
    h, m = t.split(":")
    return int(h) * 60 + int(m)


def hhmm(m: int) -> str:
    """Minutes since midnight → ``"HH:MM"``."""
    return f"{m // 60:02d}:{m % 60:02d}"


def weekday(date: str) -> str:
    """``"2026-03-05"`` → ``"Thursday"``."""
    return dt.date.fromisoformat(date).strftime("%A")


def overlaps(a: dict[str, Any], date: str, start: int, end: int) -> bool:
    """Whether event ``a`` overlaps [start, end) on ``date``."""
    return a["date"] == date and minutes(a["start"]) < end and start < minutes(a["end"])


def event_line(e: dict[str, Any]) -> str:
    """One calendar line: ``e3 | Thursday 2026-03-05 10:00-11:00 | Design review | with a@x, b@y``."""
    return f"{e['id']} | {weekday(e['date'])} {e['date']} {e['start']}-{e['end']} | {e['title']} | with {', '.join(e['attendees'])}"


def _find(items: list[dict[str, Any]], key: str, what: str) -> dict[str, Any]:
    for it in items:
        if it["id"] == key:
            return it
    raise ValueError(f"no {what} with id {key!r}")


def _mail_inbox(ctx: ToolContext) -> str:
    inbox = ctx.state["mail"]["inbox"]
    if not inbox:
        return "(inbox empty)"
    return "\n".join(f"{m['id']} | from {m['from_name']} <{m['from']}> | {m['subject']}" for m in inbox)


def _mail_read(ctx: ToolContext, message_id: str) -> str:
    m = _find(ctx.state["mail"]["inbox"], message_id, "message")
    return f"From: {m['from_name']} <{m['from']}>\nDate: {m['date']}\nSubject: {m['subject']}\n\n{m['body']}"


def _mail_send(ctx: ToolContext, to: str, subject: str, body: str) -> str:
    if "@" not in to:
        raise ValueError(f"'to' must be an email address, got {to!r}")
    ctx.state["mail"]["sent"].append({"to": to.strip(), "subject": subject, "body": body})
    return f"Sent to {to.strip()}."


def _calendar_list(ctx: ToolContext, date: str | None = None) -> str:
    if date is not None and not _DATE_RE.match(date):
        raise ValueError(f"date must be YYYY-MM-DD, got {date!r}")
    events = [e for e in ctx.state["calendar"] if date is None or e["date"] == date]
    events.sort(key=lambda e: (e["date"], e["start"], e["id"]))
    if not events:
        return f"No events{' on ' + date if date else ''}."
    return "\n".join(event_line(e) for e in events)


def _calendar_move(ctx: ToolContext, event_id: str, date: str, start: str) -> str:
    if not _DATE_RE.match(date):
        raise ValueError(f"date must be YYYY-MM-DD, got {date!r}")
    try:
        dt.date.fromisoformat(date)
    except ValueError as e:
        raise ValueError(f"not a calendar date: {date!r}") from e
    if not _TIME_RE.match(start):
        raise ValueError(f"start must be HH:MM (24h), got {start!r}")
    e = _find(ctx.state["calendar"], event_id, "event")
    dur = minutes(e["end"]) - minutes(e["start"])
    if minutes(start) + dur > 24 * 60:
        raise ValueError("the event would run past midnight")
    e["date"], e["start"], e["end"] = date, start, hhmm(minutes(start) + dur)
    return f"Moved: {event_line(e)}"


def _calendar_cancel(ctx: ToolContext, event_id: str) -> str:
    e = _find(ctx.state["calendar"], event_id, "event")
    ctx.state["calendar"].remove(e)
    return f"Cancelled: {e['title']} ({e['date']} {e['start']})."


def _docs_list(ctx: ToolContext) -> str:
    docs = ctx.state["docs"]
    return "\n".join(f"{d['id']} | {d['title']}" for d in docs) if docs else "(no documents)"


def _docs_read(ctx: ToolContext, doc_id: str) -> str:
    d = _find(ctx.state["docs"], doc_id, "document")
    return f"{d['title']}\n\n{d['body']}"


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


_S = {"type": "string"}

APP_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("mail_inbox", "List the inbox: one line per message with its id, sender and subject.", _obj({}, []), True, _mail_inbox),
    ToolSpec("mail_read", "Read one inbox message by id.", _obj({"message_id": {**_S, "description": "message id, e.g. m2"}}, ["message_id"]), True, _mail_read),
    ToolSpec(
        "mail_send",
        "Send an email.",
        _obj({"to": {**_S, "description": "recipient email address"}, "subject": _S, "body": _S}, ["to", "subject", "body"]),
        False,
        _mail_send,
    ),
    ToolSpec(
        "calendar_list",
        "List calendar events, optionally only those on one date (YYYY-MM-DD).",
        _obj({"date": {**_S, "description": "YYYY-MM-DD"}}, []),
        True,
        _calendar_list,
    ),
    ToolSpec(
        "calendar_move",
        "Move an event to a new date and start time; its duration is kept.",
        _obj({"event_id": _S, "date": {**_S, "description": "YYYY-MM-DD"}, "start": {**_S, "description": "HH:MM, 24h"}}, ["event_id", "date", "start"]),
        False,
        _calendar_move,
    ),
    ToolSpec("calendar_cancel", "Cancel (delete) an event.", _obj({"event_id": _S}, ["event_id"]), False, _calendar_cancel),
    ToolSpec("docs_list", "List documents: id and title.", _obj({}, []), True, _docs_list),
    ToolSpec("docs_read", "Read a document by id.", _obj({"doc_id": {**_S, "description": "document id, e.g. doc1"}}, ["doc_id"]), True, _docs_read),
)
"""The mock-app tools with their handlers."""
