"""The EAGLE-3 draft (k3post.spec.eagle3) and its vLLM / SGLang export (k3post.spec.export)."""

import json

import pytest
import torch
from safetensors import safe_open

from k3post.models import build_tiny_family, build_tiny_moe
from k3post.spec.eagle3 import (
    DraftVocab, Eagle3Draft, engine_capturable, from_sglang_ids, from_vllm_ids, sglang_ids, step_weights,
    target_features, unrolled_logits, vllm_ids,
)
from k3post.spec.export import export_eagle3, load_eagle3
from k3post.spec.mtp import MTPHead

V = 96


def _perturb(module, scale=0.02, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


@pytest.fixture(scope="module")
def target():
    return build_tiny_moe(V, "tiny", seed=0)  # 4 layers


def _trained_like_mtp(target):
    head = MTPHead.from_target(target)
    _perturb(head)  # not the init: every weight matters
    return head


def test_step0_equals_the_mtp_head_exactly(target):
    head = _trained_like_mtp(target)
    L = target.config.num_hidden_layers
    draft = Eagle3Draft.from_target(target, (1, 2, L), mtp=head)
    ids_BT = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(0))
    pos_BT = torch.arange(13).expand(2, 13)
    fused_BT3D, final_BTD = target_features(target, ids_BT, draft.config.aux_layer_ids)
    assert torch.equal(draft.fc(fused_BT3D), final_BTD)  # fc starts as [0 0 I]
    next_BT = torch.cat([ids_BT[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)  # x_{t+1}; the unroll's pad past the end
    want = head.logits(target, next_BT, final_BTD, pos_BT)
    got, _ = draft(fused_BT3D, next_BT, pos_BT)
    assert torch.equal(got, want)
    assert torch.equal(unrolled_logits(draft, fused_BT3D, ids_BT, steps=2)[0], want)


def _engine_capture(target, ids_BT, layers_to_capture):
    """What vLLM / SGLang record: the residual stream entering each layer in ``layers_to_capture``."""
    seen = {}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, a, kw, i=i: seen.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(target.model.layers) if i in layers_to_capture]
    with torch.no_grad():
        target(ids_BT)
    for h in hooks:
        h.remove()
    return [seen[i] for i in sorted(seen)]


def test_layer_id_conversions_select_the_same_states(target):
    L = target.config.num_hidden_layers
    ids = (0, 2, L - 1)  # id 0 converts too (the Qwen3-MoE loops record it; Llama's cannot: tests/test_spec_export.py)
    ids_BT = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    fused, _ = target_features(target, ids_BT, ids)
    ours = list(fused.split(target.config.hidden_size, dim=-1))
    # vLLM: `if idx in aux_hidden_state_layers: record(hidden + residual)` before layer idx
    vllm = _engine_capture(target, ids_BT, set(vllm_ids(ids)))
    # SGLang: layers_to_capture = [j + 1 for j in eagle_aux_hidden_state_layer_ids], recorded before layer i
    sglang = _engine_capture(target, ids_BT, {j + 1 for j in sglang_ids(ids)})
    for a, b, c in zip(ours, vllm, sglang):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert sglang_ids(ids) == [-1, 1, L - 2] and from_sglang_ids(sglang_ids(ids)) == list(ids)
    assert from_vllm_ids(vllm_ids(ids)) == list(ids)
    # id i < L is transformers' output_hidden_states[i]
    with torch.no_grad():
        hs = target(ids_BT, output_hidden_states=True).hidden_states
    assert torch.equal(ours[1], hs[2])
    # the MTP's input (id L) is recorded by neither engine: both stop before the last layer's output
    assert engine_capturable((1, 2, L - 1), L) and not engine_capturable((1, 2, L), L) and not engine_capturable(ids, L)
    assert _engine_capture(target, ids_BT, {L}) == [] and _engine_capture(target, ids_BT, {sglang_ids([L])[0] + 1}) == []


def _brute_force(draft, fused_T3D, ids_T, pos_T, steps, pad_id=0):
    """Inference, for every prefix: prefill the draft over the prefix's sample (step 0), then draft
    steps-1 tokens one at a time (feeding the true tokens), each step appending its key to the cache."""
    block = draft.midlayer
    T = len(ids_T)
    padded = torch.cat([ids_T, torch.full((steps,), pad_id)])
    out = torch.zeros(steps, T, draft.config.draft_vocab_size, dtype=fused_T3D.dtype)
    for t in range(T):
        s0 = t - int(pos_T[t])  # the sample's first position
        h = draft.fc(fused_T3D[s0:t + 1])[None]
        q, k, v = block.qkv(draft.embed_tokens(padded[s0 + 1:t + 2])[None], h, pos_T[s0:t + 1][None])
        causal = torch.ones(t + 1 - s0, t + 1 - s0, dtype=torch.bool).tril()[None, None]
        g = block.finish(h, block.attend(q, k, v, causal))[:, -1:]
        out[0, t] = draft.logits(g)[0, 0]
        for i in range(1, steps):
            q, k1, v1 = block.qkv(draft.embed_tokens(padded[t + 1 + i].view(1, 1)), g, (pos_T[t] + i).view(1, 1))
            k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
            g = block.finish(g, block.attend(q, k, v, torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)))
            out[i, t] = draft.logits(g)[0, 0]
    return out


def test_attend_unrolled_equals_one_masked_softmax_over_concatenated_keys(target):
    """The unroll's attention at step N (step-0 keys + the N diagonal keys, `MidLayer.attend_unrolled`) equals
    `attend` over the concatenated keys [k0, k1, …, kN] with the step-0 mask and N diagonal masks, in value and
    in every input's gradient (float64, GQA 4 query heads over 2 key heads, a packed row: two samples)."""
    block = Eagle3Draft.from_target(target, (1, 2, 4)).midlayer.double()
    H, K, d = block.n_heads, block.n_kv, block.head_dim
    assert H > K  # grouped-query attention is exercised
    B, T, N = 2, 9, 3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, T, d, generator=g, dtype=torch.float64, requires_grad=True)
    k0, v0 = (torch.randn(B, K, T, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kd, vd = (torch.randn(B, K, T, N, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    seg = torch.tensor([0] * 4 + [1] * 5)
    allowed0 = (torch.ones(T, T, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])).expand(B, 1, T, T)
    got = block.attend_unrolled(q, k0, v0, allowed0, kd, vd)
    diag = torch.eye(T, dtype=torch.bool).expand(B, 1, T, T)
    want = block.attend(q, torch.cat([k0, *kd.unbind(3)], 2), torch.cat([v0, *vd.unbind(3)], 2),
                        torch.cat([allowed0] + [diag] * N, -1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads_got = torch.autograd.grad((got * w).sum(), (q, k0, v0, kd, vd))
    grads_want = torch.autograd.grad((want * w).sum(), (q, k0, v0, kd, vd))
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert grads_got[3].abs().sum() > 0  # the diagonal keys are attended to


@pytest.mark.parametrize("packed", [False, True], ids=["one-sample", "packed"])
def test_unrolled_steps_equal_autoregressive_drafting(packed):
    target = build_tiny_moe(V, "tiny", seed=0)  # its own: the draft shares (and here casts) its embedding
    draft = Eagle3Draft.from_target(target, (0, 2, 4), mtp=_trained_like_mtp(target))
    _perturb(draft.fc, scale=0.05, seed=3)
    T, steps = 12, 7
    ids_BT = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(4))
    pos_T = torch.cat([torch.arange(5), torch.arange(T - 5)]) if packed else torch.arange(T)
    pos_BT = pos_T.expand(2, T)
    fused, _ = target_features(target, ids_BT, draft.config.aux_layer_ids, position_ids_BT=pos_BT)
    draft, fused = draft.double(), fused.double()  # float64: the two computations agree to ~1e-15
    with torch.no_grad():
        got = unrolled_logits(draft, fused, ids_BT, steps=steps, position_ids_BT=pos_BT)
        for b in range(2):
            want = _brute_force(draft, fused[b], ids_BT[b], pos_T, steps)
            torch.testing.assert_close(got[:, b], want, rtol=0, atol=1e-10)
    assert got.shape == (steps, 2, T, V)
    assert not torch.allclose(got[1], got[0])  # later steps are different predictions


def test_step_weights_golden():
    assert step_weights(4).tolist() == pytest.approx([1.0, 0.8, 0.64, 0.512])


def test_draft_vocab_from_token_frequencies():
    # counts over ids 0..5: id 3 ×3, id 1 ×2, id 5 ×1 → top-2 = {3, 1}, stored ascending [1, 3]
    vocab = DraftVocab.from_token_ids([[3, 3, 1], [1, 3, 5]], vocab_size=6, size=2)
    assert vocab.target_ids.tolist() == [1, 3]
    assert vocab.d2t.tolist() == [1, 2]  # d2t[j] = target_id - j
    assert vocab.t2d.tolist() == [False, True, False, True, False, False]
    # ties go to the smaller id
    assert DraftVocab.from_counts(torch.tensor([0, 2, 2, 1]), 1).target_ids.tolist() == [1]
    with pytest.raises(ValueError):
        DraftVocab.from_counts(torch.tensor([1, 2]), 3)


def test_reduced_vocab_head_is_the_target_rows(target):
    vocab = DraftVocab.from_token_ids([list(range(0, V, 3)) * 2, [5, 7]], V, size=20)
    head = _trained_like_mtp(target)
    full = Eagle3Draft.from_target(target, (0, 2, 4), mtp=head)
    small = Eagle3Draft.from_target(target, (0, 2, 4), mtp=head, draft_vocab=vocab)
    assert torch.equal(small.lm_head.weight, target.lm_head.weight[vocab.target_ids])
    ids_BT = torch.randint(0, V, (1, 8))
    fused, _ = target_features(target, ids_BT, (0, 2, 4))
    pos = torch.arange(8)[None]
    torch.testing.assert_close(small(fused, ids_BT, pos)[0], full(fused, ids_BT, pos)[0][..., vocab.target_ids])


def test_from_a_dense_target_layer_without_mtp():
    llama = build_tiny_family("llama", 64)
    draft = Eagle3Draft.from_target(llama, (0, 1, 2))
    last = llama.model.layers[-1]
    D = llama.config.hidden_size
    q = draft.midlayer.self_attn.q_proj.weight
    assert torch.equal(q[:, D:], last.self_attn.q_proj.weight) and not q[:, :D].any()
    assert torch.equal(draft.midlayer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert not draft.embed_tokens.weight.requires_grad and draft.embed_tokens is llama.get_input_embeddings()


def test_export_layout_and_reload(target, tmp_path):
    vocab = DraftVocab.from_token_ids([[1, 2, 2, 9, 40, 40, 40, 77]], V, size=5)
    L = target.config.num_hidden_layers
    draft = Eagle3Draft.from_target(target, (1, 2, L), mtp=_trained_like_mtp(target), draft_vocab=vocab)
    _perturb(draft.fc, seed=5)
    export_eagle3(draft, tmp_path, nonstock=True)  # id L: for an engine that records it (tests/test_spec_export.py)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"]) == (V, 5, 128)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, L]  # vLLM: the state entering a layer
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, L - 1]  # SGLang: leaving a layer
    D, H, K, hd, F = 128, 4, 2, 32, target.config.intermediate_size
    want = {
        "fc.weight": (D, 3 * D), "norm.weight": (D,), "lm_head.weight": (5, D), "d2t": (5,), "t2d": (V,),
        "midlayer.input_layernorm.weight": (D,), "midlayer.hidden_norm.weight": (D,),
        "midlayer.post_attention_layernorm.weight": (D,),
        "midlayer.self_attn.q_proj.weight": (H * hd, 2 * D), "midlayer.self_attn.k_proj.weight": (K * hd, 2 * D),
        "midlayer.self_attn.v_proj.weight": (K * hd, 2 * D), "midlayer.self_attn.o_proj.weight": (D, H * hd),
        "midlayer.mlp.gate_proj.weight": (F, D), "midlayer.mlp.up_proj.weight": (F, D),
        "midlayer.mlp.down_proj.weight": (D, F),
    }
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in got.items()} == want
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool
    assert (got["d2t"] + torch.arange(5)).tolist() == [1, 2, 9, 40, 77]  # ascending target ids
    assert got["t2d"].nonzero().flatten().tolist() == [1, 2, 9, 40, 77]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path)  # what vLLM and SGLang read the folder's config with
    assert (hf.model_type, hf.draft_vocab_size, hf.head_dim, hf.rope_parameters["rope_theta"]) == ("llama", 5, hd, 10000.0)
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [0, 1, L - 1]
    back = load_eagle3(tmp_path, target.get_input_embeddings())
    assert back.config.aux_layer_ids == draft.config.aux_layer_ids
    ids_BT = torch.randint(0, V, (2, 10))
    fused, _ = target_features(target, ids_BT, (1, 2, L))
    with torch.no_grad():
        assert torch.equal(unrolled_logits(back, fused, ids_BT, 3), unrolled_logits(draft, fused, ids_BT, 3))
