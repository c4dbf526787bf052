"""The lean forward of the embedded engine: a Llama-style decoder's forward over a slot KV cache, op for op
with the Hugging Face model it reads its weights from, without the per-step Python machinery of ``generate()``.

``LeanForward`` runs a forward of its own that reuses the Hugging Face modules
and weights of a Llama-style decoder (Qwen3-MoE here): ``embed_tokens``, per layer
``input_layernorm``, ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, ``q_norm`` /
``k_norm`` (when present), the model's own rotary table, ``post_attention_layernorm``, the
routed experts (with the MXFP4 / MXFP8 fake quantization that ``k3post.quant.qat.apply_qat``
patches in), the final ``norm`` and ``lm_head``. What it drops is the per-step Python
machinery of ``generate()``: mask builders, ``DynamicCache`` objects, logits processors,
module calls. Forwards of few tokens (decode steps) run the MoE dense over all experts,
routed with HF's top-k rule (``dense_moe``); prefills of many tokens call ``layer.mlp``.
Attention: q/k/v as one fused GEMM; prefill runs ``scaled_dot_product_attention``, decode
steps attend over the slot cache (``attend_step``; no mask when all rows sit at the same
position).

Everything the forward derives from the weights (fused q/k/v, stacked q/k norm weights,
pre-transposed projections, the stacked expert weights, MXFP4 fake-quantized once when
QAT is on) lives in one plan per weight version (``weights``, a ``WeightPlan``), checked once per forward
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

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3post.quant import qat as qat_module
from k3post.quant.mx import MX_FORMATS, fake_quant_fp8_lastdim, fake_quant_mx
from k3post.quant.qat import QATConfig
from k3post.rollout.kv_cache import SlotKVCache
from k3post.routing_replay import RouteRecorder, softmax_topk_rule
from k3post.rollout.segments import attention_segments

__all__ = ["LEAN_MODEL_TYPES", "LeanForward", "Norm", "WeightPlan", "expert_act", "fake_quant_act", "lean_blocker", "norm_of", "rms", "rotate",
           "topk_router_rule"]


@dataclass(frozen=True)
class _RMSNorm:
    """A plain RMSNorm's parameters: ``weight`` broadcasts against x (the stacked per-head
    q/k norm weights are [H+G, E]); ``eps`` also as a 0-dim tensor for ``rms``."""

    weight: torch.Tensor
    eps: float
    eps_t: torch.Tensor


Norm = _RMSNorm | nn.Module
"""An RMSNorm as the engine applies it; anything but a plain fp32 RMSNorm is called as a module."""


def norm_of(norm: nn.Module, weight: torch.Tensor | None = None) -> Norm:
    """``norm`` as a ``Norm``: an ``_RMSNorm`` when it is a plain RMSNorm (a ``weight`` and
    a ``variance_epsilon``, class name ending in RMSNorm, fp32), else the module. ``weight``
    overrides the module's weight (the per-head q/k norm weights stacked as [H+G, E]); it needs a plain
    RMSNorm (ValueError otherwise: the module would apply its own weight to every head)."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if w is None or eps is None or type(norm).__name__[-7:] != "RMSNorm" or w.dtype != torch.float32:
        if weight is not None:
            raise ValueError(f"norm_of: a stacked weight needs a plain fp32 RMSNorm, got {type(norm).__name__} ({w.dtype if w is not None else 'no weight'})")
        return norm
    return _RMSNorm(w if weight is None else weight, float(eps), torch.tensor(float(eps), dtype=w.dtype, device=w.device))


class _QKNorm(nn.Module):
    """Per-head q / k norms that are not plain fp32 RMSNorms (a bf16 model's, whose HF module computes in fp32 and
    casts back): the model's q norm on the first ``n_q`` heads of a [S, H+G, E] block, its k norm on the rest."""

    def __init__(self, q_norm: nn.Module, k_norm: nn.Module, n_q: int) -> None:
        super().__init__()
        self.q_norm, self.k_norm, self.n_q = q_norm, k_norm, n_q

    def forward(self, qk_SNE: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_norm(qk_SNE[..., : self.n_q, :]), self.k_norm(qk_SNE[..., self.n_q :, :])], dim=-2)


def rms(x_SD: torch.Tensor, norm: Norm, exact: bool) -> torch.Tensor:
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


def rotate(qk_SNE: torch.Tensor, cos_S1E: torch.Tensor, ssin_S1E: torch.Tensor, exact: bool) -> torch.Tensor:
    """Rotary embedding, ``x cos + rotate_half(x) sin``, as ``x cos + roll(x, E/2) * (sign *
    sin)`` (sign = -1 on the first half; exact). exact: HF's mul, mul, add; otherwise the
    second product and the sum fused into one ``addcmul`` (may round differently)."""
    rolled_SNE = torch.roll(qk_SNE, qk_SNE.shape[-1] // 2, dims=-1)
    if exact:
        return qk_SNE * cos_S1E + rolled_SNE * ssin_S1E
    return torch.addcmul(qk_SNE * cos_S1E, rolled_SNE, ssin_S1E)


def fake_quant_act(x_S: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
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


def topk_router_rule(router: Any, X: int, D: int) -> bool | None:
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
        return softmax_topk_rule(torch.softmax(F.linear(h_ND, weight).float(), dim=-1), out[1], out[2], router.top_k)


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
    """One routed-experts block as the dense MoE uses it (see ``dense_moe``)."""

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


def expert_act(m: _MoEWeights, gu_S2I: torch.Tensor) -> torch.Tensor:
    """An expert's activation a [*S, I] from its gate / up output [*S, 2I]: ``act(gate) * up`` (or the experts
    module's own ``_apply_gate``), MXFP8 fake-quantized along I under QAT (the down GEMM's input)."""
    I = m.width
    if m.apply_gate is not None:
        a_SI = m.apply_gate(gu_S2I.reshape(-1, 2 * I)).view(*gu_S2I.shape[:-1], I)
    else:
        a_SI = m.act(gu_S2I[..., :I]) * gu_S2I[..., I:]
    return a_SI if m.qat is None else fake_quant_act(a_SI, m.qat.activation_format, m.qat.block_size)


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's weights as the engine's forward uses them."""

    in_norm: Norm
    qkv: _Proj  # W [(H+2G)E, D]: q, k, v rows
    qk_norm: Norm | None  # per-head q/k RMSNorm, weight [H+G, E]
    o_proj: _Proj | None  # W [D, HE] of a plain nn.Linear o_proj (None: call the module)
    post_norm: Norm
    moe: _MoEWeights | None  # None: the MLP runs as ``layer.mlp``


@dataclass(frozen=True)
class WeightPlan:
    """Everything the forward reads from the model, for one weight version."""

    key: tuple[tuple[int, int], ...]  # (id, version) of every model parameter, then QAT config ids
    exact: bool  # HF's op sequence where the engine can (QAT on and qat_op_order "hf")
    embed: torch.Tensor | None  # weight of a plain nn.Embedding (None: call the module)
    layers: list[_LayerWeights]
    final_norm: Norm
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


class LeanForward:
    """The lean forward over ``model``'s own modules and weights and a slot KV cache of ``num_slots`` rows of up
    to ``max_len`` positions (module doc). ``qat_op_order``: "hf" runs HF's op order under QAT, "fast" the cheaper
    forms (`EmbeddedEngine`); forwards of at most ``dense_moe_max_tokens`` tokens run the MoE dense over all
    experts, larger ones call ``layer.mlp``. Check eligibility with ``lean_blocker`` first.

    The surface it shares with `k3post.rollout.hf_forward.HFForward`: ``cache``, ``forward_chunks``,
    ``capture_layers`` (decoder layers whose output hidden states forwards keep) and ``captured``."""

    _always_exact = False  # the exact forward (`k3post.rollout.embedded.exact`) keeps HF's forms with or without QAT

    def __init__(self, model: Any, num_slots: int, max_len: int, *, qat_op_order: str = "hf",
                 dense_moe_max_tokens: int = 64) -> None:
        cfg = model.config
        inner = model.model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = int(max_len)
        self.qat_op_order = qat_op_order
        self.dense_moe_max_tokens = dense_moe_max_tokens
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        self._norm = inner.norm
        self._lm_head = model.lm_head
        attn0 = self._layers[0].self_attn
        self._head_dim = int(attn0.head_dim)
        self._n_heads = int(cfg.num_attention_heads)
        self._n_kv = int(cfg.num_key_value_heads)
        self.scaling = float(attn0.scaling)
        self.cache = SlotKVCache(len(self._layers), num_slots, self._n_kv, self._head_dim, max_len=self.max_model_len,
                                 dtype=self.dtype, device=self.device)
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
        # where every parameter lives (module._parameters, name): weights() checks their identity and version per forward
        self._param_slots = [(m._parameters, n) for m in model.modules() for n, p in m._parameters.items() if p is not None]
        self._plan: WeightPlan | None = None
        self._wq_stores: list[dict[str, dict[str, Any]]] = [{} for _ in self._layers]  # HF-path MoE weights, quantized
        self._pos_P = torch.arange(self.max_model_len, device=self.device)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self._neg_inf = torch.full((), float("-inf"), dtype=self.dtype, device=self.device)
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None  # [B, T, A, D] of the last forward that captured
        self.routes: RouteRecorder | None = None  # records each row's experts (routing replay) when set

    def _recording(self, slots_N: torch.Tensor, pos_N: torch.Tensor, valid_N: torch.Tensor | None = None) -> Any:
        """A context in which the forward's rows (row n: position pos_N[n] of slot slots_N[n]) have their
        experts recorded (`k3post.routing_replay.RouteRecorder`); a no-op without a recorder."""
        return nullcontext() if self.routes is None else self.routes.rows(slots_N, pos_N, valid_N)

    def weights(self) -> WeightPlan:
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

    def _build_weights(self, key: tuple[tuple[int, int], ...]) -> WeightPlan:
        H, G = self._n_heads, self._n_kv
        exact = self._always_exact or (self.qat_op_order == "hf" and any(k != id(None) for k, _ in key[len(self._param_slots):]))
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
                if isinstance(norm_of(q_norm), _RMSNorm) and isinstance(norm_of(k_norm), _RMSNorm):
                    qk_norm = norm_of(q_norm, torch.cat([q_norm.weight.expand(H, -1), k_norm.weight.expand(G, -1)]))
                else:  # each module on its own heads (before, a bf16 model's k heads got the q norm's weight)
                    qk_norm = _QKNorm(q_norm, k_norm, H)
            o = attn.o_proj
            layers.append(_LayerWeights(
                in_norm=norm_of(layer.input_layernorm),
                qkv=_Proj.of(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0), qkv_b, exact),
                qk_norm=qk_norm,
                o_proj=_Proj.of(o.weight, o.bias, exact) if type(o) is nn.Linear else None,
                post_norm=norm_of(layer.post_attention_layernorm),
                moe=self.moe_weights(layer.mlp, exact) if self._dense_moe_ok[li] else None,
            ))
        emb, head = self._embed, self._lm_head
        return WeightPlan(
            key=key,
            exact=exact,
            embed=emb.weight if type(emb) is nn.Embedding and emb.max_norm is None else None,
            layers=layers,
            final_norm=norm_of(self._norm),
            lm_head=_Proj.of(head.weight, head.bias, exact) if type(head) is nn.Linear else None,
        )

    @staticmethod
    def moe_weights(mlp: Any, exact: bool) -> _MoEWeights:
        """A routed-experts block's dense-MoE weights (see ``dense_moe``)."""
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
        norm_topk = topk_router_rule(router, X, D)
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
        """Drop the forward's derived copies of the weights (rebuilt on next use). Needed
        only after changing parameters through ``.data`` (which bypasses the tensor version
        counter the forward watches)."""
        self._plan = None
        self._wq_stores = [{} for _ in self._layers]

    def _qkv(self, w: WeightPlan, lw: _LayerWeights, x_BTD: torch.Tensor, cos_BT1E: torch.Tensor, sin_BT1E: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Normed, rotated q [B, H, T, E] and k, v [B, G, T, E] of one layer (HF's math:
        RMSNorm -> projections -> per-head q/k RMSNorm -> rotary, with q and k handled as one
        [B, T, H+G, E] block)."""
        B, T, _ = x_BTD.shape
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        qkv_BTNE = lw.qkv(rms(x_BTD, lw.in_norm, w.exact).view(B * T, -1)).view(B, T, H + 2 * G, E)
        qk_BTNE = self._qk_rotary(w, lw, qkv_BTNE[:, :, : H + G], cos_BT1E, sin_BT1E)
        qk_BNTE = qk_BTNE.transpose(1, 2)
        return qk_BNTE[:, :H], qk_BNTE[:, H:], qkv_BTNE[:, :, H + G :].transpose(1, 2)

    @staticmethod
    def _qk_rotary(w: WeightPlan, lw: _LayerWeights, qk_SNE: torch.Tensor, cos_S1E: torch.Tensor, sin_S1E: torch.Tensor) -> torch.Tensor:
        """Per-head q/k RMSNorm (when the model has one), then the rotary embedding."""
        if lw.qk_norm is not None:
            qk_SNE = rms(qk_SNE, lw.qk_norm, w.exact)
        return rotate(qk_SNE, cos_S1E, sin_S1E, w.exact)

    def _o_proj(self, w: WeightPlan, lw: _LayerWeights, li: int, x_ND: torch.Tensor, o_NF: torch.Tensor) -> torch.Tensor:
        """x + o_proj(o)."""
        if lw.o_proj is None:
            return x_ND + self._layers[li].self_attn.o_proj(o_NF)
        return lw.o_proj(o_NF, x_ND)

    def _finish_layer(self, w: WeightPlan, li: int, x_BTD: torch.Tensor, o_BHTE: torch.Tensor) -> torch.Tensor:
        """Attention output projection + residual, post-attention norm, MLP + residual."""
        B, _, T, _ = o_BHTE.shape
        x_ND = self._o_proj(w, w.layers[li], li, x_BTD.reshape(B * T, -1), o_BHTE.transpose(1, 2).reshape(B * T, -1))
        return self._mlp(w, li, x_ND).view(B, T, -1)

    def _mlp(self, w: WeightPlan, li: int, x_ND: torch.Tensor) -> torch.Tensor:
        """x + MLP(post_norm(x)) for N tokens: the dense MoE for few tokens, else ``layer.mlp``."""
        lw = w.layers[li]
        h_ND = rms(x_ND, lw.post_norm, w.exact)
        N = h_ND.shape[0]
        mlp = self._layers[li].mlp
        if lw.moe is not None and N <= self.dense_moe_max_tokens:
            return self.dense_moe(lw.moe, mlp, h_ND, x_ND, w.exact,
                                  None if self.routes is None else lambda e_NK: self.routes.record(li, e_NK))
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
    def dense_moe(m: _MoEWeights, mlp: Any, h_ND: torch.Tensor, x_ND: torch.Tensor, exact: bool,
                  on_route: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
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
        does not fuse the router into the up GEMM then). ``on_route(e_NK)`` receives the chosen experts
        when the engine routes (a router module called here reports through its own hooks).
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
            gu_NF = m.up(h_ND if m.qat is None else fake_quant_act(h_ND, m.qat.activation_format, m.qat.block_size))
        if logits_NX is None:
            _, w_NK, e_NK = mlp.gate(h_ND)
        elif exact or not m.norm_topk:
            w_NK, e_NK = torch.topk(torch.softmax(logits_NX, dim=-1, dtype=torch.float), m.top_k, dim=-1)  # as HF: fp32
            if m.norm_topk:
                w_NK /= w_NK.sum(dim=-1, keepdim=True)
        else:
            top_NK, e_NK = torch.topk(logits_NX, m.top_k, dim=-1)
            w_NK = torch.softmax(top_NK, dim=-1)
        if on_route is not None and logits_NX is not None:
            on_route(e_NK)
        if w_NK.dtype != h_ND.dtype:
            w_NK = w_NK.to(h_ND.dtype)
        w_NX = h_ND.new_zeros(N, X).scatter_(1, e_NK, w_NK)
        a_NXI = expert_act(m, gu_NF.view(N, X, 2 * I))
        if exact:
            y_XND = torch.bmm(a_NXI.transpose(0, 1), m.down_w.view(X, I, -1))
            return x_ND + (y_XND * w_NX.t()[:, :, None]).sum(dim=0)
        return torch.addmm(x_ND, (a_NXI * w_NX[:, :, None]).view(N, X * I), m.down_w)

    def _attend(self, q_BHTE: torch.Tensor, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_BHTE, k_BGLE, v_BGLE, attn_mask=mask, scale=self.scaling, enable_gqa=self._n_heads != self._n_kv
        )

    def attend_step(
        self, w: WeightPlan, q_BHE: torch.Tensor, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor, mask: torch.Tensor | None
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
                              alpha=self.scaling)
        return torch.bmm(torch.softmax(s_XRL, dim=-1), v_BGLE.reshape(B * G, L, E)).view(B, H * E)

    def _chunk_inputs(self, chunks: list[list[int]], starts: list[int]) -> tuple[
            list[int], int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chunk forward's inputs (the cache grown to hold them): chunk lengths, T (the longest), L (positions
        attended), ids [B, T] right-padded with 0, t [T] = 0..T-1, valid [B, T] (t < the chunk's length), starts [B]."""
        dev = self.device
        lens = [len(c) for c in chunks]
        T = max(lens)
        L = max(st + n for st, n in zip(starts, lens))
        self.cache.ensure_capacity(L)
        ids_BT = torch.zeros(len(chunks), T, dtype=torch.long, device=dev)
        for b, c in enumerate(chunks):
            ids_BT[b, : lens[b]] = torch.tensor(c, dtype=torch.long)
        t_T = torch.arange(T, device=dev)
        valid_BT = t_T[None, :] < torch.tensor(lens, device=dev)[:, None]
        return lens, T, L, ids_BT, t_T, valid_BT, torch.tensor(starts, dtype=torch.long, device=dev)

    def _embed_ids(self, w: WeightPlan, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, w.embed) if w.embed is not None else self._embed(ids)

    def _logits(self, w: WeightPlan, x_BD: torch.Tensor) -> torch.Tensor:
        h_BD = rms(x_BD, w.final_norm, w.exact)
        return w.lm_head(h_BD) if w.lm_head is not None else self._lm_head(h_BD)

    def _rotary(self, pos_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [*S, 1, E] of the model's own rotary table at positions pos_S."""
        return self._cos_PE[pos_S].unsqueeze(-2), self._ssin_PE[pos_S].unsqueeze(-2)

    def decode(self, ids: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [B, V] of one token per row: row b (slot b) feeds ``ids[b]`` at position ``positions[b]``,
        attending to its slot's cached positions 0..positions[b] - 1 and itself.

        The decode forward works on [B, D] rows (T = 1 squeezed out) with few ops per layer:
        one q/k/v GEMM, q/k norm + rotary on one [B, H+G, E] block, one indexed write per K
        and V, attention over the slot cache (``attend_step``; no mask when every row sits
        at the same position; rows of ragged lengths in contiguous ranges, each over its own
        longest context, `k3post.rollout.segments`), o_proj + residual, the dense MoE."""
        B = len(ids)
        dev = self.device
        pos_list = list(positions)
        L = max(pos_list) + 1
        self.cache.ensure_capacity(L)
        w = self.weights()
        pos_B = torch.tensor(pos_list, dtype=torch.long, device=dev)
        ids_B = torch.tensor(ids, dtype=torch.long, device=dev)
        mask = None  # every row attends to its positions 0..pos_b: no mask when all sit at L - 1
        segs = [(0, B, L)]
        if min(pos_list) < L - 1:
            segs = attention_segments([p + 1 for p in pos_list])
            mask = self.decode_mask(w, pos_B, L)
        with self._recording(torch.arange(B, device=dev), pos_B):
            return self.decode_stack(w, ids_B, pos_B, mask, segs, L)

    def decode_mask(self, w: WeightPlan, pos_B: torch.Tensor, L: int) -> torch.Tensor:
        """``decode_stack``'s mask for rows at positions pos_B over L cached positions (row b keeps 0..pos_b):
        boolean [B, 1, 1, L] when ``w.exact``, else additive (0 / -inf) [B*G, 1, L], one row per (row, kv head)."""
        B, G = pos_B.shape[0], self._n_kv
        keep_BL = self._pos_P[:L] <= pos_B[:, None]
        if w.exact:
            return keep_BL.view(B, 1, 1, L)
        return torch.where(keep_BL, self._zero, self._neg_inf).repeat_interleave(G, dim=0).view(B * G, 1, L)

    def decode_stack(self, w: WeightPlan, ids_B: torch.Tensor, pos_B: torch.Tensor, mask: torch.Tensor | None,
                     segs: list[tuple[int, int, int]], L: int) -> torch.Tensor:
        """The tensor work of ``decode``: logits [B, V] of ``ids_B`` at ``pos_B`` over L cached positions, with
        ``mask`` (None when every row sits at L - 1; boolean [B, 1, 1, L] when ``w.exact``, else additive
        [B*G, 1, L]) and the attention ranges ``segs`` ((a, b, n): rows a..b-1 over n positions)."""
        B = ids_B.shape[0]
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        NE = (H + G) * E
        cos_B1E, sin_B1E = self._rotary(pos_B)
        index_BG = self.cache.step_index(pos_B)
        x_BD = self._embed_ids(w, ids_B)
        for li, lw in enumerate(w.layers):
            qkv_BF = lw.qkv(rms(x_BD, lw.in_norm, w.exact))
            qk_BNE = self._qk_rotary(w, lw, qkv_BF[:, :NE].view(B, H + G, E), cos_B1E, sin_B1E)
            self.cache.write_step(li, index_BG, qk_BNE[:, H:], qkv_BF[:, NE:].view(B, G, E))
            k_BGLE, v_BGLE = self.cache.view(li, B, L)
            if len(segs) == 1:
                o_BF = self.attend_step(w, qk_BNE[:, :H], k_BGLE, v_BGLE, mask)
            else:  # no row padded to a much longer one: one call per range a..b-1 over n positions
                assert mask is not None
                o_BF = torch.cat([
                    self.attend_step(w, qk_BNE[a:b, :H], k_BGLE[a:b, :, :n], v_BGLE[a:b, :, :n],
                                      mask[a:b, ..., :n] if w.exact else mask[a * G : b * G, :, :n])
                    for a, b, n in segs
                ])
            x_BD = self._mlp(w, li, self._o_proj(w, lw, li, x_BD, o_BF))
        return self._logits(w, x_BD)

    def verify(self, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Logits [B, T, V] of a speculative round's verify forward, decode-shaped: row b (slot b) feeds
        ``chunks[b]`` (its pending token and drafts) at positions starts[b].. .

        Like ``decode`` with T query positions per row instead of one: the B*T rows go through one
        q/k/v GEMM, one q/k norm + rotary, one indexed K/V write per layer (``step_index`` over [B, T]
        positions), attention over the slot cache views (no gather) under the causal mask
        key <= starts[b] + t, and the dense MoE on B*T rows. Rows shorter than T (capped by max_model_len)
        are padded with their last token; their padded positions are clamped to max_model_len - 1, past
        the row's valid positions (their K/V is overwritten before any read; their logits are unused).
        The hidden states after ``capture_layers`` are captured [B, T, A, D] as on the chunk path."""
        B, dev = len(chunks), self.device
        T = max(len(c) for c in chunks)
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        NE, N = (H + G) * E, B * T
        ids_BT = torch.tensor([c + [c[-1]] * (T - len(c)) for c in chunks], dtype=torch.long, device=dev)
        start_B = torch.tensor(starts, dtype=torch.long, device=dev)
        pos_BT = (start_B[:, None] + self._pos_P[:T][None, :]).clamp_(max=self.max_model_len - 1)
        L = int(pos_BT.max()) + 1
        self.cache.ensure_capacity(L)
        keep_B1TL = (self._pos_P[:L][None, None, :] <= pos_BT[:, :, None])[:, None]
        cos_N1E, sin_N1E = self._rotary(pos_BT.view(N))
        index_NG = self.cache.step_index(pos_BT)
        w = self.weights()
        x_ND = self._embed_ids(w, ids_BT.view(N))
        aux: dict[int, torch.Tensor] = {}
        with self._recording(torch.arange(B, device=dev).repeat_interleave(T), pos_BT.view(N)):
            for li, lw in enumerate(w.layers):
                qkv_NF = lw.qkv(rms(x_ND, lw.in_norm, w.exact))
                qk_NME = self._qk_rotary(w, lw, qkv_NF[:, :NE].view(N, H + G, E), cos_N1E, sin_N1E)
                self.cache.write_step(li, index_NG, qk_NME[:, H:], qkv_NF[:, NE:].view(N, G, E))
                k_BGLE, v_BGLE = self.cache.view(li, B, L)
                o_BHTE = self._attend(qk_NME[:, :H].view(B, T, H, E).transpose(1, 2), k_BGLE, v_BGLE, keep_B1TL)
                x_ND = self._mlp(w, li, self._o_proj(w, lw, li, x_ND, o_BHTE.transpose(1, 2).reshape(N, H * E)))
                if li in self.capture_layers:
                    aux[li] = x_ND.view(B, T, -1)
        if self.capture_layers:
            self.captured = torch.stack([aux[i] for i in self.capture_layers], dim=2)
        return self._logits(w, x_ND).view(B, T, -1)

    def forward_chunks(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], *, logits: bool = True,
        all_positions: bool = False,
    ) -> torch.Tensor | None:
        """Forward token chunks of B sequences: row b holds positions starts[b].. of the sequence in slot
        slots[b], whose positions < starts[b] are already cached. Writes every chunk's K/V into its slot;
        returns the logits [B, V] of each chunk's last token (None when ``logits`` is False; with
        ``all_positions`` [B, T, V] of every position, rows right-padded to the longest chunk T). The
        hidden states after ``capture_layers`` are kept in ``captured`` [B, T, A, D]."""
        B, dev = len(chunks), self.device
        lens, T, L, ids_BT, t_T, valid_BT, start_B = self._chunk_inputs(chunks, starts)
        qpos_BT = (start_B[:, None] + t_T[None, :]).clamp_(max=self.max_model_len - 1)
        all_fresh = not any(starts)
        if all_fresh:  # plain causal attention over the new positions only (HF's prefill math)
            mask_B1TL = (t_T[None, :] <= t_T[:, None])[None, None]
        else:
            l_L = torch.arange(L, device=dev)
            mask_B1TL = (l_L[None, None, :] <= qpos_BT[:, :, None])[:, None]
        w = self.weights()
        x_BTD = self._embed_ids(w, ids_BT)
        cos_BT1E, sin_BT1E = self._rotary(qpos_BT)
        aux: dict[int, torch.Tensor] = {}
        with self._recording(torch.tensor(slots, device=dev).repeat_interleave(T), qpos_BT.view(-1), valid_BT.view(-1)):
            for li, lw in enumerate(w.layers):
                q_BHTE, k_BGTE, v_BGTE = self._qkv(w, lw, x_BTD, cos_BT1E, sin_BT1E)
                for b in range(B):
                    self.cache.write_block(li, slots[b], starts[b], k_BGTE[b, :, : lens[b]], v_BGTE[b, :, : lens[b]])
                if all_fresh:
                    k_BGLE, v_BGLE = k_BGTE, v_BGTE
                else:
                    k_BGLE, v_BGLE = self.cache.gather(li, slots, L)
                x_BTD = self._finish_layer(w, li, x_BTD, self._attend(q_BHTE, k_BGLE, v_BGLE, mask_B1TL))
                if li in self.capture_layers:
                    aux[li] = x_BTD
        if self.capture_layers:
            self.captured = torch.stack([aux[i] for i in self.capture_layers], dim=2)
        if not logits:
            return None
        if all_positions:
            return self._logits(w, x_BTD.reshape(B * T, -1)).view(B, T, -1)
        last_B = torch.tensor([n - 1 for n in lens], dtype=torch.long, device=dev)
        return self._logits(w, x_BTD[torch.arange(B, device=dev), last_B])
