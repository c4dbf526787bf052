"""bench/mx_quant.py: the headline's baseline arm (k3post's grouped expert kernel with the quantizer
replaced by the identity) computes what transformers' stock experts compute, so ``qat_step_overhead``
compares the same work with and without MX rounding; the library quantizer is restored afterwards.

Shape legend: B batch, T sequence, V vocab.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import k3post.quant.qat as qat

_spec = importlib.util.spec_from_file_location("bench_mx_quant", Path(__file__).parents[1] / "bench" / "mx_quant.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def _small_model() -> torch.nn.Module:
    model = bench.tiny_moe(seed=0, vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4)
    with torch.no_grad():  # wider than transformers' std-0.02 init, so MXFP4 rounding visibly moves the logits
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.1)
    return model.eval()


def _logits_and_grad(model: torch.nn.Module, arm: str, ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def fwd_bwd() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids_BT, labels=ids_BT)
        out.loss.backward()
        return out.logits.detach(), model.model.layers[0].mlp.experts.gate_up_proj.grad.clone()

    return bench.run_arm(model, arm, fwd_bwd)


def test_identity_arm_computes_the_stock_experts_function():
    model = _small_model()
    ids_BT = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    library_fq = qat.qat_fake_quant
    stock_BTV, stock_grad = _logits_and_grad(model, "stock", ids_BT)
    ident_BTV, ident_grad = _logits_and_grad(model, "grouped_identity", ids_BT)
    qat_BTV, _ = _logits_and_grad(model, "qat", ids_BT)
    # the identity arm runs the QAT forward (k3post's grouped kernel), not transformers' forward
    assert "forward" in model.model.layers[0].mlp.experts.__dict__
    # same function as transformers' experts: logits and the expert-weight gradient agree to fp32 noise
    torch.testing.assert_close(ident_BTV, stock_BTV, rtol=0, atol=1e-5)
    torch.testing.assert_close(ident_grad, stock_grad, rtol=1e-4, atol=1e-6)
    # ... while the QAT arm really rounds (MXFP4 weights move the logits by far more than noise)
    assert (qat_BTV - stock_BTV).abs().max().item() > 1e-3
    # the library's quantizer is back after the identity arm, and "stock" removes QAT exactly
    assert qat.qat_fake_quant is library_fq
    bench.set_experts(model, "stock")
    assert not any(hasattr(m, "_k3post_qat") or "forward" in m.__dict__ for m in model.modules())


def test_bench_qat_reports_fair_headline_and_separate_kernel_ratio():
    out = bench.bench_qat(3, batch=1, seq=32, model=_small_model())
    for key in ("qat_step_overhead", "grouped_vs_stock_experts", "qat_vs_stock_experts"):
        assert out[f"{key}_n"] == 3.0 and out[f"{key}_min"] <= out[f"{key}_max"]
    # headline = median(qat) / median(grouped identity), by definition (common.ratio_summary)
    assert abs(out["qat_step_overhead"] - out["step_ms_qat_median"] / out["step_ms_grouped_identity_median"]) < 1e-9
    assert out["qat_target_met"] == (out["qat_step_overhead"] <= 1.5)
