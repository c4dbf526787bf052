"""Models: load any Hugging Face causal LM from a local folder; build the tiny Qwen3-MoE of the demo.

Everything is plain ``transformers``: a model made here is saved with ``save_pretrained`` as safetensors
and loads back with ``AutoModelForCausalLM.from_pretrained`` anywhere, bit-identical.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from k3post.config.model import ModelConfig, TokenizerConfig  # noqa: F401  (re-exported)
from k3post.errors import UserError

log = logging.getLogger("k3post.models")

#: Qwen3-MoE shapes by preset name. Expert widths are multiples of 32 so MX blocks (32 along the
#: reduction dimension) tile every expert GEMM exactly. `tiny` is the CPU calibration model
#: (../shared/CALIBRATION.md): ~1.05 M parameters with a 512-token vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
}


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a config dtype name to a torch dtype (ValueError naming the valid ones)."""
    if name not in _DTYPES:
        raise UserError(f"unknown dtype '{name}'; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def tiny_moe_config(vocab_size: int, preset: str = "tiny", **overrides: Any) -> Qwen3MoeConfig:
    """A Qwen3-MoE config from a preset; `overrides` replace preset fields."""
    if preset not in PRESETS:
        raise UserError(f"unknown model preset '{preset}'; expected one of {sorted(PRESETS)}")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        rope_theta=10000.0,
        output_router_logits=False,
    )
    kwargs.update(PRESETS[preset])
    kwargs.update(overrides)
    for key in ("moe_intermediate_size", "hidden_size"):
        if kwargs[key] % 32:
            raise UserError(f"{key}={kwargs[key]} must be a multiple of 32 so MX blocks tile the expert GEMMs")
    return Qwen3MoeConfig(**kwargs)


def build_tiny_moe(
    vocab_size: int,
    preset: str = "tiny",
    *,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
    **overrides: Any,
) -> Qwen3MoeForCausalLM:
    """A freshly initialised tiny Qwen3-MoE (fp32), deterministic for a given seed."""
    cfg = tiny_moe_config(vocab_size, preset, **overrides)
    cfg.pad_token_id = pad_token_id
    cfg.eos_token_id = eos_token_id
    cfg.bos_token_id = bos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(cfg)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model


def load_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """Load a causal LM from a local folder (no hub access)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(f"{p}: not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype(dtype), local_files_only=True)
    return model


def save_model(model: PreTrainedModel, out_dir: str | Path, tokenizer: Any | None = None) -> Path:
    """Save weights as safetensors (+ the tokenizer when given) so plain transformers loads the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
