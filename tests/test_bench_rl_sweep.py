"""bench/rl_sweep.py: the parameter-change measure says how far RL moved the policy, in the master weights
and in the MX-quantized expert weights the QAT forward actually uses."""

from __future__ import annotations


import pytest
import torch

from k3post.models import build_tiny_moe
from k3post.quant.qat import QATConfig, apply_qat, quantized_expert_weights
from tests.bench_module import load_bench

bench = load_bench("rl_sweep")


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    a, b = build_tiny_moe(64, seed=0), build_tiny_moe(64, seed=0)
    for m in (a, b):
        apply_qat(m, QATConfig())
    return a, b


def test_identical_models_moved_nothing() -> None:
    a, b = _pair()
    m = bench.param_change(a, b)
    assert m["mean_abs_delta"] == 0.0 and m["relative"] == 0.0 and m["quantized_changed_share"] == 0.0
    assert m["mean_abs"] > 0


def test_relative_change_and_quantized_share() -> None:
    a, b = _pair()
    q = quantized_expert_weights(a)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(2.0)  # every weight moves by its own size: relative change 1 (up to fp32 sums)
    m = bench.param_change(a, b)
    assert m["relative"] == pytest.approx(1.0, rel=1e-4) and m["experts_relative"] == pytest.approx(1.0, rel=1e-4)
    # the MX block scale is a power of 2, so quant(2W) = 2 quant(W): exactly the nonzero MX values change
    nonzero = sum(int((w != 0).sum()) for w in q.values()) / sum(w.numel() for w in q.values())
    assert m["quantized_changed_share"] == pytest.approx(nonzero, rel=1e-9)
    with torch.no_grad():  # a step far below the MXFP4 grid leaves the forward's expert weights as they were
        a2, b2 = _pair()
        for name, p in b2.named_parameters():
            if name in q:
                p.add_(1e-7 * torch.sign(p))
    tiny = bench.param_change(a2, b2)
    assert 0 < tiny["experts_relative"] < 1e-4 and tiny["quantized_changed_share"] < 0.01
