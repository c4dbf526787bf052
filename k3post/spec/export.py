"""Write an ``Eagle3Draft`` as the folder vLLM and SGLang load as an EAGLE-3 draft, and read it back.

    folder/config.json         LlamaForCausalLMEagle3: the block's Llama fields, vocab_size (target),
                               draft_vocab_size, the aux layer ids in each engine's convention
    folder/model.safetensors   fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
                               midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
                               norm.weight, lm_head.weight, d2t (int64 [W]), t2d (bool [V])

vLLM renames ``midlayer.`` to ``layers.0.``, prefixes ``model.`` (all but lm_head), reads d2t as
``draft_id_to_target_id`` and skips t2d; SGLang prefixes ``model.`` and turns d2t into its hot-token ids.
Neither needs ``embed_tokens`` (both share the target's), so it is not written. The aux ids: vLLM reads the
top-level ``eagle_aux_hidden_state_layer_ids`` (state entering a layer), SGLang reads
``eagle_config.eagle_aux_hidden_state_layer_ids`` (state leaving a layer): the same layers, two numberings.
Both size ``fc`` from ``target_hidden_size`` (3 × it inputs), written explicitly. A draft whose aux ids stock
engines cannot record (``engine_capturable``: the final layer's output, or layer 0) is refused unless
``nonstock=True`` (``draft.nonstock_export``): such a folder fails at serve time in both. The loaders'
name / shape / dtype contract is checked in tests/test_spec_export.py against their source.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from k3post.spec.eagle3 import (
    DraftVocab, Eagle3Config, Eagle3Draft, engine_capturable, from_vllm_ids, sglang_ids, vllm_ids,
)

__all__ = ["NonStockLayout", "export_eagle3", "load_eagle3", "nonstock_message"]

log = logging.getLogger("k3post.spec.export")

_BLOCK_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "initializer_range")


def _config_json(draft: Eagle3Draft, dtype: torch.dtype) -> dict:
    cfg, block = draft.config, draft.config.block
    rope = dict(block.rope_parameters)
    out = {k: getattr(block, k) for k in _BLOCK_KEYS}
    out.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        draft_vocab_size=cfg.draft_vocab_size,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        norm_before_residual=False,
        rope_theta=rope["rope_theta"],
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        rope_parameters=rope,
        torch_dtype=str(dtype).removeprefix("torch."),
        eagle_aux_hidden_state_layer_ids=vllm_ids(cfg.aux_layer_ids),
        eagle_config={"eagle_aux_hidden_state_layer_ids": sglang_ids(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        target_hidden_size=block.hidden_size,
        k3post={"aux_layer_ids": list(cfg.aux_layer_ids), "num_target_layers": cfg.num_target_layers,
                "stock_engines": engine_capturable(cfg.aux_layer_ids, cfg.num_target_layers)},
    )
    return out


class NonStockLayout(ValueError):
    """The draft's aux ids include a state stock vLLM / SGLang do not record (``engine_capturable``)."""


def nonstock_message(ids: tuple[int, ...] | list[int], num_layers: int) -> str:
    """Why aux ``ids`` of an ``num_layers``-layer target do not serve on stock vLLM / SGLang."""
    return (f"aux layer ids {list(ids)} (k3post's count: the state entering layer i; {num_layers} is the last layer's "
            f"output, the MTP head's input) are not what stock vLLM and SGLang hand a draft: they record the states "
            f"entering layers 1..{num_layers - 1}, each once and in layer order, so a draft needs 3 strictly ascending "
            "ids in that range; otherwise it gets too few features for its fc (a shape error at serve time) or "
            "features in another order")


def export_eagle3(draft: Eagle3Draft, folder: str | Path, dtype: torch.dtype | None = None,
                  nonstock: bool = False) -> Path:
    """Write ``draft`` to ``folder`` (module docstring); weights in ``dtype`` (default: the draft's).
    Raises ``NonStockLayout`` before writing anything when stock engines cannot serve the draft's aux ids,
    unless ``nonstock`` (then it writes it, for a patched engine or k3post's own, with a warning)."""
    cfg = draft.config
    if not engine_capturable(cfg.aux_layer_ids, cfg.num_target_layers):
        why = nonstock_message(cfg.aux_layer_ids, cfg.num_target_layers)
        if not nonstock:
            raise NonStockLayout(f"{why}; not exported. Train with the default aux layers, or pass nonstock=True "
                                 "(draft.nonstock_export=true) for an engine that records them")
        log.warning("%s; exported anyway (nonstock): it serves only on an engine that records them", why)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or draft.fc.weight.dtype
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()
               if not k.startswith("embed_tokens.") and k not in ("d2t", "t2d")}
    tensors["d2t"] = draft.d2t.detach().to(torch.int64).contiguous()
    tensors["t2d"] = draft.t2d.detach().to(torch.bool).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config_json(draft, dtype), indent=2) + "\n")
    return out


def load_eagle3(folder: str | Path, embed_tokens: nn.Embedding | None = None) -> Eagle3Draft:
    """The draft written by ``export_eagle3``; ``embed_tokens`` (the target's) is shared, not stored."""
    path = Path(folder)
    raw = json.loads((path / "config.json").read_text())
    block = LlamaConfig(**{k: raw[k] for k in _BLOCK_KEYS}, num_hidden_layers=1, rope_parameters=raw["rope_parameters"],
                        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    meta = raw.get("k3post", {})
    ids = meta.get("aux_layer_ids") or from_vllm_ids(raw["eagle_aux_hidden_state_layer_ids"])
    tensors = load_file(str(path / "model.safetensors"))
    vocab = DraftVocab.from_d2t(tensors["d2t"], raw["vocab_size"])
    if not torch.equal(vocab.t2d, tensors["t2d"]):
        raise ValueError(f"{path}: t2d does not mark the ids d2t names")
    full = len(vocab.target_ids) == raw["vocab_size"] and torch.equal(vocab.target_ids, torch.arange(raw["vocab_size"]))
    cfg = Eagle3Config(tuple(ids), int(meta.get("num_target_layers", max(ids))), block, None if full else vocab)
    dtype = tensors["fc.weight"].dtype
    draft = Eagle3Draft(cfg, embed_tokens).to(dtype)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the draft (missing {missing}, unexpected {unexpected})")
    return draft
