"""The EAGLE-3 export against stock vLLM and SGLang (issue 30 §3): what each loader does with the folder
(parameter names, shapes, dtypes, d2t / t2d, config keys) and which target states each hands the draft, written
down from their source as checker functions, and run on k3post's default export and on layouts that fail.

Sources (read at these commits; the rules each checker follows are quoted in its docstring):

- vLLM ``vllm/model_executor/models/llama_eagle3.py`` @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190:
  ``Eagle3LlamaForCausalLM.load_weights`` (t2d skipped; d2t → ``draft_id_to_target_id``, a long [draft_vocab_size]
  parameter; every name but lm_head gets ``model.``; ``embed_tokens`` skipped when absent) and
  ``LlamaModel.load_weights`` (``midlayer.`` → ``layers.0.``; q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``);
  ``fc`` = Linear(3 · ``target_hidden_size`` (else hidden_size) → hidden_size); layer 0's qkv input is 2 · hidden.
- vLLM ``vllm/model_executor/models/llama.py`` @ e06c9ba2a6ea923a84add30f5dafaea126429b81: ``LlamaModel.forward``
  appends ``hidden_states + residual`` before layer ``idx`` when ``idx in self.aux_hidden_state_layers``
  (residual is None before layer 0); default ``(2, num_layers // 2, num_layers - 3)``.
- vLLM ``vllm/model_executor/models/qwen3_moe.py`` @ 2e0831b0ab951c8896d4dd5d6cb9c3350a4574de: the same loop,
  with a ``residual is not None`` guard; the same default.
- vLLM ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424:
  ``get_eagle3_aux_layers_from_config`` reads the draft config's top-level ``eagle_aux_hidden_state_layer_ids``
  (else the model's default).
- SGLang ``python/sglang/srt/models/llama_eagle3.py`` @ 03d5a7771f6082e7737a5f19cae7d1e863087013:
  ``LlamaForCausalLMEagle3`` (``model.fc`` = Linear(3 · ``target_hidden_size`` (else hidden_size) → hidden),
  ``model.midlayer`` with qkv input 2 · hidden, ``model.norm``, ``lm_head`` [``config.draft_vocab_size``, hidden],
  read as an attribute); ``load_weights``: d2t → ``hot_token_id = d2t + arange``, t2d skipped, q/k/v and
  gate/up stacked, ``model.`` prefixed when the name is not a parameter, a name matching no parameter dropped
  without a word.
- SGLang ``python/sglang/srt/models/llama.py`` @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf:
  ``set_eagle3_layers_to_capture``: ``layers_to_capture = [val + 1 for val in layer_ids]`` (default
  ``[2, L // 2, L - 3]``); ``LlamaModel.forward`` appends ``hidden_states + residual`` before layer ``i`` when
  ``i in self.layers_to_capture``.
- SGLang ``python/sglang/srt/models/qwen3_moe.py`` @ e3d8e9aec2c7f120ad4d4c6e7ee08cc19346fdbd: the same rule; its
  model runner passes the draft config's ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` (None when absent).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from k3post.models import build_tiny_family, build_tiny_moe
from k3post.spec.eagle3 import (
    DraftVocab, Eagle3Draft, engine_capturable, stock_aux_layers, target_features, unrolled_logits,
)
from k3post.spec.export import NonStockLayout, export_eagle3, load_eagle3

V = 96
_STACKED = ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
            (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))


class ServeError(AssertionError):
    """What the engine would fail with (a load error, a shape error, a silently unloaded weight)."""


def _shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The draft's parameters (suffixes shared by both loaders) and their shapes from the draft config."""
    D, F, H, K = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or D // H
    tgt = getattr(cfg, "target_hidden_size", None) or D
    return {"fc.weight": (D, 3 * tgt), "self_attn.qkv_proj.weight": ((H + 2 * K) * hd, 2 * D),
            "self_attn.o_proj.weight": (D, H * hd), "mlp.gate_up_proj.weight": (2 * F, D), "mlp.down_proj.weight": (D, F),
            "input_layernorm.weight": (D,), "hidden_norm.weight": (D,), "post_attention_layernorm.weight": (D,),
            "norm.weight": (D,), "lm_head.weight": (cfg.draft_vocab_size, D)}


def _shard_rows(cfg, shard) -> tuple[int, int]:
    """(offset, rows) of a q / k / v or gate / up shard inside its stacked parameter."""
    D, F, H, K = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or D // H
    return {"q": (0, H * hd), "k": (H * hd, K * hd), "v": ((H + K) * hd, K * hd), 0: (0, F), 1: (F, F)}[shard]


def _load(params: dict[str, torch.Tensor], name: str, w: torch.Tensor, shard=None, cfg=None) -> None:
    p = params[name]
    if shard is None:
        if tuple(w.shape) != tuple(p.shape):
            raise ServeError(f"{name}: checkpoint shape {tuple(w.shape)} != parameter {tuple(p.shape)}")
        p.copy_(w)
    else:
        off, rows = _shard_rows(cfg, shard)
        if tuple(w.shape) != (rows, p.shape[1]):
            raise ServeError(f"{name}[{shard}]: checkpoint shape {tuple(w.shape)} != shard {(rows, p.shape[1])}")
        p[off:off + rows].copy_(w)


def _check_common(folder: Path) -> tuple[object, dict[str, torch.Tensor]]:
    cfg = AutoConfig.from_pretrained(folder)  # both engines read the draft's config.json through transformers
    if cfg.architectures != ["LlamaForCausalLMEagle3"]:
        raise ServeError(f"architectures {cfg.architectures}: both engines register LlamaForCausalLMEagle3")
    if getattr(cfg, "draft_vocab_size", None) is None:
        raise ServeError("config has no draft_vocab_size (SGLang reads config.draft_vocab_size)")
    if getattr(cfg, "tie_word_embeddings", False):
        raise ServeError("tie_word_embeddings: SGLang would use the embedding as lm_head and drop lm_head.weight")
    tensors = load_file(str(folder / "model.safetensors"))
    d2t = tensors.get("d2t")
    if d2t is not None:
        if d2t.dtype != torch.int64 or tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise ServeError(f"d2t {d2t.dtype} {tuple(d2t.shape)}: vLLM's draft_id_to_target_id is long [draft_vocab_size]")
        ids = d2t + torch.arange(len(d2t))
        if not (ids[1:] > ids[:-1]).all() or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ServeError("d2t + arange must be ascending target ids < vocab_size")
    return cfg, tensors


def vllm_load(folder: Path) -> dict[str, torch.Tensor]:
    """vLLM's ``Eagle3LlamaForCausalLM.load_weights`` + ``LlamaModel.load_weights`` (module docstring) on the
    exported folder: returns its parameters, or raises ``ServeError`` for a missing, unknown or misshapen weight."""
    cfg, tensors = _check_common(folder)
    shapes = _shapes(cfg)
    params = {("lm_head.weight" if k == "lm_head.weight" else
               f"model.{k}" if k in ("fc.weight", "norm.weight") else f"model.layers.0.{k}"): torch.zeros(v)
              for k, v in shapes.items()}
    params["draft_id_to_target_id"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    params["model.embed_tokens.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    loaded = set()
    for name, w in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        shard = None
        for ckpt, param, sid in _STACKED:
            if ckpt in name:
                name, shard = name.replace(ckpt, param), sid
                break
        if name not in params:
            raise ServeError(f"vLLM: no parameter {name} (AutoWeightsLoader raises on unexpected weights)")
        _load(params, name, w, shard, cfg)
        loaded.add(name)
    missing = set(params) - loaded - {"model.embed_tokens.weight"}  # embed_tokens: the target's is shared
    if "draft_id_to_target_id" not in loaded:
        missing.discard("draft_id_to_target_id")  # no d2t: skipped, the full vocabulary
    if missing:
        raise ServeError(f"vLLM: weights not in the checkpoint: {sorted(missing)}")
    return params


def sglang_load(folder: Path) -> dict[str, torch.Tensor]:
    """SGLang's ``LlamaForCausalLMEagle3.load_weights`` (module docstring): returns its parameters (and
    ``hot_token_id``), or raises ``ServeError`` where SGLang would drop a weight without a word or fail."""
    cfg, tensors = _check_common(folder)
    shapes = _shapes(cfg)
    params = {("lm_head.weight" if k == "lm_head.weight" else
               f"model.{k}" if k in ("fc.weight", "norm.weight") else f"model.midlayer.{k}"): torch.zeros(v)
              for k, v in shapes.items()}
    params["model.embed_tokens.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    loaded, out = set(), {}
    for name, w in tensors.items():
        if "d2t" in name:
            out["hot_token_id"] = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        shard = None
        for ckpt, param, sid in _STACKED:
            if ckpt in name:
                name, shard = name.replace(ckpt, param), sid
                break
        name = name if name in params else f"model.{name}"
        if name not in params:
            raise ServeError(f"SGLang: {name} matches no parameter and would be dropped silently")
        _load(params, name, w, shard, cfg)
        loaded.add(name)
    missing = set(params) - loaded - {"model.embed_tokens.weight"}
    if missing:
        raise ServeError(f"SGLang: weights not in the checkpoint: {sorted(missing)}")
    return {**params, **out}


def _capture(target, ids_BT: torch.Tensor, layers_to_capture: list[int], llama_loop: bool) -> list[torch.Tensor]:
    """The engines' layer loop: ``if i in layers: record(hidden_states + residual)`` before layer i, in layer
    order, once per layer. The residual stream entering layer i is transformers' layer input; before layer 0
    the Llama loops add a residual that is still None (a TypeError), the Qwen3-MoE loops guard it."""
    if llama_loop and 0 in layers_to_capture:
        raise ServeError("before layer 0 the Llama loop computes hidden_states + residual with residual None")
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, a, kw, i=i: seen.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(target.model.layers) if i in layers_to_capture]
    try:
        with torch.no_grad():
            target(ids_BT)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in sorted(seen)]


def vllm_features(target, folder: Path, ids_BT: torch.Tensor) -> torch.Tensor:
    """The fused features vLLM hands the draft: the states before the layers of the config's top-level
    ``eagle_aux_hidden_state_layer_ids``, concatenated; a ``ServeError`` when they do not fit ``fc``."""
    cfg = json.loads((folder / "config.json").read_text())
    llama = target.config.model_type == "llama"
    return _fit(_capture(target, ids_BT, list(cfg["eagle_aux_hidden_state_layer_ids"]), llama), cfg, "vLLM")


def sglang_features(target, folder: Path, ids_BT: torch.Tensor) -> torch.Tensor:
    """The same for SGLang: ``layers_to_capture = [j + 1 for j in eagle_config.eagle_aux_hidden_state_layer_ids]``."""
    cfg = json.loads((folder / "config.json").read_text())
    layers = [j + 1 for j in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return _fit(_capture(target, ids_BT, layers, target.config.model_type == "llama"), cfg, "SGLang")


def _fit(states: list[torch.Tensor], cfg: dict, engine: str) -> torch.Tensor:
    fused = torch.cat(states, dim=-1) if states else torch.zeros(0)
    want = 3 * cfg.get("target_hidden_size", cfg["hidden_size"])
    if fused.shape[-1] != want:
        raise ServeError(f"{engine}: the target hands {fused.shape[-1]} features, fc expects {want} (a shape error)")
    return fused


def serves_on_stock_engines(target, folder: Path, ids_BT: torch.Tensor, aux: tuple[int, ...]) -> None:
    """Both loaders load ``folder`` and both hand the draft exactly k3post's fused features for ``aux``."""
    want, _ = target_features(target, ids_BT, aux)
    for load, features in ((vllm_load, vllm_features), (sglang_load, sglang_features)):
        params = load(folder)
        assert params["model.fc.weight"].shape[1] == want.shape[-1]
        assert torch.equal(features(target, folder, ids_BT), want), load.__name__


@pytest.fixture(scope="module")
def target():
    return build_tiny_moe(V, "tiny", seed=0)  # 4 layers, the demo's shape


def _draft(target, aux, vocab=None):
    torch.manual_seed(0)
    d = Eagle3Draft.from_target(target, aux, draft_vocab=vocab)
    with torch.no_grad():
        d.fc.weight.add_(torch.randn(d.fc.weight.shape) * 0.02)  # every slot of fc matters
    return d


def test_default_export_loads_and_runs_in_vllm_and_sglang(target, tmp_path) -> None:
    """The default layout (1, L//2, L−1) of the 4-layer target: every weight loads in both with its shape,
    d2t / t2d as both read them, and both engines hand the draft the features it was trained on."""
    L = target.config.num_hidden_layers
    aux = stock_aux_layers(L)
    assert aux == (1, 2, 3) and engine_capturable(aux, L)
    vocab = DraftVocab.from_token_ids([[1, 2, 2, 9, 40, 40, 40, 77]], V, size=5)
    draft = _draft(target, aux, vocab)
    export_eagle3(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: states entering layers 1, 2, 3
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: leaving layers 0, 1, 2
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == 128 and cfg["draft_vocab_size"] == 5
    assert cfg["k3post"]["stock_engines"] is True
    ids_BT = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    serves_on_stock_engines(target, tmp_path, ids_BT, aux)
    v, s = vllm_load(tmp_path), sglang_load(tmp_path)
    assert torch.equal(v["model.fc.weight"], draft.fc.weight) and torch.equal(s["model.fc.weight"], draft.fc.weight)
    q = draft.midlayer.self_attn.q_proj.weight
    assert torch.equal(v["model.layers.0.self_attn.qkv_proj.weight"][:q.shape[0]], q)
    assert torch.equal(s["model.midlayer.self_attn.qkv_proj.weight"][:q.shape[0]], q)
    assert (v["draft_id_to_target_id"] + torch.arange(5)).tolist() == s["hot_token_id"].tolist() == [1, 2, 9, 40, 77]
    # the draft k3post reloads computes what it exported
    back = load_eagle3(tmp_path, target.get_input_embeddings())
    fused, _ = target_features(target, ids_BT, aux)
    with torch.no_grad():
        assert torch.equal(unrolled_logits(back, fused, ids_BT, 2), unrolled_logits(draft, fused, ids_BT, 2))


@pytest.mark.parametrize("aux, why", [
    ((1, 2, 4), "hands 256 features, fc expects 384"),  # the old default: id L, the final layer's output
    ((1, 1, 3), "hands 256 features, fc expects 384"),  # a repeated id is recorded once
])
def test_non_stock_layouts_fail_in_the_checkers_and_are_refused(target, tmp_path, aux, why) -> None:
    """A layout stock engines cannot serve: ``export_eagle3`` refuses it and writes nothing; exported anyway
    (``nonstock=True``), it loads but both engines hand it too few features (the serve-time shape error)."""
    L = target.config.num_hidden_layers
    assert not engine_capturable(aux, L)
    with pytest.raises(NonStockLayout, match="stock vLLM and SGLang"):
        export_eagle3(_draft(target, aux), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    folder = export_eagle3(_draft(target, aux), tmp_path / "forced", nonstock=True)
    assert json.loads((folder / "config.json").read_text())["k3post"]["stock_engines"] is False
    vllm_load(folder), sglang_load(folder)  # the weights load ...
    ids_BT = torch.randint(0, V, (1, 7))
    for features in (vllm_features, sglang_features):  # ... and the first forward fails
        with pytest.raises(ServeError, match=why):
            features(target, folder, ids_BT)


def test_layer_zero_and_unsorted_ids(tmp_path) -> None:
    """Id 0 fails on a Llama target in both engines (no residual before layer 0); unsorted ids arrive in layer
    order, not the draft's: neither is stock, both refused."""
    llama = build_tiny_family("llama", V, num_hidden_layers=4)
    ids_BT = torch.randint(0, V, (1, 6))
    folder = export_eagle3(_draft(llama, (0, 2, 3)), tmp_path / "zero", nonstock=True)
    for features in (vllm_features, sglang_features):
        with pytest.raises(ServeError, match="residual None"):
            features(llama, folder, ids_BT)
    unsorted = (3, 1, 2)
    folder = export_eagle3(_draft(llama, unsorted), tmp_path / "unsorted", nonstock=True)
    want, _ = target_features(llama, ids_BT, unsorted)
    assert not torch.equal(vllm_features(llama, folder, ids_BT), want)  # right size, wrong order
    for aux in ((0, 2, 3), unsorted):
        assert not engine_capturable(aux, 4)
        with pytest.raises(NonStockLayout):
            export_eagle3(_draft(llama, aux), tmp_path / "x")
    # the stock layout of the same Llama target serves on both
    folder = export_eagle3(_draft(llama, stock_aux_layers(4)), tmp_path / "stock")
    serves_on_stock_engines(llama, folder, ids_BT, stock_aux_layers(4))


def test_stock_aux_layers_by_depth() -> None:
    """(1, L//2, L−1): strictly ascending in 1..L−1 for every L ≥ 4; fewer layers have no three distinct
    recordable states. The engines' own fallback (2, L//2, L−3) is not even valid below 7 layers."""
    for L in range(4, 80):
        aux = stock_aux_layers(L)
        assert engine_capturable(aux, L) and aux[-1] == L - 1
    for L in (1, 2, 3):
        with pytest.raises(ValueError, match="fewer than 3 states"):
            stock_aux_layers(L)
    assert [L for L in range(4, 12) if not engine_capturable((2, L // 2, L - 3), L)] == [4, 5, 6]
