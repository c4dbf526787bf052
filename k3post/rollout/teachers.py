"""MOPD teachers as scorers: `TeacherPool` gives the log-prob of given tokens under each expert, by expert name.

A local teacher (a model folder) scores through an engine the factory builds over it (`ScoringEngine.score`); an
endpoint teacher (an OpenAI-compatible base URL, e.g. vLLM's server or `k3post serve EXPERT_DIR`) is asked for prompt
log-probs from ``/v1/completions`` with ``echo=True, logprobs=0, max_tokens=0`` (the vLLM convention). Stage 3
(`k3post.stages.mopd`) and its Ray actors (`k3post.distributed.ray_cluster.TeacherActor`) use it.

Shape legend: none (token lists).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from k3post.httpclient import RetryTransport, retrying_client
from k3post.models import load_model
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout.engine import ScoringEngine
from k3post.rollout.factory import build_engine, close_engine
from k3post.urls import is_url

__all__ = ["TeacherPool"]

log = logging.getLogger("k3post.mopd")  # the teachers' loads and evictions belong to stage 3's log


class TeacherPool:
    """Teachers for log-prob scoring only (prefill, no sampling), by expert name.

    A local teacher (a model folder) is loaded on first use into CPU memory and scores through an engine the
    factory builds over it (`scorer`, `k3post.rollout.engine.ScoringEngine`); at most ``max_resident`` stay
    loaded, the least recently used is dropped first (with its engine). An endpoint teacher (an ``http(s)://`` base URL) is
    asked for prompt log-probs (module doc) through the retrying client (`k3post.httpclient`: ``retry``, default
    4 retries with backoff on 408 / 429 / 5xx and transport errors; its counters are ``retry.stats``). ``stats``
    counts loads, hits, evictions, endpoint requests, scored sequences and tokens.
    """

    def __init__(
        self,
        experts: Mapping[str, str],
        *,
        max_resident: int = 3,
        dtype: str = "float32",
        qat: QATConfig | None = None,
        batch_tokens: int = 8192,
        timeout_s: float = 120.0,
        retry: RetryTransport | None = None,
    ) -> None:
        if not experts:
            raise ValueError("TeacherPool needs at least one expert (name -> model folder or URL)")
        if not isinstance(max_resident, int) or max_resident < 1:
            raise ValueError(f"max_resident must be an int >= 1, got {max_resident!r}")
        for name, spec in experts.items():
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"expert {name!r}: expected a model folder or an http(s) URL, got {spec!r}")
            if not is_url(spec) and not (Path(spec) / "config.json").is_file():
                raise ValueError(f"expert {name!r}: {spec} is neither a model folder (no config.json) nor an http(s) URL")
        self.experts = dict(experts)
        self.max_resident = max_resident
        self.dtype = dtype
        self.qat = qat
        self.batch_tokens = batch_tokens
        self.timeout_s = timeout_s
        self.retry = retry if retry is not None else RetryTransport()
        self._resident: OrderedDict[str, torch.nn.Module] = OrderedDict()
        self._scorers: dict[str, ScoringEngine] = {}  # the engines that score with the resident local teachers
        self._client: Any = None
        self.stats = {"loads": 0, "hits": 0, "evictions": 0, "endpoint_requests": 0, "sequences": 0, "tokens": 0}

    @property
    def names(self) -> list[str]:
        """Every expert name, sorted."""
        return sorted(self.experts)

    @property
    def resident(self) -> list[str]:
        """Local teachers in memory, least recently used first."""
        return list(self._resident)

    def _spec(self, expert: str) -> str:
        if expert not in self.experts:
            raise ValueError(f"no teacher for expert {expert!r}; configured: {self.names}")
        return self.experts[expert]

    def model(self, expert: str) -> torch.nn.Module:
        """The local teacher ``expert`` (eval mode, no gradients), loaded when not resident."""
        spec = self._spec(expert)
        if is_url(spec):
            raise ValueError(f"expert {expert!r} is an endpoint ({spec}), not a local model")
        if expert in self._resident:
            self.stats["hits"] += 1
            self._resident.move_to_end(expert)
            return self._resident[expert]
        while len(self._resident) >= self.max_resident:
            old, _ = self._resident.popitem(last=False)
            if old in self._scorers:
                close_engine(self._scorers.pop(old))
            self.stats["evictions"] += 1
            log.info("teacher %s evicted", old)
        model = load_model(spec, self.dtype)
        if self.qat is not None and self.qat.enabled:
            apply_qat(model, self.qat)
        model.eval().requires_grad_(False)
        self.stats["loads"] += 1
        self._resident[expert] = model
        return model

    def scorer(self, expert: str) -> ScoringEngine:
        """The engine that scores with the local teacher ``expert`` (built by the factory over `model`, one per
        resident teacher, closed when the teacher is evicted)."""
        model = self.model(expert)
        engine = self._scorers.get(expert)  # dropped with its teacher on eviction and on close
        if engine is None:
            engine = build_engine(model, None, role=f"MOPD teacher {expert}", max_batch_size=1,
                                  max_prefill_tokens=self.batch_tokens)
            self._scorers[expert] = engine
        return engine

    def score(self, expert: str, ids: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[list[float]]:
        """``out[b][j] = log π_expert(ids[b][p] | ids[b][:p])`` for p = positions[b][j] (1 ≤ p < len(ids[b])):
        one prefill per batch of sequences (``batch_tokens`` padded tokens), float32, no sampling."""
        spec = self._spec(expert)
        if len(ids) != len(positions):
            raise ValueError(f"ids and positions differ in length: {len(ids)} vs {len(positions)}")
        for b, (seq, pos) in enumerate(zip(ids, positions)):
            if any(not 1 <= p < len(seq) for p in pos):
                raise ValueError(f"sequence {b}: positions must lie in [1, {len(seq)}), got {list(pos)[:8]}...")
        self.stats["sequences"] += len(ids)
        self.stats["tokens"] += sum(len(p) for p in positions)
        if is_url(spec):
            return self._score_endpoint(expert, spec, ids, positions)
        full = self.scorer(expert).score(ids)  # full[b][p - 1] = log p(ids[b][p] | ids[b][:p])
        return [[lp[p - 1] for p in pos] for lp, pos in zip(full, positions)]

    def score_all(self, jobs: Mapping[str, tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]]) -> dict[str, list[list[float]]]:
        """`score` for several experts: ``jobs[expert] = (ids, positions)``. Resident teachers go first, then
        the others by name, so a teacher loaded here never evicts one this call still needs (with an LRU of
        ``max_resident``, sorted order alone reloads teachers it just evicted). The scores do not depend on
        the order."""
        resident = [e for e in self.resident if e in jobs]
        return {e: self.score(e, *jobs[e]) for e in resident + sorted(set(jobs) - set(resident))}

    def _score_endpoint(self, expert: str, spec: str, ids: Sequence[Sequence[int]],
                        positions: Sequence[Sequence[int]]) -> list[list[float]]:
        base, _, fragment = spec.partition("#")
        root = base.rstrip("/")
        url = root + ("/completions" if root.endswith("/v1") else "/v1/completions")
        if self._client is None:
            self._client = retrying_client(self.timeout_s, self.retry)
        body = {"model": fragment or expert, "prompt": [list(map(int, s)) for s in ids], "echo": True, "logprobs": 0,
                "max_tokens": 0, "temperature": 0.0}
        resp = self._client.post(url, json=body)
        self.stats["endpoint_requests"] += 1
        if resp.status_code != 200:
            raise RuntimeError(f"teacher {expert!r}: {url} answered HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            choices = sorted(resp.json()["choices"], key=lambda c: int(c["index"]))
            token_lps = [c["logprobs"]["token_logprobs"] for c in choices]
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"teacher {expert!r}: {url} returned no prompt log-probs: {resp.text[:500]}") from e
        if len(token_lps) != len(ids) or any(len(lp) < len(s) for lp, s in zip(token_lps, ids)):
            raise RuntimeError(f"teacher {expert!r}: {url} echoed {[len(lp) for lp in token_lps]} log-probs for "
                               f"prompts of {[len(s) for s in ids]} tokens")
        return [[float(lp[p]) for p in pos] for lp, pos in zip(token_lps, positions)]

    def close(self) -> None:
        """Drop every resident teacher, its scoring engine and the HTTP client."""
        for engine in self._scorers.values():
            close_engine(engine)
        self._scorers.clear()
        self._resident.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
