"""MXFP4 / MXFP8 quantization-aware training for transformers-5 MoE models (SPEC §6.1).

What is quantized (everything else stays in high precision: attention, routers
``mlp.gate``, shared experts, embeddings, LM head, norms):

* routed-expert weights -> MXFP4 E2M1 (``QATConfig.weight_format``), blocks of 32 along
  the GEMM reduction dim;
* the inputs of the expert GEMMs (the token hidden states entering gate/up, and the
  activated intermediate entering down) -> MXFP8 E4M3 (``QATConfig.activation_format``),
  blocks of 32 along the hidden / intermediate dim.

Fake quantization with a straight-through estimator (STE):

    forward:  y = fake_quant_mx(x)          (k3post.quant.mx, OCP MX v1.0)
    backward: dL/dx = dL/dy                 (Bengio et al. 2013, "Estimating or
                                             propagating gradients through stochastic
                                             neurons"; the usual QAT STE)

so the master weights stay fp32/bf16 and receive the full gradient.

How it hooks in: ``apply_qat`` gives each expert module an instance-level ``forward``
(the class forward is untouched; ``remove_qat`` deletes the instance attribute, which
restores the original forward exactly).

* Fused 3-D experts (Qwen3-MoE ``Qwen3MoeExperts``, gpt-oss, DeepSeek-V3, ... : params
  ``gate_up_proj`` [E, 2I, H] / ``up_proj`` [E, I, H] and ``down_proj`` [E, H, I], or
  the transposed layout [E, in, out] when ``module.is_transposed``): the QAT forward
  quantizes each weight tensor ONCE per call (not per expert slice, not per token),
  quantizes the token states once, sorts the (token, k) pairs by expert and runs
  grouped GEMMs (``torch.nn.functional.grouped_mm`` when available, else one ``mm`` per
  expert). It honours the flags transformers' ``@use_experts_implementation`` sets
  (``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``,
  ``_apply_gate``); it replaces whatever ``config._experts_implementation`` chose.
* Per-expert ``nn.Linear`` experts (a ``ModuleList`` named ``experts`` of MLPs): each
  Linear's forward becomes ``F.linear(fq_act(x), fq_w(W), b)``.

The rollout engine uses the same numbers: ``quantized_expert_weights(model)`` returns
``fake_quant_mx`` of every quantized weight with the same format, block size and axis
as the training forward, and a QAT model in ``eval()`` under ``torch.no_grad()`` /
``torch.inference_mode()`` produces bit-identical logits to the training forward.

Shape legend:
    T   tokens (batch * sequence, flattened)
    K   experts per token (top-k)
    S   routed (token, expert) pairs, S = T * K
    E   routed experts
    H   hidden size
    I   expert intermediate size (2I for fused gate+up)
    O   output features of a projection, N: input (reduction) features
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3post.config.quant import QATConfig
from k3post.quant.mx import fake_quant_mx

__all__ = [
    "QATConfig",
    "apply_qat",
    "remove_qat",
    "quantized_expert_weights",
    "qat_fake_quant",
    "weight_quant_cache",
]

logger = logging.getLogger("k3post.qat")

_CFG_ATTR = "_k3post_qat"
_ORIG_FORWARD_ATTR = "_k3post_qat_orig_forward"
_KIND_ATTR = "_k3post_qat_kind"
_WCACHE_ATTR = "_k3post_qat_wcache"


class _STEFakeQuant(torch.autograd.Function):
    """y = fake_quant_mx(x) forward; dL/dx = dL/dy backward (straight-through)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fmt: str, block_size: int, axis: int) -> torch.Tensor:  # type: ignore[override]
        return fake_quant_mx(x, fmt, block_size, axis)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad_y, None, None, None


def qat_fake_quant(x: torch.Tensor, fmt: str, block_size: int = 32, axis: int = -1) -> torch.Tensor:
    """MX fake quantization with a straight-through gradient.

    Forward value is exactly ``fake_quant_mx(x, fmt, block_size, axis)`` (same bits with
    or without autograd); the gradient w.r.t. x is the incoming gradient unchanged.

    Args:
        x: any shape, float32 / bfloat16 / float16, ``x.shape[axis] % block_size == 0``.
    Returns:
        same shape and dtype as x.
    """
    return _STEFakeQuant.apply(x, fmt, block_size, axis)


class _STECached(torch.autograd.Function):
    """y = w_q (the already fake-quantized value of w) forward; dL/dw = dL/dy backward: `qat_fake_quant`'s
    value and gradient, without quantizing again."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return w_q.view_as(w_q)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad_y, None


@contextlib.contextmanager
def weight_quant_cache(model: nn.Module, store: dict[str, dict[str, Any]] | None = None) -> Iterator[None]:
    """Inside, every QAT weight of ``model`` is fake-quantized once and reused by later forwards (same value,
    same straight-through gradient), instead of once per forward: for the micro-batches of one optimizer step,
    where the weights cannot change (an RL step runs 2 forwards per group: 64 quantizations of every expert
    weight at 32 groups). A parameter replaced or changed in place (its tensor, data pointer or version
    counter) is quantized again anyway, so a stale value is never used.

    Args:
        model: any module; its QAT modules get the cache.
        store: where the quantized values live: None (default) drops them when the block ends; a dict the
            caller keeps (keyed by module name) carries them into its next block, for a caller that runs
            many forwards between weight changes (the rollout engine's MoE calls: one quantization per weight
            version instead of one per decode step).
    A module whose cache an enclosing block opened keeps that one (the outer block owns it)."""
    opened = []
    for name, m in _qat_modules(model):
        if _WCACHE_ATTR in m.__dict__:
            continue
        m.__dict__[_WCACHE_ATTR] = {} if store is None else store.setdefault(name, {})
        opened.append(m)
    try:
        yield
    finally:
        for m in opened:
            m.__dict__.pop(_WCACHE_ATTR, None)


def _weight_fake_quant(module: nn.Module, name: str, w: torch.Tensor, fmt: str, block_size: int, axis: int) -> torch.Tensor:
    """``qat_fake_quant(w, ...)`` for the weight ``name`` of ``module``: from `weight_quant_cache` when one is open."""
    cache = module.__dict__.get(_WCACHE_ATTR)
    if cache is None:
        return qat_fake_quant(w, fmt, block_size, axis)
    key = (id(w), w.data_ptr(), w._version, fmt, block_size, axis)
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = cache[name] = (key, fake_quant_mx(w.detach(), fmt, block_size, axis))
    if torch.is_grad_enabled() and w.requires_grad:
        return _STECached.apply(w, hit[1])
    return hit[1]


# --------------------------------------------------------------------------- discovery


def _param3d(module: nn.Module, name: str) -> nn.Parameter | None:
    p = module._parameters.get(name)
    return p if p is not None and p.dim() == 3 else None


def _is_fused_experts(module: nn.Module) -> bool:
    """A module holding routed experts as 3-D parameters ``down_proj`` + (``gate_up_proj``
    or ``up_proj``), each [E, out, in] (or [E, in, out] if ``module.is_transposed``)."""
    return _param3d(module, "down_proj") is not None and (
        _param3d(module, "gate_up_proj") is not None or _param3d(module, "up_proj") is not None
    )


def _fused_up_name(module: nn.Module) -> str:
    has_gate = getattr(module, "has_gate", _param3d(module, "gate_up_proj") is not None)
    return "gate_up_proj" if has_gate else "up_proj"


def _reduction_axis(module: nn.Module) -> int:
    """Reduction dim of a fused [E, out, in] weight is the last one; -2 if transposed."""
    return -2 if getattr(module, "is_transposed", False) else -1


def _check_divisible(what: str, length: int, block_size: int) -> None:
    if length % block_size != 0:
        raise ValueError(
            f"cannot MX-quantize {what}: reduction length {length} is not a multiple of "
            f"QATConfig.block_size={block_size}"
        )


def _find_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, kind) for every routed-expert module; kind is "fused" for
    a 3-D experts module and "linear" for an ``nn.Linear`` inside a ``ModuleList`` named
    ``experts``. Modules nested in an already-found experts container are not repeated."""
    found: list[tuple[str, nn.Module, str]] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        if _is_fused_experts(module):
            found.append((name, module, "fused"))
            claimed.append(name)
        elif isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts":
            for sub_name, sub in module.named_modules():
                if isinstance(sub, nn.Linear):
                    found.append((f"{name}.{sub_name}", sub, "linear"))
            claimed.append(name)
    return found


# --------------------------------------------------------------------------- forwards


def _grouped_linear(x_SN: torch.Tensor, w_EON: torch.Tensor, counts_E: list[int], transposed: bool) -> torch.Tensor:
    """Rows of x_SN sorted by expert (counts_E rows for expert e) times their expert's
    weight: y_s = x_s W_e^T (or x_s W_e when ``transposed``, W_e then [N, O]).

    Uses ``torch.nn.functional.grouped_mm`` where it exists and accepts the inputs,
    else one ``mm`` per expert with tokens (the same math)."""
    w_ENO = w_EON if transposed else w_EON.transpose(-2, -1)
    x_SN = x_SN.to(w_ENO.dtype)
    grouped_mm = getattr(F, "grouped_mm", None)
    if grouped_mm is not None:
        offsets_E = torch.tensor(counts_E, dtype=torch.int32, device=x_SN.device).cumsum(0, dtype=torch.int32)
        try:
            return grouped_mm(x_SN, w_ENO, offs=offsets_E)
        except (RuntimeError, NotImplementedError):  # dtype / device / alignment not supported
            pass
    outs: list[torch.Tensor] = []
    start = 0
    for e, n in enumerate(counts_E):
        if n:
            outs.append(x_SN[start : start + n] @ w_ENO[e])
        start += n
    if not outs:
        return x_SN.new_zeros(0, w_ENO.shape[-1])
    return torch.cat(outs, dim=0)


def _default_apply_gate(module: nn.Module, gate_up_SI2: torch.Tensor) -> torch.Tensor:
    gate_SI, up_SI = gate_up_SI2.chunk(2, dim=-1)
    return module.act_fn(gate_SI) * up_SI


def _fused_experts_qat_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """QAT forward of a fused experts module (replaces e.g. ``Qwen3MoeExperts.forward``).

        x_q   = FQ8(x_TH)                          token states, blocks along H
        W_q   = FQ4(W) for gate_up / up and down   once per call, blocks along the
                                                   reduction dim
        h_S   = gate(x_q[t_s] W_up_q[e_s]^T (+b))  act(g) * u for gated experts
        y_S   = FQ8(h_S) W_down_q[e_s]^T (+b)
        out_t = sum_k w_tk * y_(t,k)

    Args:
        hidden_states: [T, H]; top_k_index: [T, K] int; top_k_weights: [T, K].
    Returns:
        [T, H] in hidden_states' dtype.
    """
    cfg: QATConfig = getattr(self, _CFG_ATTR)
    fmt_w, fmt_a, bs = cfg.weight_format, cfg.activation_format, cfg.block_size
    axis = _reduction_axis(self)
    transposed = bool(getattr(self, "is_transposed", False))
    has_gate = _fused_up_name(self) == "gate_up_proj"
    has_bias = bool(getattr(self, "has_bias", False))
    up_name = "gate_up_proj" if has_gate else "up_proj"

    w_up_E = _weight_fake_quant(self, up_name, getattr(self, up_name), fmt_w, bs, axis)
    w_down_E = _weight_fake_quant(self, "down_proj", self.down_proj, fmt_w, bs, axis)
    x_TH = qat_fake_quant(hidden_states, fmt_a, bs, -1)

    T, K = top_k_index.shape
    num_experts = w_up_E.shape[0]
    expert_S = top_k_index.reshape(-1)
    expert_sorted_S, perm_S = torch.sort(expert_S, stable=True)
    counts_E = torch.bincount(expert_S, minlength=num_experts).tolist()
    if len(counts_E) > num_experts:
        raise ValueError(f"top_k_index holds expert ids >= num_experts={num_experts}")

    x_SH = x_TH[perm_S // K]
    h_S = _grouped_linear(x_SH, w_up_E, counts_E, transposed)
    if has_bias:
        h_S = h_S + getattr(self, f"{up_name}_bias")[expert_sorted_S]
    if has_gate:
        apply_gate = getattr(self, "_apply_gate", None)
        h_SI = apply_gate(h_S) if apply_gate is not None else _default_apply_gate(self, h_S)
    else:
        h_SI = self.act_fn(h_S)
    h_SI = qat_fake_quant(h_SI, fmt_a, bs, -1)
    y_SH = _grouped_linear(h_SI, w_down_E, counts_E, transposed)
    if has_bias:
        y_SH = y_SH + self.down_proj_bias[expert_sorted_S]
    if getattr(self, "has_post_expert_norm", False):
        y_SH = self.post_expert_norm(y_SH)
    y_SH = y_SH * top_k_weights.reshape(-1)[perm_S].unsqueeze(-1).to(y_SH.dtype)

    inv_perm_S = torch.empty_like(perm_S)
    inv_perm_S[perm_S] = torch.arange(perm_S.numel(), device=perm_S.device)
    out_TH = y_SH[inv_perm_S].view(T, K, -1).sum(dim=1)
    return out_TH.to(hidden_states.dtype)


def _linear_qat_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """QAT forward of one per-expert Linear: y = FQ8(x) FQ4(W)^T + b, blocks along
    in_features. x: [..., N]; W: [O, N]; returns [..., O]."""
    cfg: QATConfig = getattr(self, _CFG_ATTR)
    w_ON = _weight_fake_quant(self, "weight", self.weight, cfg.weight_format, cfg.block_size, -1)
    x_q = qat_fake_quant(x, cfg.activation_format, cfg.block_size, -1)
    return F.linear(x_q.to(w_ON.dtype), w_ON, self.bias)


# --------------------------------------------------------------------------- public API


def _qat_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, _CFG_ATTR)]


def apply_qat(model: nn.Module, cfg: QATConfig) -> list[str]:
    """Turn on MX fake quantization of the routed experts of ``model`` (in place).

    Args:
        model: a transformers-5 MoE model (or any module tree with fused 3-D experts or a
            ``ModuleList`` named ``experts``).
        cfg: formats and block size; ``cfg.enabled=False`` makes this a no-op.

    Returns:
        Qualified names of the quantized weight parameters, e.g.
        ``model.layers.0.mlp.experts.gate_up_proj`` (fused) or
        ``model.layers.0.mlp.experts.3.down_proj.weight`` (per-expert Linear). Also logged
        on the "k3post.qat" logger.

    Raises:
        ValueError: QAT already applied, a reduction dim not divisible by the block size,
            or an expert-parallel experts module (not supported).
    """
    if not isinstance(cfg, QATConfig):
        raise ValueError(f"cfg must be a QATConfig, got {type(cfg).__name__}")
    if not cfg.enabled:
        logger.info("QAT disabled (QATConfig.enabled=False); model unchanged")
        return []
    if _qat_modules(model):
        raise ValueError("QAT is already applied to this model; call remove_qat first")
    found = _find_expert_modules(model)
    bs = cfg.block_size
    names: list[str] = []
    for name, module, kind in found:  # validate everything before touching anything
        if kind == "fused":
            if getattr(module, "_is_expert_parallel", False):
                raise ValueError(f"{name}: expert-parallel experts modules are not supported by apply_qat")
            axis = _reduction_axis(module)
            up = getattr(module, _fused_up_name(module))
            _check_divisible(f"{name}.{_fused_up_name(module)} {tuple(up.shape)}", up.shape[axis], bs)
            _check_divisible(f"{name}.down_proj {tuple(module.down_proj.shape)}", module.down_proj.shape[axis], bs)
            names += [f"{name}.{_fused_up_name(module)}", f"{name}.down_proj"]
        else:
            _check_divisible(f"{name}.weight {tuple(module.weight.shape)}", module.weight.shape[-1], bs)
            names.append(f"{name}.weight")
    for name, module, kind in found:
        setattr(module, _ORIG_FORWARD_ATTR, module.__dict__.get("forward"))
        setattr(module, _KIND_ATTR, kind)
        setattr(module, _CFG_ATTR, cfg)
        fwd = _fused_experts_qat_forward if kind == "fused" else _linear_qat_forward
        module.forward = types.MethodType(fwd, module)
    logger.info(
        "apply_qat: %d expert weights -> %s, their GEMM inputs -> %s (block %d): %s",
        len(names), cfg.weight_format, cfg.activation_format, bs, names,
    )
    if not names:
        logger.warning("apply_qat found no routed-expert weights in %s", type(model).__name__)
    return names


def remove_qat(model: nn.Module) -> list[str]:
    """Undo ``apply_qat`` exactly: every patched module gets its original forward back
    and the QAT attributes are deleted. Weights were never modified.

    Returns:
        Names of the modules that were restored (empty if QAT was not applied).
    """
    restored: list[str] = []
    for name, module in _qat_modules(model):
        orig = getattr(module, _ORIG_FORWARD_ATTR)
        if orig is None:
            del module.forward
        else:
            module.forward = orig
        for attr in (_CFG_ATTR, _ORIG_FORWARD_ATTR, _KIND_ATTR):
            delattr(module, attr)
        restored.append(name)
    logger.info("remove_qat: restored %d modules", len(restored))
    return restored


@torch.no_grad()
def quantized_expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The expert weights exactly as the QAT forward sees them, for a rollout engine.

    For every weight ``apply_qat`` returned: ``fake_quant_mx(W, weight_format,
    block_size, axis)`` with axis = the reduction dim (-1 for [E, out, in] and
    nn.Linear [out, in]; -2 for transposed fused experts). Same function, same
    arguments, hence bit-identical to the training forward.

    Returns:
        {qualified parameter name: dequantized weight (same shape / dtype as W)};
        empty if QAT is not applied.
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in _qat_modules(model):
        cfg: QATConfig = getattr(module, _CFG_ATTR)
        if getattr(module, _KIND_ATTR) == "fused":
            axis = _reduction_axis(module)
            for pname in (_fused_up_name(module), "down_proj"):
                w = getattr(module, pname)
                out[f"{name}.{pname}"] = fake_quant_mx(w, cfg.weight_format, cfg.block_size, axis)
        else:
            out[f"{name}.weight"] = fake_quant_mx(module.weight, cfg.weight_format, cfg.block_size, -1)
    return out
