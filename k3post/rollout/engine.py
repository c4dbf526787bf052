"""The rollout-engine protocol (STYLE.md point 6) and the pure pieces every engine shares.

Every engine (``EmbeddedEngine`` in pure PyTorch, ``VLLMEngine``, ``SGLangEngine``) takes
prompt token ids plus ``SamplingParams`` and returns, per request, the sampled ids, the
log-prob of each sampled token and the policy version that sampled it (STYLE.md point 5:
the rollout side owns staleness). Above this file everything is engine-blind.

Log-prob convention: ``output_logprobs[i] = log softmax(logits)[output_ids[i]]`` of the
*raw* model distribution (temperature 1, no top-k / top-p), i.e. log pi_old of SPEC §3.1,
which is what a plain HF forward over the full sequence gives.

Counter-based sampling (``token_uniform`` + ``sample_from_logits``): the random draw of the
token at output position i of a request is a function of (request seed, i) only,
``u = splitmix64(seed, i) / 2**64``, turned into a token by inverse-CDF sampling over the
probabilities sorted in descending order. Results therefore do not depend on batch
composition, slot, the number of other running requests, or whether a paused request is
resumed from its KV cache or re-prefilled.

Shape legend:
    B   sequences in a batch (one row per running request)
    V   vocabulary size
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "FinishReason",
    "FINISH_REASONS",
    "SamplingParams",
    "GenerationRequest",
    "GenerationResult",
    "KVState",
    "RolloutEngine",
    "SteppableEngine",
    "ScoringEngine",
    "check_score_ids",
    "generate_by_stepping",
    "QueuedRequestsMixin",
    "shared_prefix_len",
    "NamedTensors",
    "request_seed",
    "token_uniform",
    "token_uniforms",
    "sample_from_logits",
    "sample_unfiltered",
    "sampling_probs",
]

FinishReason = Literal["stop", "length", "abort", "paused"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "paused")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""Weights for ``update_weights``: a mapping or an iterable of (HF parameter name, tensor)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    Fields:
        temperature: 0 is greedy (argmax); otherwise logits / temperature.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 (or -1) disables it.
        max_tokens: most new tokens for this request (given continuation tokens count).
        stop_ids: token ids that end the request (the stop token is kept in the output);
            None means the engine default (``<|end_of_msg|>``); () means never stop early.
        seed: sampling seed. Same seed + same prompt -> same tokens. None derives one from
            the engine seed and the request id. Give the K samples of one prompt distinct
            seeds (or leave None), else they are identical.
        ignore_eos: never stop on a stop id (the stop tokens are still sampled normally, not
            masked); requests then run to max_tokens. For benchmarks with drawn lengths
            (``ignore_eos`` of vLLM / SGLang).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.stop_ids is not None:
            if isinstance(self.stop_ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_ids
            ):
                raise ValueError(f"SamplingParams.stop_ids must be a tuple of token ids >= 0 or None, got {self.stop_ids!r}")
            object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering is active."""
        return self.top_k > 0


def _check_ids(name: str, ids: Sequence[int]) -> list[int]:
    out = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in out):
        raise ValueError(f"{name} must be a sequence of token ids (ints >= 0)")
    return out


@dataclass
class GenerationRequest:
    """One sequence to sample.

    A *continuation* (resume by re-submission) carries the output tokens sampled earlier
    in ``given_ids`` with their recorded log-probs, versions and KV versions (``given_kv_versions``;
    left empty: unknown, -1 each); the engine treats them
    as already generated (they appear first in the result, with their recorded values)
    and samples only the rest. Counter-based sampling makes the continuation draw
    exactly the tokens the uninterrupted run would have drawn.

    ``keep_kv``: when the request finishes with reason "stop", an engine that supports it
    (``EmbeddedEngine``) keeps its KV cache (a CPU `KVState` over the prompt and every
    output token but the last) until ``take_kv`` / ``export_kv`` takes it, so the next
    turn of the same conversation, whose context extends this one, is added with
    ``add_request(next, kv=state)`` and prefills only its new tail. Engines without the
    feature ignore the flag.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    given_ids: list[int] = field(default_factory=list)
    given_logprobs: list[float] = field(default_factory=list)
    given_versions: list[int] = field(default_factory=list)
    keep_kv: bool = False
    given_kv_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        self.prompt_ids = _check_ids(f"request {self.request_id!r}: prompt_ids", self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_ids is empty")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: sampling must be a SamplingParams")
        self.given_ids = _check_ids(f"request {self.request_id!r}: given_ids", self.given_ids)
        self.given_logprobs = [float(x) for x in self.given_logprobs]
        self.given_versions = [int(v) for v in self.given_versions]
        self.given_kv_versions = [int(v) for v in self.given_kv_versions] or [-1] * len(self.given_ids)
        if not isinstance(self.keep_kv, bool):
            raise ValueError(f"request {self.request_id!r}: keep_kv must be a bool, got {self.keep_kv!r}")
        n = len(self.given_ids)
        if len(self.given_logprobs) != n or len(self.given_versions) != n or len(self.given_kv_versions) != n:
            raise ValueError(
                f"request {self.request_id!r}: given_ids ({n}), given_logprobs ({len(self.given_logprobs)}), "
                f"given_versions ({len(self.given_versions)}) and given_kv_versions ({len(self.given_kv_versions)}) "
                "must have the same length"
            )
        if n >= self.sampling.max_tokens:
            raise ValueError(
                f"request {self.request_id!r}: {n} given tokens already reach max_tokens={self.sampling.max_tokens}"
            )

    @classmethod
    def continuation(
        cls, partial: "GenerationResult", sampling: SamplingParams, *, keep_kv: bool = False
    ) -> "GenerationRequest":
        """Re-submit a paused result: same id and prompt, its tokens recorded as given."""
        return cls(
            request_id=partial.request_id,
            prompt_ids=list(partial.prompt_ids),
            sampling=sampling,
            given_ids=list(partial.output_ids),
            given_logprobs=list(partial.output_logprobs),
            given_versions=list(partial.output_versions),
            keep_kv=keep_kv,
            given_kv_versions=list(partial.output_kv_versions),
        )


@dataclass
class GenerationResult:
    """What an engine returns for one request (finished, paused or aborted).

    ``output_ids`` includes any given continuation tokens first; ``output_logprobs[i]`` is
    the raw-model log-prob of ``output_ids[i]`` and ``output_versions[i]`` the policy
    version that sampled it. ``output_kv_versions[i]``: the oldest policy version among the KV
    entries that token attended to (below ``output_versions[i]`` when the sequence kept KV
    computed before a weight update, `KVState.oldest_version`); -1 where the engine does not
    say (left empty: -1 for every token). ``finish_reason``: "stop" (a stop id, kept as the last
    token), "length" (max_tokens or the engine's max_model_len), "abort", "paused". ``routes``: with
    route recording on (`k3post.routing_replay`), [n, M, K] int16, the experts each context position
    0..n-1 (prompt + output but tokens the engine has not fed yet) was routed to in each MoE layer; None
    when the engine does not record them.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: FinishReason
    output_kv_versions: list[int] = field(default_factory=list)
    routes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        self.output_kv_versions = [int(v) for v in self.output_kv_versions] or [-1] * len(self.output_ids)
        if not len(self.output_ids) == len(self.output_logprobs) == len(self.output_versions) == len(self.output_kv_versions):
            raise ValueError(
                f"result {self.request_id!r}: output_ids, output_logprobs, output_versions and output_kv_versions "
                "differ in length"
            )
        n_ctx = len(self.prompt_ids) + len(self.output_ids)
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] > n_ctx):
            raise ValueError(f"result {self.request_id!r}: routes shaped {tuple(self.routes.shape)}, expected "
                             f"[<= {n_ctx} context positions, MoE layers, top_k]")

    @property
    def num_tokens(self) -> int:
        """Number of output tokens (given + newly sampled)."""
        return len(self.output_ids)


@dataclass
class KVState:
    """The KV cache of one paused sequence, on CPU, for an external KV pool (SPEC §3.2).

    ``keys[l]`` / ``values[l]``: layer l, [kv_heads, N, head_dim] for the N tokens
    ``context_ids`` (the prompt + every output token except the last one, which is the
    pending input of the next decode step). ``weight_version``: the policy version when
    the newest of these entries was computed; ``oldest_version``: when the oldest was (None:
    ``weight_version``; older when the sequence kept its KV across a weight update). Keys and values may differ in heads and width
    (whatever the model caches: MLA holds its latent [1, N, kv_lora_rank] as keys and the shared
    rotary key [1, N, qk_rope_head_dim] as values); both cover the same N positions. ``routes``: [N, M, K]
    experts of each position per MoE layer when the engine records them (`k3post.routing_replay`), else None.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    context_ids: list[int]
    weight_version: int
    oldest_version: int | None = None
    routes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.oldest_version is None:
            self.oldest_version = self.weight_version
        if self.oldest_version > self.weight_version:
            raise ValueError(f"KVState: oldest_version {self.oldest_version} is newer than weight_version {self.weight_version}")
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("KVState needs one key and one value tensor per layer")
        n = len(self.context_ids)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.dim() != 3 or v.dim() != 3 or k.shape[1] != n or v.shape[1] != n:
                raise ValueError(
                    f"KVState layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} must both be "
                    f"[heads, {n}, width] for {n} context tokens"
                )
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] != n):
            raise ValueError(f"KVState: routes shaped {tuple(self.routes.shape)}, expected [{n}, MoE layers, top_k]")

    @property
    def num_tokens(self) -> int:
        """N, the number of cached positions."""
        return len(self.context_ids)

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors (for a pool sized in bytes)."""
        routes = 0 if self.routes is None else self.routes.numel() * self.routes.element_size()
        return routes + sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(self.keys, self.values))


@runtime_checkable
class RolloutEngine(Protocol):
    """The narrow protocol every rollout engine implements."""

    @property
    def version(self) -> int:
        """Current policy version (bumped by ``update_weights``)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Sample every request to completion; results in the order of ``requests``."""
        ...

    def pause(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Stop the given in-flight requests, keeping their state; partial results with
        finish_reason "paused"."""
        ...

    def resume(self, request_ids: Sequence[str]) -> None:
        """Re-queue paused requests (ahead of new ones, in the given order)."""
        ...

    def abort(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Drop requests (queued, running or paused); partial results with finish_reason "abort"."""
        ...

    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Load weights by HF parameter name and bump the version; returns the new version."""
        ...


@runtime_checkable
class ScoringEngine(Protocol):
    """An engine that also scores given token ids with its current weights (prefill only, no sampling): the
    log-probs MOPD teachers give the student's tokens, and what an OpenAI ``echo`` request returns."""

    def score(self, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, ``out[b][t - 1] = log p(ids[b][t] | ids[b][:t])`` for t = 1 .. len(ids[b]) - 1, under the
        raw model distribution (no temperature), in the order of ``ids``. A one-token sequence gets ``[]``."""
        ...


def check_score_ids(ids: Sequence[Sequence[int]], vocab: int | None = None, max_model_len: int | None = None) -> list[list[int]]:
    """``ids`` as lists of ints for ``score``; ValueError naming the sequence (and the token position) when one is
    empty, longer than ``max_model_len`` or holds a token outside [0, vocab) (either None: no bound), or not an int."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"score: ids must be a sequence of token-id sequences, got {type(ids).__name__}")
    out = []
    for b, seq in enumerate(ids):
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or not seq:
            raise ValueError(f"score: sequence {b} must be a non-empty sequence of token ids, got {seq!r:.80}")
        if max_model_len is not None and len(seq) > max_model_len:
            raise ValueError(f"score: sequence {b} has {len(seq)} tokens, more than max_model_len {max_model_len}")
        for t, tok in enumerate(seq):
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or vocab is not None and tok >= vocab:
                raise ValueError(f"score: sequence {b}, position {t}: {tok!r} is not a token id in [0, {vocab or 'vocab'})")
        out.append([int(t) for t in seq])
    return out


@runtime_checkable
class SteppableEngine(RolloutEngine, Protocol):
    """An engine a partial-rollout scheduler drives one decode step at a time."""

    def add_request(self, request: GenerationRequest, kv: KVState | None = None) -> None:
        """Queue a request (optionally with the KV cache of its context, else it is prefilled)."""
        ...

    def step(self) -> list[GenerationResult]:
        """Admit queued requests into free slots, decode one token for every running one;
        returns the requests that finished in this step."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request is queued or running (paused ones do not count)."""
        ...

    def export_kv(self, request_id: str) -> KVState:
        """Take the KV cache of a paused request (CPU tensors); the engine keeps no copy."""
        ...

    def import_kv(self, request_id: str, kv: KVState) -> None:
        """Attach a KV cache to a queued request so it skips the prefill."""
        ...


def shared_prefix_len(contexts: Sequence[Sequence[int]], min_len: int) -> int:
    """Length of the prefix common to every context, leaving each at least one token of its own (its last position
    must produce logits); 0 when fewer than two contexts, ``min_len`` <= 0, or the prefix is shorter than
    ``min_len``. What an engine prefills once for fresh rows admitted together (`EmbeddedEngine`'s prefix sharing)."""
    if len(contexts) < 2 or min_len <= 0:
        return 0
    first = contexts[0]
    n = min(len(c) for c in contexts) - 1
    for ctx in contexts[1:]:
        i = 0
        while i < n and ctx[i] == first[i]:
            i += 1
        n = i
        if n < min_len:
            return 0
    return n


class QueuedRequestsMixin:
    """Request bookkeeping shared by steppable engines that hold their own queue (`EmbeddedEngine`,
    `k3post.rollout.replay.ReplayEngine`): import / take / drop KV, pause, resume, abort.

    The engine provides ``_queue`` (a deque of sequences with ``rid`` and ``result(reason)``), ``_paused``
    (request id -> sequence), ``_kept`` (request id -> `KVState` of finished ``keep_kv`` requests),
    ``_attach_kv(seq, kv)`` and ``_take(request_ids, what) -> [(seq, where it was)]``, which removes the
    requests from queue, slots and paused, keeping the KV of running ones.
    """

    _queue: Any
    _paused: dict[str, Any]
    _kept: dict[str, KVState]

    def _attach_kv(self, seq: Any, kv: KVState) -> None:
        raise NotImplementedError

    def _take(self, request_ids: Sequence[str], what: str) -> list[tuple[Any, str]]:
        raise NotImplementedError

    def import_kv(self, request_id: str, kv: KVState) -> None:
        """Attach ``kv`` to a queued request so its admission skips the prefill."""
        for seq in self._queue:
            if seq.rid == request_id:
                self._attach_kv(seq, kv)
                return
        raise ValueError(f"import_kv: request {request_id!r} is not queued in this engine")

    def take_kv(self, request_id: str) -> KVState | None:
        """The KV cache kept for a finished ``keep_kv`` request (CPU tensors), removed from
        the engine; None when none is kept (not finished with "stop", already taken or
        dropped). Its ``context_ids`` are the request's prompt + output ids but the last."""
        return self._kept.pop(request_id, None)

    def drop_kv(self, request_ids: Sequence[str] | None = None) -> int:
        """Discard kept KV states of finished requests (all when ``request_ids`` is None);
        unknown ids are ignored. Returns how many were dropped."""
        if isinstance(request_ids, str):
            raise ValueError("drop_kv takes a sequence of request ids, not a single str")
        if request_ids is None:
            n = len(self._kept)
            self._kept.clear()
            return n
        return sum(self._kept.pop(r, None) is not None for r in request_ids)

    def pause(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Pause queued / running requests: their slots are freed, their KV caches kept in
        the engine; returns partial results (finish_reason "paused")."""
        if isinstance(request_ids, str):
            raise ValueError("pause takes a sequence of request ids, not a single str")
        already = [r for r in request_ids if r in self._paused]
        if already:
            raise ValueError(f"pause: requests {already} are already paused")
        taken = self._take(request_ids, "pause")
        out = []
        for seq, _ in taken:
            self._paused[seq.rid] = seq
            out.append(seq.result("paused"))
        return out

    def resume(self, request_ids: Sequence[str]) -> None:
        """Re-queue paused requests ahead of new ones, in the given order; they reuse the
        KV cache kept at pause time (no prefill)."""
        if isinstance(request_ids, str):
            raise ValueError("resume takes a sequence of request ids, not a single str")
        missing = [r for r in request_ids if r not in self._paused]
        if missing:
            raise ValueError(f"resume: requests {missing} are not paused in this engine")
        for rid in reversed(list(dict.fromkeys(request_ids))):
            self._queue.appendleft(self._paused.pop(rid))

    def abort(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Drop queued, running or paused requests; partial results (finish_reason "abort")."""
        taken = self._take(request_ids, "abort")
        return [seq.result("abort") for seq, _ in taken]


def generate_by_stepping(engine: SteppableEngine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """``generate`` of a steppable engine: add every request, ``step`` until none is left;
    results in request order. The engine must be idle (mix with requests already in flight
    through ``add_request`` / ``step``)."""
    if engine.has_unfinished():
        raise ValueError("generate() needs an idle engine; drive in-flight requests with step()")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("generate(): request ids must be unique")
    for r in requests:
        engine.add_request(r)
    done: dict[str, GenerationResult] = {}
    while engine.has_unfinished():
        for res in engine.step():
            done[res.request_id] = res
    return [done[i] for i in ids]


# --------------------------------------------------------------------------- counter-based RNG

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(engine_seed: int, request_id: str) -> int:
    """The seed of a request with ``SamplingParams.seed=None``: mix of the engine seed and a
    stable 32-bit hash (CRC-32) of the request id; the same on every run and machine."""
    return _splitmix64(((engine_seed & 0xFFFFFFFF) << 32) | zlib.crc32(request_id.encode("utf-8")))


def token_uniform(seed: int, position: int) -> float:
    """The uniform draw u in [0, 1) for output position ``position`` of a request seeded
    ``seed``: u = (splitmix64(splitmix64(seed) + position) >> 11) * 2^-53 (53 random bits)."""
    return (_splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64) >> 11) * (1.0 / (1 << 53))


def token_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """``token_uniform`` for each (seed, position) pair, as a float64 tensor [B]."""
    return torch.tensor([token_uniform(s, p) for s, p in zip(seeds, positions)], dtype=torch.float64)


def sample_from_logits(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    u_B: torch.Tensor,
) -> torch.Tensor:
    """Sample one token per row, vectorised over rows with per-row parameters.

        greedy rows (temperature 0):  argmax_v logits[v]
        unfiltered rows (top_k 0, top_p 1):  p = softmax(logits / T);
                     c = cumsum(p) in vocabulary order; token = first v with c_v > u * c_last
        filtered rows: p sorted descending (stable, ties by id); keep ranks r < top_k
                     (top_k 0 keeps all) and ranks whose preceding mass
                     sum_{r'<r} p_r' < top_p (the nucleus; rank 0 always kept);
                     c = cumsum(kept p); token = sorted id at the first rank with
                     c_r > u * c_last                              (inverse CDF)

    The result of a row depends only on that row's logits, parameters and u, never on
    the other rows.

    Args:
        logits_BV: [B, V] raw logits (any float dtype; computed in float32).
        temperature_B: [B] float, >= 0.
        top_k_B: [B] int, 0 (or < 0) disables.
        top_p_B: [B] float in (0, 1].
        u_B: [B] float64 uniforms in [0, 1) (``token_uniforms``).
    Returns:
        [B] int64 token ids.
    """
    if logits_BV.dim() != 2:
        raise ValueError(f"logits_BV must be [B, V], got {tuple(logits_BV.shape)}")
    B, V = logits_BV.shape
    for name, t in (("temperature_B", temperature_B), ("top_k_B", top_k_B), ("top_p_B", top_p_B), ("u_B", u_B)):
        if t.shape != (B,):
            raise ValueError(f"{name} must have shape [{B}], got {tuple(t.shape)}")
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    any_greedy = bool(greedy_B.any())
    out_B = logits_BV.argmax(dim=-1) if any_greedy else None
    if out_B is not None and bool(greedy_B.all()):
        return out_B
    temp_B = temperature_B.to(torch.float32)
    if any_greedy:
        temp_B = torch.where(greedy_B, torch.ones_like(temp_B), temp_B)
    probs_BV = torch.softmax(logits_BV / temp_B[:, None], dim=-1)
    # Rows without top-k / top-p invert the CDF in vocabulary order (no sort needed); rows
    # with a filter invert it in descending-probability order. Which order a row uses
    # depends only on its own parameters, so rows stay independent of each other.
    filt_B = ((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1.0)
    cdf_BV = torch.cumsum(probs_BV.double(), dim=-1)
    order_BV: torch.Tensor | None = None
    if bool(filt_B.any()):
        rows_F = filt_B.nonzero().squeeze(-1)
        sorted_p_FV, sorted_id_FV = torch.sort(probs_BV[rows_F], dim=-1, descending=True, stable=True)
        kept_FV = _keep_top(sorted_p_FV, top_k_B[rows_F], top_p_B[rows_F]).double()
        order_BV = torch.arange(V, device=logits_BV.device).expand(B, V).clone()
        order_BV[rows_F] = sorted_id_FV
        cdf_BV[rows_F] = torch.cumsum(kept_FV, dim=-1)
    rank_B = _inverse_cdf(cdf_BV, u_B)
    sampled_B = rank_B if order_BV is None else order_BV.gather(1, rank_B.unsqueeze(-1)).squeeze(-1)
    if out_B is None:
        return sampled_B
    return torch.where(greedy_B, out_B, sampled_B)


def _keep_top(sorted_p_FV: torch.Tensor, top_k_F: torch.Tensor, top_p_F: torch.Tensor) -> torch.Tensor:
    """Rows of probabilities sorted in descending order with their top-k / top-p filter applied: rank r
    is kept when r < top_k (top_k <= 0 keeps all) and its preceding mass sum_{r'<r} p_r' < top_p (rank 0
    always kept); dropped ranks are 0 (not renormalised). [F, V] -> [F, V]."""
    V = sorted_p_FV.shape[-1]
    rank_V = torch.arange(V, device=sorted_p_FV.device)
    k_F = torch.where(top_k_F > 0, top_k_F, torch.full_like(top_k_F, V))
    keep_FV = rank_V[None, :] < k_F[:, None]
    mass_before_FV = torch.cumsum(sorted_p_FV, dim=-1) - sorted_p_FV
    keep_FV &= (mass_before_FV < top_p_F.to(sorted_p_FV.dtype)[:, None]) | (rank_V[None, :] == 0)
    return torch.where(keep_FV, sorted_p_FV, torch.zeros_like(sorted_p_FV))


def sampling_probs(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """The distribution ``sample_from_logits`` samples each row from, in vocabulary order, float64 [B, V]:

        greedy rows (temperature 0):  one-hot at argmax_v logits[v]
        other rows:  p = softmax(logits / T) (fp32), top-k / top-p filtered as ``sample_from_logits``
                     filters it (rank r kept when r < top_k and sum_{r'<r} p_r' < top_p), renormalised

    Speculative decoding (`k3post.rollout.speculative`) verifies drafts against this p, so a verified
    token follows the same law as a plainly sampled one."""
    logits_BV = logits_BV.float()
    B, V = logits_BV.shape
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B, dtype=torch.float32), temperature_B.float())
    probs_BV = torch.softmax(logits_BV / temp_B[:, None], dim=-1)
    filt_B = ((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1.0)
    out_BV = probs_BV.double()
    if bool(filt_B.any()):
        rows_F = filt_B.nonzero().squeeze(-1)
        sorted_p_FV, sorted_id_FV = torch.sort(probs_BV[rows_F], dim=-1, descending=True, stable=True)
        kept_FV = _keep_top(sorted_p_FV, top_k_B[rows_F], top_p_B[rows_F]).double()
        out_BV[rows_F] = torch.zeros_like(kept_FV).scatter_(1, sorted_id_FV, kept_FV / kept_FV.sum(-1, keepdim=True))
    if bool(greedy_B.any()):
        rows_G = greedy_B.nonzero().squeeze(-1)
        out_BV[rows_G] = torch.zeros_like(out_BV[rows_G]).scatter_(1, logits_BV[rows_G].argmax(-1, keepdim=True), 1.0)
    return out_BV


def _inverse_cdf(cdf_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Per row, the first index r with c_r > u * c_last (c = cdf_BV, non-decreasing): [B]."""
    target_B1 = (u_B.to(cdf_BV.dtype) * cdf_BV[:, -1]).unsqueeze(-1)
    rank_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    # u < 1 so target < c_last and rank <= V-1 (clamp guards rounding); the first c_r > target
    # never lands on a zero-probability (filtered) entry, since c is flat across those.
    return rank_B.clamp_(max=cdf_BV.shape[-1] - 1)


def sample_unfiltered(logits_BV: torch.Tensor, temperature_B: torch.Tensor | None, u_B: torch.Tensor) -> torch.Tensor:
    """``sample_from_logits`` for a batch whose rows all sample plainly (temperature > 0,
    no top-k, top-p 1), without its per-row branching; the same ops on those rows, hence
    the same tokens bit for bit (tested):

        p = softmax(logits / T);  c = cumsum(p) in vocabulary order;
        token = first v with c_v > u * c_last

    Args:
        logits_BV: [B, V] raw logits (computed in float32).
        temperature_B: [B] float32, > 0; None means temperature 1 for every row (the
            division by 1 is skipped: it is exact).
        u_B: [B] float64 uniforms in [0, 1) (``token_uniforms``).
    Returns:
        [B] int64 token ids.
    """
    if logits_BV.dim() != 2:
        raise ValueError(f"logits_BV must be [B, V], got {tuple(logits_BV.shape)}")
    logits_BV = logits_BV.float()
    if temperature_B is not None:
        logits_BV = logits_BV / temperature_B.to(torch.float32)[:, None]
    return _inverse_cdf(torch.cumsum(torch.softmax(logits_BV, dim=-1).double(), dim=-1), u_B)
