"""Tests of ``Eagle3Drafter`` (k3post.spec.drafter): the EAGLE-3 draft driving speculative decoding.

(a) greedy speculative decoding with it gives plain decoding's tokens (lean and general engine paths);
(b) its q at drafted step i equals ``sampling_probs`` of ``unrolled_logits`` step i at the context's last
    position, teacher-forced with the drafted tokens (temperature 1 and 0.7 / top-k / top-p; reduced vocabulary,
    zeros outside it), and a row rebuilt after ``release`` (features from the target) drafts the same q;
(c) the exact law of tests/test_speculative.py (enumerated, two steps) and its Monte-Carlo chi-square through
    the engine hold with it.

Target: test_speculative's tiny Qwen3-MoE (vocabulary 64, 2 layers). Draft: ``Eagle3Draft.from_target`` with
aux ids (1, 1, 2), a 48-id vocabulary and fc perturbed off its [0 0 I] start.

Shape legend: V target vocabulary, K drafts, B rows.
"""

from __future__ import annotations

import pytest
import torch

from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams
from k3post.rollout.engine import sampling_probs
from k3post.rollout.speculative import DraftRow, SpeculativeConfig, acceptance_probs, residual_probs
from k3post.spec.drafter import Eagle3Drafter
from k3post.spec.eagle3 import DraftVocab, Eagle3Draft, target_features, unrolled_logits
from tests.test_speculative import PROMPT, V, _chi2_pvalue, _first_token_law, _probs, _requests, _target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = (1, 1, 2)


@pytest.fixture(scope="module")
def models():
    target = _target()
    keep = torch.arange(V)[torch.arange(V) % 4 != 1]  # 48 ids: ids 1, 5, 9, … are outside the draft vocabulary
    draft = Eagle3Draft.from_target(target, AUX, draft_vocab=DraftVocab(keep, V))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        draft.fc.weight.add_(torch.randn(draft.fc.weight.shape, generator=g) * 0.05)
    return target, draft.eval()


def _aux_row(target, draft, context: list[int], sp: SamplingParams, key: str = "x", seed: int = 7) -> DraftRow:
    """A DraftRow as the engine builds it for a fresh request: the target's hidden states after the aux layers
    (engine ids = k3post ids - 1) of positions 0 .. n-2."""
    fused, _ = target_features(target, torch.tensor([context]), AUX)
    D = fused.shape[-1] // 3
    return DraftRow(key, context, sp, seed, 0, fused[0, :-1].view(-1, 3, D), 0)


def _bound(draft, target=None, rows: int = 4) -> Eagle3Drafter:
    d = Eagle3Drafter(draft, target)
    d.bind(rows, 64, V)
    return d


def test_refuses_layer_id_zero(models):
    target, _ = models
    with pytest.raises(ValueError, match="id 0"):
        Eagle3Drafter(Eagle3Draft.from_target(target, (0, 1, 2)))
    assert Eagle3Drafter(models[1]).aux_layers == (0, 0, 1)


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)])
def test_q_equals_unrolled_steps(models, sp):
    """q_i of a proposal after context c (n tokens) = sampling_probs(unrolled_logits(c + d_1 .. d_{k-1})[i] at
    t = n-2), mapped to target ids, for i = 0 .. k-1: step i at t reads x_{t+1+i} = d_i (the pending token for
    i = 0) and predicts the token the drafter drew d_{i+1} from. A second proposal after two more tokens (the
    incremental path) matches too, and so does a released and rebuilt row."""
    target, draft = models
    k = 5
    ctx = PROMPT + [11, 30, 2]
    dr = _bound(draft, target)
    for step, context in enumerate([ctx, ctx + [40, 17]]):
        row = _aux_row(target, draft, context, sp)
        if step == 1:  # the engine hands only the positions computed since the last proposal
            row.aux_hidden, row.aux_start = row.aux_hidden[len(ctx) - 1:], len(ctx) - 1
        d_1K, q_1KV = dr.propose([row], k)
        ids = torch.tensor([context + d_1K[0, :-1].tolist()])
        fused, _ = target_features(target, ids, AUX)
        with torch.no_grad():
            logits_NW = unrolled_logits(draft, fused, ids, steps=k)[:, 0, len(context) - 2]
        full_NV = torch.full((k, V), float("-inf"))
        full_NV[:, draft.target_ids] = logits_NW
        want_KV = sampling_probs(full_NV, torch.full((k,), sp.temperature), torch.full((k,), sp.top_k),
                                 torch.full((k,), sp.top_p))
        assert (q_1KV[0] - want_KV).abs().max().item() < 1e-5  # fp32: keys summed in another order
        assert q_1KV[0][:, 1::4].abs().max().item() == 0  # zero outside the draft vocabulary
        assert (q_1KV[0].sum(-1) - 1).abs().max().item() < 1e-6  # an fp32 softmax
        assert all(q_1KV[0, j, d_1K[0, j]] > 0 for j in range(k))
        dr.rollback("x", len(context))
    # rebuilt from the context (a release, then aux_start past what the drafter holds): the same q
    row = _aux_row(target, draft, ctx + [40, 17], sp)
    row.aux_hidden, row.aux_start = row.aux_hidden[-2:], len(ctx) - 1
    dr.release("x")
    d2_1K, q2_1KV = dr.propose([row], k)
    assert dr.rebuilds == 1
    assert torch.equal(d2_1K, d_1K) and (q2_1KV - q_1KV).abs().max().item() < 1e-5


def test_batched_rows_equal_single_rows(models):
    """Ragged rows proposed together draft what each drafts alone (padding is masked)."""
    target, draft = models
    sp = SamplingParams()
    ctxs = [PROMPT, PROMPT + [5, 6, 7, 8, 9], [2, 60]]
    rows = [_aux_row(target, draft, c, sp, key=f"r{i}", seed=i) for i, c in enumerate(ctxs)]
    d_BK, q_BKV = _bound(draft).propose(rows, 4)
    for b, r in enumerate(rows):
        d_1K, q_1KV = _bound(draft).propose([r], 4)
        assert torch.equal(d_1K[0], d_BK[b]) and (q_1KV[0] - q_BKV[b]).abs().max().item() < 1e-5


@pytest.mark.parametrize("path", ["lean", "general"])
def test_greedy_speculative_equals_plain_decoding(models, path):
    target, draft = models
    reqs = _requests(5, temperature=0.0)
    plain = EmbeddedEngine(target, max_batch_size=3, stop_ids=(), path=path).generate(reqs)
    engine = EmbeddedEngine(target, speculative=SpeculativeConfig(Eagle3Drafter(draft), 3), stop_ids=(),
                            max_batch_size=3, path=path)
    got = engine.generate(reqs)
    for a, b in zip(plain, got):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5
    assert 0 < engine.stats["spec_accepted"] < engine.stats["spec_drafted"]  # acceptances and rejections


def _eagle_probs(target, draft, contexts: list[list[int]], sp: SamplingParams) -> torch.Tensor:
    """The drafter's q of its first draft after each context (fresh rows): [B, V] float64."""
    rows = [_aux_row(target, draft, c, sp, key=f"c{i}") for i, c in enumerate(contexts)]
    return _bound(draft, rows=len(rows)).propose(rows, 1)[1][:, 0]


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)])
def test_exact_law_equals_target_one_and_two_steps(models, sp):
    """test_speculative's enumerated law with the EAGLE-3 q: P(y1) = p1(y1) and P(y1, y2) = p1(y1) p2(y2 | y1)."""
    target, draft = models
    p1_V, q1_V = _probs(target, [PROMPT], sp)[0], _eagle_probs(target, draft, [PROMPT], sp)[0]
    assert torch.minimum(p1_V, q1_V).sum() < 0.9
    assert (_first_token_law(p1_V, q1_V) - p1_V).abs().max().item() < 1e-6
    ctx2 = [PROMPT + [y] for y in range(V)]
    p2_VV, q2_VV = _probs(target, ctx2, sp), _eagle_probs(target, draft, ctx2, sp)
    acc1_V = q1_V * acceptance_probs(p1_V, q1_V)
    law2_VV = _first_token_law(p2_VV, q2_VV)
    joint_VV = acc1_V[:, None] * law2_VV + (1 - acc1_V.sum()) * residual_probs(p1_V, q1_V)[:, None] * law2_VV
    assert (joint_VV - p1_V[:, None] * p2_VV).abs().max().item() < 1e-6


def test_monte_carlo_two_steps_chi_square(models):
    """2,000 seeds through the engine with the Eagle3Drafter (k = 2): the first two tokens follow
    p1(y1) p2(y2 | y1) (p-value > 1e-3); a draft distribution used as the target's (the pairs drawn from
    q1 q2 instead) is rejected (p-value < 1e-6), so the test can tell the two apart."""
    target, draft = models
    sp = SamplingParams()
    p1_V = _probs(target, [PROMPT], sp)[0]
    p2_VV = _probs(target, [PROMPT + [y] for y in range(V)], sp)
    want_C = (p1_V[:, None] * p2_VV).flatten()
    engine = EmbeddedEngine(target, speculative=SpeculativeConfig(Eagle3Drafter(draft), 2), stop_ids=(),
                            max_batch_size=256, max_model_len=16)
    counts_VV = torch.zeros(V, V, dtype=torch.float64)
    for r in engine.generate([GenerationRequest(f"m{i}", PROMPT, SamplingParams(max_tokens=2, stop_ids=(), seed=i))
                              for i in range(2000)]):
        counts_VV[r.output_ids[0], r.output_ids[1]] += 1
    assert 0.05 < engine.stats["spec_acceptance_rate"] < 0.95
    assert _chi2_pvalue(counts_VV.flatten(), want_C) > 1e-3
    q1_V = _eagle_probs(target, draft, [PROMPT], sp)[0]
    q2_VV = _eagle_probs(target, draft, [PROMPT + [y] for y in range(V)], sp)
    assert _chi2_pvalue(counts_VV.flatten(), (q1_V[:, None] * q2_VV).flatten()) < 1e-6


def test_a_feature_gap_without_target_warns_and_is_counted(models, caplog):
    """A row whose context has no target hidden states (after a KV import) and no target= to recompute them
    drafts from zeros: never silently (a warning once, and the ``zero_filled`` count)."""
    target, draft = models
    d = _bound(draft)
    row = DraftRow("gap", list(PROMPT), SamplingParams(temperature=1.0), 7, 0, None, 0)
    with caplog.at_level("WARNING", logger="k3post.spec"):
        d.propose([row], 2)
    assert d.zero_filled == len(PROMPT) - 1 and "no target hidden states" in caplog.text
    full = _bound(draft, target)
    full.propose([row], 2)
    assert full.zero_filled == 0 and full.rebuilds == 1


def test_engine_draft_config_key(models, tmp_path):
    """``engine.draft`` turns speculative decoding on through the factory: an EAGLE-3 export (as `k3post draft`
    writes it) drives an Eagle3Drafter, another model folder a ModelDrafter; greedy tokens equal plain decoding;
    a folder that is no model is a clear error."""
    from k3post.config.rollout import EngineConfig
    from k3post.errors import UserError
    from k3post.models import save_model
    from k3post.rollout.factory import build_engine
    from k3post.spec.export import export_eagle3

    target, draft = models
    reqs = _requests(5, temperature=0.0)
    plain = build_engine(target, max_batch_size=3, stop_ids=()).generate(reqs)
    small = _target()  # a (same-vocabulary) causal LM as a classic draft model
    # AUX has id L = 2, which k3post's engine records and stock vLLM / SGLang do not: a nonstock export
    for folder in (export_eagle3(draft, tmp_path / "eagle3", nonstock=True), save_model(small, tmp_path / "small")):
        engine = build_engine(target, engine=EngineConfig(draft=str(folder), num_draft_tokens=2), max_batch_size=3,
                              stop_ids=())
        assert [r.output_ids for r in engine.generate(reqs)] == [r.output_ids for r in plain]
        assert engine.stats["spec_target_forwards"] > 0
    with pytest.raises(UserError, match="not a model folder"):
        build_engine(target, engine=EngineConfig(draft=str(tmp_path)), max_batch_size=3)
    with pytest.raises(ValueError, match="needs engine.kind=embedded"):
        EngineConfig(kind="http", urls=["http://127.0.0.1:1"], draft="x")


def test_slots_are_bounded_reused_and_drafting_runs_to_the_length_limit(models):
    """The drafter keeps one KV slot per live request: more live requests than it was bound for is a clear
    error, a released slot is reused (and its old entries are not read: the new row drafts what a fresh
    drafter drafts), and drafting k tokens at a context one short of max_len works (the drafted positions the
    engine never verifies are clamped into the cache)."""
    target, draft = models
    sp = SamplingParams()
    dr = Eagle3Drafter(draft, target)
    dr.bind(2, 16, V)
    dr.propose([_aux_row(target, draft, PROMPT, sp, key="a"), _aux_row(target, draft, PROMPT + [8], sp, key="b")], 3)
    with pytest.raises(ValueError, match="more live requests than the 2"):
        dr.propose([_aux_row(target, draft, PROMPT, sp, key="c")], 3)
    dr.release("a")
    ctx = [2, 60, 17, 33, 9, 41, 12]
    d_1K, q_1KV = dr.propose([_aux_row(target, draft, ctx, sp, key="c")], 3)
    d0_1K, q0_1KV = _bound(draft, target).propose([_aux_row(target, draft, ctx, sp, key="c")], 3)
    assert torch.equal(d_1K, d0_1K) and (q_1KV - q0_1KV).abs().max().item() < 1e-6
    long = (PROMPT * 4)[:15]  # n = max_len - 1: drafted steps reach positions 14 .. 18 > 15
    d_1K, q_1KV = dr.propose([_aux_row(target, draft, long, sp, key="b")], 5)
    assert q_1KV.shape == (1, 5, V) and torch.isfinite(q_1KV).all() and (q_1KV.sum(-1) - 1).abs().max() < 1e-6
