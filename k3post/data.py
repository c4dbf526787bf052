"""SFT data: JSONL conversations → XTML token ids with loss masks → packed rows.

Legend: R rows in a micro-batch, L packed row length.

A JSONL line is ``{"messages": [...], "tools": [...] | null, "effort": "low"|"high"|"max"|null}`` with
OpenAI chat messages plus ``reasoning_content``. Every problem is reported with file and line; a config
switch turns per-sample problems into counted skips instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from typing import TYPE_CHECKING

from k3post.config.data import DataConfig  # noqa: F401  (re-exported: `from k3post.data import DataConfig`)
from k3post.errors import UserError
from k3post.io import MalformedLineError, json_line

if TYPE_CHECKING:
    from k3post.xtml import XTML

ROLES = ("system", "user", "assistant", "tool")


class DataError(UserError):
    """A sample is malformed; the message names file and line, `reason` is a short category for skip counts."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Sample:
    """One rendered conversation."""

    ids: list[int]
    loss_mask: list[bool]
    source: str  # "file:line" for messages

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class LoadStats:
    """What `load_sft_jsonl` read, kept and skipped (by reason), and the longest sample skipped as too long."""

    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    max_len: int = 0  # the limit the samples were loaded with
    longest: int = 0  # tokens of the longest sample skipped for exceeding max_len (0: none)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        """One line for the user: how many of how many samples were skipped, why, and (too long ones) the
        longest against ``sft.max_len`` with the setting that keeps them all."""
        n = sum(self.skipped.values())
        parts = []
        for reason, k in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            if reason == "too_long":
                parts.append(f"{k} longer than sft.max_len={self.max_len} tokens (the longest {self.longest:,}; "
                             f"sft.max_len={self.longest} keeps them all)")
            else:
                parts.append(f"{k} {reason.replace('_', ' ')}")
        return f"skipped {n} of {self.read} samples: " + "; ".join(parts)


def _spec_name(spec: Any) -> Any:
    """The name of an OpenAI function spec (``{"function": {"name": ...}}`` or ``{"name": ...}``); None if absent."""
    if not isinstance(spec, dict):
        return None
    inner = spec.get("function") or spec
    return inner.get("name") if isinstance(inner, dict) else None


def check_record(rec: Any) -> None:
    """Structural checks the XTML renderer does not make: roles, declared tools. Raises ValueError."""
    from k3post.xtml import is_tool_declaration

    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object, got {type(rec).__name__}")
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("key 'messages' must be a non-empty list")
    tools = rec.get("tools") or []
    if not isinstance(tools, list):
        raise ValueError("key 'tools' must be a list of OpenAI function specs or null")
    declared = {_spec_name(t) for t in tools}
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r}; expected one of {ROLES}")
        if is_tool_declaration(m):  # mid-session tool declaration adds tools from here on
            declared |= {_spec_name(t) for t in m.get("tools") or []}
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            if not isinstance(call, dict) or not isinstance(call.get("function") or {}, dict):
                raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object with a 'function' object")
            name = (call.get("function") or {}).get("name")
            if name not in declared:
                raise ValueError(f"messages[{i}].tool_calls[{j}]: call to undeclared tool {name!r}; declared: {sorted(n for n in declared if n)}")
    effort = rec.get("effort")
    if effort not in (None, "low", "high", "max"):
        raise ValueError(f"key 'effort': unknown effort {effort!r}; expected low, high, max or null")


def render_record(xtml: XTML, rec: dict[str, Any], mode: str = "think") -> tuple[list[int], list[bool]]:
    r = xtml.render(rec["messages"], tools=rec.get("tools") or None, effort=rec.get("effort"), mode=mode)
    return list(r.ids), [bool(x) for x in r.loss_mask]


def _records(p: Path) -> Iterator[tuple[str, Any]]:
    """``(path:line, record)`` for every non-blank line, the record checked (`check_record`); a `DataError`
    (reason malformed_json / invalid_record) naming the line is yielded in the record's place."""
    with p.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                rec = json_line(line, where)
            except MalformedLineError as e:
                yield where, DataError(str(e), "malformed_json")
                continue
            try:
                check_record(rec)
            except ValueError as e:
                yield where, DataError(f"{where}: {e}", "invalid_record")
                continue
            yield where, rec


def check_sft_jsonl(path: str | Path) -> None:
    """The tokenizer-free part of `load_sft_jsonl`'s checks (JSON and record structure, each line), so that a
    bad line is an input error before a run folder is written; the first bad line raises its `DataError`."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: SFT data file not found")
    for _, rec in _records(p):
        if isinstance(rec, DataError):
            raise rec


def load_sft_jsonl(
    path: str | Path, xtml: XTML, *, max_len: int, on_bad_sample: str = "error", mode: str = "think"
) -> tuple[list[Sample], LoadStats]:
    """Read, validate and render every line. Errors name `path:line`; `on_bad_sample="skip"` counts them instead.
    A bad ``on_bad_sample`` or ``mode`` is the setting's error (its config key, `k3post.config.sft.SFTConfig`),
    before any line is read: no line of the data is to blame."""
    if on_bad_sample not in ("error", "skip"):
        raise UserError(f"sft.on_bad_sample must be error or skip, got {on_bad_sample!r}")
    from k3post.xtml import MODES

    if mode not in MODES:
        raise UserError(f"sft.mode must be think or instruct, got {mode!r}")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: SFT data file not found")
    samples: list[Sample] = []
    stats = LoadStats(max_len=max_len)
    for where, rec in _records(p):
        stats.read += 1
        try:
            if isinstance(rec, DataError):
                raise rec
            try:
                ids, mask = render_record(xtml, rec, mode)
            except DataError:
                raise
            except ValueError as e:
                raise DataError(f"{where}: {e}", "invalid_record") from e
            if len(ids) > max_len:
                if on_bad_sample == "skip":
                    stats.longest = max(stats.longest, len(ids))
                raise DataError(f"{where}: sample is {len(ids)} tokens, longer than max_len={max_len} (sft.max_len: "
                                "raise it, or sft.on_bad_sample=skip leaves such samples out and counts them)", "too_long")
            if not any(mask):
                raise DataError(f"{where}: sample has no trainable (assistant) tokens", "no_trainable_tokens")
        except DataError as e:
            if on_bad_sample == "error":
                raise
            stats.skip(e.reason)
            continue
        samples.append(Sample(ids, mask, where))
        stats.kept += 1
    if not samples:
        raise DataError(f"{p}: no usable samples ({stats.read} read, skipped {stats.skipped})"
                        + (f"; {stats.summary()}" if stats.skipped else ""))
    return samples, stats




@dataclass
class PackedBatch:
    """A micro-batch of packed rows.

    input_ids_RL, position_ids_RL: tokens and per-segment positions (restart at 0 for every sample)
    attention_mask_R1LL: block-diagonal causal mask (True = may attend): no attention across samples
    labels_RL: next-token targets, -100 where not trained (mask off, segment end, padding)
    segments: per row, the lengths of its samples in order (the padding after them not listed): what
      `k3post.packed_attention` runs one causal attention call per; None when not known
    """

    input_ids_RL: torch.Tensor
    position_ids_RL: torch.Tensor
    attention_mask_R1LL: torch.Tensor
    labels_RL: torch.Tensor
    segments: tuple[tuple[int, ...], ...] | None = None

    @property
    def n_target_tokens(self) -> int:
        return int((self.labels_RL != -100).sum())

    def to(self, device: torch.device | str) -> "PackedBatch":
        """The batch with its tensors on ``device`` (itself when they are there already)."""
        if self.input_ids_RL.device == torch.device(device):
            return self
        return replace(self, input_ids_RL=self.input_ids_RL.to(device), position_ids_RL=self.position_ids_RL.to(device),
                                   attention_mask_R1LL=self.attention_mask_R1LL.to(device), labels_RL=self.labels_RL.to(device))


def pack_rows(samples: Sequence[Sample], order: Sequence[int], max_len: int) -> list[list[int]]:
    """Greedy first-fit-in-order packing: consecutive samples (in `order`) share a row while they fit."""
    rows: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = len(samples[i])
        if used + n > max_len and cur:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return rows


def collate(samples: Sequence[Sample], rows: Sequence[Sequence[int]], max_len: int, pad_id: int) -> PackedBatch:
    """Build a :class:`PackedBatch` from rows of sample indices, padded to the longest row."""
    L = min(max_len, max(sum(len(samples[i]) for i in row) for row in rows))
    R = len(rows)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    seg = torch.full((R, L), -1, dtype=torch.long)
    labels = torch.full((R, L), -100, dtype=torch.long)
    for r, row in enumerate(rows):
        t = 0
        for s_idx, i in enumerate(row):
            s = samples[i]
            n = len(s)
            ids[r, t : t + n] = torch.tensor(s.ids)
            pos[r, t : t + n] = torch.arange(n)
            seg[r, t : t + n] = s_idx
            # token t+k predicts token t+k+1 when that token is trainable and in the same sample
            m = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
            tgt = torch.tensor(s.ids[1:])
            labels[r, t : t + n - 1] = torch.where(m, tgt, torch.full_like(tgt, -100))
            t += n
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    attn = (same & causal)[:, None]
    # padding rows attend to themselves only, so softmax never sees an all-masked row
    attn = attn | torch.eye(L, dtype=torch.bool)[None, None]
    return PackedBatch(ids, pos, attn, labels, tuple(tuple(len(samples[i]) for i in row) for row in rows))


def iter_microbatches(
    samples: Sequence[Sample], *, pack_len: int, rows_per_batch: int, seed: int, epoch: int
) -> Iterator[list[list[int]]]:
    """The packed micro-batches of one epoch, in a seeded order (a pure function of seed and epoch).

    Samples up to `pack_len` tokens are packed into rows of `pack_len`; a longer sample gets a row of its
    own. A micro-batch holds at most `rows_per_batch * pack_len` tokens: `rows_per_batch` packed rows, or
    fewer long rows (grouped by length, so padding stays small). Attention cost grows with the square of the
    row length, so short samples never pay for the long ones' rows.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(samples), generator=g).tolist()
    short = [i for i in order if len(samples[i]) <= pack_len]
    long_ = sorted((i for i in order if len(samples[i]) > pack_len), key=lambda i: len(samples[i]))
    budget = rows_per_batch * pack_len
    batches: list[list[list[int]]] = []
    rows = pack_rows(samples, short, pack_len)
    batches += [rows[k : k + rows_per_batch] for k in range(0, len(rows), rows_per_batch)]
    cur: list[list[int]] = []
    for i in long_:  # ascending length: the longest row of a batch is the last one added
        if cur and (len(cur) + 1) * len(samples[i]) > budget:
            batches.append(cur)
            cur = []
        cur.append([i])
    if cur:
        batches.append(cur)
    for k in torch.randperm(len(batches), generator=g).tolist():
        yield batches[k]
