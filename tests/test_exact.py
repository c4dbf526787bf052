"""The exact mode (issue 35, ``rl.rollout.exact``, `k3post.rollout.embedded.exact`): the engine's behaviour log-probs equal the
trainer's recomputed ones bit for bit whatever the batch composition, prefix sharing, pause / resume or slot count,
and the mode fails closed where that cannot hold."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from k3post.models import build_tiny_family, build_tiny_moe
from k3post.policy_step import TokenSequence, policy_grads
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.embedded import exact as exact_module
from k3post.rollout.embedded.exact import (KEY_BLOCK, TILE, ExactForward, check_batch_invariance, exact_attention,
                                           exact_blocker, exact_forward_for, tiled_mm)
from k3post.rollout.engine import GenerationRequest, GenerationResult
from k3post.rollout.factory import model_drafter
from k3post.rollout.speculative import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 300


def _model(seed: int = 0, qat: bool = True) -> torch.nn.Module:
    m = build_tiny_moe(V, seed=seed, pad_token_id=0, eos_token_id=1).eval()
    if qat:
        apply_qat(m, QATConfig())
    return m


def _requests(n: int, *, shared: int = 0, seed: int = 0, max_tokens: int = 20) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(5, V, (shared,), generator=g).tolist()
    return [GenerationRequest(f"r{i}", head + torch.randint(5, V, (4 + 7 * i,), generator=g).tolist(),
                              SamplingParams(max_tokens=max_tokens + 3 * i, seed=i, stop_ids=())) for i in range(n)]


def _trainer_logprobs(model: torch.nn.Module, r: GenerationResult) -> list[float]:
    """The trainer's exact log-probs of a result's sampled tokens."""
    ids = r.prompt_ids + r.output_ids
    lp = exact_forward_for(model, len(ids)).token_logprobs(torch.tensor([ids]))[0]
    return lp[len(r.prompt_ids):].tolist()


def test_tiled_mm_gives_a_row_the_same_bits_whatever_shares_its_call():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 128, generator=g), torch.randn(96, 128, generator=g)
    ref = tiled_mm(x, w.t())
    torch.testing.assert_close(ref, x @ w.t(), rtol=1e-5, atol=1e-5)  # it is the product
    for m in (1, 2, 3, 5, 15, 16, 17, 100):
        assert torch.equal(tiled_mm(x[:m], w.t()), ref[:m]), m
    for _ in range(20):  # other neighbours, other places in a tile
        idx = torch.randperm(300, generator=g)[: int(torch.randint(1, 40, (1,), generator=g))]
        assert torch.equal(tiled_mm(x[idx], w.t()), ref[idx])
    assert tiled_mm(x[:0], w.t()).shape == (0, 96)


def test_exact_attention_is_attention_and_ignores_blocks_past_a_query():
    g = torch.Generator().manual_seed(1)
    B, H, G, T, E = 2, 4, 2, 70, 32
    q, k, v = torch.randn(B, H, T, E, generator=g), torch.randn(B, G, T, E, generator=g), torch.randn(B, G, T, E, generator=g)
    pos = torch.arange(T).expand(B, T)
    o = exact_attention(q, k, v, pos, 0.17)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.17, enable_gqa=True)
    torch.testing.assert_close(o, want.transpose(1, 2).reshape(B, T, H * E), rtol=1e-5, atol=1e-6)
    # more keys past every query (another key block, as a longer row of a decode batch brings): the same bits
    pad_k = torch.cat([k, torch.randn(B, G, 2 * KEY_BLOCK, E, generator=g)], dim=2)
    pad_v = torch.cat([v, torch.randn(B, G, 2 * KEY_BLOCK, E, generator=g)], dim=2)
    assert torch.equal(exact_attention(q, pad_k, pad_v, pos, 0.17), o)
    # one query at a time (a decode step) over the keys so far
    for t in (0, 5, KEY_BLOCK - 1, KEY_BLOCK, T - 1):
        got = exact_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pos[:, t : t + 1], 0.17)
        assert torch.equal(got[:, 0], o[:, t]), t
    # another row beside it
    assert torch.equal(exact_attention(q[:1], k[:1], v[:1], pos[:1], 0.17), o[:1])


@pytest.mark.parametrize("qat", [False, True])
def test_the_exact_forward_is_the_models_forward(qat):
    model = _model(qat=qat)
    ids = torch.randint(2, V, (3, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = model(input_ids=ids).logits
    got = exact_forward_for(model, 90).logits(ids)
    if not qat:  # fp32 rounding of other reduction orders (measured 5e-7 on the logits)
        torch.testing.assert_close(got, hf, rtol=1e-5, atol=1e-5)
    else:  # an MXFP8 rounding boundary turns a last-bit difference into a step of the activation grid
        assert float((got - hf).abs().mean()) < 1e-3
        assert bool((got.argmax(-1) == hf.argmax(-1)).float().mean() > 0.97)


@pytest.mark.parametrize("qat", [False, True])
def test_the_engines_log_probs_are_the_trainers_bit_for_bit_in_any_composition(qat):
    model = _model(qat=qat)
    reqs = _requests(5, shared=20)
    runs = {}
    for slots, sharing in ((1, False), (3, True), (8, True)):
        eng = EmbeddedEngine(model, max_batch_size=slots, max_model_len=256, prefix_sharing=sharing, exact=True)
        assert eng.path == "exact"
        runs[slots] = eng.generate(copy.deepcopy(reqs))
    for r in runs[8]:
        assert r.output_logprobs == _trainer_logprobs(model, r), r.request_id
    for slots in (1, 3):  # batch-invariant: the same tokens and log-probs whatever the batches
        for a, b in zip(runs[slots], runs[8]):
            assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs


def test_a_shared_prompt_run_once_gives_the_same_bits():
    model = _model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (4, 150), generator=g)
    ids[:, :70] = ids[0, :70]
    fwd = exact_forward_for(model, 150)
    full, shared = fwd.token_logprobs(ids), fwd.token_logprobs(ids, prefix_len=70)
    assert torch.equal(shared[:, 70:], full[:, 70:]) and not shared[:, :70].any()
    mask = torch.rand(ids.shape, generator=g) < 0.2  # the sampled tokens alone: the same bits there, 0 elsewhere
    some = fwd.token_logprobs(ids, prefix_len=70, mask_BT=mask)
    keep = mask & (torch.arange(150) >= 70)
    assert torch.equal(some[keep], full[keep]) and not some[~keep].any()
    with pytest.raises(ValueError, match="prefix_len"):
        fwd.logits(ids, prefix_len=150)


def test_the_default_engine_is_not_exact():
    """The comparison above can fail: the lean engine's log-probs differ from the exact forward's in the last bits."""
    model = _model(qat=False)
    res = EmbeddedEngine(model, max_batch_size=8, max_model_len=256).generate(_requests(4))
    assert any(r.output_logprobs != _trainer_logprobs(model, r) for r in res)


def test_pause_resume_and_exported_kv_stay_exact():
    model = _model()
    eng = EmbeddedEngine(model, max_batch_size=4, max_model_len=256, exact=True)
    reqs = _requests(3, max_tokens=30)
    for r in reqs:
        eng.add_request(r)
    done: dict[str, GenerationResult] = {}
    _steps(eng, done, 6)
    partial = {p.request_id: p for p in eng.pause(["r0", "r2"])}
    kv = eng.export_kv("r2")
    _steps(eng, done, 5)  # r1 runs alone for a while
    eng.resume(["r0"])
    p2 = partial["r2"]
    eng.add_request(GenerationRequest("r2", p2.prompt_ids + p2.output_ids,
                                      SamplingParams(max_tokens=reqs[2].sampling.max_tokens - len(p2.output_ids), seed=2,
                                                     stop_ids=())), kv=kv)
    _steps(eng, done)
    for rid in ("r0", "r1", "r2"):  # r2's prompt holds the tokens it had at the pause
        assert done[rid].output_logprobs == _trainer_logprobs(model, done[rid]), rid


def _steps(eng: EmbeddedEngine, done: dict[str, GenerationResult], n: int | None = None) -> None:
    """``n`` engine steps (None: until nothing is queued or running), finished results into ``done``."""
    while (n is None and eng.has_unfinished()) or (n is not None and n > 0):
        done.update((r.request_id, r) for r in eng.step())
        n = None if n is None else n - 1


def test_policy_grads_use_exact_values_and_fail_closed_on_any_gap():
    model = _model()
    eng = EmbeddedEngine(model, max_batch_size=4, max_model_len=256, exact=True)
    res = eng.generate(_requests(3))
    seqs = [TokenSequence(r.prompt_ids + r.output_ids, [False] * len(r.prompt_ids) + [True] * len(r.output_ids),
                          [0.0] * len(r.prompt_ids) + list(r.output_logprobs),
                          [0.0] * len(r.prompt_ids) + [0.5 - i * 0.4] * len(r.output_ids),
                          versions=[-1] * len(r.prompt_ids) + [0] * len(r.output_ids)) for i, r in enumerate(res)]
    groups = [(seqs, 0)]
    out = policy_grads(model, groups, pad_id=0, token_normalizer=60.0, version=0, exact=True)
    assert out["gap_n"] == sum(len(r.output_ids) for r in res) and out["gap_sum"] == 0.0 and out["max/gap"] == 0.0
    g_exact = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    ref = policy_grads(model, groups, pad_id=0, token_normalizer=60.0, version=0)
    assert ref["max/gap"] > 0  # the model's own forward is not the engine's, bit for bit
    g_ref = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for a, b in zip(g_exact, g_ref):  # the gradient is the model's forward's (the ratios differ by ~1e-6)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    model.zero_grad()
    # one recorded log-prob one ulp off: refused, naming where
    bad = copy.deepcopy(seqs)
    t = bad[1].mask.index(True) + 2
    bad[1].behavior_logp[t] = float(torch.nextafter(torch.tensor(bad[1].behavior_logp[t]), torch.tensor(0.0)))
    with pytest.raises(RuntimeError, match=rf"rl.rollout.exact: 1 token\(s\) sampled by version 0 .*position {t}"):
        policy_grads(model, [(bad, 0)], pad_id=0, token_normalizer=60.0, version=0, exact=True)
    # tokens an older version sampled are not held to it (the policy moved: partial rollout)
    out = policy_grads(model, [(bad, 0)], pad_id=0, token_normalizer=60.0, version=1, exact=True)
    assert out["gap_n"] == 0 and out["moved_gap_n"] == sum(s.num_trainable for s in bad)


def test_speculative_rounds_stay_exact():
    """Verify forwards of drafted tokens (several positions per row, rejected ones overwritten) record the trainer's
    log-probs too."""
    model = _model()
    drafter = copy.deepcopy(model)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.02)
    eng = EmbeddedEngine(model, max_batch_size=3, max_model_len=256, exact=True,
                         speculative=SpeculativeConfig(model_drafter(drafter), 3))
    res = eng.generate(_requests(4))
    assert 0 < eng.stats["spec_accepted"] < eng.stats["spec_drafted"]
    for r in res:
        assert r.output_logprobs == _trainer_logprobs(model, r), r.request_id


def test_the_exact_engine_records_routes_for_replay():
    """rl.rollout.exact with rl.rollout.routing_replay: the exact engine records every fed position's experts, as the lean engine does
    (the two route alike but at last-bit ties of the router logits)."""
    model = _model()
    reqs = _requests(3)
    got = EmbeddedEngine(model, max_batch_size=4, max_model_len=256, exact=True, record_routes=True).generate(reqs)
    ref = EmbeddedEngine(model, max_batch_size=4, max_model_len=256, record_routes=True).generate(reqs)
    same = total = 0
    for a, b in zip(got, ref):
        assert a.routes is not None and b.routes is not None and bool((a.routes >= 0).all())
        n = min(len(a.routes), len(b.routes), len(a.prompt_ids))  # the prompts: the same tokens on both
        same += int((a.routes[:n] == b.routes[:n]).all(-1).all(-1).sum())
        total += n
    assert same >= 0.95 * total, (same, total)


def test_the_engines_score_is_exact_too():
    model = _model()
    eng = EmbeddedEngine(model, max_batch_size=2, max_model_len=128, exact=True)
    r = eng.generate(_requests(1))[0]
    assert eng.score([r.prompt_ids + r.output_ids])[0][len(r.prompt_ids) - 1:] == r.output_logprobs


def test_the_self_check_fails_closed_on_kernels_that_are_not_batch_invariant(monkeypatch):
    """One F.linear call per projection (no tiles): 1-3 rows take another kernel than 4 or more on this CPU, so a
    decode step of one row is off from the trainer's forward in the last bits, and the check must say so."""
    model = _model(qat=False)
    monkeypatch.setattr(exact_module, "tiled_mm", lambda x, b: x @ b)
    monkeypatch.setattr(exact_module, "_CHECKED", set())
    with pytest.raises(RuntimeError, match="not batch-invariant on this machine.*differ by up to"):
        check_batch_invariance(model)
    monkeypatch.undo()
    check_batch_invariance(model)  # the real kernels pass


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_other_families_run_exactly(family):
    """Dense gated MLPs (Llama, Qwen3) and Mixtral's router: the model's forward to fp32 rounding, and the engine's
    log-probs the trainer's bit for bit."""
    model = build_tiny_family(family, V, seed=0, pad_token_id=0, eos_token_id=1).eval()
    ids = torch.randint(2, V, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hf = model(input_ids=ids).logits
    torch.testing.assert_close(exact_forward_for(model, 80).logits(ids), hf, rtol=1e-5, atol=1e-5)
    for r in EmbeddedEngine(model, max_batch_size=3, max_model_len=256, exact=True).generate(_requests(4)):
        assert r.output_logprobs == _trainer_logprobs(model, r), (family, r.request_id)


@pytest.mark.parametrize("family, why", [("qwen2_moe", "neither plain routed experts nor a plain gated MLP"),
                                         ("gpt_oss", "not one the lean forward mirrors"),
                                         ("deepseek_v3", "not one the lean forward mirrors")])
def test_families_it_cannot_run_are_named(family, why):
    assert why in (exact_blocker(build_tiny_family(family, V), 128) or "")


def test_models_the_exact_forward_cannot_run_are_refused():
    bf16 = build_tiny_moe(V, seed=0).to(torch.bfloat16)
    assert "float32" in (exact_blocker(bf16, 128) or "")
    with pytest.raises(ValueError, match="rl.rollout.exact: the exact forward cannot run .*float32"):
        EmbeddedEngine(bf16, max_batch_size=2, max_model_len=128, exact=True)
    with pytest.raises(ValueError, match="path='general'"):
        EmbeddedEngine(_model(), max_batch_size=2, max_model_len=128, exact=True, path="general")
    assert exact_blocker(_model(), 128) is None
    assert TILE == 16 and KEY_BLOCK == 64
    m = _model()
    first = exact_forward_for(m, 10)
    assert isinstance(first, ExactForward) and exact_forward_for(m, first.max_model_len) is first
    grown = exact_forward_for(m, first.max_model_len + 1)  # rebuilt, to twice the length: not once per new length
    assert grown is not first and grown.max_model_len == 2 * first.max_model_len
