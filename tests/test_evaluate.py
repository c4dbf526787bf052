"""Tests of k3post.recipes.evaluate: completions through the rollout engine (token-for-token parity with
HF ``generate`` greedy, with and without QAT; seeded sampling checked against an inverse CDF of
HF's logits by hand), the engine argument (reuse, wrong model, busy engine, left idle after an
error), ``evaluate_family`` bookkeeping and the think-token count.

Shape legend: T positions, V vocabulary.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from k3post.envs.families.registry import get_family
from k3post.recipes.evaluate import EvalConfig, complete, count_think_tokens, evaluate_family, greedy_complete
from k3post.models import build_tiny_moe
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams
from k3post.rollout.engine import request_seed, token_uniform
from k3post.xtml import EOM, XTML

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 16


def _model(tok, seed: int, qat: bool):
    model = build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    if qat:
        apply_qat(model, QATConfig())
    return model.eval()


def _prompts(vocab: int) -> list[list[int]]:
    """8 prompts of lengths 3..38 (ids >= 5: no XTML specials)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 7, 12, 5, 20, 38, 9, 26)]


def _hf_greedy(model, prompt: list[int], stop_id: int) -> list[int]:
    """Reference: HF ``generate`` greedy on one unpadded prompt; the new tokens, cut after the first stop."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=MAX_NEW,
            do_sample=False, eos_token_id=stop_id, pad_token_id=stop_id,
        )
    return _cut(out[0, len(prompt):].tolist(), stop_id)


def _cut(row: list[int], stop_id: int) -> list[int]:
    return row[: row.index(stop_id) + 1] if stop_id in row else row


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "qat"])
def parity_case(request, xtml_tokenizer):
    """(model, prompts, stop id, HF reference completions). HF greedy runs once per prompt with
    its usual stop (EOM, which this untrained model never emits within MAX_NEW tokens); the stop
    id is then the token emitted most often after the 4th new token, so some completions stop
    early and others run to MAX_NEW. Greedy decoding is deterministic, so ``generate`` stopping
    on that id gives these rows cut after their first stop (checked literally on one of them)."""
    tok = xtml_tokenizer
    model = _model(tok, seed=3, qat=request.param)
    prompts = _prompts(len(tok))
    eom = tok.convert_tokens_to_ids(EOM)
    free = [_hf_greedy(model, p, eom) for p in prompts]
    assert all(len(r) == MAX_NEW and eom not in r for r in free)
    stop = Counter(t for row in free for t in row[4:]).most_common(1)[0][0]
    ref = [_cut(r, stop) for r in free]
    i = next(i for i, r in enumerate(ref) if len(r) < MAX_NEW)
    assert _hf_greedy(model, prompts[i], stop) == ref[i]
    return model, prompts, stop, ref


def test_greedy_matches_hf_generate_token_for_token(parity_case):
    model, prompts, stop, ref = parity_case
    n_stopped = sum(r[-1:] == [stop] and len(r) < MAX_NEW for r in ref)
    assert n_stopped >= 2 and any(len(r) == MAX_NEW and stop not in r for r in ref)  # both ends are exercised
    # 3 slots for 8 prompts: finished rows are refilled from the queue (continuous batching)
    got = greedy_complete(model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, pad_id=0, batch_size=3)
    assert got == ref
    assert complete(model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, batch_size=8) == ref
    assert all(r.count(stop) <= 1 for r in got)


def test_sampled_completions_follow_the_seeded_inverse_cdf(xtml_tokenizer):
    tok = xtml_tokenizer
    model = _model(tok, seed=3, qat=False)
    prompts = _prompts(len(tok))
    stop = tok.convert_tokens_to_ids(EOM)
    kw = dict(max_new_tokens=6, stop_id=stop, temperature=0.7, seed=11)
    a = complete(model, prompts, batch_size=8, **kw)
    assert complete(model, prompts, batch_size=1, **kw) == a  # independent of batching
    assert complete(model, prompts, batch_size=8, **{**kw, "seed": 12}) != a
    # first token of prompt i, by hand: p = softmax(logits / 0.7) of HF's forward at the prompt's
    # last position; c = cumsum(p) in vocabulary order; token = first v with c_v > u * c_V,
    # u = token_uniform(request_seed(11, str(i)), 0) (the documented per-prompt seed, output position 0)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            logits_V = model(torch.tensor([p])).logits[0, -1].double()
        c_V = torch.cumsum(torch.softmax(logits_V / 0.7, -1), -1)
        u = token_uniform(request_seed(11, str(i)), 0)
        assert a[i][0] == int((c_V > u * c_V[-1]).nonzero()[0])


def test_engine_argument(xtml_tokenizer):
    tok = xtml_tokenizer
    model = _model(tok, seed=3, qat=False)
    prompts = [_prompts(len(tok))[k] for k in (0, 1, 2, 5)]
    stop = tok.convert_tokens_to_ids(EOM)
    engine = EmbeddedEngine(model, tok, max_batch_size=2, max_model_len=32)
    want = complete(model, prompts[:3], max_new_tokens=4, stop_id=stop)
    assert complete(model, prompts[:3], max_new_tokens=4, stop_id=stop, engine=engine) == want
    other = _model(tok, seed=4, qat=False)
    with pytest.raises(ValueError, match="different model"):
        complete(other, prompts, max_new_tokens=4, stop_id=stop, engine=engine)
    # prompts[3] has 38 tokens > max_model_len 32: the call fails, and the engine is left idle
    with pytest.raises(ValueError, match="max_model_len"):
        complete(model, prompts, max_new_tokens=4, stop_id=stop, engine=engine)
    assert not engine.has_unfinished() and engine.num_paused == 0
    engine.add_request(GenerationRequest("busy", prompts[0], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="idle engine"):
        complete(model, prompts[:1], max_new_tokens=4, stop_id=stop, engine=engine)
    with pytest.raises(ValueError, match="batch_size"):
        complete(model, prompts, max_new_tokens=4, stop_id=stop, batch_size=0)


def test_evaluate_family_bookkeeping(xtml_tokenizer):
    tok = xtml_tokenizer
    x = XTML(tok)
    model = _model(tok, seed=3, qat=False).train()
    fam = get_family("general.arithmetic")
    tasks = fam.generate(3, seed=0)
    cfg = EvalConfig(max_new_tokens=8, n_examples=2)
    res = evaluate_family(model, x, fam, tasks, effort="low", cfg=cfg)
    assert model.training  # the train/eval mode is restored
    prompts = [x.render(list(t.messages), effort="low", add_generation_prompt=True).ids for t in tasks]
    comps = complete(model, prompts, max_new_tokens=8, stop_id=x.eom_id)
    assert res["n"] == 3 and res["family"] == fam.name and res["effort"] == "low" and res["temperature"] == 0.0
    assert res["mean_output_tokens"] == sum(map(len, comps)) / 3
    assert res["malformed"] == 3 and res["pass_rate"] == 0.0  # an untrained model writes no valid XTML in 8 tokens
    assert [e["task"] for e in res["examples"]] == [t.id for t in tasks[:2]]
    engine = EmbeddedEngine(model, tok, max_batch_size=2)
    assert evaluate_family(model, x, fam, tasks, effort="low", cfg=cfg, engine=engine) == res
    sampled = evaluate_family(model, x, fam, tasks, effort="low", cfg=EvalConfig(max_new_tokens=8, temperature=1.0, seed=5))
    assert sampled["temperature"] == 1.0 and sampled["n"] == 3


def test_count_think_tokens(xtml_tokenizer):
    x = XTML(xtml_tokenizer)
    # the completion starts inside the think channel: the tokens before the first <|close|> are thinking
    a, b = 40, 41
    assert count_think_tokens(x, [a, b, a, x.close_id, b, x.eom_id]) == 3
    assert count_think_tokens(x, [x.close_id, a]) == 0
    assert count_think_tokens(x, [a, b]) == 2  # never closed: all of it
