"""Tests of speculative decoding in the embedded engine (k3post.rollout.speculative): the verification
rule (golden), the exact law of the emitted tokens on real tiny models (enumerated), a seeded Monte-Carlo
chi-square test with a broken variant as negative control, the acceptance rate against sum_x min(p, q),
greedy parity with plain decoding, and continuous batching / stops / max_tokens / pause / resume.

Target: a tiny Qwen3-MoE (vocabulary 64, 2 layers, untied head, init std 0.3 so distributions are peaked
enough for chi-square cells). Drafters: a noisy copy of the target (sum min(p, q) ~ 0.5) and a smaller,
differently seeded model (1 layer).

Shape legend: V vocabulary, K drafts, T verified positions (K + 1), B rows.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from k3post.models import build_tiny_moe
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams
from k3post.rollout import speculative as spec_mod
from k3post.rollout.engine import sampling_probs
from k3post.rollout.factory import draft_forward, model_drafter
from k3post.rollout.model_drafter import ModelDrafter
from k3post.rollout.speculative import (
    SpeculativeConfig,
    acceptance_probs,
    residual_probs,
    verify_drafts,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 64
PROMPT = [3, 9, 20, 7]


def _target() -> torch.nn.Module:
    return build_tiny_moe(V, seed=0, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=False,
                          initializer_range=0.3).eval()


@pytest.fixture(scope="module")
def models():
    """(target, close drafter: the target plus Gaussian noise of std 0.045, small drafter: 1 layer, seed 1)."""
    target = _target()
    close = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.045)
    small = build_tiny_moe(V, seed=1, hidden_size=64, num_hidden_layers=1, tie_word_embeddings=False,
                           initializer_range=0.3).eval()
    return target, close, small


def _spec_engine(target, drafter_model, k: int, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(target, speculative=SpeculativeConfig(model_drafter(drafter_model), k), stop_ids=(), **kw)


def _probs(model, contexts: list[list[int]], sp: SamplingParams) -> torch.Tensor:
    """sampling_probs of the next token after each context (one forward, equal lengths): [B, V] float64."""
    with torch.no_grad():
        logits_BV = model(torch.tensor(contexts)).logits[:, -1]
    B = len(contexts)
    return sampling_probs(logits_BV, torch.full((B,), sp.temperature), torch.full((B,), sp.top_k),
                          torch.full((B,), sp.top_p))


# --------------------------------------------------------------------------- the rule (golden)


def test_verify_drafts_golden():
    # p = [0.5, 0.3, 0.2] at every position, q = [0.2, 0.6, 0.2].
    # acceptance min(1, p/q) = [1, 0.5, 1]; residual norm(max(0, p - q)) = [0.3, 0, 0] / 0.3 = [1, 0, 0].
    # row 0: drafts (0, 1), u_acc (0.9, 0.4): 0 accepted (ratio 1), 1 accepted (0.4 < 0.5): a = 2, bonus from p
    #        with u_res 0.85 -> cdf [0.5, 0.8, 1.0] -> token 2.
    # row 1: drafts (1, 0), u_acc (0.6, 0.0): 1 rejected (0.6 >= 0.5): a = 0, residual -> token 0 for any u.
    # row 2: drafts (2, 2), k = 1: 2 accepted, the second draft is not verified: a = 1, bonus with u_res 0.1 -> 0.
    p_BTV = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).expand(3, 3, 3)
    q_BKV = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64).expand(3, 2, 3)
    a_B, next_B = verify_drafts(
        p_BTV, q_BKV, torch.tensor([[0, 1], [1, 0], [2, 2]]), torch.tensor([2, 2, 1]),
        torch.tensor([[0.9, 0.4], [0.6, 0.0], [0.3, 0.0]], dtype=torch.float64),
        torch.tensor([[0.5, 0.5, 0.85], [0.99, 0.5, 0.5], [0.5, 0.1, 0.5]], dtype=torch.float64),
    )
    assert a_B.tolist() == [2, 0, 1] and next_B.tolist() == [2, 0, 0]
    assert acceptance_probs(torch.tensor([0.3, 0.0, 0.2]), torch.tensor([0.6, 0.5, 0.0])).tolist() == [0.5, 0.0, 1.0]
    assert residual_probs(p_BTV[0, :1], q_BKV[0, :1]).tolist() == [[1.0, 0.0, 0.0]]


# --------------------------------------------------------------------------- the law of the emitted tokens


def _first_token_law(p_SV: torch.Tensor, q_SV: torch.Tensor) -> torch.Tensor:
    """P(first emitted token = y) of one round: draft x ~ q accepted with min(1, p/q), else the residual:
    q(y) min(1, p(y)/q(y)) + (1 - sum_x q(x) min(1, p(x)/q(x))) norm(max(0, p - q))(y)."""
    acc_SV = q_SV * acceptance_probs(p_SV, q_SV)
    return acc_SV + (1 - acc_SV.sum(-1, keepdim=True)) * residual_probs(p_SV, q_SV)


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)])
def test_exact_law_equals_target_one_and_two_steps(models, sp):
    """Enumerated over the whole vocabulary, with k = 2 drafts. One step: P(y1) = _first_token_law(p1, q1).
    Two steps: y2 comes either from the same round (d1 = y1 accepted, then d2 accepted or the residual at
    position 2: q1 acc1(y1) [q2 acc2(y2) + (1 - sum q2 acc2) res2(y2)]) or from the next round after a
    rejection at position 1 (R1 res1(y1) * the first-token law at context + y1, the same expression since
    the drafter is a function of its context), so P(y1, y2) = law1(y1) law2(y2 | y1); it must equal
    p1(y1) p2(y2 | y1) to the fp32 rounding of the softmaxes (a wrong rule is off by ~1e-2), and a drafter unlike the target (sum min(p, q) < 1) makes the
    check non-trivial."""
    target, close, small = models
    for drafter in (close, small):
        p1_V, q1_V = _probs(target, [PROMPT], sp)[0], _probs(drafter, [PROMPT], sp)[0]
        assert torch.minimum(p1_V, q1_V).sum() < 0.9
        law1_V = _first_token_law(p1_V, q1_V)
        assert (law1_V - p1_V).abs().max().item() < 1e-6  # p, q: fp32 softmax sums are 1 to ~1e-7
        ctx2 = [PROMPT + [y] for y in range(V)]
        p2_VV, q2_VV = _probs(target, ctx2, sp), _probs(drafter, ctx2, sp)
        acc1_V = q1_V * acceptance_probs(p1_V, q1_V)
        rej1 = 1 - acc1_V.sum()
        law2_VV = _first_token_law(p2_VV, q2_VV)
        same_round_VV = acc1_V[:, None] * law2_VV
        next_round_VV = rej1 * residual_probs(p1_V, q1_V)[:, None] * law2_VV
        joint_VV = same_round_VV + next_round_VV
        assert (joint_VV - p1_V[:, None] * p2_VV).abs().max().item() < 1e-6
        assert abs(joint_VV.sum().item() - 1) < 1e-6


def _two_token_counts(target, drafter, n: int, sp_kw: dict, seed0: int = 0) -> tuple[torch.Tensor, EmbeddedEngine]:
    """Counts [V, V] of the first two tokens of n seeded speculative runs (k = 2) from PROMPT."""
    engine = _spec_engine(target, drafter, 2, max_batch_size=256, max_model_len=16)
    reqs = [GenerationRequest(f"m{i}", PROMPT, SamplingParams(max_tokens=2, stop_ids=(), seed=seed0 + i, **sp_kw))
            for i in range(n)]
    counts_VV = torch.zeros(V, V, dtype=torch.float64)
    for r in engine.generate(reqs):
        counts_VV[r.output_ids[0], r.output_ids[1]] += 1
    return counts_VV, engine


def _chi2_pvalue(counts_C: torch.Tensor, probs_C: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities; cells expected below 5 are pooled into one.
    p-value from the Wilson-Hilferty normal approximation of the chi-square tail (accurate to ~1e-3 at these
    degrees of freedom)."""
    n = counts_C.sum()
    exp_C = probs_C * n
    big = exp_C >= 5
    obs = torch.cat([counts_C[big], counts_C[~big].sum()[None]])
    exp = torch.cat([exp_C[big], exp_C[~big].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum().item()
    dof = len(obs) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_monte_carlo_two_steps_chi_square_with_negative_control(models, monkeypatch):
    """2,000 seeds through the engine (k = 2, first two tokens, close drafter): the pairs follow
    p1(y1) p2(y2 | y1) (p-value > 1e-3). Negative control: the residual drawn from p instead of
    norm(max(0, p - q)) (the law becomes min(p, q) + (1 - sum min(p, q)) p) is rejected (p-value < 1e-6)."""
    target, close, _ = models
    sp = SamplingParams()
    p1_V = _probs(target, [PROMPT], sp)[0]
    p2_VV = _probs(target, [PROMPT + [y] for y in range(V)], sp)
    want_C = (p1_V[:, None] * p2_VV).flatten()
    counts_VV, engine = _two_token_counts(target, close, 2000, {})
    assert 0.2 < engine.stats["spec_acceptance_rate"] < 0.9  # both branches are exercised
    assert _chi2_pvalue(counts_VV.flatten(), want_C) > 1e-3
    monkeypatch.setattr(spec_mod, "residual_probs", lambda p_SV, q_SV: p_SV)
    broken_VV, _ = _two_token_counts(target, close, 2000, {})
    assert _chi2_pvalue(broken_VV.flatten(), want_C) < 1e-6


def test_acceptance_rate_equals_sum_min_p_q(models):
    """k = 1, one round per request from PROMPT: accepted / drafted estimates beta = sum_x min(p(x), q(x))
    (the probability of accepting a draft x ~ q); 1,500 seeds, tolerance 4 binomial standard errors. The
    acceptance length of a k = 1 round is 1 + the acceptance rate."""
    target, _, small = models
    sp = SamplingParams(temperature=0.8)
    beta = torch.minimum(_probs(target, [PROMPT], sp)[0], _probs(small, [PROMPT], sp)[0]).sum().item()
    n = 1500
    engine = _spec_engine(target, small, 1, max_batch_size=256, max_model_len=16)
    engine.generate([GenerationRequest(f"a{i}", PROMPT, SamplingParams(temperature=0.8, max_tokens=1, seed=i))
                     for i in range(n)])
    st = engine.stats
    assert st["spec_drafted"] == n and st["spec_target_forwards"] == math.ceil(n / 256)
    tol = 4 * math.sqrt(beta * (1 - beta) / n)
    assert abs(st["spec_acceptance_rate"] - beta) < tol, (st["spec_acceptance_rate"], beta, tol)
    assert st["spec_acceptance_length"] == pytest.approx(1 + st["spec_acceptance_rate"])


# --------------------------------------------------------------------------- engine behaviour


def _requests(n: int, *, temperature: float = 1.0, max_tokens: int = 14, **kw) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(f"r{i}", torch.randint(5, V, (3 + 2 * i,), generator=g).tolist(),
                              SamplingParams(temperature=temperature, max_tokens=max_tokens + 3 * i, stop_ids=(),
                                             seed=100 + i, **kw)) for i in range(n)]


@pytest.mark.parametrize("path", ["lean", "general"])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(models, path):
    target, close, small = models
    reqs = _requests(5, temperature=0.0)
    plain = EmbeddedEngine(target, max_batch_size=3, stop_ids=(), path=path).generate(reqs)
    for drafter in (close, small):
        engine = _spec_engine(target, drafter, 3, max_batch_size=3, path=path)
        got = engine.generate(reqs)
        for a, b in zip(plain, got):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5
        assert (drafter is close) <= engine.stats["spec_accepted"] < engine.stats["spec_drafted"]  # rejections seen
        if drafter is close:  # and acceptances: the noisy copy agrees with the target's argmax often
            assert engine.stats["spec_acceptance_length"] > 1.2


def _drive(engine: EmbeddedEngine, reqs: list[GenerationRequest], n_steps: int = 10 ** 6) -> dict:
    done = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(n_steps):
        if not engine.has_unfinished():
            break
        done.update({x.request_id: x for x in engine.step()})
    return done


@pytest.mark.parametrize("path", ["lean", "general"])
def test_batching_stops_max_tokens_pause_resume_same_tokens(models, path):
    """Ragged prompts at temperature 1 with k = 4: each request alone, all in one batch, and in two slots
    with a pause mid-generation (resumed in place, exported and re-imported, re-submitted without KV) give
    the same tokens; a stop id and max_tokens that fall inside an accepted run cut it there."""
    target, close, _ = models
    reqs = _requests(4, top_k=30)
    alone = {r.request_id: _spec_engine(target, close, 4, max_batch_size=1, path=path).generate([r])[0] for r in reqs}
    engine = _spec_engine(target, close, 4, max_batch_size=4, path=path)
    batch = {r.request_id: r for r in engine.generate(reqs)}
    assert engine.stats["spec_acceptance_length"] > 1.5
    for rid, r in alone.items():
        assert batch[rid].output_ids == r.output_ids
        assert max(abs(x - y) for x, y in zip(batch[rid].output_logprobs, r.output_logprobs)) < 1e-5
    # a stop id / max_tokens inside an accepted run: the last round emitted more than was kept
    ref, sp = batch["r3"], reqs[3].sampling
    for cut in range(3, 9):
        stop_tok = ref.output_ids[cut]
        first = ref.output_ids.index(stop_tok)
        e_stop, e_len = _spec_engine(target, close, 4, path=path), _spec_engine(target, close, 4, path=path)
        stopped = e_stop.generate([GenerationRequest("r3", reqs[3].prompt_ids, SamplingParams(
            top_k=30, max_tokens=sp.max_tokens, stop_ids=(stop_tok,), seed=sp.seed))])[0]
        assert stopped.finish_reason == "stop" and stopped.output_ids == ref.output_ids[: first + 1]
        short = e_len.generate([GenerationRequest("r3", reqs[3].prompt_ids, SamplingParams(
            top_k=30, max_tokens=cut, stop_ids=(), seed=sp.seed))])[0]
        assert short.finish_reason == "length" and short.output_ids == ref.output_ids[:cut]
        if e_stop.stats["spec_emitted"] > first + 1 and e_len.stats["spec_emitted"] > cut:
            break
    else:
        raise AssertionError("no cut fell inside an accepted run")
    for mode in ("resume", "export_kv", "reprefill"):
        engine = _spec_engine(target, close, 4, max_batch_size=2, path=path)
        done = _drive(engine, reqs, 3)
        assert "r1" not in done and engine.num_running == 2
        (partial,) = engine.pause(["r1"])
        assert 0 < partial.num_tokens < len(batch["r1"].output_ids)
        done.update(_drive(engine, [], 2))
        if mode == "resume":
            engine.resume(["r1"])
        else:
            kv = engine.export_kv("r1")
            engine.add_request(GenerationRequest.continuation(partial, reqs[1].sampling),
                               kv=kv if mode == "export_kv" else None)
        done.update(_drive(engine, []))
        for rid, r in batch.items():
            assert done[rid].output_ids == r.output_ids, (mode, rid)
        assert done["r1"].output_logprobs[: partial.num_tokens] == partial.output_logprobs


def test_speculative_config_validation(models):
    target, close, _ = models
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig(model_drafter(close), 0)
    with pytest.raises(ValueError, match="Drafter"):
        SpeculativeConfig(object(), 2)
    big = build_tiny_moe(2 * V, seed=0, hidden_size=64, num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft vocabulary"):
        EmbeddedEngine(target, speculative=SpeculativeConfig(model_drafter(big), 2))
    # engines are built by the factory only: a ModelDrafter made without its forward builder says where to get one
    with pytest.raises(ValueError, match=r"factory.model_drafter\(model\)"):
        EmbeddedEngine(target, speculative=SpeculativeConfig(ModelDrafter(close), 2))


class _AuxRecorder(ModelDrafter):
    """A ModelDrafter that asks for the target's hidden states after layers (0, 1) and records them."""

    aux_layers = (0, 1)

    def __init__(self, model) -> None:
        super().__init__(model, build_forward=draft_forward)
        self.seen: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, rows, k):  # type: ignore[no-untyped-def]
        for r in rows:
            if r.aux_hidden is not None:
                self.seen.setdefault(r.key, []).append((r.aux_start, r.aux_hidden.clone()))
        return super().propose(rows, k)


@pytest.mark.parametrize("path", ["lean", "general"])
def test_drafter_receives_target_hidden_states_of_aux_layers(models, path):
    """A drafter with aux_layers gets, over the rounds, the target's hidden states after those layers for
    every context position in order (positions 0 .. n-1 contiguous), equal to the outputs of the target's
    decoder layers in one plain HF forward over the final context (forward hooks; fp32 rounding 1e-4)."""
    target, close, _ = models
    rec = _AuxRecorder(close)
    engine = EmbeddedEngine(target, speculative=SpeculativeConfig(rec, 3), stop_ids=(), max_batch_size=3, path=path)
    results = engine.generate(_requests(3))
    for res in results:
        chunks = rec.seen[res.request_id]
        assert [st for st, _ in chunks] == [sum(len(h) for _, h in chunks[:i]) for i in range(len(chunks))]
        got_NAD = torch.cat([h for _, h in chunks])
        ids = res.prompt_ids + res.output_ids
        grabbed = {}
        hooks = [target.model.layers[i].register_forward_hook(
            lambda _m, _i, out, i=i: grabbed.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in (0, 1)]
        with torch.no_grad():
            target(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        want_NAD = torch.stack([grabbed[0][0], grabbed[1][0]], dim=1)[: len(got_NAD)]
        assert len(got_NAD) >= len(ids) - 4  # every position but those of the last round
        assert (got_NAD - want_NAD).abs().max().item() < 1e-4


def test_row_sampling_probs_equals_sampling_probs_bit_for_bit():
    """``row_sampling_probs`` (its shortcut when every row samples unfiltered, and the general path for a mixed
    batch) gives ``sampling_probs``' float64 distributions exactly, row by row and position by position."""
    g = torch.Generator().manual_seed(0)
    logits_BSV = torch.randn(3, 4, 50, generator=g) * 3
    for sps in ([SamplingParams(temperature=1.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3,
                                                                                                 top_k=50)],
                [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(top_p=0.8)]):
        got_BSV = spec_mod.row_sampling_probs(logits_BSV, sps)
        for b, sp in enumerate(sps):
            want_SV = sampling_probs(logits_BSV[b], torch.full((4,), sp.temperature), torch.full((4,), sp.top_k),
                                     torch.full((4,), sp.top_p))
            assert got_BSV.dtype == torch.float64 and torch.equal(got_BSV[b], want_SV)


@pytest.mark.parametrize("aux", [(), (0, 1)])
def test_lean_verify_forward_equals_the_chunk_forward(models, aux):
    """The lean path's decode-shaped verify forward (one indexed K/V write per layer, attention over the slot
    views) gives the chunk forward's logits at every verified position, the same hidden states after the aux
    layers and the same cache entries, for rows at different positions and ragged chunks (a row shorter than
    the rest is padded; its padded logits are not compared)."""
    target = models[0]
    engine = EmbeddedEngine(target, max_batch_size=3, stop_ids=(), path="lean")
    engine._lean.capture_layers = aux
    for i, n in enumerate((4, 9, 6)):
        engine.add_request(GenerationRequest(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=50, seed=i)))
    for _ in range(3):
        engine.step()
    seqs = engine._running
    chunks = [[s.context[-1], 11, 40, 2] for s in seqs[:2]] + [[seqs[2].context[-1], 7]]
    starts = [s.n_cached for s in seqs]
    with torch.inference_mode():
        want_BTV = engine._forward_chunks(chunks, starts, [s.slot for s in seqs], all_positions=True)
        want_aux = engine._lean.captured
        want_kv = [t[:, :, : max(starts) + 4].clone() for t in engine.cache.keys + engine.cache.values]
        got_BTV = engine._lean.verify(chunks, starts)
        got_aux = engine._lean.captured
    for b, c in enumerate(chunks):
        assert (got_BTV[b, : len(c)] - want_BTV[b, : len(c)]).abs().max().item() < 1e-5
        if aux:
            assert (got_aux[b, : len(c)] - want_aux[b, : len(c)]).abs().max().item() < 1e-5
        for t_want, t_got in zip(want_kv, engine.cache.keys + engine.cache.values):
            lo, hi = starts[b], starts[b] + len(c)
            assert (t_got[b, :, lo:hi] - t_want[b, :, lo:hi]).abs().max().item() < 1e-5
    assert got_BTV.shape[1] == 4 and (got_aux is None) == (not aux)
