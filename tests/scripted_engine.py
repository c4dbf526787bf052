"""A steppable rollout engine whose "model" is a script: request -> the token ids it samples.

For tests that must put exact token streams (random ids, truncated XTML, special tokens out of place,
adversarial tool calls) through the real `AgentLoop`, `PartialRolloutScheduler`, environments and
renderer. It implements the whole `SteppableEngine` protocol with the semantics of `EmbeddedEngine`:
``max_batch_size`` slots, one token per running request per `step`, stop ids (``<|end_of_msg|>`` by
default), ``max_tokens`` and ``max_model_len`` ("length"), pause / resume / abort, continuation requests
(``given_ids``), KV export / import (the "KV" is a zero tensor per context token: nothing is computed,
but the pool and the scheduler handle real `KVState` objects), and a weight version.

The script is called once per request (at `add_request`) and must be a pure function of the request
(prompt, seed), so a continuation re-derives the same tokens: its given tokens must be a prefix of them.

Shape legend: none (token lists only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from k3post.rollout.engine import GenerationRequest, GenerationResult, KVState, NamedTensors

Script = Callable[[GenerationRequest], list[int]]


@dataclass
class _Req:
    req: GenerationRequest
    tokens: list[int]  # everything the script samples for this request
    out: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ScriptedEngine:
    """See the module doc. ``logprob`` is the behaviour log-prob recorded for every scripted token."""

    def __init__(
        self,
        script: Script,
        *,
        eom_id: int,
        max_batch_size: int = 8,
        max_model_len: int | None = None,
        logprob: float = -1.0,
    ) -> None:
        self.script = script
        self.eom_id = eom_id
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.logprob = logprob
        self._version = 0
        self._queue: OrderedDict[str, _Req] = OrderedDict()
        self._running: OrderedDict[str, _Req] = OrderedDict()
        self._paused: dict[str, _Req] = {}
        self.cache = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.stats = {"requests": 0, "steps": 0, "kv_imports": 0}

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: NamedTensors) -> int:
        self._version += 1
        return self._version

    def add_request(self, request: GenerationRequest, kv: KVState | None = None) -> None:
        rid = request.request_id
        if rid in self._queue or rid in self._running or rid in self._paused:
            raise ValueError(f"request {rid!r} is already in the engine")
        tokens = [int(t) for t in self.script(request)]
        given = list(request.given_ids)
        if [self._token_at(tokens, i) for i in range(len(given))] != given:
            raise AssertionError(f"request {rid!r}: the script is not deterministic (given tokens differ)")
        if kv is not None:
            if kv.context_ids != (request.prompt_ids + given)[: kv.num_tokens]:
                raise ValueError(f"request {rid!r}: the KV state does not cover a prefix of its context")
            self.stats["kv_imports"] += 1
        self.stats["requests"] += 1
        self._queue[rid] = _Req(request, tokens, given, list(request.given_versions))

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._running)

    def kv_utilization(self) -> float:
        return len(self._running) / self.max_batch_size

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def step(self) -> list[GenerationResult]:
        while self._queue and len(self._running) < self.max_batch_size:
            rid, r = self._queue.popitem(last=False)
            self._running[rid] = r
        self.stats["steps"] += 1
        finished = []
        for rid, r in list(self._running.items()):
            reason = self._advance(r)
            if reason is not None:
                del self._running[rid]
                finished.append(self._result(r, reason))
        return finished

    def _advance(self, r: _Req) -> str | None:
        sp = r.req.sampling
        room = None if self.max_model_len is None else self.max_model_len - len(r.req.prompt_ids)
        t = self._token_at(r.tokens, len(r.out))
        r.out.append(t)
        r.versions.append(self._version)
        stops = {self.eom_id} if sp.stop_ids is None else set(sp.stop_ids)
        if t in stops and not sp.ignore_eos:
            return "stop"
        if len(r.out) >= sp.max_tokens or (room is not None and len(r.out) >= room):
            return "length"
        return None

    def _token_at(self, tokens: list[int], i: int) -> int:
        """Output token i; past the script's end it repeats its last token (a model that never stops)."""
        if i < len(tokens):
            return tokens[i]
        return tokens[-1] if tokens else self.eom_id

    def _result(self, r: _Req, reason: str) -> GenerationResult:
        return GenerationResult(r.req.request_id, list(r.req.prompt_ids), list(r.out), [self.logprob] * len(r.out),
                                list(r.versions), reason)  # type: ignore[arg-type]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        for req in requests:
            self.add_request(req)
        done: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for res in self.step():
                done[res.request_id] = res
        return [done[r.request_id] for r in requests]

    def pause(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        out = []
        for rid in request_ids:
            r = self._running.pop(rid, None) or self._queue.pop(rid, None)
            if r is None:
                raise ValueError(f"request {rid!r} is not queued or running")
            self._paused[rid] = r
            out.append(self._result(r, "paused"))
        return out

    def resume(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._queue[rid] = self._paused.pop(rid)
            self._queue.move_to_end(rid, last=False)

    def abort(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        out = []
        for rid in request_ids:
            r = self._queue.pop(rid, None) or self._running.pop(rid, None) or self._paused.pop(rid, None)
            if r is not None:
                out.append(self._result(r, "abort"))
        return out

    def export_kv(self, request_id: str) -> KVState:
        r = self._paused.pop(request_id)
        context = r.req.prompt_ids + r.out[:-1]
        zeros = torch.zeros(1, len(context), 1)
        return KVState([zeros], [zeros.clone()], context, self._version)

    def import_kv(self, request_id: str, kv: KVState) -> None:
        if request_id not in self._queue:
            raise ValueError(f"request {request_id!r} is not queued")
        self.stats["kv_imports"] += 1
