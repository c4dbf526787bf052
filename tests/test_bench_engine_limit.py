"""bench/engine_limit.py: the FLOP count of a decoded token (golden, by hand), timed steps that are all decode steps,
and the summary keys its last line promises."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3post.models import build_tiny_moe

_spec = importlib.util.spec_from_file_location("bench_engine_limit", Path(__file__).parents[1] / "bench" / "engine_limit.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_flops_per_token_golden():
    # D 8, H 2, G 1, E 4, X 4 experts (top 2) of width 6, vocab 10, one layer, context 3:
    # q/k/v 2·8·(2·4 + 2·1·4) = 256, o 2·(2·4)·8 = 128, router 2·8·4 = 64, experts 2·3·2·8·6 = 576,
    # attention 4·2·4·3 = 96 -> 1,120 a layer; lm_head 2·8·10 = 160 -> 1,280
    moe = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_hidden_layers=1,
                          vocab_size=10, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    assert bench.flops_per_token(moe, 3) == 1280
    # a dense MLP (no experts) of width 6: 3·2·8·6 = 288 instead of router + experts (640)
    dense = SimpleNamespace(**{**vars(moe), "num_experts": 0, "intermediate_size": 6})
    assert bench.flops_per_token(dense, 3) == 1280 - 640 + 288
    # the real preset: attention grows with the context, 4·H·E per position per layer
    cfg = build_tiny_moe(300, "tiny", seed=0).config
    c = cfg.get_text_config(decoder=True)
    assert bench.flops_per_token(cfg, 11) - bench.flops_per_token(cfg, 10) == 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers


def test_timed_steps_decode_every_row_and_the_summary_has_its_keys():
    model = build_tiny_moe(300, "tiny", seed=0).eval()
    step_s, ctx = bench.decode_step(model, 3, 8, 2)
    assert step_s > 0 and ctx == 8 + 1 + 3 + 0.5  # prompt, the first token, 3 warm-up steps, the timed steps' mean
    res = bench.measure([1, 2], context=8, steps=2, vocab=300, repeats=2)
    assert {"limit_ratio_b1", "limit_ratio_b2", "limit_ratio_b1_noqat", "limit_ratio_b2_noqat",
            "qat_hf_over_fast_b1", "qat_hf_over_fast_b2"} <= set(res)
    assert [r["batch"] for r in res["qat_orders"]] == [1, 2]
    assert all(r["min"] <= r["median"] <= r["max"] and r["fast_ms"] > 0 and r["hf_ms"] > 0 for r in res["qat_orders"])
    assert [(r["batch"], r["qat"]) for r in res["rows"]] == [(1, True), (2, True), (1, False), (2, False)]
    # a step cannot beat the arithmetic it has to do at the machine's GEMM rate
    assert all(r["ratio"] > 1 for r in res["rows"]) and res["peak_gflops"] > 0
