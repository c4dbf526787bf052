"""Two forward paths under one scheduler (admission, prefix sharing, sampling, pause / resume, KV
export / import are shared): the *lean* forward described below, for the decoder families it
mirrors op for op (``lean_blocker`` is the strict eligibility check: Llama, Mistral, Qwen2/3,
Qwen2/3-MoE, Mixtral without a sliding window shorter than ``max_model_len``), and the *general*
path for every other causal LM (gpt-oss, DeepSeek-V3 / Kimi-K2 MLA, ...): the model's own forward
over a per-sequence HF ``DynamicCache`` (`k3post.rollout.hf_forward`). ``engine.path`` says which
runs; the constructor's ``path`` forces one.

The lean forward (`k3post.rollout.embedded.forward.LeanForward`) and the general one
(`k3post.rollout.hf_forward.HFForward`) share one surface: ``cache`` (the slot KV cache),
``forward_chunks`` (token chunks continuing each slot's cache), ``capture_layers`` / ``captured``
(hidden states a speculative drafter reads); the lean one also has decode- and verify-shaped forwards.

One ``step()``:
  1. admission: queued requests (resumed ones first) fill the free slots, up to
     ``max_prefill_tokens`` per step; their contexts (prompt + given tokens) are prefilled
     in one padded batch; identical contexts (the K samples of one prompt) are prefilled
     once and their KV rows copied, and a prefix common to all fresh contexts (the
     system / effort header) is prefilled once (prefix sharing); a request with an
     imported KV cache prefills only the uncached tail;
  2. decode (runs first in a step): one batched forward of one token for every running
     request; slots freed by finished ones are refilled in the same step's admission;
  3. sampling: every row samples from its own logits with its own parameters and its
     counter-based uniform (``k3post.rollout.engine.sample_from_logits``); the log-prob of
     the raw distribution and the current policy version are recorded per token;
  4. finished requests (stop id, max_tokens, max_model_len) leave, and the last running
     slot moves into each hole, so running sequences always occupy slots 0..n-1 and the
     next step's queue refill happens at once (continuous batching).

Paused requests hand back their partial state (tokens, log-probs, versions) and keep their
KV cache inside the engine until ``resume`` (reuses it), ``export_kv`` (moves it out to
CPU and forgets the request) or ``abort``.

Multi-turn KV reuse: a request added with ``keep_kv=True`` that finishes with reason
"stop" leaves its KV cache (CPU ``KVState`` over prompt + output tokens except the last,
which was sampled but never fed) in the engine; ``take_kv`` (or ``export_kv``) hands it
out, and the next turn, whose context extends it, is added with ``kv=`` that state: only
the new tail (the last sampled token, the tool results, the generation prefix) is
prefilled. ``drop_kv`` discards kept states that will not be used.

Shape legend (the forward's own dims are in `k3post.rollout.embedded.forward`'s):
    B   sequences in a batch (slots 0..B-1)
    T   positions per row in a forward (1 when decoding; 1 + drafts in a speculative round)
    K   drafted tokens per row (speculative)
    V   vocabulary size
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3post.config.rollout import QAT_OP_ORDERS
from k3post.scoring import sequence_logprobs
from k3post.quant import qat as qat_module
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout.embedded.exact import ExactForward, exact_forward_for
from k3post.rollout.embedded.forward import LeanForward, lean_blocker
from k3post.rollout.embedded.spec_rounds import SpeculativeRounds
from k3post.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    KVState,
    NamedTensors,
    QueuedRequestsMixin,
    check_score_ids,
    generate_by_stepping,
    request_seed,
    sample_from_logits,
    shared_prefix_len,
    sample_unfiltered,
    token_uniforms,
)
from k3post.rollout.hf_forward import HFForward
from k3post.routing_replay import RouteRecorder
from k3post.rollout.speculative import SpeculativeConfig

__all__ = ["EmbeddedEngine"]

log = logging.getLogger("k3post.rollout")


@dataclass
class _Seq:
    """Engine-side state of one request."""

    request: GenerationRequest
    seed: int
    stop_ids: frozenset[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    kv_versions: list[int]  # per output token: the oldest weight version among the KV entries it attended to
    n_cached: int = 0  # context positions whose K/V are in the slot cache (or in `kv`)
    kv_oldest: int = -1  # the weight version of the oldest of those entries
    slot: int = -1
    kv: KVState | None = None  # imported / retained KV while queued or paused
    aux: list[torch.Tensor] = field(default_factory=list)  # speculative: target hidden [N, A, D] not yet drafted on
    aux_start: int = 0  # context position of aux's first row
    context: list[int] = field(default_factory=list)  # prompt + output_ids
    routes: torch.Tensor | None = None  # recorded routes of the fed positions, taken when the request left its slot

    @property
    def rid(self) -> str:
        return self.request.request_id

    def result(self, finish_reason: str) -> GenerationResult:
        return GenerationResult(
            request_id=self.rid,
            prompt_ids=list(self.request.prompt_ids),
            output_ids=list(self.output_ids),
            output_logprobs=list(self.logprobs),
            output_versions=list(self.versions),
            finish_reason=finish_reason,  # type: ignore[arg-type]
            output_kv_versions=list(self.kv_versions),
            routes=self.kv.routes if self.kv is not None else self.routes,
        )




class EmbeddedEngine(QueuedRequestsMixin, SpeculativeRounds):
    """Continuous-batching rollout engine over a Hugging Face causal LM (pure PyTorch).

    Args:
        model_or_dir: an HF Llama-style decoder-only ``PreTrainedModel`` (Qwen3-MoE,
            Qwen3, Llama, ...) or a local model folder (loaded with
            ``k3post.models.load_model``). A model object is used in place (weights
            shared, e.g. with a co-located trainer).
        tokenizer: used only for the default stop id ``<|end_of_msg|>``; when None and
            ``model_or_dir`` is a folder holding a tokenizer, that one is loaded; else the
            config's ``eos_token_id``.
        max_batch_size: slots, i.e. most sequences decoded together.
        max_model_len: most positions (prompt + output) of one sequence; defaults to
            ``config.max_position_embeddings``.
        qat: apply MX QAT (``apply_qat``) to the model before use. A model that already has
            QAT applied uses it as is (the engine calls the patched expert modules).
        seed: engine seed, used for requests whose ``SamplingParams.seed`` is None.
        stop_ids: overrides the default stop ids.
        prefix_sharing: prefill identical contexts admitted together once, and a prefix
            common to all fresh contexts admitted together (at least ``min_shared_prefix``
            tokens, e.g. the system / effort header) once.
        min_shared_prefix: shortest common prefix worth sharing (0 disables that part).
        dense_moe_max_tokens: forwards of at most this many tokens (decode steps) run the
            MoE experts as dense GEMMs over all experts with cached (QAT: MXFP4
            fake-quantized once per weight version) expert weights; larger ones (prefill)
            call ``layer.mlp`` itself (under QAT with its expert weights fake-quantized once
            per weight version too, `k3post.quant.qat.weight_quant_cache`). HF's router
            module picks the experts either way. 0 always calls ``layer.mlp``.
        max_prefill_tokens: most context tokens prefilled in one step (bounds activation
            memory); further queued requests are admitted in the next steps.
        path: "auto" (default) runs the lean forward when ``lean_blocker`` finds nothing it
            cannot reproduce exactly, else the general path (the model's own forward over a
            per-sequence HF ``DynamicCache``, `k3post.rollout.hf_forward`); "lean" raises
            ValueError when the model is not eligible; "general" forces the general path.
            ``engine.path`` says which one runs (logged at INFO with the reason).
        speculative: speculative decoding (`k3post.rollout.speculative`): every decode step drafts
            k tokens per row with the drafter and verifies them in one target forward; the tokens
            follow the target's law (greedy: plain decoding's tokens) and carry the target's log-probs.
            Admission then prefills a context but its last token, which the next step's round decodes.
        qat_op_order: the lean forward's ops under QAT. "hf" (default): HF's op order (``F.linear``,
            SDPA, per-expert down products summed in expert order); "fast": the same ops as without QAT
            (pre-transposed GEMMs, batched-GEMM decode attention, routing weights folded into the down
            GEMM) around the same fake-quantized tensors. Either differs from HF's whole-sequence forward
            in the last bit of some values (other GEMM shapes), and an MXFP8 rounding boundary turns such
            a bit into ~1e-4 of log-prob. Measured in RL (docs/decisions.md, issue 32 §qatorder): "fast"
            1.1-1.3x a decode step, a train-rollout gap ~4x larger (median per step 4e-6 against 1e-6):
            an opt-in (``engine.qat_op_order``).
        exact: the exact forward (`k3post.rollout.embedded.exact`, ``engine.path`` "exact"): every log-prob the
            engine records equals the trainer's recomputed one (`k3post.policy_step`, ``exact``) bit for bit, whatever
            the batch composition, prefix sharing, pause / resume or server. ValueError for a model it cannot run
            (`exact_blocker`), RuntimeError when this machine's kernels fail its batch-invariance self-check.
        record_routes: record the experts every fed position was routed to in every MoE layer (routing
            replay, `k3post.routing_replay`): they move with the KV (prefix sharing, pause / resume, kept
            multi-turn KV) and come back in `GenerationResult.routes`. ValueError when the model's routers
            are not plain top-k routers.

    ``shares_weights``: the engine decodes with the model object's own parameters, so a co-located
    trainer's optimizer step is visible to it and a weight push is a version bump
    (`k3post.rollout.factory.Rollout.push_weights`).
    """

    shares_weights = True

    def __init__(
        self,
        model_or_dir: nn.Module | str | Path,
        tokenizer: Any | None = None,
        *,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        qat: QATConfig | None = None,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
        prefix_sharing: bool = True,
        dense_moe_max_tokens: int = 64,
        max_prefill_tokens: int = 2048,
        min_shared_prefix: int = 16,
        path: str = "auto",
        speculative: SpeculativeConfig | None = None,
        qat_op_order: str = "hf",
        record_routes: bool = False,
        exact: bool = False,
    ) -> None:
        model: Any
        if isinstance(model_or_dir, (str, Path)):
            from k3post.models import load_model

            model = load_model(model_or_dir)
            if tokenizer is None and any(
                (Path(model_or_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
            ):
                from k3post.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(model_or_dir)
        elif isinstance(model_or_dir, nn.Module):
            model = model_or_dir
        else:
            raise ValueError(f"model_or_dir must be an nn.Module or a model folder, got {type(model_or_dir).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if qat_op_order not in QAT_OP_ORDERS:
            raise ValueError(f"qat_op_order must be one of {QAT_OP_ORDERS}, got {qat_op_order!r}")
        self.qat_op_order = qat_op_order
        if path not in ("auto", "lean", "general"):
            raise ValueError(f"path must be 'auto', 'lean' or 'general', got {path!r}")
        if not isinstance(model, nn.Module) or not callable(getattr(model, "get_input_embeddings", None)) \
                or not hasattr(model, "config"):
            raise ValueError(f"EmbeddedEngine needs a Hugging Face causal LM (a PreTrainedModel), got {type(model).__name__}")
        self.model = model
        cfg = model.config
        if qat is not None and qat.enabled and not self.qat_enabled:
            apply_qat(model, qat)
        if max_model_len is None:
            max_model_len = getattr(cfg.get_text_config(decoder=True), "max_position_embeddings", None)
            if max_model_len is None:
                raise ValueError(f"{type(model).__name__}'s config has no max_position_embeddings: pass max_model_len")
        self.max_model_len = int(max_model_len)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.max_batch_size = max_batch_size
        self.seed = int(seed)
        self.prefix_sharing = bool(prefix_sharing)
        if not isinstance(dense_moe_max_tokens, int) or dense_moe_max_tokens < 0:
            raise ValueError(f"dense_moe_max_tokens must be an int >= 0, got {dense_moe_max_tokens!r}")
        self.dense_moe_max_tokens = dense_moe_max_tokens
        if not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
        self.max_prefill_tokens = max_prefill_tokens
        if not isinstance(min_shared_prefix, int) or min_shared_prefix < 0:
            raise ValueError(f"min_shared_prefix must be an int >= 0, got {min_shared_prefix!r}")
        self.min_shared_prefix = min_shared_prefix
        self.default_stop_ids: frozenset[int] = self._default_stop_ids(tokenizer, stop_ids)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self._vocab = int(model.get_input_embeddings().num_embeddings)

        self._lean: LeanForward | None = None  # the lean path's forward (decode- and verify-shaped forwards too)
        self._forward: LeanForward | HFForward
        if exact:  # the batch-invariant forward (k3post.rollout.embedded.exact): fails closed where it cannot run
            if path == "general":
                raise ValueError("exact=True runs the exact forward; path='general' asks for the model's own forward")
            self.path: str = "exact"
            self._forward = ExactForward(model, max_batch_size, self.max_model_len)
            log.info("EmbeddedEngine: exact path for %s (batch-invariant: log-probs equal the trainer's bit for bit)",
                     type(model).__name__)
        else:
            blocker = lean_blocker(model, self.max_model_len)
            if path == "lean" and blocker is not None:
                raise ValueError(f"path='lean': the lean forward cannot run {type(model).__name__}: {blocker}")
            self.path = "general" if path == "general" or blocker is not None else "lean"
            why = "forced by path='general'" if path == "general" else blocker or "a Llama-style decoder it mirrors exactly"
            log.info("EmbeddedEngine: %s path for %s (%s); under QAT the %s op order", self.path, type(model).__name__, why,
                     qat_op_order)
            if self.path == "general":
                self._forward = HFForward(model, max_batch_size, self.max_model_len)
            else:
                self._forward = self._lean = LeanForward(model, max_batch_size, self.max_model_len,
                                                         qat_op_order=qat_op_order, dense_moe_max_tokens=dense_moe_max_tokens)
        self.cache = self._forward.cache
        self._routes: RouteRecorder | None = None
        if record_routes:
            self._routes = self._forward.routes = RouteRecorder(model, max_batch_size, self.max_model_len, self.device)
        self._version = 0
        self._queue: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # index == slot
        self._paused: dict[str, _Seq] = {}
        self._kept: dict[str, KVState] = {}  # KV of finished keep_kv requests, until taken
        self.stats: dict[str, int | float] = {
            "steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "shared_prefills": 0, "shared_prefix_tokens": 0,
            "kv_kept": 0, "kv_reused_tokens": 0,
        }
        self._spec = speculative
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
            speculative.drafter.bind(max_batch_size, self.max_model_len + speculative.num_draft_tokens, self._vocab)
            n_layers = int(getattr(cfg.get_text_config(decoder=True), "num_hidden_layers"))
            aux_layers = tuple(int(i) for i in speculative.drafter.aux_layers)
            if any(not 0 <= i < n_layers for i in aux_layers):
                raise ValueError(f"drafter aux_layers {aux_layers} outside the target's {n_layers} layers")
            self._forward.capture_layers = aux_layers
            self.stats.update(spec_target_forwards=0, spec_drafted=0, spec_accepted=0, spec_emitted=0,
                              spec_acceptance_rate=0.0, spec_acceptance_length=0.0)

    def _default_stop_ids(self, tokenizer: Any | None, stop_ids: Sequence[int] | None) -> frozenset[int]:
        if stop_ids is not None:
            return frozenset(int(t) for t in stop_ids)
        if tokenizer is not None:
            from k3post.xtml import EOM

            eom = tokenizer.convert_tokens_to_ids(EOM)
            if not isinstance(eom, int) or eom == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"the tokenizer has no {EOM} token; pass stop_ids explicitly")
            return frozenset([int(eom)])
        eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return frozenset()
        return frozenset([int(eos)] if isinstance(eos, int) else [int(t) for t in eos])

    @property
    def version(self) -> int:
        """Policy version stamped on every sampled token."""
        return self._version

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding setup (drafter, tokens a round), None when decoding plainly."""
        return self._spec

    @property
    def qat_enabled(self) -> bool:
        """True when the model's routed experts run the MX fake-quant (QAT) forward."""
        return any(hasattr(m, qat_module._CFG_ATTR) for m in self.model.modules())

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def num_queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def num_paused(self) -> int:
        """Paused requests still held by the engine."""
        return len(self._paused)

    def kv_utilization(self) -> float:
        """Cached positions of running requests / (slots x max_model_len)."""
        return sum(s.n_cached for s in self._running) / (self.max_batch_size * self.max_model_len)

    @property
    def num_kept_kv(self) -> int:
        """KV states of finished ``keep_kv`` requests not yet taken (``take_kv`` / ``drop_kv``)."""
        return len(self._kept)

    def partial_outputs(self) -> dict[str, tuple[list[int], list[float]]]:
        """Output ids and log-probs sampled so far (given continuation tokens first) of every
        request holding a slot, by request id. The lists are the engine's own (no copies,
        for a streaming reader between steps): read them, do not modify them."""
        return {s.rid: (s.output_ids, s.logprobs) for s in self._running}

    def has_unfinished(self) -> bool:
        """True while any request is queued or running (paused ones do not count)."""
        return bool(self._queue or self._running)

    def _live_ids(self) -> set[str]:
        return {s.rid for s in self._queue} | {s.rid for s in self._running} | set(self._paused)

    def add_request(self, request: GenerationRequest, kv: KVState | None = None) -> None:
        """Queue ``request`` (FIFO). ``kv``: the KV cache of a proper prefix of its context
        (prompt + given ids): ``export_kv`` of its paused earlier self, or ``take_kv`` of the
        previous turn of the same conversation (a finished ``keep_kv`` request); only the
        remaining suffix is prefilled. Without it the whole context is prefilled. Raises
        ValueError when ``kv.context_ids`` is not a proper prefix of the context (or the KV
        does not fit the model)."""
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"add_request takes a GenerationRequest, got {type(request).__name__}")
        if request.request_id in self._live_ids():
            raise ValueError(f"request id {request.request_id!r} is already queued, running or paused in this engine")
        context = request.prompt_ids + request.given_ids
        if len(context) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt + given tokens = {len(context)} positions leave no room "
                f"under max_model_len={self.max_model_len}"
            )
        vocab = self._vocab
        if max(context) >= vocab:
            raise ValueError(f"request {request.request_id!r}: token id {max(context)} >= vocabulary size {vocab}")
        sp = request.sampling
        seq = _Seq(
            request=request,
            seed=sp.seed if sp.seed is not None else request_seed(self.seed, request.request_id),
            stop_ids=frozenset(sp.stop_ids) if sp.stop_ids is not None else self.default_stop_ids,
            output_ids=list(request.given_ids),
            logprobs=list(request.given_logprobs),
            versions=list(request.given_versions),
            kv_versions=list(request.given_kv_versions),
            context=context,
        )
        if kv is not None:
            self._attach_kv(seq, kv)
        self._queue.append(seq)

    def _attach_kv(self, seq: _Seq, kv: KVState) -> None:
        if not isinstance(kv, KVState):
            raise ValueError(f"kv must be a KVState, got {type(kv).__name__}")
        n = kv.num_tokens
        if n > len(seq.context) - 1 or kv.context_ids != seq.context[:n]:
            raise ValueError(
                f"request {seq.rid!r}: the KV state covers {n} tokens that are not a proper prefix of its "
                f"context ({len(seq.context)} tokens)"
            )
        bad = self.cache.shape_error(kv.keys, kv.values)
        if bad is not None:
            raise ValueError(f"request {seq.rid!r}: the KV state does not fit this model: {bad}")
        seq.kv = kv

    def export_kv(self, request_id: str) -> KVState:
        """Take a paused request out of the engine with its KV cache (CPU tensors), or the
        kept KV of a finished ``keep_kv`` request (as ``take_kv``, but raising when none).

        The caller keeps the partial ``GenerationResult`` that ``pause`` returned and
        re-submits ``GenerationRequest.continuation(result, sampling)`` with
        ``add_request(..., kv=state)`` (or without ``kv``: re-prefill, same tokens)."""
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            return kept
        seq = self._paused.get(request_id)
        if seq is None:
            raise ValueError(f"export_kv: request {request_id!r} is not paused in this engine")
        if seq.kv is None:
            raise ValueError(f"export_kv: paused request {request_id!r} holds no KV cache (it never reached a slot)")
        del self._paused[request_id]
        kv = seq.kv
        return KVState(
            keys=[k.to("cpu") for k in kv.keys], values=[v.to("cpu") for v in kv.values],
            context_ids=list(kv.context_ids), weight_version=kv.weight_version, oldest_version=kv.oldest_version,
            routes=kv.routes,
        )

    def _take(self, request_ids: Sequence[str], what: str) -> list[tuple[_Seq, str]]:
        """Remove the given requests from queue / slots / paused; (seq, where it was)."""
        if isinstance(request_ids, str):
            raise ValueError(f"{what} takes a sequence of request ids, not a single str")
        wanted = list(dict.fromkeys(request_ids))
        found: dict[str, tuple[_Seq, str]] = {}
        for seq in self._queue:
            if seq.rid in wanted:
                found[seq.rid] = (seq, "queued")
        for seq in self._running:
            if seq.rid in wanted:
                found[seq.rid] = (seq, "running")
        for rid, seq in self._paused.items():
            if rid in wanted:
                found[rid] = (seq, "paused")
        unknown = [r for r in wanted if r not in found]
        if unknown:
            raise ValueError(f"{what}: unknown request ids {unknown} (not queued, running or paused)")
        self._queue = deque(s for s in self._queue if s.rid not in found)
        running_hit = [s for s in self._running if s.rid in found]
        for seq in running_hit:  # keep the KV cache of running ones before freeing slots
            seq.kv = self._export_kv(seq)
        self._free_slots({s.slot for s in running_hit})
        for rid in found:
            self._paused.pop(rid, None)
            if self._spec is not None:  # rebuilt from the context when it runs again
                self._spec.drafter.release(rid)
        return [found[r] for r in wanted]

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Copy tensors into the model parameters / buffers by HF name and bump the version.

        Tokens sampled after this call carry the new version. Running sequences keep the
        KV cache computed with the earlier weights (as vLLM / SGLang do on an in-place
        update). Args: ``version``: set this version (must exceed the current one)
        instead of current + 1. Returns the new version."""
        items = list(named_tensors.items()) if hasattr(named_tensors, "items") else list(named_tensors)  # type: ignore[union-attr]
        targets: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        unknown = [n for n, _ in items if n not in targets]
        if unknown:
            raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        for name, t in items:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(targets[name].shape):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"update_weights: {name} has shape {got}, the model expects {tuple(targets[name].shape)}")
        if version is not None and version <= self._version:
            raise ValueError(f"update_weights: version {version} must exceed the current version {self._version}")
        with torch.no_grad():
            for name, t in items:
                targets[name].copy_(t.to(targets[name].device, targets[name].dtype))
        self._version = self._version + 1 if version is None else int(version)
        return self._version

    def score(self, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """`ScoringEngine.score` with the model's own forward (HF's, under QAT its MX fake-quant forward: the
        numbers the trainer computes), batched by ``max_prefill_tokens`` padded tokens. It reads no slot and no
        rotary table of the engine, so requests in flight are untouched and ``max_model_len`` does not cap it
        (the model's forward does: a MOPD teacher scores the student's context under its own effort header, a
        few tokens longer); call it between steps (the engine is not thread-safe)."""
        seqs = check_score_ids(ids, self._vocab)
        forward = None
        if self.path == "exact":  # the exact forward's numbers (a trainer's exact recomputation: rl.rollout.exact)
            forward = exact_forward_for(self.model, max(len(s) for s in seqs)).token_logprobs
        return [lp[1:] for lp in sequence_logprobs(self.model, seqs, self.max_prefill_tokens, forward=forward)]

    def refresh_weights(self) -> None:
        """Drop the engine's derived copies of the weights (rebuilt on next use). Needed only after changing
        parameters through ``.data`` (which bypasses the tensor version counter the lean forward watches);
        the general path reads the model's parameters directly."""
        if isinstance(self._forward, LeanForward):  # the lean or the exact forward
            self._forward.refresh_weights()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results in request order. The engine must be
        idle (use ``add_request`` / ``step`` to mix with requests already in flight)."""
        return generate_by_stepping(self, requests)

    def step(self) -> list[GenerationResult]:
        """Admit queued requests into free slots (prefill, first token), decode one token
        for every request that was already running; return those that finished."""
        was_training = self.model.training
        if was_training:  # eval() walks every module: only when needed
            self.model.eval()
        try:
            with torch.inference_mode():
                finished: list[_Seq] = []
                reasons: dict[str, str] = {}
                if self._running:
                    (self._decode if self._spec is None else self._decode_spec)(list(self._running), finished, reasons)
                    self._keep_finished_kv(finished, reasons)
                    self._free_slots({s.slot for s in finished})  # refilled at once below
                admitted = self._admit()
                if admitted:
                    first: list[_Seq] = []
                    self._prefill(admitted, first, reasons)
                    self._keep_finished_kv(first, reasons)
                    self._free_slots({s.slot for s in first})
                    finished += first
                self.stats["steps"] += 1
                if self._spec is not None:
                    for s in finished:
                        self._spec.drafter.release(s.rid)
        finally:
            if was_training:
                self.model.train()
        return [s.result(reasons[s.rid]) for s in finished]

    def _export_kv(self, seq: _Seq) -> KVState:
        """A CPU copy of the slot state of a running request: positions 0..n_cached-1 (KV, and routes when
        recorded)."""
        keys, values = self.cache.export(seq.slot, seq.n_cached)
        routes = None if self._routes is None else self._routes.cache.export(seq.slot, seq.n_cached)
        return KVState(keys, values, seq.context[: seq.n_cached], self._version, seq.kv_oldest, routes)

    def _keep_finished_kv(self, finished: list[_Seq], reasons: dict[str, str]) -> None:
        """Copy the slot KV of finished ``keep_kv`` requests that stopped ("stop") to CPU
        before their slots are freed: positions 0..n_cached-1, i.e. the context but the
        last sampled token; with route recording, every finished request's routes too."""
        for seq in finished:
            if seq.slot < 0:
                continue
            if seq.request.keep_kv and reasons.get(seq.rid) == "stop":
                self._kept[seq.rid] = kv = self._export_kv(seq)
                seq.routes = kv.routes
                self.stats["kv_kept"] += 1
            elif self._routes is not None:
                seq.routes = self._routes.cache.export(seq.slot, seq.n_cached)

    def _free_slots(self, slots: set[int]) -> None:
        """Remove the sequences in ``slots``; the last running ones move into the holes left
        below the new count, so the running sequences stay in slots 0..n-1 (one KV copy per
        hole, not one per sequence behind it)."""
        if not slots:
            return
        n_keep = len(self._running) - len(slots)
        holes = sorted(i for i in slots if i < n_keep)
        movers = [seq for seq in self._running[n_keep:] if seq.slot not in slots]
        with torch.inference_mode():  # the cache holds inference tensors; pause / abort run outside step()
            for hole, seq in zip(holes, movers):
                self._copy_slot(seq.slot, hole, seq.n_cached)
                seq.slot = hole
        for i in slots:
            self._running[i].slot = -1
        running: list[_Seq] = [seq for seq in self._running if seq.slot >= 0]
        running.sort(key=lambda seq: seq.slot)
        self._running = running

    def _admit(self) -> list[_Seq]:
        """Move queued requests into free slots, at most ``max_prefill_tokens`` uncached
        context tokens per step (always at least one request)."""
        free = self.max_batch_size - len(self._running)
        admitted: list[_Seq] = []
        budget = self.max_prefill_tokens
        while free > 0 and self._queue:
            head = self._queue[0]
            cost = len(head.context) - (head.kv.num_tokens if head.kv is not None else 0)
            if admitted and cost > budget:
                break
            budget -= cost
            seq = self._queue.popleft()
            seq.slot = len(self._running)
            self._running.append(seq)
            if seq.kv is not None:
                self.cache.load(seq.slot, seq.kv.keys, seq.kv.values)
                if self._routes is not None:
                    self._routes.cache.load(seq.slot, seq.kv.num_tokens, seq.kv.routes)
                seq.n_cached = seq.kv.num_tokens
                seq.kv_oldest = int(seq.kv.oldest_version)  # type: ignore[arg-type]
                self.stats["kv_reused_tokens"] += seq.n_cached
                seq.kv = None
            else:  # its whole KV is computed in this step, with the current weights
                seq.n_cached = 0
                seq.kv_oldest = self._version
            admitted.append(seq)
            free -= 1
        return admitted

    def _record(self, seqs: list[_Seq], logits_BV: torch.Tensor, finished: list[_Seq], reasons: dict[str, str]) -> None:
        """Sample one token per row, append token / log-prob / version, detect finishes."""
        sps = [s.request.sampling for s in seqs]
        dev = logits_BV.device
        V = logits_BV.shape[-1]
        u_B = token_uniforms([s.seed for s in seqs], [len(s.output_ids) for s in seqs]).to(dev)
        if all(sp.temperature > 0 and sp.top_p >= 1.0 and not 0 < sp.top_k < V for sp in sps):
            temps = [float(sp.temperature) for sp in sps]  # plain sampling: no sort, no filter
            temp_B = None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32, device=dev)
            tok_B = sample_unfiltered(logits_BV, temp_B, u_B)
        else:
            params_3B = torch.tensor(
                [[sp.temperature for sp in sps], [float(sp.top_k) for sp in sps], [sp.top_p for sp in sps]],
                dtype=torch.float64, device=dev,
            )
            tok_B = sample_from_logits(logits_BV, params_3B[0].float(), params_3B[1].long(), params_3B[2].float(), u_B)
        logp_B = torch.log_softmax(logits_BV.float(), dim=-1).gather(1, tok_B[:, None]).squeeze(1)
        for seq, tok, lp in zip(seqs, tok_B.tolist(), logp_B.tolist()):
            self._append(seq, tok, lp, finished, reasons)

    def _append(self, seq: _Seq, tok: int, logprob: float, finished: list[_Seq], reasons: dict[str, str]) -> bool:
        """Append one sampled token (its log-prob, the current version, the oldest version in its KV); True when
        it finishes the request."""
        seq.output_ids.append(tok)
        seq.logprobs.append(logprob)
        seq.versions.append(self._version)
        seq.kv_versions.append(seq.kv_oldest)
        seq.context.append(tok)
        sp = seq.request.sampling
        reason = None
        if tok in seq.stop_ids and not sp.ignore_eos:
            reason = "stop"
        elif len(seq.output_ids) >= sp.max_tokens or len(seq.context) >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        reasons[seq.rid] = reason
        finished.append(seq)
        return True

    def _decode(self, seqs: list[_Seq], finished: list[_Seq], reasons: dict[str, str]) -> None:
        """One token for sequences in slots 0..B-1 (their pending token at position n_cached)."""
        if self._lean is None:
            logits_BV = self._forward.forward_chunks([[s.context[-1]] for s in seqs], [s.n_cached for s in seqs],
                                                     [s.slot for s in seqs])
        else:
            logits_BV = self._lean.decode([s.context[-1] for s in seqs], [s.n_cached for s in seqs])
        for s in seqs:
            s.n_cached += 1
        self.stats["decode_tokens"] += len(seqs)
        self._record(seqs, logits_BV, finished, reasons)

    def _forward_chunks(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], *, logits: bool = True,
        all_positions: bool = False,
    ) -> torch.Tensor | None:
        """Forward token chunks of B sequences: row b holds positions starts[b].. of the
        sequence in slot slots[b], whose positions < starts[b] are already cached. Writes
        every chunk's K/V into its slot; returns the logits [B, V] of each chunk's last
        token (None when ``logits`` is False; with ``all_positions`` [B, T, V] of every
        position, rows right-padded to the longest chunk T)."""
        if not all_positions:  # a speculative verify forward is counted by _decode_spec
            self.stats["prefill_tokens"] += sum(len(c) for c in chunks)
        if self._lean is None:
            logits_BV = self._forward.forward_chunks(chunks, starts, slots, all_positions=all_positions)
            return logits_BV if logits else None
        return self._lean.forward_chunks(chunks, starts, slots, logits=logits, all_positions=all_positions)

    def _copy_slot(self, src: int, dst: int, length: int) -> None:
        """The first ``length`` cached positions of slot ``src`` (KV, routes when recorded) into slot ``dst``."""
        self.cache.copy_slot(src, dst, length)
        if self._routes is not None:
            self._routes.cache.copy_slot(src, dst, length)

    def _share_common_prefix(self, rows: list[_Seq]) -> None:
        """Prefix sharing across different prompts admitted together: when fresh rows share
        a common prefix of at least ``min_shared_prefix`` tokens (e.g. the system / effort
        header), prefill it once, copy its K/V into the other rows' slots and mark it cached."""
        fresh = [s for s in rows if s.n_cached == 0]
        n = shared_prefix_len([s.context for s in fresh], self.min_shared_prefix)
        if not n:
            return
        first = fresh[0].context
        self._forward_chunks([first[:n]], [0], [fresh[0].slot], logits=False)
        for s in fresh:
            if s is not fresh[0]:
                self._copy_slot(fresh[0].slot, s.slot, n)
            s.n_cached = n
        self.stats["shared_prefix_tokens"] += n * (len(fresh) - 1)

    def _prefill(self, seqs: list[_Seq], finished: list[_Seq], reasons: dict[str, str]) -> None:
        """Run the uncached tail of each admitted context (positions n_cached..end) and
        sample the first new token from the last position. Identical contexts (the K
        samples of one prompt) are run once; a prefix common to all fresh contexts is run
        once (``_share_common_prefix``). Speculative: ``_prefill_spec``."""
        if self._spec is not None:
            self._prefill_spec(seqs)
            return
        groups: dict[tuple[int, ...], list[_Seq]] = {}
        rows: list[_Seq] = []
        for s in seqs:
            key = tuple(s.context) if (self.prefix_sharing and s.n_cached == 0) else (-1 - len(rows),)
            if key in groups:
                groups[key].append(s)
                self.stats["shared_prefills"] += 1
            else:
                groups[key] = [s]
                rows.append(s)
        if self.prefix_sharing:
            self._share_common_prefix(rows)
        starts = [s.n_cached for s in rows]
        logits_BV = self._forward_chunks([s.context[s.n_cached :] for s in rows], starts, [s.slot for s in rows])
        assert logits_BV is not None
        # expand shared rows: copy the KV of the prefilled slot to every member of its group
        out_seqs: list[_Seq] = []
        out_rows: list[int] = []
        for b, (key, members) in enumerate(groups.items()):
            s = members[0]
            assert s is rows[b]
            for m in members:
                if m is not s:
                    self._copy_slot(s.slot, m.slot, len(s.context))
                m.n_cached = len(m.context)
                out_seqs.append(m)
                out_rows.append(b)
        # the pending token of each sequence is the one sampled now: n_cached = len(context) - 1 after it
        self._record(out_seqs, logits_BV[torch.tensor(out_rows, dtype=torch.long, device=self.device)], finished, reasons)
