"""A modelled engine for rollout simulation: the real scheduler and agent loop, recorded tokens, priced steps.

`ReplayEngine` implements the steppable engine protocol (`engine.py`) with the slot, queue, pause,
KV-export and kept-KV semantics of `EmbeddedEngine`, but runs no model: every request's tokens
come from a `ReplayBook` recorded from a real run (`RecordingMixin` on any engine), and every
``step()`` is priced by a `CostCurve` into a virtual clock (``clock_s``). Sampling in k3post is
counter-based (a token is a function of the request seed, its context and the weights), and the
scheduler makes no wall-clock decision, so with the weights unchanged a trajectory samples the same
tokens under any scheduling: the recording of one run replays exactly under another λ, staleness
bound, slot count or machine. What changes is which requests share a step, and so the step trace
and its price. ``bench/partial_rollout.py --simulate`` uses it; every number it prints from it is
labelled simulated.

Modelled, not run: log-probs are the recorded ones, KV caches are placeholders with the real
shapes and byte counts (``kv_shape``) so the CPU `KVPool` and the scheduler's byte budgets behave
as with the real engine; ``update_weights`` only bumps the version (the recording holds one policy).
A request whose seed or prompt the book does not hold raises: the replay never invents tokens.

Shape legend: none.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from k3post.rollout.cost_model import CostCurve, StepWork
from k3post.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    KVState,
    NamedTensors,
    QueuedRequestsMixin,
    generate_by_stepping,
    request_seed,
    shared_prefix_len,
)

__all__ = ["ReplayBook", "ReplayEngine", "ReplayMiss", "RecordingMixin", "save_books", "load_books"]


class ReplayMiss(KeyError):
    """The book holds no recorded turn for a request (unknown seed, or a different prompt)."""

    def __str__(self) -> str:  # KeyError quotes its message
        return str(self.args[0])


def _prompt_key(ids: Sequence[int]) -> tuple[int, int]:
    return len(ids), zlib.crc32(json.dumps(list(ids)).encode())


@dataclass
class ReplayBook:
    """Recorded turns by request seed: (prompt length, prompt crc32) and the whole output
    (ids, log-probs, finish reason "stop" or "length")."""

    turns: dict[int, tuple[tuple[int, int], list[int], list[float], str]] = field(default_factory=dict)

    @staticmethod
    def _check(output_ids: Sequence[int], logprobs: Sequence[float], finish: str) -> None:
        if finish not in ("stop", "length"):
            raise ValueError(f"only finished turns are recorded, got finish {finish!r}")
        if len(logprobs) != len(output_ids) or not output_ids:
            raise ValueError(f"a turn needs one log-prob per output token and at least one token, got "
                             f"{len(output_ids)} tokens and {len(logprobs)} log-probs")

    def add(self, seed: int, prompt_ids: Sequence[int], output_ids: Sequence[int], logprobs: Sequence[float],
            finish: str) -> None:
        self._check(output_ids, logprobs, finish)
        key = _prompt_key(prompt_ids)
        old = self.turns.get(seed)
        if old is not None and (old[0] != key or old[1] != list(output_ids)):
            raise ValueError(f"seed {seed}: two different turns recorded (the policy is not the same in both runs?)")
        self.turns[seed] = (key, list(output_ids), [float(x) for x in logprobs], finish)

    def lookup(self, seed: int, prompt_ids: Sequence[int]) -> tuple[list[int], list[float], str]:
        got = self.turns.get(seed)
        if got is None:
            raise ReplayMiss(f"replay: no recorded turn for seed {seed} ({len(self.turns)} recorded)")
        if got[0] != _prompt_key(prompt_ids):
            raise ReplayMiss(f"replay: seed {seed} was recorded with another prompt ({got[0][0]} tokens, this one "
                             f"{len(prompt_ids)}): the replayed run diverged from the recorded one")
        return got[1], got[2], got[3]

    def merge(self, other: "ReplayBook") -> int:
        """Add ``other``'s turns; a seed both hold keeps this book's turn. Returns how many such
        seeds hold a different turn in ``other`` (same policy and seed should sample the same turn)."""
        differ = 0
        for seed, turn in other.turns.items():
            mine = self.turns.setdefault(seed, turn)
            differ += mine[0] != turn[0] or mine[1] != turn[1]
        return differ

    def __len__(self) -> int:
        return len(self.turns)

    def rows(self) -> list[list[Any]]:
        return [[s, list(k), o, [round(x, 5) for x in lp], f] for s, (k, o, lp, f) in self.turns.items()]

    @classmethod
    def from_rows(cls, rows: list[Any], where: str) -> "ReplayBook":
        book = cls()
        for i, row in enumerate(rows):
            try:
                s, k, o, lp, f = row
                ids, lps = [int(x) for x in o], [float(x) for x in lp]
                cls._check(ids, lps, str(f))
                book.turns[int(s)] = ((int(k[0]), int(k[1])), ids, lps, str(f))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: turn {i} is malformed ({e})") from None
        return book


def save_books(path: str | Path, books: Sequence[ReplayBook], meta: dict[str, Any] | None = None) -> Path:
    """Write ``books`` (e.g. one per repeat of a bench: seeds repeat across repeats) and ``meta`` as gzipped JSON."""
    path = Path(path)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        json.dump({"meta": meta or {}, "books": [b.rows() for b in books]}, fh)
    return path


def load_books(path: str | Path) -> tuple[list[ReplayBook], dict[str, Any]]:
    """The books and meta `save_books` wrote; a clear error naming the file when it is not one."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            d = json.load(fh)
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a gzipped replay file ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("books"), list):
        raise ValueError(f"{path}: no 'books' list (written by save_books?)")
    books = [ReplayBook.from_rows(rows, f"{path}: book {i}") for i, rows in enumerate(d["books"])]
    return books, dict(d.get("meta") or {})


class RecordingMixin:
    """Mix into an engine class (before it): every request that finishes ("stop" / "length") goes
    into ``self.book`` under its sampling seed, and, while ``tracing``, every step's `StepWork` into
    ``self.work_log`` (needs the engine's ``_running`` list of sequences with ``context`` and
    ``stats["prefill_tokens"]``, as `EmbeddedEngine` has)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.book = ReplayBook()
        self.work_log: list[StepWork] = []
        self.tracing = True
        self._seeds: dict[str, int] = {}

    def add_request(self, request: GenerationRequest, kv: KVState | None = None) -> None:
        super().add_request(request, kv)  # type: ignore[misc]
        sp = request.sampling
        self._seeds[request.request_id] = sp.seed if sp.seed is not None else request_seed(
            self.seed, request.request_id)  # type: ignore[attr-defined]

    def step(self) -> list[GenerationResult]:
        running = self._running  # type: ignore[attr-defined]
        rows, ctx = len(running), sum(len(s.context) for s in running)
        before = self.stats["prefill_tokens"]  # type: ignore[attr-defined]
        out = super().step()  # type: ignore[misc]
        if self.tracing:
            self.work_log.append(StepWork(rows, ctx, self.stats["prefill_tokens"] - before))  # type: ignore[attr-defined]
        for res in out:
            seed = self._seeds.pop(res.request_id, None)
            if seed is not None and res.finish_reason in ("stop", "length"):
                self.book.add(seed, res.prompt_ids, res.output_ids, res.output_logprobs, res.finish_reason)
        return out


@dataclass
class _Seq:
    request: GenerationRequest
    seed: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    context: list[int]
    script: tuple[list[int], list[float], str]
    n_cached: int = 0
    kv_tokens: int = 0  # tokens covered by an attached KV state (queued)
    kv_version: int = 0

    @property
    def rid(self) -> str:
        return self.request.request_id

    def result(self, reason: str) -> GenerationResult:
        return GenerationResult(self.rid, list(self.request.prompt_ids), list(self.output_ids), list(self.logprobs),
                                list(self.versions), reason)  # type: ignore[arg-type]


class ReplayEngine(QueuedRequestsMixin):
    """The steppable engine protocol over a `ReplayBook`, each step priced by ``curve`` (module doc).

    Args:
        book: the recorded turns.
        curve: prices each step into ``clock_s`` (None: only the `StepWork` trace is kept).
        max_batch_size / max_model_len / max_prefill_tokens / prefix_sharing / min_shared_prefix:
            as `EmbeddedEngine` (admission and prefill work follow the same rules).
        kv_shape: (layers, kv heads, head dim, bytes per element) of the modelled model's KV cache.
        seed: engine seed (requests without a sampling seed derive one from it, as the real engine).
    """

    kv_transfer = True

    def __init__(self, book: ReplayBook, curve: CostCurve | None = None, *, max_batch_size: int = 32,
                 max_model_len: int = 4096, max_prefill_tokens: int = 2048, prefix_sharing: bool = True,
                 min_shared_prefix: int = 16, kv_shape: tuple[int, int, int, int] = (2, 1, 32, 4),
                 seed: int = 0) -> None:
        if not isinstance(book, ReplayBook):
            raise ValueError(f"book must be a ReplayBook, got {type(book).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self.book, self.curve = book, curve
        self.max_batch_size, self.max_model_len = max_batch_size, int(max_model_len)
        self.max_prefill_tokens, self.prefix_sharing = int(max_prefill_tokens), bool(prefix_sharing)
        self.min_shared_prefix, self.seed = int(min_shared_prefix), int(seed)
        layers, heads, dim, itemsize = kv_shape
        dtype = {2: torch.float16, 4: torch.float32}[itemsize]
        self.cache = SimpleNamespace(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype)
        self._placeholder = torch.zeros(1, dtype=dtype)
        self._queue: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._paused: dict[str, _Seq] = {}
        self._kept: dict[str, KVState] = {}
        self._version = 0
        self.clock_s = 0.0
        self.work_log: list[StepWork] = []
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "shared_prefills": 0,
                      "shared_prefix_tokens": 0, "kv_reused_tokens": 0, "turns": 0}

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kv_utilization(self) -> float:
        return sum(s.n_cached for s in self._running) / (self.max_batch_size * self.max_model_len)

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._running)

    def _kv(self, context: list[int], version: int) -> KVState:
        c = self.cache
        n = len(context)
        shape = (c.num_kv_heads, n, c.head_dim)
        t = [self._placeholder.expand(*shape) for _ in range(c.num_layers)]
        return KVState(t, list(t), list(context), version)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: GenerationRequest, kv: KVState | None = None) -> None:
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"add_request takes a GenerationRequest, got {type(request).__name__}")
        rid = request.request_id
        if any(s.rid == rid for s in self._queue) or any(s.rid == rid for s in self._running) or rid in self._paused:
            raise ValueError(f"request id {rid!r} is already queued, running or paused in this engine")
        context = request.prompt_ids + request.given_ids
        if len(context) >= self.max_model_len:
            raise ValueError(f"request {rid!r}: {len(context)} positions leave no room under max_model_len="
                             f"{self.max_model_len}")
        sp = request.sampling
        seed = sp.seed if sp.seed is not None else request_seed(self.seed, rid)
        script = self.book.lookup(seed, request.prompt_ids)
        if script[0][: len(request.given_ids)] != request.given_ids:
            raise ReplayMiss(f"replay: request {rid!r} continues tokens the recording did not sample")
        seq = _Seq(request, seed, list(request.given_ids), list(request.given_logprobs), list(request.given_versions),
                   context, script)
        if kv is not None:
            self._attach_kv(seq, kv)
        self._queue.append(seq)

    def _attach_kv(self, seq: _Seq, kv: KVState) -> None:
        n = kv.num_tokens
        if n > len(seq.context) - 1 or kv.context_ids != seq.context[:n]:
            raise ValueError(f"request {seq.rid!r}: the KV state covers {n} tokens that are not a proper prefix of "
                             f"its context ({len(seq.context)} tokens)")
        seq.kv_tokens, seq.kv_version = n, kv.weight_version

    def export_kv(self, request_id: str) -> KVState:
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            return kept
        seq = self._paused.get(request_id)
        if seq is None:
            raise ValueError(f"export_kv: request {request_id!r} is not paused in this engine")
        if seq.kv_tokens == 0:
            raise ValueError(f"export_kv: paused request {request_id!r} holds no KV cache (it never reached a slot)")
        del self._paused[request_id]
        return self._kv(seq.context[: seq.kv_tokens], seq.kv_version)

    def _take(self, request_ids: Sequence[str], what: str) -> list[tuple[_Seq, str]]:
        if isinstance(request_ids, str):
            raise ValueError(f"{what} takes a sequence of request ids, not a single str")
        wanted = list(dict.fromkeys(request_ids))
        found: dict[str, tuple[_Seq, str]] = {s.rid: (s, "queued") for s in self._queue if s.rid in wanted}
        for s in self._running:
            if s.rid in wanted:
                s.kv_tokens, s.kv_version = s.n_cached, self._version  # the slot's KV is kept
                found[s.rid] = (s, "running")
        found.update({r: (s, "paused") for r, s in self._paused.items() if r in wanted})
        unknown = [r for r in wanted if r not in found]
        if unknown:
            raise ValueError(f"{what}: unknown request ids {unknown} (not queued, running or paused)")
        self._queue = deque(s for s in self._queue if s.rid not in found)
        self._running = [s for s in self._running if s.rid not in found]
        for r in found:
            self._paused.pop(r, None)
        return [found[r] for r in wanted]

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Bump the version (the recording holds one policy: the tensors are not used)."""
        if version is not None and version <= self._version:
            raise ValueError(f"update_weights: version {version} must exceed the current version {self._version}")
        self._version = self._version + 1 if version is None else int(version)
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return generate_by_stepping(self, requests)

    # ------------------------------------------------------------------ stepping
    def _next(self, seq: _Seq, finished: list[_Seq], reasons: dict[str, str]) -> None:
        """Append the recorded token at the sequence's next output position; detect its finish."""
        ids, lps, finish = seq.script
        i = len(seq.output_ids)
        if i >= len(ids):
            raise ReplayMiss(f"replay: request {seq.rid!r} runs past its recorded {len(ids)} tokens")
        seq.output_ids.append(ids[i])
        seq.logprobs.append(lps[i])
        seq.versions.append(self._version)
        seq.context.append(ids[i])
        reason = None
        if i + 1 == len(ids):
            reason = finish
        elif i + 1 >= seq.request.sampling.max_tokens or len(seq.context) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            reasons[seq.rid] = reason
            finished.append(seq)

    def _finish(self, finished: list[_Seq], reasons: dict[str, str]) -> None:
        for seq in finished:
            if seq.request.keep_kv and reasons[seq.rid] == "stop":
                self._kept[seq.rid] = self._kv(seq.context[: len(seq.context) - 1], self._version)
        gone = {s.rid for s in finished}
        self._running = [s for s in self._running if s.rid not in gone]

    def _admit(self) -> list[_Seq]:
        free = self.max_batch_size - len(self._running)
        admitted: list[_Seq] = []
        budget = self.max_prefill_tokens
        while free > 0 and self._queue:
            head = self._queue[0]
            cost = len(head.context) - head.kv_tokens
            if admitted and cost > budget:
                break
            budget -= cost
            seq = self._queue.popleft()
            seq.n_cached = seq.kv_tokens
            self.stats["kv_reused_tokens"] += seq.kv_tokens
            seq.kv_tokens = 0
            self._running.append(seq)
            admitted.append(seq)
            free -= 1
        return admitted

    def _prefill_tokens(self, seqs: list[_Seq]) -> int:
        """Tokens the real engine forwards to prefill ``seqs``: identical fresh contexts once, a
        prefix common to every distinct fresh context once (`EmbeddedEngine._prefill`)."""
        rows: list[_Seq] = []
        seen: set[tuple[int, ...]] = set()
        for s in seqs:
            if self.prefix_sharing and s.n_cached == 0:
                key = tuple(s.context)
                if key in seen:
                    self.stats["shared_prefills"] += 1
                    continue
                seen.add(key)
            rows.append(s)
        fresh = [s for s in rows if s.n_cached == 0]
        shared = shared_prefix_len([s.context for s in fresh], self.min_shared_prefix) if self.prefix_sharing else 0
        self.stats["shared_prefix_tokens"] += shared * (len(fresh) - 1)
        return sum(len(s.context) - s.n_cached for s in rows) - shared * (len(fresh) - 1)

    def step(self) -> list[GenerationResult]:
        """Decode one recorded token for every running request, admit and prefill queued ones
        (first token), price the step; returns the requests that finished."""
        finished: list[_Seq] = []
        reasons: dict[str, str] = {}
        rows, ctx = len(self._running), sum(len(s.context) for s in self._running)
        for seq in list(self._running):
            seq.n_cached = len(seq.context)
            self._next(seq, finished, reasons)
        self.stats["decode_tokens"] += rows
        self._finish(finished, reasons)
        admitted = self._admit()
        prefill = 0
        if admitted:
            prefill = self._prefill_tokens(admitted)
            self.stats["prefill_tokens"] += prefill
            first: list[_Seq] = []
            for seq in admitted:
                seq.n_cached = len(seq.context)
                self._next(seq, first, reasons)
            self._finish(first, reasons)
            finished += first
        work = StepWork(rows, ctx, prefill)
        self.work_log.append(work)
        if self.curve is not None:
            self.clock_s += self.curve.price(work) / 1000.0
        self.stats["steps"] += 1
        self.stats["turns"] += len(finished)
        return [s.result(reasons[s.rid]) for s in finished]
