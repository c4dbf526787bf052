"""Every supported decoder family through the embedded engine: which path it takes (lean / general),
behaviour log-prob parity with a teacher-forced HF forward (fp32, <= 1e-5), with and without MX QAT,
the same tokens on both paths, pause / export_kv / import_kv round trips on the general path, and the
router rule the lean dense MoE reads off the router (the Mixtral regression).

Shape legend: T sequence length, V vocabulary, N tokens, D hidden size, X experts, K experts per token.
"""

from __future__ import annotations

import copy

import pytest
import torch

from k3post.models import FAMILIES, build_tiny_family
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, GenerationRequest, GenerationResult, SamplingParams
from k3post.rollout.embedded.forward import topk_router_rule
from k3post.xtml import EOM
from test_engine import _hf_logprobs

TOL = 1e-5
LEAN = {"llama", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"}
MOE = ["qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]
#: routed-expert weights apply_qat must find (per MoE layer), by family
QAT_NAMES = {
    "qwen2_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "mixtral": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "deepseek_v3": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(xtml_tokenizer):
    """family -> a fresh tiny fp32 model with the tokenizer's vocabulary (eval mode)."""
    tok = xtml_tokenizer
    return {f: build_tiny_family(f, len(tok), seed=0, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.convert_tokens_to_ids(EOM)).eval() for f in FAMILIES}


def _requests(vocab: int) -> list[GenerationRequest]:
    """Three requests of ragged lengths (continuous batching), longer than gpt-oss's window of 8."""
    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(f"r{i}", torch.randint(5, vocab, (n,), generator=g).tolist(),
                              SamplingParams(max_tokens=m, stop_ids=(), seed=10 + i))
            for i, (n, m) in enumerate([(12, 10), (5, 14), (9, 7)])]


def _max_diff(model: torch.nn.Module, results: list[GenerationResult]) -> float:
    return max((torch.tensor(r.output_logprobs) - _hf_logprobs(model, r)).abs().max().item() for r in results)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_logprob_parity_per_family(models, family):
    model = models[family]
    engine = EmbeddedEngine(model, max_batch_size=3, max_model_len=64)
    assert engine.path == ("lean" if family in LEAN else "general")
    res = engine.generate(_requests(model.config.vocab_size))
    assert [len(r.output_ids) for r in res] == [10, 14, 7]
    assert _max_diff(model, res) <= TOL
    if family in LEAN:  # the general path on the same model: same tokens, same parity
        general = EmbeddedEngine(model, max_batch_size=3, max_model_len=64, path="general")
        assert general.path == "general"
        res_g = general.generate(_requests(model.config.vocab_size))
        assert [r.output_ids for r in res_g] == [r.output_ids for r in res]
        assert _max_diff(model, res_g) <= TOL
    else:
        with pytest.raises(ValueError, match="path='lean'"):
            EmbeddedEngine(model, max_model_len=64, path="lean")


@pytest.mark.parametrize("family", MOE)
def test_engine_logprob_parity_under_qat(models, family):
    model = copy.deepcopy(models[family])
    names = apply_qat(model, QATConfig())
    n_moe = sum(1 for n in names if n.endswith("down_proj"))
    assert n_moe == {"deepseek_v3": 2, "gpt_oss": 3}.get(family, 2)
    assert all(any(n.endswith(s) for s in QAT_NAMES[family]) for n in names)
    engine = EmbeddedEngine(model, max_batch_size=3, max_model_len=64)
    assert engine.qat_enabled
    res = engine.generate(_requests(model.config.vocab_size))
    assert _max_diff(model, res) <= TOL  # the HF forward runs the same QAT experts
    plain = EmbeddedEngine(models[family], max_batch_size=3, max_model_len=64).generate(_requests(model.config.vocab_size))
    assert _max_diff(models[family], plain) <= TOL
    # QAT changes the numbers (the experts really are fake-quantized)
    assert any(a.output_logprobs != b.output_logprobs for a, b in zip(res, plain))


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_general_path_pause_export_import_round_trip(models, family):
    model = models[family]
    reqs = _requests(model.config.vocab_size)
    ref = EmbeddedEngine(model, max_batch_size=3, max_model_len=64).generate(reqs)
    engine = EmbeddedEngine(model, max_batch_size=3, max_model_len=64)
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    partial = {p.request_id: p for p in engine.pause(["r0", "r1"])}
    states = {rid: engine.export_kv(rid) for rid in partial}
    assert states["r1"].num_tokens == len(reqs[1].prompt_ids) + len(partial["r1"].output_ids) - 1
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    for rid, p in partial.items():  # re-submit with the exported KV: only the tail is prefilled
        engine.add_request(GenerationRequest.continuation(p, reqs[int(rid[1])].sampling), kv=states[rid])
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    for r in ref:
        assert done[r.request_id].output_ids == r.output_ids
        assert torch.allclose(torch.tensor(done[r.request_id].output_logprobs), torch.tensor(r.output_logprobs), atol=1e-6)
    assert engine.stats["kv_reused_tokens"] == sum(s.num_tokens for s in states.values())
    # pause -> resume inside the engine gives the same continuation too
    engine2 = EmbeddedEngine(model, max_batch_size=3, max_model_len=64)
    for r in reqs:
        engine2.add_request(r)
    engine2.step()
    engine2.step()
    engine2.pause(["r2"])
    engine2.resume(["r2"])
    out = {}
    while engine2.has_unfinished():
        out.update({r.request_id: r.output_ids for r in engine2.step()})
    assert out == {r.request_id: r.output_ids for r in ref}


def test_general_path_rejects_a_kv_state_of_another_shape(models):
    gpt, ds = models["gpt_oss"], models["deepseek_v3"]
    reqs = _requests(gpt.config.vocab_size)
    eng = EmbeddedEngine(ds, max_batch_size=1, max_model_len=64)
    eng.add_request(reqs[0])
    eng.step()
    (p,) = eng.pause(["r0"])
    kv = eng.export_kv("r0")
    assert kv.keys[0].shape[::2] == (1, 32) and kv.values[0].shape[::2] == (1, 8)  # MLA latent, rotary key
    other = EmbeddedEngine(gpt, max_batch_size=1, max_model_len=64)
    with pytest.raises(ValueError, match="does not fit"):
        other.add_request(GenerationRequest.continuation(p, reqs[0].sampling), kv=kv)


def test_router_rule_is_read_off_the_router(models):
    """The Mixtral regression: its router always renormalises the top-k softmax and has no
    ``norm_topk_prob``; the engine once read that missing flag as False and decoded with unnormalised
    routing weights (log-probs off by ~1e-2). The rule now comes from the router's own output."""
    for family, want in (("mixtral", True), ("qwen3_moe", True), ("qwen2_moe", False), ("deepseek_v3", None)):
        mlp = models[family].model.layers[-1].mlp
        X, D = mlp.experts.gate_up_proj.shape[0], models[family].config.hidden_size
        assert topk_router_rule(mlp.gate, X, D) is want, family
    gpt = models["gpt_oss"].model.layers[0].mlp.router  # biased router: the engine would call the module
    assert topk_router_rule(gpt, gpt.weight.shape[0], gpt.weight.shape[1]) is None


def test_general_path_shares_prefixes_and_keeps_kv_like_the_lean_path(models):
    """Prefix sharing (identical contexts and a common header), a kept KV for the next turn, and a weight
    update run through the same scheduler on both paths: the same tokens and log-probs to 1e-6."""
    model = models["qwen3_moe"]
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    header = torch.randint(5, V, (20,), generator=g).tolist()
    tails = [torch.randint(5, V, (n,), generator=g).tolist() for n in (3, 6)]
    reqs = [GenerationRequest(f"s{i}", header + tails[i % 2], SamplingParams(max_tokens=6, stop_ids=(), seed=i))
            for i in range(4)]
    out = {}
    for path in ("lean", "general"):
        engine = EmbeddedEngine(model, max_batch_size=4, max_model_len=64, path=path)
        res = engine.generate(reqs)
        assert engine.stats["shared_prefills"] == 2 and engine.stats["shared_prefix_tokens"] == 20
        first = res[0]
        stop = first.output_ids[2]
        turn1 = GenerationRequest("t1", first.prompt_ids, SamplingParams(max_tokens=6, stop_ids=(stop,), seed=0),
                                  keep_kv=True)
        (r1,) = engine.generate([turn1])
        assert r1.finish_reason == "stop"
        kv = engine.take_kv("t1")
        assert kv is not None and kv.num_tokens == len(r1.prompt_ids) + len(r1.output_ids) - 1
        turn2 = GenerationRequest("t2", r1.prompt_ids + r1.output_ids + tails[1], SamplingParams(max_tokens=5, seed=9))
        engine.add_request(turn2, kv=kv)
        while engine.has_unfinished():
            done = engine.step()
        assert engine.update_weights({}) == 1
        out[path] = res + [r1] + done
    for a, b in zip(out["lean"], out["general"]):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-6)


def test_engine_forward_is_a_config_key(models):
    """``engine.forward`` in a stage's config reaches the embedded engine (build_engine); a bad value fails
    when the config is made, and ``lean`` on a model the lean forward cannot reproduce fails naming it."""
    from k3post.config.rollout import EngineConfig
    from k3post.rollout.factory import build_engine

    for forward, want in (("auto", "lean"), ("general", "general"), ("lean", "lean")):
        engine = build_engine(models["qwen3_moe"], engine=EngineConfig(forward=forward), max_batch_size=2, max_model_len=64)
        assert engine.path == want
    assert build_engine(models["gpt_oss"], engine=EngineConfig(), max_batch_size=2, max_model_len=64).path == "general"
    with pytest.raises(ValueError, match="path='lean'"):
        build_engine(models["gpt_oss"], engine=EngineConfig(forward="lean"), max_model_len=64)
    with pytest.raises(ValueError, match="engine.forward must be one of"):
        EngineConfig(forward="fast")
