"""The human-in-the-loop review queue (SPEC §2): uncertain samples wait on disk for a reviewer.

Layout of a queue folder::

    QUEUE/
      items/<id>.json      one item per sample: {"id", "sample", "flags", "added", "edits": [...]}
      decisions.jsonl      append-only log: {"id", "decision": accept|reject|edit, "reviewer", "note",
                           "time", "previous"} (an edit also carries the edited "sample" and the
                           "previous_messages"); the source of truth for an item's status and, after
                           an edit, its sample: appending the record is the one step that commits a
                           decision, so a kill before it changes nothing and a kill after it loses nothing
      edits/               scratch files of edits in progress (kept when an edit fails)
      .lock                a `filelock` lock held for every read-check-write

An item's status is its last decision: none → ``pending``; ``accept`` or ``edit`` → ``accepted``;
``reject`` → ``rejected``. Only accepted items reach training (`accepted_samples`). Every decision
is appended under the lock after checking the item is still in the state the reviewer saw, so
two reviewers deciding at the same time never lose a decision: the second one to decide an item
that the first already decided gets a ValueError naming who decided it (``force=True`` overrides,
and both decisions stay in the log).

    q = ReviewQueue("data/sft.review")
    for item in q.items("pending"):
        print(q.render(item["id"]))
    q.decide("s-3f9a", "accept", reviewer="ana", note="fine")
"""

from __future__ import annotations

import copy
import datetime as _dt
import getpass
import io
import json
import os
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock

from k3post.errors import UserError
from k3post.io import MalformedLineError, append_jsonl, atomic_write, read_values, write_jsonl
from k3post.synth.samples import count_sample_tokens, sft_record
from k3post.synth.verify import VerifyContext, outcome_stage, quality_stage, structure_stage

__all__ = ["ReviewQueue", "DECISIONS", "STATUSES", "default_reviewer", "reverify", "render_item_plain", "render_item_rich"]

DECISIONS: tuple[str, ...] = ("accept", "reject", "edit")
STATUSES: tuple[str, ...] = ("pending", "accepted", "rejected")
_STATUS_OF = {"accept": "accepted", "edit": "accepted", "reject": "rejected"}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_reviewer() -> str:
    """``$K3POST_REVIEWER``, else the login name."""
    name = os.environ.get("K3POST_REVIEWER")
    if name:
        return name
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _write_item(path: Path, data: Any) -> None:
    atomic_write(path, json.dumps(data, ensure_ascii=False, indent=1))


def reverify(sample: Mapping[str, Any], tokenizer: Any = None) -> list[dict[str, str]]:
    """Re-check an edited sample: structure, outcome (replayed in a fresh environment) and the
    quality checks that do not depend on other samples (budget, repetition). Returns the
    ``{"stage", "status", "reason", "detail"}`` of every stage run."""
    ctx = VerifyContext(tokenizer=tokenizer)  # a fresh dedup index: the sample only meets itself
    out = []
    for name, stage in (("structure", structure_stage), ("outcome", outcome_stage), ("quality", quality_stage)):
        res = stage(sample, ctx)
        out.append({"stage": name, **res.to_dict()})
        if res.status == "reject":
            break
    return out


class ReviewQueue:
    """A review queue in a folder (see the module docstring)."""

    def __init__(self, root: str | Path, *, lock_timeout_s: float = 60.0) -> None:
        """Args: root: the queue folder (created if missing); lock_timeout_s: how long to wait for the lock."""
        self.root = Path(root)
        self.items_dir = self.root / "items"
        self.edits_dir = self.root / "edits"
        self.log_path = self.root / "decisions.jsonl"
        self.items_dir.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.root / ".lock"), timeout=lock_timeout_s)

    # ------------------------------------------------------------------ reading

    def ids(self) -> list[str]:
        """All item ids, sorted."""
        return sorted(p.stem for p in self.items_dir.glob("*.json"))

    def resolve(self, ref: str) -> str:
        """The item id ``ref`` names: the full id or a unique prefix. ValueError otherwise."""
        ids = self.ids()
        if ref in ids:
            return ref
        hits = [i for i in ids if i.startswith(ref)]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            raise UserError(f"{self.root}: no review item {ref!r} ({len(ids)} items; see `k3post review list`)")
        raise UserError(f"{self.root}: {ref!r} is ambiguous, it matches {hits[:5]}{' ...' if len(hits) > 5 else ''}")

    def log(self) -> list[dict[str, Any]]:
        """Every decision, in order (a last record a kill cut short was never committed: left out)."""
        try:
            return read_values(self.log_path)
        except MalformedLineError as e:
            raise UserError(f"{e} (a malformed decision record)") from e

    def _read_item(self, item_id: str) -> dict[str, Any]:
        p = self.items_dir / f"{item_id}.json"
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{self.root}: no review item {item_id!r}") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{p}:{e.lineno}: malformed review item: {e.msg}") from e

    def _with_status(self, item: dict[str, Any], decisions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        mine = [d for d in decisions if d.get("id") == item["id"]]
        item["decisions"] = mine
        edits = [d for d in mine if d.get("decision") == "edit" and "sample" in d]
        if edits:  # an edit's log record is its commit point: the item file may not have been rewritten yet
            item["sample"] = copy.deepcopy(edits[-1]["sample"])
            known = {(e.get("time"), e.get("reviewer")) for e in item.get("edits", [])}
            item["edits"] = list(item.get("edits", [])) + [
                {"time": d["time"], "reviewer": d["reviewer"], "previous_messages": d["previous_messages"]}
                for d in edits if (d["time"], d["reviewer"]) not in known]
        item["status"] = _STATUS_OF[mine[-1]["decision"]] if mine else "pending"
        return item

    def get(self, ref: str) -> dict[str, Any]:
        """The item (with ``status`` and its ``decisions``) for an id or unique prefix."""
        item_id = self.resolve(ref)
        return self._with_status(self._read_item(item_id), self.log())

    def items(self, status: str | None = None) -> list[dict[str, Any]]:
        """All items, optionally only those with ``status`` (pending / accepted / rejected)."""
        if status is not None and status not in STATUSES:
            raise UserError(f"unknown review status {status!r}; expected one of {STATUSES}")
        log = self.log()
        out = [self._with_status(self._read_item(i), log) for i in self.ids()]
        return [it for it in out if status is None or it["status"] == status]

    def accepted_samples(self) -> list[dict[str, Any]]:
        """The samples a reviewer accepted (edited ones in their edited form): the only queue items that reach training."""
        return [it["sample"] for it in self.items("accepted")]

    # ------------------------------------------------------------------ writing

    def add(self, sample: Mapping[str, Any], flags: Sequence[Mapping[str, Any]]) -> str:
        """Queue ``sample`` with the stages' ``flags``; returns its id. Re-adding a queued id changes nothing."""
        item_id = str(sample.get("id") or "")
        if not item_id or "/" in item_id or item_id.startswith("."):
            raise UserError(f"a sample needs a file-name-safe 'id' to be queued, got {item_id!r}")
        with self.lock:
            p = self.items_dir / f"{item_id}.json"
            if not p.exists():
                _write_item(p, {"id": item_id, "sample": dict(sample), "flags": [dict(f) for f in flags], "added": _now(), "edits": []})
        return item_id

    def _append(self, entry: Mapping[str, Any]) -> None:
        """Append one decision record (under the lock): the single step that commits a decision."""
        append_jsonl(self.log_path, entry)

    def _check_open(self, item_id: str, log: Sequence[Mapping[str, Any]], force: bool) -> str:
        mine = [d for d in log if d.get("id") == item_id]
        status = _STATUS_OF[mine[-1]["decision"]] if mine else "pending"
        if status != "pending" and not force:
            last = mine[-1]
            raise UserError(
                f"{item_id} was already {status} ({last['decision']}) by {last['reviewer']} at {last['time']}; "
                "use --force to override (both decisions stay in the log)"
            )
        return status

    def decide(self, ref: str, decision: str, *, reviewer: str | None = None, note: str = "", force: bool = False) -> dict[str, Any]:
        """Record ``accept`` or ``reject`` for an item; returns the logged decision."""
        if decision not in ("accept", "reject"):
            raise UserError(f"decision must be 'accept' or 'reject' (use edit() to edit), got {decision!r}")
        item_id = self.resolve(ref)
        with self.lock:
            previous = self._check_open(item_id, self.log(), force)
            entry = {"id": item_id, "decision": decision, "reviewer": reviewer or default_reviewer(), "note": note,
                     "time": _now(), "previous": previous}
            self._append(entry)
        return entry

    def edit(
        self,
        ref: str,
        *,
        reviewer: str | None = None,
        note: str = "",
        editor: str | None = None,
        tokenizer: Any = None,
        check: Callable[[Mapping[str, Any]], list[dict[str, str]]] | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        """Open the item's messages in ``$EDITOR``, re-verify the result, and on success save it as accepted.

        The editor gets a JSON file holding the messages list. After it exits the file must hold a
        JSON list of messages (errors name the file, line and column). The edited sample is
        re-verified by ``check`` (default `reverify`: structure, outcome by replay, budget and
        repetition); if a check rejects it the item is left unchanged and a ValueError gives the
        reasons and the path of the kept edit file. The lock is not held while the editor is
        open; on saving, an item someone else decided or edited meanwhile is a conflict
        (ValueError) rather than an overwrite.
        """
        item_id = self.resolve(ref)
        before = self._with_status(self._read_item(item_id), self.log())
        if before["status"] != "pending" and not force:
            self._check_open(item_id, before["decisions"], force)
        n_decisions = len(before["decisions"])
        self.edits_dir.mkdir(exist_ok=True)
        path = self.edits_dir / f"{item_id}.{os.getpid()}.json"
        path.write_text(json.dumps(before["sample"]["messages"], ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        cmd = editor or os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
        try:
            rc = subprocess.call([*shlex.split(cmd), str(path)])
        except OSError as e:
            raise UserError(f"cannot run the editor {cmd!r} ($EDITOR): {e}") from e
        if rc != 0:
            raise UserError(f"the editor {cmd!r} exited with status {rc}; nothing saved (edit file kept at {path})")
        try:
            messages = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}:{e.colno}: invalid JSON after editing: {e.msg}; nothing saved") from e
        if isinstance(messages, dict) and "messages" in messages:
            messages = messages["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{path}: must hold a non-empty JSON list of messages; nothing saved")
        sample = copy.deepcopy(before["sample"])
        old_messages = sample["messages"]
        if messages == old_messages:
            raise UserError(f"{item_id}: the messages were not changed; use `accept` or `reject` instead")
        sample["messages"] = messages
        sample["verdict"] = None  # the outcome must be recomputed from the edited turns
        sample["truncated"], sample["truncation"] = False, None
        sample["tokens"] = count_sample_tokens(messages, sample.get("tools"), sample.get("effort"), None if tokenizer is None else _xtml(tokenizer))
        checks = (check or (lambda s: reverify(s, tokenizer)))(sample)
        bad = [c for c in checks if c["status"] == "reject"]
        if bad:
            why = "; ".join(f"{c['stage']}: {c['reason']} ({c['detail']})" for c in bad)
            raise UserError(f"{item_id}: the edited sample fails re-verification: {why}. Nothing saved; edit file kept at {path}")
        replayed = next((c for c in checks if c["stage"] == "outcome"), None)
        with self.lock:
            log = self.log()
            now = self._with_status(self._read_item(item_id), log)
            if len(now["decisions"]) != n_decisions or now["sample"]["messages"] != old_messages:
                last = now["decisions"][-1] if now["decisions"] else {"reviewer": "?", "decision": "change", "time": "?"}
                raise UserError(
                    f"{item_id} changed while you edited it ({last['decision']} by {last['reviewer']} at {last['time']}); "
                    f"nothing saved, your edit is kept at {path}"
                )
            if replayed is not None:
                sample["reverified"] = replayed
            # the record carries the edited sample, so appending it is the one step that commits the edit;
            # the item file is rewritten after it (a kill in between: `_with_status` reads the sample from the log)
            entry = {"id": item_id, "decision": "edit", "reviewer": reviewer or default_reviewer(), "note": note,
                     "time": _now(), "previous": now["status"], "checks": checks, "sample": sample,
                     "previous_messages": old_messages}
            stored = {k: v for k, v in now.items() if k not in ("status", "decisions")}
            stored["edits"] = list(stored.get("edits", [])) + [
                {"time": entry["time"], "reviewer": entry["reviewer"], "previous_messages": old_messages}
            ]
            stored["sample"] = sample
            self._append(entry)
            _write_item(self.items_dir / f"{item_id}.json", stored)
        path.unlink(missing_ok=True)
        return entry

    def export(self, out: str | Path) -> Path:
        """Write the accepted samples as SFT records (`k3post.synth.samples.sft_record`) to ``out``."""
        return write_jsonl(out, [sft_record(s) for s in self.accepted_samples()])

    # ------------------------------------------------------------------ display

    def render(self, ref: str, *, use_rich: bool | None = None, width: int = 100) -> str:
        """The item as text: rich panels when ``use_rich`` (default: if rich is installed), else plain sections."""
        item = self.get(ref)
        if use_rich is None:
            use_rich = _has_rich()
        if use_rich:
            buf = io.StringIO()
            render_item_rich(item, file=buf, width=width)
            return buf.getvalue()
        return render_item_plain(item, width=width)


def _xtml(tokenizer: Any) -> Any:
    from k3post.xtml import XTML

    return XTML(tokenizer)


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _header_lines(item: Mapping[str, Any]) -> list[str]:
    s = item["sample"]
    tok = s.get("tokens") or {}
    verdict = s.get("verdict") or {}
    lines = [
        f"{item['id']}  [{item['status']}]  {s.get('family')} · effort {s.get('effort')} · teacher {s.get('teacher')}",
        f"task {s.get('task_id')} · seed {s.get('seed')} · reward {verdict.get('reward', '—')} · tokens reasoning "
        f"{tok.get('reasoning', '?')} / output {tok.get('output', '?')} / total {tok.get('total', '?')} ({tok.get('method', '?')})",
    ]
    for f in item.get("flags") or []:
        lines.append(f"flag  {f['stage']}: {f['reason']} - {f.get('detail', '')}")
    for d in item.get("decisions") or []:
        lines.append(f"log   {d['time']} {d['decision']} by {d['reviewer']}" + (f": {d['note']}" if d.get("note") else ""))
    return lines


def _calls(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = []
    for k, c in enumerate(m.get("tool_calls") or [], 1):
        fn = c.get("function") or {}
        args = fn.get("arguments", "")
        try:
            pretty = json.dumps(json.loads(args) if isinstance(args, str) else args, ensure_ascii=False, indent=2)
        except json.JSONDecodeError:
            pretty = str(args)
        out.append((f"call {k}: {fn.get('name')}", pretty))
    return out


def _role_title(i: int, m: Mapping[str, Any]) -> str:
    extra = m.get("name") or m.get("type") or ""
    return f"[{i}] {m.get('role')}" + (f" ({extra})" if extra else "")


def render_item_plain(item: Mapping[str, Any], width: int = 100) -> str:
    """Plain-text rendering: a header, flags, decisions, then one section per message with its channels."""
    from k3post.xtml import is_tool_declaration

    bar = "═" * width
    out = [bar, *_header_lines(item), bar]
    for i, m in enumerate(item["sample"].get("messages") or []):
        title = f"── {_role_title(i, m)} "
        out.append(title + "─" * max(0, width - len(title)))
        if m.get("role") == "assistant":
            parts = [("think", m.get("reasoning_content") or ""), ("response", m.get("content") or "")] + _calls(m)
            for label, text in parts:
                lines = str(text).splitlines() or [""]
                out.append(f"  {label:>10} │ {lines[0]}")
                out.extend(f"  {'':>10} │ {ln}" for ln in lines[1:])
        elif is_tool_declaration(m):
            out.append("  declares: " + ", ".join((t.get("function") or t).get("name", "?") for t in m.get("tools") or []))
        else:
            out.extend("  " + ln for ln in str(m.get("content") or "").splitlines() or [""])
    return "\n".join(out) + "\n"


def render_item_rich(item: Mapping[str, Any], *, file: Any = None, width: int | None = None) -> None:
    """Rich rendering (panels per message, colored channels) to ``file`` (default stdout)."""
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.text import Text

    from k3post.xtml import is_tool_declaration

    console = Console(file=file, width=width, highlight=False, soft_wrap=False)
    head = Text()
    for k, line in enumerate(_header_lines(item)):
        style = "bold" if k == 0 else "yellow" if line.startswith("flag") else "cyan" if line.startswith("log") else "dim"
        head.append(line + "\n", style=style)
    color = {"pending": "yellow", "accepted": "green", "rejected": "red"}[item["status"]]
    console.print(Panel(head, title=f"review {item['id']}", border_style=color))
    styles = {"system": "magenta", "user": "blue", "assistant": "green", "tool": "cyan"}
    for i, m in enumerate(item["sample"].get("messages") or []):
        role = str(m.get("role"))
        if role == "assistant":
            body: list[Any] = []
            if m.get("reasoning_content"):
                body += [Text("think", style="bold dim"), Text(m["reasoning_content"], style="dim italic")]
            body += [Text("response", style="bold"), Text(m.get("content") or "")]
            for label, text in _calls(m):
                body += [Text(label, style="bold cyan"), Text(text)]
            renderable: Any = Group(*body)
        elif is_tool_declaration(m):
            renderable = Text("declares: " + ", ".join((t.get("function") or t).get("name", "?") for t in m.get("tools") or []))
        else:
            renderable = Text(str(m.get("content") or ""))
        console.print(Panel(renderable, title=_role_title(i, m), title_align="left", border_style=styles.get(role, "white")))
