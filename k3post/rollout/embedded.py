"""The embedded rollout engine: continuous-batching decoding in pure PyTorch over an HF model.

Two forward paths under one scheduler (admission, prefix sharing, sampling, pause / resume, KV
export / import are shared): the *lean* forward described below, for the decoder families it
mirrors op for op (``lean_blocker`` is the strict eligibility check: Llama, Mistral, Qwen2/3,
Qwen2/3-MoE, Mixtral without a sliding window shorter than ``max_model_len``), and the *general*
path for every other causal LM (gpt-oss, DeepSeek-V3 / Kimi-K2 MLA, ...): the model's own forward
over a per-sequence HF ``DynamicCache`` (`k3post.rollout.hf_forward`). ``engine.path`` says which
runs; the constructor's ``path`` forces one.

``EmbeddedEngine`` runs a lean forward of its own that reuses the Hugging Face modules
and weights of a Llama-style decoder (Qwen3-MoE here): ``embed_tokens``, per layer
``input_layernorm``, ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, ``q_norm`` /
``k_norm`` (when present), the model's own rotary table, ``post_attention_layernorm``, the
routed experts (with the MXFP4 / MXFP8 fake quantization that ``k3post.quant.qat.apply_qat``
patches in), the final ``norm`` and ``lm_head``. What it drops is the per-step Python
machinery of ``generate()``: mask builders, ``DynamicCache`` objects, logits processors,
module calls. Forwards of few tokens (decode steps) run the MoE dense over all experts,
routed with HF's top-k rule (``_dense_moe``); prefills of many tokens call ``layer.mlp``.
Attention: q/k/v as one fused GEMM; prefill runs ``scaled_dot_product_attention``, decode
steps attend over the slot cache (``_attend_step``; no mask when all rows sit at the same
position).

Everything the forward derives from the weights (fused q/k/v, stacked q/k norm weights,
pre-transposed projections, the stacked expert weights, MXFP4 fake-quantized once when
QAT is on) lives in one plan per weight version (``_weights``), checked once per forward
against every parameter's identity and tensor version counter (so ``update_weights``,
in-place optimizer steps, parameter replacement and ``apply_qat`` / ``remove_qat`` all
rebuild it; ``refresh_weights`` covers writes through ``.data``).

Numerics. With QAT on the forward follows HF's op sequence bit for bit where it can
(``F.rms_norm``, rotary as mul-mul-add, the router's softmax / top-k / renormalise,
per-expert down products summed in expert order, residuals added after each
projection), because the MXFP8 rounding of activations turns a last-bit difference into
a ~1e-4 log-prob difference. With QAT off it uses cheaper forms that agree with HF to
~1e-7: RMSNorm from ``vector_norm``, ``addcmul`` rotary, router and expert-up rows in
one GEMM, the routing weights folded into one down GEMM, ``addmm`` residuals,
pre-transposed weights, decode attention as two batched GEMMs instead of SDPA. The
choice depends on QAT only, never on the batch size (which, as before, can still move the
last bits through the BLAS kernels' row-count paths and the attended length).

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

Shape legend:
    B   sequences in a batch
    T   positions per sequence in a forward (1 when decoding)
    L   attended key positions
    V   vocabulary size
    D   hidden size
    H   attention heads,  G  kv heads,  E  head dim,  R  query heads per kv head (H / G)
    P   positions of the rotary table (max_model_len)
    N   tokens in a forward (B * T);  X  routed experts (in attention: B * G row / kv-head
        pairs);  K  experts per token;  I  expert width
    F   a fused output width: (H+2G)E for q/k/v, HE for the attention output, X*2I (+ X
        router rows) for the experts' gate/up
    J, O  a projection's input / output width;  S  any leading shape (helpers)
    B1, 1L, ...  a 1 marks a broadcast / size-one dim
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3post.config.rollout import QAT_OP_ORDERS
from k3post.quant import qat as qat_module
from k3post.quant.mx import MX_FORMATS, fake_quant_fp8_lastdim, fake_quant_mx
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    KVState,
    NamedTensors,
    QueuedRequestsMixin,
    generate_by_stepping,
    request_seed,
    sample_from_logits,
    shared_prefix_len,
    sample_unfiltered,
    token_uniforms,
)
from k3post.rollout.hf_forward import HFForward
from k3post.rollout.kv_cache import SlotKVCache
from k3post.rollout.speculative import DraftRow, SpeculativeConfig, row_sampling_probs, stream_uniforms, verify_drafts
from k3post.rollout.speculative import STREAM_ACCEPT, STREAM_RESIDUAL
from k3post.rollout.segments import attention_segments

__all__ = ["EmbeddedEngine", "LEAN_MODEL_TYPES", "lean_blocker"]

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
    n_cached: int = 0  # context positions whose K/V are in the slot cache (or in `kv`)
    slot: int = -1
    kv: KVState | None = None  # imported / retained KV while queued or paused
    aux: list[torch.Tensor] = field(default_factory=list)  # speculative: target hidden [N, A, D] not yet drafted on
    aux_start: int = 0  # context position of aux's first row
    context: list[int] = field(default_factory=list)  # prompt + output_ids

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
        )


@dataclass(frozen=True)
class _RMSNorm:
    """A plain RMSNorm's parameters: ``weight`` broadcasts against x (the stacked per-head
    q/k norm weights are [H+G, E]); ``eps`` also as a 0-dim tensor for ``_rms``."""

    weight: torch.Tensor
    eps: float
    eps_t: torch.Tensor


_Norm = _RMSNorm | nn.Module
"""An RMSNorm as the engine applies it; anything but a plain fp32 RMSNorm is called as a module."""


def _norm_of(norm: nn.Module, weight: torch.Tensor | None = None) -> _Norm:
    """``norm`` as a ``_Norm``: an ``_RMSNorm`` when it is a plain RMSNorm (a ``weight`` and
    a ``variance_epsilon``, class name ending in RMSNorm, fp32), else the module. ``weight``
    overrides the module's weight (the per-head q/k norm weights stacked as [H+G, E])."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if w is None or eps is None or type(norm).__name__[-7:] != "RMSNorm" or w.dtype != torch.float32:
        return norm
    return _RMSNorm(w if weight is None else weight, float(eps), torch.tensor(float(eps), dtype=w.dtype, device=w.device))


def _rms(x_SD: torch.Tensor, norm: _Norm, exact: bool) -> torch.Tensor:
    """HF RMSNorm over the last dim, ``w * x / sqrt(mean(x^2) + eps)``.

    exact: ``F.rms_norm`` (bit-identical to HF's module). Otherwise five small ops with
    mean(x^2) read off ``vector_norm`` as ``||x||^2 / D`` (equal to HF's up to fp32
    rounding, ~1e-7 relative), cheaper per call on CPU."""
    if not isinstance(norm, _RMSNorm):
        return norm(x_SD)
    D = x_SD.shape[-1]
    if exact:
        if norm.weight.dim() == 1:
            return F.rms_norm(x_SD, (D,), norm.weight, norm.eps)
        return F.rms_norm(x_SD, (D,), None, norm.eps) * norm.weight
    n_S1 = torch.linalg.vector_norm(x_SD, 2, -1, True)
    return x_SD * torch.addcmul(norm.eps_t, n_S1, n_S1, value=1.0 / D).rsqrt_() * norm.weight


def _rotate(qk_SNE: torch.Tensor, cos_S1E: torch.Tensor, ssin_S1E: torch.Tensor, exact: bool) -> torch.Tensor:
    """Rotary embedding, ``x cos + rotate_half(x) sin``, as ``x cos + roll(x, E/2) * (sign *
    sin)`` (sign = -1 on the first half; exact). exact: HF's mul, mul, add; otherwise the
    second product and the sum fused into one ``addcmul`` (may round differently)."""
    rolled_SNE = torch.roll(qk_SNE, qk_SNE.shape[-1] // 2, dims=-1)
    if exact:
        return qk_SNE * cos_S1E + rolled_SNE * ssin_S1E
    return torch.addcmul(qk_SNE * cos_S1E, rolled_SNE, ssin_S1E)


def _fake_quant_act(x_S: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """``fake_quant_mx(x, fmt, block_size, -1)`` of an expert-GEMM input: the few-op MXFP8 form
    (`k3post.quant.mx.fake_quant_fp8_lastdim`, bit-identical) without fake_quant_mx's checks, since
    decode steps quantize tiny tensors where per-op overhead dominates; other formats and dtypes
    call ``fake_quant_mx``."""
    if MX_FORMATS[fmt].name == "fp4_e2m1" or x_S.dtype != torch.float32:
        return fake_quant_mx(x_S, fmt, block_size, -1)
    return fake_quant_fp8_lastdim(x_S, fmt, block_size)


def _plain_silu(act: Any) -> bool:
    """True for ``nn.SiLU`` and transformers' ``SiLUActivation`` (``F.silu``) with its own forward."""
    return type(act) is nn.SiLU or (
        type(act).__name__ == "SiLUActivation" and getattr(type(act).forward, "__module__", "") == "transformers.activations"
        and "forward" not in vars(act)
    )


def _is_default_gate(fn: Any) -> bool:
    """True when an experts class's ``_apply_gate`` is absent or transformers' default,
    ``act(gate) * up`` over the two halves (which the dense MoE inlines)."""
    return fn is None or (
        getattr(fn, "__qualname__", "") == "_default_apply_gate" and getattr(fn, "__module__", "") == "transformers.integrations.moe"
    )


def _topk_router_rule(router: Any, X: int, D: int) -> bool | None:
    """Which rule a router with one weight [X, D] and an int ``top_k`` follows, read off its own
    output on a fixed probe h [16, D], not off a config flag (Mixtral's router always renormalises
    and has no ``norm_topk_prob``):

        p = softmax(h W^T);  (w, e) = top-k(p);  w / sum_k w  (True)  or  w  (False)

    None when the router matches neither (grouped, biased, sigmoid routers...): the engine then
    calls the router module."""
    weight = getattr(router, "weight", None)
    if not (isinstance(weight, torch.Tensor) and set(dict(router.named_parameters())) == {"weight"}
            and not list(router.buffers()) and tuple(weight.shape) == (X, D)
            and isinstance(getattr(router, "top_k", None), int)):
        return None
    g = torch.Generator().manual_seed(0)
    h_ND = torch.randn(16, D, generator=g).to(weight.device, weight.dtype)
    with torch.inference_mode():
        out = router(h_ND)
        if not (isinstance(out, tuple) and len(out) == 3):
            return None
        p_NK, e_NK = torch.topk(torch.softmax(F.linear(h_ND, weight).float(), dim=-1), router.top_k, dim=-1)
        if out[2].shape != e_NK.shape or not torch.equal(out[2], e_NK):
            return None
        for norm in (True, False):
            w_NK = p_NK / p_NK.sum(dim=-1, keepdim=True) if norm else p_NK
            if torch.allclose(out[1].float(), w_NK, rtol=1e-5, atol=1e-7):
                return norm
    return None


@dataclass(frozen=True)
class _Proj:
    """A projection ``y = x W^T + b`` on rows x [N, J]. ``w`` is W [O, J] as the model holds
    it (``F.linear``, HF's op: exact mode) or, when ``transposed``, W^T [J, O] contiguous
    (``mm`` / ``addmm`` on the pre-transposed weight: 5-10% faster at decode sizes on CPU)."""

    w: torch.Tensor
    b: torch.Tensor | None
    transposed: bool

    @staticmethod
    def of(w_OJ: torch.Tensor, b_O: torch.Tensor | None, exact: bool) -> _Proj:
        return _Proj(w_OJ, b_O, False) if exact else _Proj(w_OJ.t().contiguous(), b_O, True)

    def __call__(self, x_NJ: torch.Tensor, res_NO: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus the residual ``res`` when given (fused into ``addmm`` when W^T
        is held and there is no bias; exact mode adds it after the projection, as HF does)."""
        if not self.transposed:
            y_NO = F.linear(x_NJ, self.w, self.b)
        elif self.b is None:
            return torch.mm(x_NJ, self.w) if res_NO is None else torch.addmm(res_NO, x_NJ, self.w)
        else:
            y_NO = torch.addmm(self.b, x_NJ, self.w)
        return y_NO if res_NO is None else res_NO + y_NO


@dataclass(frozen=True)
class _MoEWeights:
    """One routed-experts block as the dense MoE uses it (see ``_dense_moe``)."""

    n_experts: int  # X
    width: int  # I
    top_k: int  # K (0 when the router module is called)
    router: _Proj | None  # W [X, D] of a plain top-k router (routed by the engine), else None
    norm_topk: bool
    up: _Proj | None  # W [X*2I, D] (MXFP4 fake-quantized under QAT); None when ``router_up`` holds it
    router_up: _Proj | None  # router rows on top of the up rows, [X + X*2I, D] (plain router, not exact)
    down_w: torch.Tensor  # [X*I, D]: down^T of every expert stacked (MXFP4 fake-quantized under QAT)
    act: Any  # the expert activation (F.silu for a plain SiLU module)
    apply_gate: Any  # the experts module's own ``_apply_gate``, or None for act(gate) * up
    qat: QATConfig | None


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's weights as the engine's forward uses them."""

    in_norm: _Norm
    qkv: _Proj  # W [(H+2G)E, D]: q, k, v rows
    qk_norm: _Norm | None  # per-head q/k RMSNorm, weight [H+G, E]
    o_proj: _Proj | None  # W [D, HE] of a plain nn.Linear o_proj (None: call the module)
    post_norm: _Norm
    moe: _MoEWeights | None  # None: the MLP runs as ``layer.mlp``


@dataclass(frozen=True)
class _Weights:
    """Everything the forward reads from the model, for one weight version."""

    key: tuple[tuple[int, int], ...]  # (id, version) of every model parameter, then QAT config ids
    exact: bool  # HF's op sequence where the engine can (QAT on and qat_op_order "hf")
    embed: torch.Tensor | None  # weight of a plain nn.Embedding (None: call the module)
    layers: list[_LayerWeights]
    final_norm: _Norm
    lm_head: _Proj | None  # W [V, D] of a plain nn.Linear lm_head (None: call the module)


#: HF decoder families whose layer the lean forward mirrors op for op (pre-norm attention with q/k/v/o
#: projections, optional per-head q/k RMSNorm, one rotary table, pre-norm MLP or routed experts)
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})
_LEAN_ATTN_CHILDREN = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rotary_emb"})
_LEAN_LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})


def lean_blocker(model: Any, max_model_len: int) -> str | None:
    """Why the lean forward cannot reproduce ``model`` exactly (None when it can): the model type is
    one it mirrors (``LEAN_MODEL_TYPES``), every layer has exactly the Llama-style modules and no
    parameters of its own elsewhere (attention sinks, extra norms), no layer attends through a sliding
    window shorter than ``max_model_len``, the rotary table does not depend on the sequence length,
    and per-head q/k norms are RMSNorms sharing one epsilon. Anything else takes the general path."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one the lean forward mirrors ({', '.join(sorted(LEAN_MODEL_TYPES))})"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) or not hasattr(model, "lm_head"):
        return "not laid out as model.model.embed_tokens / layers / norm / rotary_emb + model.lm_head"
    windows = [w for w in [getattr(cfg, "sliding_window", None)] if w and model_type in ("mistral", "mixtral")]
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        windows.append(getattr(cfg, "sliding_window", None) or 0)
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        if set(dict(layer.named_children())) != _LEAN_LAYER_CHILDREN or list(layer.named_parameters(recurse=False)):
            return f"layer {i} holds {sorted(dict(layer.named_children()))}, not the Llama-style {sorted(_LEAN_LAYER_CHILDREN)}"
        if not set(dict(attn.named_children())) <= _LEAN_ATTN_CHILDREN or list(attn.named_parameters(recurse=False)) \
                or not all(type(getattr(attn, a, None)) is nn.Linear for a in ("q_proj", "k_proj", "v_proj")) \
                or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
            return f"layer {i}'s attention is not plain q/k/v/o projections (extra modules or parameters such as sinks)"
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (q_norm is None) != (k_norm is None) or q_norm is not None and (
                getattr(q_norm, "variance_epsilon", None) is None
                or q_norm.variance_epsilon != getattr(k_norm, "variance_epsilon", None)):
            return f"layer {i}'s q/k norms are not two RMSNorms with one variance_epsilon"
        if getattr(attn, "sliding_window", None):
            windows.append(attn.sliding_window)
    if windows and min(windows) < max_model_len:
        return f"sliding-window attention (window {min(windows)} < max_model_len {max_model_len})"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        return f"rope_type={rope_type!r} depends on the sequence length (the lean forward precomputes one table)"
    return None


class EmbeddedEngine(QueuedRequestsMixin):
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

        blocker = lean_blocker(model, self.max_model_len)
        if path == "lean" and blocker is not None:
            raise ValueError(f"path='lean': the lean forward cannot run {type(model).__name__}: {blocker}")
        self.path: str = "general" if path == "general" or blocker is not None else "lean"
        why = "forced by path='general'" if path == "general" else blocker or "a Llama-style decoder it mirrors exactly"
        log.info("EmbeddedEngine: %s path for %s (%s); under QAT the %s op order", self.path, type(model).__name__, why,
                 qat_op_order)
        self._general: HFForward | None = None
        self.cache: Any
        self._layers: list[Any] = []
        if self.path == "general":
            self._general = HFForward(model, max_batch_size, self.max_model_len)
            self.cache = self._general.cache
        else:
            self._init_lean(model)
        self._plan: _Weights | None = None
        self._wq_stores: list[dict[str, dict[str, Any]]] = [{} for _ in self._layers]  # HF-path MoE weights, quantized
        self._pos_P = torch.arange(self.max_model_len, device=self.device)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self._neg_inf = torch.full((), float("-inf"), dtype=self.dtype, device=self.device)
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
        self._aux_layers: tuple[int, ...] = ()
        self._captured: torch.Tensor | None = None  # hidden [B, T, A, D] of the aux layers, last chunk forward
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
            speculative.drafter.bind(max_batch_size, self.max_model_len + speculative.num_draft_tokens, self._vocab)
            n_layers = int(getattr(cfg.get_text_config(decoder=True), "num_hidden_layers"))
            self._aux_layers = tuple(int(i) for i in speculative.drafter.aux_layers)
            if any(not 0 <= i < n_layers for i in self._aux_layers):
                raise ValueError(f"drafter aux_layers {self._aux_layers} outside the target's {n_layers} layers")
            if self._general is not None:
                self._general.capture_layers = self._aux_layers
            self.stats.update(spec_target_forwards=0, spec_drafted=0, spec_accepted=0, spec_emitted=0,
                              spec_acceptance_rate=0.0, spec_acceptance_length=0.0)

    # ------------------------------------------------------------------ setup helpers
    def _init_lean(self, model: Any) -> None:
        """The lean forward's view of the model: modules, rotary tables, the slot cache."""
        cfg = model.config
        inner = model.model
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        self._norm = inner.norm
        self._lm_head = model.lm_head
        attn0 = self._layers[0].self_attn
        self._head_dim = int(attn0.head_dim)
        self._n_heads = int(cfg.num_attention_heads)
        self._n_kv = int(cfg.num_key_value_heads)
        self._scaling = float(attn0.scaling)
        self.cache = SlotKVCache(
            len(self._layers), self.max_batch_size, self._n_kv, self._head_dim,
            max_len=self.max_model_len, dtype=self.dtype, device=self.device,
        )
        with torch.inference_mode():
            pos_1P = torch.arange(self.max_model_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos_1PE, sin_1PE = inner.rotary_emb(probe, position_ids=pos_1P)
        self._cos_PE = cos_1PE[0]
        half = self._head_dim // 2
        self._ssin_PE = torch.cat([-sin_1PE[0, :, :half], sin_1PE[0, :, half:]], dim=-1)  # for roll()
        self._dense_moe_ok = [self._dense_moe_eligible(layer.mlp) for layer in self._layers]
        # modules QAT patches (apply_qat / remove_qat change the dense-MoE weights and, under qat_op_order 'hf', the op order)
        self._qat_targets = [m for _, m, _ in qat_module._find_expert_modules(model)]
        # where every parameter lives (module._parameters, name): _weights() checks their identity and version per forward
        self._param_slots = [(m._parameters, n) for m in model.modules() for n, p in m._parameters.items() if p is not None]

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

    # ------------------------------------------------------------------ public state
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

    # ------------------------------------------------------------------ requests
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
        if self._general is not None:
            bad = self._general.cache.shape_error(kv.keys, kv.values)
            if bad is not None:
                raise ValueError(f"request {seq.rid!r}: the KV state does not fit this model: {bad}")
        elif len(kv.keys) != len(self._layers) or kv.keys[0].shape[0] != self._n_kv or kv.keys[0].shape[2] != self._head_dim:
            raise ValueError(
                f"request {seq.rid!r}: KV state shaped {len(kv.keys)} x {tuple(kv.keys[0].shape)} does not fit this "
                f"model ({len(self._layers)} layers x [{self._n_kv}, N, {self._head_dim}])"
            )
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
            context_ids=list(kv.context_ids), weight_version=kv.weight_version,
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
            keys, values = self.cache.export(seq.slot, seq.n_cached)
            seq.kv = KVState(keys, values, seq.context[: seq.n_cached], self._version)
        self._free_slots({s.slot for s in running_hit})
        for rid in found:
            self._paused.pop(rid, None)
            if self._spec is not None:  # rebuilt from the context when it runs again
                self._spec.drafter.release(rid)
        return [found[r] for r in wanted]

    # ------------------------------------------------------------------ weights
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

    # ------------------------------------------------------------------ driving
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

    # ------------------------------------------------------------------ internals
    def _keep_finished_kv(self, finished: list[_Seq], reasons: dict[str, str]) -> None:
        """Copy the slot KV of finished ``keep_kv`` requests that stopped ("stop") to CPU
        before their slots are freed: positions 0..n_cached-1, i.e. the context but the
        last sampled token."""
        for seq in finished:
            if seq.request.keep_kv and reasons.get(seq.rid) == "stop" and seq.slot >= 0:
                keys, values = self.cache.export(seq.slot, seq.n_cached)
                self._kept[seq.rid] = KVState(keys, values, seq.context[: seq.n_cached], self._version)
                self.stats["kv_kept"] += 1

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
                self.cache.copy_slot(seq.slot, hole, seq.n_cached)
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
                seq.n_cached = seq.kv.num_tokens
                self.stats["kv_reused_tokens"] += seq.n_cached
                seq.kv = None
            else:
                seq.n_cached = 0
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
        """Append one sampled token (its log-prob, the current version); True when it finishes the request."""
        seq.output_ids.append(tok)
        seq.logprobs.append(logprob)
        seq.versions.append(self._version)
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

    # ------------------------------------------------------------------ speculative decoding
    def _prefill_spec(self, seqs: list[_Seq]) -> None:
        """Admission under speculative decoding: prefill each context but its last token, which stays
        pending for the next step's round (so a fresh, resumed or re-submitted request enters the same
        state, and its tokens are the ones an uninterrupted run draws)."""
        if self.prefix_sharing and not self._aux_layers:  # a drafter reading hidden states needs every row's
            self._share_common_prefix(seqs)
        for s in seqs:
            s.aux, s.aux_start = [], s.n_cached
        rows = [s for s in seqs if s.n_cached < len(s.context) - 1]
        if rows:
            self._forward_chunks([s.context[s.n_cached : -1] for s in rows], [s.n_cached for s in rows],
                                 [s.slot for s in rows], logits=False)
        for b, s in enumerate(rows):
            if self._captured is not None:
                s.aux.append(self._captured[b, : len(s.context) - 1 - s.n_cached])
            s.n_cached = len(s.context) - 1

    def _decode_spec(self, seqs: list[_Seq], finished: list[_Seq], reasons: dict[str, str]) -> None:
        """One speculative round for the sequences in slots 0..B-1: the drafter proposes k tokens per row,
        one target forward over [pending, d_1 .. d_kb] per row (kb = k, fewer near max_model_len) gives p
        at every position, ``verify_drafts`` accepts a prefix and draws the next token; the accepted
        tokens and that one are appended (cut at a stop id / max_tokens), with the target's raw
        log-probs; the KV of rejected positions is left behind n_cached (overwritten later)."""
        assert self._spec is not None
        k, drafter, dev = self._spec.num_draft_tokens, self._spec.drafter, self.device
        sps = [s.request.sampling for s in seqs]
        rows = [DraftRow(s.rid, s.context, sp, s.seed, len(s.output_ids)) for s, sp in zip(seqs, sps)]
        if self._aux_layers:  # the target's hidden states of the positions computed since the last proposal
            for s, r in zip(seqs, rows):
                r.aux_hidden, r.aux_start = (torch.cat(s.aux) if s.aux else None), s.aux_start
                s.aux_start += sum(len(h) for h in s.aux)
                s.aux = []
        draft_BK, q_BKV = drafter.propose(rows, k)
        draft_BK, q_BKV = draft_BK.to(dev), q_BKV.to(dev, torch.float64)
        k_list = [min(k, self.max_model_len - len(s.context) - 1) for s in seqs]
        drafts = draft_BK.tolist()
        chunks = [[s.context[-1]] + d[:kb] for s, d, kb in zip(seqs, drafts, k_list)]
        if self._general is not None:
            logits_BTV = self._forward_chunks(chunks, [s.n_cached for s in seqs], [s.slot for s in seqs],
                                              all_positions=True)
        else:
            logits_BTV = self._verify_lean(seqs, chunks)
        assert logits_BTV is not None
        T = k + 1
        if logits_BTV.shape[1] < T:  # every row capped by max_model_len: pad (those positions are unused)
            logits_BTV = F.pad(logits_BTV, (0, 0, 0, T - logits_BTV.shape[1]))
        p_BTV = row_sampling_probs(logits_BTV, sps)
        seeds = [s.seed for s in seqs]
        pos = [len(s.output_ids) + j for s in seqs for j in range(T)]
        u_acc_BT = stream_uniforms([x for x in seeds for _ in range(T)], pos, STREAM_ACCEPT).view(-1, T).to(dev)
        u_res_BT = stream_uniforms([x for x in seeds for _ in range(T)], pos, STREAM_RESIDUAL).view(-1, T).to(dev)
        k_B = torch.tensor(k_list, dtype=torch.long, device=dev)
        a_B, next_B = verify_drafts(p_BTV, q_BKV, draft_BK, k_B, u_acc_BT[:, :k], u_res_BT)
        logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
        st = self.stats
        st["spec_target_forwards"] += 1
        for b, (s, a, nxt) in enumerate(zip(seqs, a_B.tolist(), next_B.tolist())):
            st["spec_drafted"] += k_list[b]
            st["spec_accepted"] += a
            st["spec_emitted"] += a + 1
            n_ctx = len(s.context)
            for j, tok in enumerate(drafts[b][:a] + [nxt]):
                if self._append(s, tok, float(logp_BTV[b, j, tok]), finished, reasons):
                    break
            m = len(s.context) - n_ctx  # emitted (a + 1, fewer when a stop / the length cut the run)
            if self._captured is not None:  # hidden states of the pending token and the accepted drafts
                s.aux.append(self._captured[b, :m])
            s.n_cached += m
            self.stats["decode_tokens"] += m
            drafter.rollback(s.rid, n_ctx + m - 1)
        rows_seen = st["spec_emitted"] - st["spec_accepted"]  # one (row, round) pair per emitted next token
        st["spec_acceptance_rate"] = st["spec_accepted"] / max(1, st["spec_drafted"])
        st["spec_acceptance_length"] = st["spec_emitted"] / max(1, rows_seen)

    # ------------------------------------------------------------------ weights as the forward sees them
    def _weights(self) -> _Weights:
        """The forward's view of the model weights (fused q/k/v, stacked q/k norm weights,
        dense-MoE expert weights, MXFP4 fake-quantized once under QAT), rebuilt when any
        parameter changed in place (tensor version counter) or was replaced, QAT was
        applied / removed, or after ``refresh_weights``. One check per forward."""
        key = tuple((id(p), p._version) for p in (d[n] for d, n in self._param_slots)) + tuple(
            (id(m.__dict__.get(qat_module._CFG_ATTR)), 0) for m in self._qat_targets
        )
        w = self._plan
        if w is None or w.key != key:
            self._plan = w = self._build_weights(key)
        return w

    def _build_weights(self, key: tuple[tuple[int, int], ...]) -> _Weights:
        H, G = self._n_heads, self._n_kv
        exact = self.qat_op_order == "hf" and any(k != id(None) for k, _ in key[len(self._param_slots):])  # QAT on
        layers = []
        for li, layer in enumerate(self._layers):
            attn: Any = layer.self_attn
            qkv_b = None
            if attn.q_proj.bias is not None:
                qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], dim=0)
            q_norm: Any = getattr(attn, "q_norm", None)
            k_norm: Any = getattr(attn, "k_norm", None)
            qk_norm = None
            if q_norm is not None and k_norm is not None:
                qk_norm = _norm_of(q_norm, torch.cat([q_norm.weight.expand(H, -1), k_norm.weight.expand(G, -1)]))
            o = attn.o_proj
            layers.append(_LayerWeights(
                in_norm=_norm_of(layer.input_layernorm),
                qkv=_Proj.of(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0), qkv_b, exact),
                qk_norm=qk_norm,
                o_proj=_Proj.of(o.weight, o.bias, exact) if type(o) is nn.Linear else None,
                post_norm=_norm_of(layer.post_attention_layernorm),
                moe=self._moe_weights(layer.mlp, exact) if self._dense_moe_ok[li] else None,
            ))
        emb, head = self._embed, self._lm_head
        return _Weights(
            key=key,
            exact=exact,
            embed=emb.weight if type(emb) is nn.Embedding and emb.max_norm is None else None,
            layers=layers,
            final_norm=_norm_of(self._norm),
            lm_head=_Proj.of(head.weight, head.bias, exact) if type(head) is nn.Linear else None,
        )

    @staticmethod
    def _moe_weights(mlp: Any, exact: bool) -> _MoEWeights:
        """A routed-experts block's dense-MoE weights (see ``_dense_moe``)."""
        experts, router = mlp.experts, mlp.gate
        cfg: QATConfig | None = getattr(experts, qat_module._CFG_ATTR, None)
        gu_X2ID, down_XDI = experts.gate_up_proj, experts.down_proj
        if cfg is not None:  # same format, block and axis as the QAT forward and quantized_expert_weights
            gu_X2ID = fake_quant_mx(gu_X2ID, cfg.weight_format, cfg.block_size, -1)
            down_XDI = fake_quant_mx(down_XDI, cfg.weight_format, cfg.block_size, -1)
        X, D, I = down_XDI.shape
        up_FD = gu_X2ID.reshape(X * 2 * I, D)
        # a top-k router (linear -> softmax -> top-k, renormalised or not) is run by the engine;
        # other routers are called as modules
        norm_topk = _topk_router_rule(router, X, D)
        plain_router = norm_topk is not None
        fuse = plain_router and not exact and cfg is None  # under QAT the up GEMM's input is fake-quantized, the router's not
        return _MoEWeights(
            n_experts=X, width=I, top_k=int(router.top_k) if plain_router else 0,
            router=_Proj.of(router.weight, None, exact) if plain_router else None,
            norm_topk=bool(norm_topk),
            up=None if fuse else _Proj.of(up_FD, None, exact),
            router_up=_Proj.of(torch.cat([router.weight, up_FD]), None, exact) if fuse else None,
            down_w=down_XDI.transpose(1, 2).reshape(X * I, D),
            act=F.silu if _plain_silu(experts.act_fn) else experts.act_fn,
            apply_gate=None if _is_default_gate(getattr(type(experts), "_apply_gate", None)) else experts._apply_gate,
            qat=cfg,
        )

    def refresh_weights(self) -> None:
        """Drop the engine's derived copies of the weights (rebuilt on next use). Needed
        only after changing parameters through ``.data`` (which bypasses the tensor version
        counter the engine watches)."""
        self._plan = None
        self._wq_stores = [{} for _ in self._layers]

    # ------------------------------------------------------------------ forward pieces
    def _qkv(self, w: _Weights, lw: _LayerWeights, x_BTD: torch.Tensor, cos_BT1E: torch.Tensor, sin_BT1E: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Normed, rotated q [B, H, T, E] and k, v [B, G, T, E] of one layer (HF's math:
        RMSNorm -> projections -> per-head q/k RMSNorm -> rotary, with q and k handled as one
        [B, T, H+G, E] block)."""
        B, T, _ = x_BTD.shape
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        qkv_BTNE = lw.qkv(_rms(x_BTD, lw.in_norm, w.exact).view(B * T, -1)).view(B, T, H + 2 * G, E)
        qk_BTNE = self._qk_rotary(w, lw, qkv_BTNE[:, :, : H + G], cos_BT1E, sin_BT1E)
        qk_BNTE = qk_BTNE.transpose(1, 2)
        return qk_BNTE[:, :H], qk_BNTE[:, H:], qkv_BTNE[:, :, H + G :].transpose(1, 2)

    @staticmethod
    def _qk_rotary(w: _Weights, lw: _LayerWeights, qk_SNE: torch.Tensor, cos_S1E: torch.Tensor, sin_S1E: torch.Tensor) -> torch.Tensor:
        """Per-head q/k RMSNorm (when the model has one), then the rotary embedding."""
        if lw.qk_norm is not None:
            qk_SNE = _rms(qk_SNE, lw.qk_norm, w.exact)
        return _rotate(qk_SNE, cos_S1E, sin_S1E, w.exact)

    def _o_proj(self, w: _Weights, lw: _LayerWeights, li: int, x_ND: torch.Tensor, o_NF: torch.Tensor) -> torch.Tensor:
        """x + o_proj(o)."""
        if lw.o_proj is None:
            return x_ND + self._layers[li].self_attn.o_proj(o_NF)
        return lw.o_proj(o_NF, x_ND)

    def _finish_layer(self, w: _Weights, li: int, x_BTD: torch.Tensor, o_BHTE: torch.Tensor) -> torch.Tensor:
        """Attention output projection + residual, post-attention norm, MLP + residual."""
        B, _, T, _ = o_BHTE.shape
        x_ND = self._o_proj(w, w.layers[li], li, x_BTD.reshape(B * T, -1), o_BHTE.transpose(1, 2).reshape(B * T, -1))
        return self._mlp(w, li, x_ND).view(B, T, -1)

    def _mlp(self, w: _Weights, li: int, x_ND: torch.Tensor) -> torch.Tensor:
        """x + MLP(post_norm(x)) for N tokens: the dense MoE for few tokens, else ``layer.mlp``."""
        lw = w.layers[li]
        h_ND = _rms(x_ND, lw.post_norm, w.exact)
        N = h_ND.shape[0]
        mlp = self._layers[li].mlp
        if lw.moe is not None and N <= self.dense_moe_max_tokens:
            return self._dense_moe(lw.moe, mlp, h_ND, x_ND, w.exact)
        # QAT: the expert weights are fake-quantized once per weight version, not once per call (the same
        # values: 0.6 ms of a 1.6 ms MoE call at 256 tokens; docs/decisions.md, issue 32 §segments)
        with qat_module.weight_quant_cache(mlp, self._wq_stores[li]):
            return x_ND + mlp(h_ND[:, None]).view(N, -1)

    @staticmethod
    def _dense_moe_eligible(mlp: nn.Module) -> bool:
        """A plain routed-experts block (router ``gate`` + fused ``experts``, no shared
        experts, gated, no bias, [E, out, in] weights, no post-expert norm)."""
        experts, router = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
        if experts is None or router is None or set(dict(mlp.named_children())) != {"experts", "gate"}:
            return False
        gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and gu.dim() == 3):
            return False
        with torch.inference_mode():  # the router must return (logits [N, E], weights [N, K], experts [N, K])
            out = router(torch.zeros(1, gu.shape[-1], dtype=gu.dtype, device=gu.device))
        if not (isinstance(out, tuple) and len(out) == 3 and out[1].shape == out[2].shape and out[2].dim() == 2
                and not out[2].is_floating_point()):
            return False
        return (
            isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and bool(getattr(experts, "has_gate", True)) and not getattr(experts, "has_bias", False)
            and not getattr(experts, "is_transposed", False) and not getattr(experts, "has_post_expert_norm", False)
            and not getattr(experts, "_is_expert_parallel", False) and hasattr(experts, "act_fn")
            and getattr(experts, qat_module._KIND_ATTR, "fused") == "fused"
        )

    @staticmethod
    def _dense_moe(m: _MoEWeights, mlp: Any, h_ND: torch.Tensor, x_ND: torch.Tensor, exact: bool) -> torch.Tensor:
        """x + MoE(h) for a few tokens: every expert runs on every token as dense GEMMs
        (cheaper than a grouped GEMM at decode batch sizes), with routing weights that are
        zero outside each token's top-k:

            logits = h W_router^T;  (p_NK, e_NK) = top-k(softmax(logits))
            w_nk = p_nk / sum_k p_nk                       (HF's router module when the
                                                           router is not a plain top-k one)
            w_nx = w_nk if x = e_nk else 0
            h_q  = FQ8(h)                                  QAT only, blocks along D
            a_nx = gate(h_q W_up[x]^T)                     act(g) * u, all experts x
            out_n = x_n + sum_x w_nx (FQ8(a_nx) W_down[x]^T)  FQ8 on QAT only, blocks along I

        Fast form (``exact`` False): the renormalised top-k softmax as a softmax over the
        top-k logits, the router rows on top of the up rows in one GEMM (no QAT), and the
        weighted sum folded into the down GEMM, ``sum_x w_nx a_nx W_down[x]^T = [w_n1 a_n1
        ... w_nX a_nX] W_down_stacked^T``, with the residual added by ``addmm``. ``exact``:
        HF's op order (softmax, top-k, divide by the sum; per-expert down products, then the
        weighted sum over experts in expert order, then the residual): the engine's
        ``qat_op_order="hf"``. Under QAT both forms fake-quantize the same tensors (h before the
        up GEMM, a before the down GEMM; the router reads h unquantized, so the fast form
        does not fuse the router into the up GEMM then).
        """
        N, X, I = h_ND.shape[0], m.n_experts, m.width
        logits_NX: torch.Tensor | None = None
        if m.router_up is not None:
            ru_NF = m.router_up(h_ND)
            logits_NX, gu_NF = ru_NF[:, :X], ru_NF[:, X:]
        else:
            if m.router is not None:
                logits_NX = m.router(h_ND)
            assert m.up is not None
            gu_NF = m.up(h_ND if m.qat is None else _fake_quant_act(h_ND, m.qat.activation_format, m.qat.block_size))
        if logits_NX is None:
            _, w_NK, e_NK = mlp.gate(h_ND)
        elif exact or not m.norm_topk:
            w_NK, e_NK = torch.topk(torch.softmax(logits_NX, dim=-1), m.top_k, dim=-1)
            if m.norm_topk:
                w_NK /= w_NK.sum(dim=-1, keepdim=True)
        else:
            top_NK, e_NK = torch.topk(logits_NX, m.top_k, dim=-1)
            w_NK = torch.softmax(top_NK, dim=-1)
        if w_NK.dtype != h_ND.dtype:
            w_NK = w_NK.to(h_ND.dtype)
        w_NX = h_ND.new_zeros(N, X).scatter_(1, e_NK, w_NK)
        if m.apply_gate is not None:
            a_NXI = m.apply_gate(gu_NF.reshape(N * X, 2 * I)).view(N, X, I)
        else:
            gu_NX2 = gu_NF.view(N, X, 2 * I)
            a_NXI = m.act(gu_NX2[..., :I]) * gu_NX2[..., I:]
        if m.qat is not None:
            a_NXI = _fake_quant_act(a_NXI, m.qat.activation_format, m.qat.block_size)
        if exact:
            y_XND = torch.bmm(a_NXI.transpose(0, 1), m.down_w.view(X, I, -1))
            return x_ND + (y_XND * w_NX.t()[:, :, None]).sum(dim=0)
        return torch.addmm(x_ND, (a_NXI * w_NX[:, :, None]).view(N, X * I), m.down_w)

    def _attend(self, q_BHTE: torch.Tensor, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_BHTE, k_BGLE, v_BGLE, attn_mask=mask, scale=self._scaling, enable_gqa=self._n_heads != self._n_kv
        )

    def _attend_step(
        self, w: _Weights, q_BHE: torch.Tensor, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of one query per row over the slot cache, o [B, H*E]:
        softmax(q K^T * scale + mask) V per head, query head h on kv head h // (H/G).

        exact: SDPA, HF's kernel (``mask`` boolean [B, 1, 1, L]). Otherwise the two products
        as batched GEMMs over (row, kv head) with the H/G query heads of a kv head as the
        rows of one GEMM, ``mask`` additive [B*G, 1, L] (0 / -inf): each kv head's K and V
        are read once, ~10% faster per step than SDPA from 8 rows up on CPU."""
        B, H, E = q_BHE.shape
        if w.exact:
            return self._attend(q_BHE[:, :, None], k_BGLE, v_BGLE, mask).view(B, H * E)
        G, L = k_BGLE.shape[1], k_BGLE.shape[2]
        kT_XEL = k_BGLE.reshape(B * G, L, E).transpose(1, 2)  # X = B*G (row, kv head) pairs
        q_XRE = q_BHE.reshape(B * G, H // G, E)
        s_XRL = torch.baddbmm(self._zero if mask is None else mask, q_XRE, kT_XEL, beta=0.0 if mask is None else 1.0,
                              alpha=self._scaling)
        return torch.bmm(torch.softmax(s_XRL, dim=-1), v_BGLE.reshape(B * G, L, E)).view(B, H * E)

    def _embed_ids(self, w: _Weights, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, w.embed) if w.embed is not None else self._embed(ids)

    def _logits(self, w: _Weights, x_BD: torch.Tensor) -> torch.Tensor:
        h_BD = _rms(x_BD, w.final_norm, w.exact)
        return w.lm_head(h_BD) if w.lm_head is not None else self._lm_head(h_BD)

    def _rotary(self, pos_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [*S, 1, E] of the model's own rotary table at positions pos_S."""
        return self._cos_PE[pos_S].unsqueeze(-2), self._ssin_PE[pos_S].unsqueeze(-2)

    def _decode(self, seqs: list[_Seq], finished: list[_Seq], reasons: dict[str, str]) -> None:
        """One token for sequences in slots 0..B-1 (their pending token at position n_cached)."""
        if self._general is not None:
            logits_BV = self._general.forward_chunks([[s.context[-1]] for s in seqs], [s.n_cached for s in seqs],
                                                     [s.slot for s in seqs])
        else:
            logits_BV = self._decode_lean(seqs)
        for s in seqs:
            s.n_cached += 1
        self.stats["decode_tokens"] += len(seqs)
        self._record(seqs, logits_BV, finished, reasons)

    def _decode_lean(self, seqs: list[_Seq]) -> torch.Tensor:
        """Logits [B, V] of the pending tokens of the sequences in slots 0..B-1 (lean forward).

        The decode forward works on [B, D] rows (T = 1 squeezed out) with few ops per layer:
        one q/k/v GEMM, q/k norm + rotary on one [B, H+G, E] block, one indexed write per K
        and V, attention over the slot cache (``_attend_step``; no mask when every row sits
        at the same position; rows of ragged lengths in contiguous ranges, each over its own
        longest context, `k3post.rollout.segments`), o_proj + residual, the dense MoE."""
        B = len(seqs)
        dev = self.device
        pos_list = [s.n_cached for s in seqs]
        L = max(pos_list) + 1
        self.cache.ensure_capacity(L)
        w = self._weights()
        pos_B = torch.tensor(pos_list, dtype=torch.long, device=dev)
        ids_B = torch.tensor([s.context[-1] for s in seqs], dtype=torch.long, device=dev)
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        NE = (H + G) * E
        mask = None  # every row attends to its positions 0..pos_b: no mask when all sit at L - 1
        segs = [(0, B, L)]
        if min(pos_list) < L - 1:
            segs = attention_segments([p + 1 for p in pos_list])
            keep_BL = self._pos_P[:L] <= pos_B[:, None]
            if w.exact:
                mask = keep_BL.view(B, 1, 1, L)
            else:
                mask = torch.where(keep_BL, self._zero, self._neg_inf).repeat_interleave(G, dim=0).view(B * G, 1, L)
        cos_B1E, sin_B1E = self._rotary(pos_B)
        index_BG = self.cache.step_index(pos_B)
        x_BD = self._embed_ids(w, ids_B)
        for li, lw in enumerate(w.layers):
            qkv_BF = lw.qkv(_rms(x_BD, lw.in_norm, w.exact))
            qk_BNE = self._qk_rotary(w, lw, qkv_BF[:, :NE].view(B, H + G, E), cos_B1E, sin_B1E)
            self.cache.write_step(li, index_BG, qk_BNE[:, H:], qkv_BF[:, NE:].view(B, G, E))
            k_BGLE, v_BGLE = self.cache.view(li, B, L)
            if len(segs) == 1:
                o_BF = self._attend_step(w, qk_BNE[:, :H], k_BGLE, v_BGLE, mask)
            else:  # no row padded to a much longer one: one call per range a..b-1 over n positions
                assert mask is not None
                o_BF = torch.cat([
                    self._attend_step(w, qk_BNE[a:b, :H], k_BGLE[a:b, :, :n], v_BGLE[a:b, :, :n],
                                      mask[a:b, ..., :n] if w.exact else mask[a * G : b * G, :, :n])
                    for a, b, n in segs
                ])
            x_BD = self._mlp(w, li, self._o_proj(w, lw, li, x_BD, o_BF))
        return self._logits(w, x_BD)

    def _verify_lean(self, seqs: list[_Seq], chunks: list[list[int]]) -> torch.Tensor:
        """Logits [B, T, V] of a speculative round's verify forward on the lean path, decode-shaped: row b
        (slot b) feeds ``chunks[b]`` (its pending token and drafts) at positions n_cached.. .

        Like ``_decode_lean`` with T query positions per row instead of one: the B*T rows go through one
        q/k/v GEMM, one q/k norm + rotary, one indexed K/V write per layer (``step_index`` over [B, T]
        positions), attention over the slot cache views (no gather) under the causal mask
        key <= n_cached + t, and the dense MoE on B*T rows. Rows shorter than T (capped by max_model_len)
        are padded with their last token; their padded positions are clamped to max_model_len - 1, past
        the row's valid positions (their K/V is overwritten before any read; their logits are unused).
        The hidden states after ``aux_layers`` are captured [B, T, A, D] as on the chunk path."""
        B, dev = len(seqs), self.device
        assert all(s.slot == b for b, s in enumerate(seqs)), "the verify forward reads slots 0..B-1"
        T = max(len(c) for c in chunks)
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        NE, N = (H + G) * E, B * T
        ids_BT = torch.tensor([c + [c[-1]] * (T - len(c)) for c in chunks], dtype=torch.long, device=dev)
        start_B = torch.tensor([s.n_cached for s in seqs], dtype=torch.long, device=dev)
        pos_BT = (start_B[:, None] + self._pos_P[:T][None, :]).clamp_(max=self.max_model_len - 1)
        L = int(pos_BT.max()) + 1
        self.cache.ensure_capacity(L)
        keep_B1TL = (self._pos_P[:L][None, None, :] <= pos_BT[:, :, None])[:, None]
        cos_N1E, sin_N1E = self._rotary(pos_BT.view(N))
        index_NG = self.cache.step_index(pos_BT)
        w = self._weights()
        x_ND = self._embed_ids(w, ids_BT.view(N))
        aux: dict[int, torch.Tensor] = {}
        for li, lw in enumerate(w.layers):
            qkv_NF = lw.qkv(_rms(x_ND, lw.in_norm, w.exact))
            qk_NME = self._qk_rotary(w, lw, qkv_NF[:, :NE].view(N, H + G, E), cos_N1E, sin_N1E)
            self.cache.write_step(li, index_NG, qk_NME[:, H:], qkv_NF[:, NE:].view(N, G, E))
            k_BGLE, v_BGLE = self.cache.view(li, B, L)
            o_BHTE = self._attend(qk_NME[:, :H].view(B, T, H, E).transpose(1, 2), k_BGLE, v_BGLE, keep_B1TL)
            x_ND = self._mlp(w, li, self._o_proj(w, lw, li, x_ND, o_BHTE.transpose(1, 2).reshape(N, H * E)))
            if li in self._aux_layers:
                aux[li] = x_ND.view(B, T, -1)
        if self._aux_layers:
            self._captured = torch.stack([aux[i] for i in self._aux_layers], dim=2)
        return self._logits(w, x_ND).view(B, T, -1)

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
        if self._general is not None:
            logits_BV = self._general.forward_chunks(chunks, starts, slots, all_positions=all_positions)
            self._captured = self._general.captured
            return logits_BV if logits else None
        return self._forward_chunks_lean(chunks, starts, slots, logits, all_positions)

    def _forward_chunks_lean(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], logits: bool, all_positions: bool = False
    ) -> torch.Tensor | None:
        """``_forward_chunks`` of the lean forward; rows are right-padded to the longest chunk."""
        B = len(chunks)
        dev = self.device
        lens = [len(c) for c in chunks]
        T = max(lens)
        L = max(st + n for st, n in zip(starts, lens))
        self.cache.ensure_capacity(L)
        ids_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, c in enumerate(chunks):
            ids_BT[b, : lens[b]] = torch.tensor(c, dtype=torch.long)
        t_T = torch.arange(T, device=dev)
        start_B = torch.tensor(starts, dtype=torch.long, device=dev)
        qpos_BT = (start_B[:, None] + t_T[None, :]).clamp_(max=self.max_model_len - 1)
        all_fresh = not any(starts)
        if all_fresh:  # plain causal attention over the new positions only (HF's prefill math)
            mask_B1TL = (t_T[None, :] <= t_T[:, None])[None, None]
        else:
            l_L = torch.arange(L, device=dev)
            mask_B1TL = (l_L[None, None, :] <= qpos_BT[:, :, None])[:, None]
        w = self._weights()
        x_BTD = self._embed_ids(w, ids_BT)
        cos_BT1E, sin_BT1E = self._rotary(qpos_BT)
        aux: dict[int, torch.Tensor] = {}
        for li, lw in enumerate(w.layers):
            q_BHTE, k_BGTE, v_BGTE = self._qkv(w, lw, x_BTD, cos_BT1E, sin_BT1E)
            for b in range(B):
                self.cache.write_block(li, slots[b], starts[b], k_BGTE[b, :, : lens[b]], v_BGTE[b, :, : lens[b]])
            if all_fresh:
                k_BGLE, v_BGLE = k_BGTE, v_BGTE
            else:
                k_BGLE, v_BGLE = self.cache.gather(li, slots, L)
            x_BTD = self._finish_layer(w, li, x_BTD, self._attend(q_BHTE, k_BGLE, v_BGLE, mask_B1TL))
            if li in self._aux_layers:
                aux[li] = x_BTD
        if self._aux_layers:
            self._captured = torch.stack([aux[i] for i in self._aux_layers], dim=2)
        if not logits:
            return None
        if all_positions:
            return self._logits(w, x_BTD.reshape(B * T, -1)).view(B, T, -1)
        last_B = torch.tensor([n - 1 for n in lens], dtype=torch.long, device=dev)
        return self._logits(w, x_BTD[torch.arange(B, device=dev), last_B])

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
                self.cache.copy_slot(fresh[0].slot, s.slot, n)
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
                    self.cache.copy_slot(s.slot, m.slot, len(s.context))
                m.n_cached = len(m.context)
                out_seqs.append(m)
                out_rows.append(b)
        # the pending token of each sequence is the one sampled now: n_cached = len(context) - 1 after it
        self._record(out_seqs, logits_BV[torch.tensor(out_rows, dtype=torch.long, device=self.device)], finished, reasons)
