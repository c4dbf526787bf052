"""bench/rollout_engine.py: the QAT baseline HF ``generate`` runs (expert weights quantized once, only the
activation fake-quant left in its forward) computes the same numbers as the re-quantizing QAT forward and
as the engine, so ``speedup_vs_hf_generate_qat`` measures the engine, not re-quantization; the
equal-length control has the drawn workload's useful tokens.

Shape legend: B batch, T sequence, N new tokens per row, V vocab.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import k3post.quant.qat as qat
from k3post.models import build_tiny_moe
from k3post.quant.qat import QATConfig, apply_qat, quantized_expert_weights
from k3post.xtml import EOM

_spec = importlib.util.spec_from_file_location("bench_rollout_engine", Path(__file__).parents[1] / "bench" / "rollout_engine.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_qat(xtml_tokenizer):
    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    apply_qat(model, QATConfig())
    return model.eval(), tok


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (9, 14, 6)]


def test_prequantized_hf_forward_is_bit_identical_to_the_qat_forward(tiny_qat):
    model, tok = tiny_qat
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hf = bench.HFBaseline.of(model)
    assert hf.model is not model and len(hf.prequantized_ids) == len(quantized_expert_weights(model)) > 0
    params = dict(hf.model.named_parameters())
    for name, w in quantized_expert_weights(model).items():  # held quantized, once
        assert torch.equal(params[name], w) and id(params[name]) in hf.prequantized_ids
    library_fq = qat.qat_fake_quant
    calls: list[str] = []

    def counting(x, fmt, block_size=32, axis=-1):
        calls.append(fmt)
        return library_fq(x, fmt, block_size, axis)

    ids_BT = torch.tensor([_prompts(len(tok))[1]])
    qat.qat_fake_quant = counting
    try:
        with torch.no_grad():
            ref_BTV = model(ids_BT).logits  # re-quantizes the weights in every forward
            n_ref = len(calls)
            with hf.context():
                got_BTV = hf.model(ids_BT).logits
    finally:
        qat.qat_fake_quant = library_fq
    assert torch.equal(got_BTV, ref_BTV)
    # per experts block the QAT forward quantizes 2 weights + 2 activations; the baseline only the activations
    layers = model.config.num_hidden_layers
    assert n_ref == 4 * layers and calls[n_ref:] == [QATConfig().activation_format] * 2 * layers
    assert qat.qat_fake_quant is library_fq  # the context restored the library function
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the engine's model untouched


def test_hf_qat_baseline_matches_engine_on_greedy_requests(tiny_qat):
    model, tok = tiny_qat
    prompts, lengths = _prompts(len(tok)), [8, 8, 8]
    _, res, _ = bench.engine_generate(model, tok, prompts, lengths, seed=0, temperature=0.0)
    _, new_BN, logp_BN = bench.HFBaseline.of(model).generate(tok.pad_token_id, prompts, 8, seed=0, greedy=True, logprobs=True)
    assert [r.output_ids for r in res] == new_BN.tolist()
    diff_BN = (torch.tensor([r.output_logprobs for r in res]) - logp_BN).abs()
    # the engine's decode GEMMs have other shapes than HF's (left-padded batch): fp32 noise, and an
    # occasional MXFP8 rounding flip of ~1e-4 (tests/test_engine.py's bounds: 5e-3 everywhere, 1e-5 on at
    # least a third of the positions; measured here: every position within 4.8e-7)
    assert diff_BN.max().item() < 5e-3, diff_BN
    assert (diff_BN < 1e-5).float().mean().item() >= 1 / 3, diff_BN


def test_equal_length_control_and_plain_baseline(xtml_tokenizer):
    lengths = bench.draw_lengths(32, median=40, sigma=1.0, lo=4, hi=256, seed=2)
    equal = bench.equal_lengths(lengths)
    assert len(set(equal)) == 1 and len(equal) == len(lengths)
    assert abs(sum(equal) - sum(lengths)) <= len(lengths) / 2  # same useful tokens up to rounding
    model = build_tiny_moe(len(xtml_tokenizer), seed=0)
    hf = bench.HFBaseline.of(model)  # QAT off: HF runs the model itself
    assert hf.model is model and not hf.prequantized_ids
