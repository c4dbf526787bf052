"""MX QAT on transformers MoE models: what is quantized, STE gradients, train/eval
bit-identity, exact removal, a short memorisation run, per-expert nn.Linear layout.

Shape legend: B batch, T sequence, H hidden, E experts, V vocab.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import transformers
from torch import nn

import k3post.quant.qat as qat
from k3post.quant import E2M1_VALUES, fake_quant_mx, quantize_mx
from k3post.quant.qat import QATConfig, apply_qat, quantized_expert_weights, remove_qat

EXPERT_NAMES = [
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.experts.down_proj",
    "model.layers.1.mlp.experts.gate_up_proj",
    "model.layers.1.mlp.experts.down_proj",
]


def _tiny_qwen3_moe(seed: int = 0, **overrides: int) -> transformers.Qwen3MoeForCausalLM:
    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs))
    # transformers initialises the 3-D expert params with std 0.02; widen them a little
    # so MXFP4 rounding visibly changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.1)
    return model


def _ids(seed: int = 1, shape: tuple[int, int] = (2, 16)) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def _record_quant_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, torch.Tensor]]:
    """Wrap the STE quantizer the QAT forwards call; record (fmt, axis, output)."""
    calls: list[tuple[str, int, torch.Tensor]] = []
    inner = qat.qat_fake_quant

    def recording(x: torch.Tensor, fmt: str, block_size: int = 32, axis: int = -1) -> torch.Tensor:
        y = inner(x, fmt, block_size, axis)
        calls.append((fmt, axis, y.detach().clone()))
        return y

    monkeypatch.setattr(qat, "qat_fake_quant", recording)
    return calls


def _on_e2m1_grid(w: torch.Tensor, axis: int = -1) -> bool:
    """Every element of w is 2^(byte-127) * (+-E2M1 value) with its block's scale."""
    _, scales = quantize_mx(w, "fp4_e2m1", axis=axis)
    scale = torch.ldexp(torch.ones((), dtype=torch.float64), scales.double() - 127)
    scale_full = scale.repeat_interleave(32, dim=axis)
    mags = w.double().abs() / scale_full
    return bool(torch.isin(mags, torch.tensor(E2M1_VALUES, dtype=torch.float64)).all())


def test_apply_qat_returns_exactly_the_expert_weights(caplog):
    model = _tiny_qwen3_moe()
    with caplog.at_level(logging.INFO, logger="k3post.qat"):
        names = apply_qat(model, QATConfig())
    assert names == EXPERT_NAMES
    assert "model.layers.1.mlp.experts.down_proj" in caplog.text
    assert sorted(quantized_expert_weights(model)) == sorted(EXPERT_NAMES)
    # disabled config is a no-op; a second apply is an error
    assert apply_qat(_tiny_qwen3_moe(), QATConfig(enabled=False)) == []
    with pytest.raises(ValueError, match="already applied"):
        apply_qat(model, QATConfig())


def test_config_and_shape_errors():
    with pytest.raises(ValueError, match="weight_format"):
        QATConfig(weight_format="int4")
    with pytest.raises(ValueError, match="block_size"):
        QATConfig(block_size=0)
    # moe_intermediate 48: down_proj [E, H, 48] reduces over 48, not a multiple of 32
    model = _tiny_qwen3_moe(moe_intermediate_size=48)
    with pytest.raises(ValueError, match="not a multiple of QATConfig.block_size=32"):
        apply_qat(model, QATConfig())
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing patched


def test_forward_sees_mxfp4_weights_and_mxfp8_inputs(monkeypatch):
    model = _tiny_qwen3_moe()
    apply_qat(model, QATConfig())
    calls = _record_quant_calls(monkeypatch)
    model(input_ids=_ids())
    weights = [y for fmt, _, y in calls if fmt == "fp4_e2m1"]
    acts = [y for fmt, _, y in calls if fmt == "fp8_e4m3"]
    # per layer: gate_up, down (once each per forward), token states, intermediate
    assert len(weights) == 4 and len(acts) == 4
    ref = quantized_expert_weights(model)
    for name, w in zip(EXPERT_NAMES, weights):
        assert torch.equal(w, ref[name])  # the rollout engine's weights are the same bits
        assert torch.equal(fake_quant_mx(w, "fp4_e2m1"), w)
        assert _on_e2m1_grid(w)
        assert not torch.equal(w, model.get_parameter(name))  # master stays high precision
    assert [a.shape[-1] for a in acts] == [64, 32, 64, 32]  # H into gate_up, I into down
    for a in acts:
        assert torch.equal(fake_quant_mx(a, "fp8_e4m3"), a)


def test_gradients_reach_master_expert_weights():
    model = _tiny_qwen3_moe().train()
    apply_qat(model, QATConfig())
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    for name in EXPERT_NAMES:
        g = model.get_parameter(name).grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # STE through the activation quantizers: the router and attention still get gradients
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_non_expert_modules_see_unquantized_weights():
    model = _tiny_qwen3_moe().eval()
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer0 = model.model.layers[0]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        layer0.self_attn.register_forward_hook(lambda m, i, o: seen.__setitem__("attn", o[0].detach().clone())),
        layer0.mlp.gate.register_forward_hook(lambda m, i, o: seen.__setitem__("router", o[0].detach().clone())),
        model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("head_in", i[0].detach().clone())),
    ]
    ids = _ids()
    with torch.no_grad():
        model(input_ids=ids)
        plain = dict(seen)
        apply_qat(model, QATConfig())
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    assert torch.equal(seen["attn"], plain["attn"])  # attention: high precision
    assert torch.equal(seen["router"], plain["router"])  # router logits: high precision
    assert not torch.equal(seen["head_in"], plain["head_in"])  # but the experts did change
    for n, p in model.named_parameters():  # no weight was modified in place
        assert torch.equal(p, params_before[n])


def test_train_forward_equals_no_grad_eval_forward_bitwise():
    model = _tiny_qwen3_moe()
    apply_qat(model, QATConfig())
    ids = _ids(shape=(3, 24))
    model.train()
    logits_train = model(input_ids=ids, labels=ids).logits
    assert logits_train.requires_grad
    model.eval()
    with torch.no_grad():
        logits_eval = model(input_ids=ids).logits
    with torch.inference_mode():
        logits_inf = model(input_ids=ids).logits
    assert torch.equal(logits_train.detach(), logits_eval)
    assert torch.equal(logits_eval, logits_inf)


def test_remove_qat_restores_original_forward_bitwise():
    model = _tiny_qwen3_moe().eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        apply_qat(model, QATConfig())
        quantized = model(input_ids=ids).logits
        assert remove_qat(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        restored = model(input_ids=ids).logits
    assert not torch.equal(quantized, ref)
    assert torch.equal(restored, ref)
    assert not any("forward" in m.__dict__ or hasattr(m, "_k3post_qat") for m in model.modules())
    assert quantized_expert_weights(model) == {}


def test_qat_expert_forward_equals_hf_forward_without_rounding(monkeypatch):
    # With the quantizer replaced by the identity, the QAT experts forward must compute
    # the same function as transformers' own Qwen3MoeExperts forward.
    model = _tiny_qwen3_moe().eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        monkeypatch.setattr(qat, "fake_quant_mx", lambda x, fmt, bs=32, axis=-1: x.clone())
        apply_qat(model, QATConfig())
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_gpt_oss_layout_transposed_with_bias(monkeypatch):
    # gpt-oss stores experts transposed ([E, in, out]) with biases and interleaved gate/up;
    # the QAT forward follows those flags (identity quantizer -> same logits as HF), and
    # quantizes along the reduction dim (axis -2).
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, layer_types=["full_attention"],
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.05)
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        names = apply_qat(model, QATConfig())
        assert names == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
        w = quantized_expert_weights(model)["model.layers.0.mlp.experts.gate_up_proj"]  # [E, H, 2I]
        assert _on_e2m1_grid(w, axis=-2)
        assert torch.equal(w, fake_quant_mx(model.model.layers[0].mlp.experts.gate_up_proj, "fp4_e2m1", axis=-2))
        remove_qat(model)
        monkeypatch.setattr(qat, "fake_quant_mx", lambda x, fmt, bs=32, axis=-1: x.clone())
        apply_qat(model, QATConfig())
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_short_qat_training_memorises():
    # 60 AdamW steps on 4 fixed sequences of 16 tokens, QAT on throughout.
    # Recorded on this CPU (torch 2.13): loss 4.881 -> 0.001 (ln 128 = 4.85 at init).
    model = _tiny_qwen3_moe(seed=0).train()
    apply_qat(model, QATConfig())
    ids = _ids(seed=5, shape=(4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"QAT memorisation: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[0] > 4.0
    assert losses[-1] < 0.25 * losses[0]


# --------------------------------------------------------------------------- per-expert Linear layout


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x_TH)) * self.up_proj(x_TH))


class _OldStyleMoE(nn.Module):
    """Mixtral-style block: router Linear + ModuleList of per-expert MLPs + shared expert."""

    def __init__(self, hidden: int = 64, inter: int = 32, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([_MLP(hidden, inter) for _ in range(num_experts)])
        self.shared_expert = _MLP(hidden, inter)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        probs_TE = self.gate(x_TH).softmax(-1)
        w_TK, idx_TK = probs_TE.topk(self.top_k, dim=-1)
        out_TH = self.shared_expert(x_TH)
        for e, expert in enumerate(self.experts):
            tok, k = torch.where(idx_TK == e)
            if tok.numel():
                out_TH = out_TH.index_add(0, tok, expert(x_TH[tok]) * w_TK[tok, k, None])
        return out_TH


def test_per_expert_linear_layout(monkeypatch):
    torch.manual_seed(0)
    moe = _OldStyleMoE()
    x_TH = torch.randn(10, 64, requires_grad=True)
    ref = moe(x_TH).detach()
    names = apply_qat(moe, QATConfig())
    assert names == [f"experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    calls = _record_quant_calls(monkeypatch)
    out = moe(x_TH)
    assert not torch.equal(out.detach(), ref)
    qw = quantized_expert_weights(moe)
    weights = [y for fmt, _, y in calls if fmt == "fp4_e2m1"]
    assert weights and all(_on_e2m1_grid(w) for w in weights)
    assert any(torch.equal(w, qw["experts.0.gate_proj.weight"]) for w in weights)
    assert sum(1 for fmt, _, _ in calls if fmt == "fp8_e4m3") == len(weights)
    out.sum().backward()
    assert moe.experts[0].gate_proj.weight.grad.abs().sum() > 0 and torch.isfinite(x_TH.grad).all()
    remove_qat(moe)
    assert torch.equal(moe(x_TH).detach(), ref)


@pytest.mark.parametrize("layout", ["fused", "per_expert_linear"])
def test_weight_quant_cache_equals_quantizing_every_forward(layout, monkeypatch):
    """Inside `weight_quant_cache` several forwards + backwards (the micro-batches of one step) give the same losses
    and the same accumulated gradients, bit for bit, as quantizing the weights in every forward; each weight is
    quantized once; a weight changed in place inside the block is quantized again; the block leaves no cache."""
    def build() -> nn.Module:
        if layout == "fused":
            m = _tiny_qwen3_moe().train()
        else:
            torch.manual_seed(0)
            m = _OldStyleMoE()
        apply_qat(m, QATConfig())
        return m

    def run(m: nn.Module, cached: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        losses = []
        with qat.weight_quant_cache(m) if cached else contextlib.nullcontext():
            for seed in (1, 2, 3):
                if layout == "fused":
                    ids = _ids(seed)
                    loss = m(input_ids=ids, labels=ids).loss
                else:
                    loss = m(torch.randn(10, 64, generator=torch.Generator().manual_seed(seed))).square().mean()
                loss.backward()
                losses.append(float(loss.detach()))
        return losses, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref_losses, ref_grads = run(build(), cached=False)
    model = build()
    calls = []
    real = qat.fake_quant_mx
    monkeypatch.setattr(qat, "fake_quant_mx", lambda x, fmt, *a: (calls.append(fmt), real(x, fmt, *a))[1])
    losses, grads = run(model, cached=True)
    n_quantized = calls.count("fp4_e2m1")
    assert losses == ref_losses and grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert n_quantized == len(quantized_expert_weights(model))  # once each, not once per forward (3 forwards)
    assert not any(qat._WCACHE_ATTR in m.__dict__ for m in model.modules())
    # a weight changed in place inside the block (an optimizer step would be a bug there, but the cache must not
    # serve the old value): the next forward quantizes it again and sees the new value
    changed = [p for n, p in model.named_parameters() if n in quantized_expert_weights(model)]
    with qat.weight_quant_cache(model):
        first = model(input_ids=_ids(1)).logits if layout == "fused" else model(torch.ones(10, 64))
        with torch.no_grad():
            for w in changed:
                w.mul_(-1.0)
        again = model(input_ids=_ids(1)).logits if layout == "fused" else model(torch.ones(10, 64))
        assert not torch.equal(first, again)
