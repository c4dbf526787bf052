"""Models: load any Hugging Face causal LM from a local folder; build the tiny Qwen3-MoE of the demo and
tiny models of every supported family (``FAMILIES``: Llama, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss,
DeepSeek-V3).

Everything is plain ``transformers``: a model made here is saved with ``save_pretrained`` as safetensors
and loads back with ``AutoModelForCausalLM.from_pretrained`` anywhere, bit-identical.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

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
    return _init_model(cfg, seed, pad_token_id, eos_token_id, bos_token_id)


def _init_model(cfg: PretrainedConfig, seed: int, pad_token_id: int | None, eos_token_id: int | None,
                bos_token_id: int | None) -> Any:
    """A freshly initialised causal LM of ``cfg`` (fp32) with the given special ids, deterministic for ``seed``."""
    cfg.pad_token_id = pad_token_id
    cfg.eos_token_id = eos_token_id
    cfg.bos_token_id = bos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model


#: Tiny configs of each supported decoder family (hidden 64, 2-3 layers), for tests and as the shape of a
#: real checkpoint's config. Expert widths and the hidden size are multiples of 32 so MX QAT blocks tile
#: every expert GEMM. gpt-oss alternates sliding-window (window 8) and full layers; DeepSeek-V3 has MLA
#: (q / kv LoRA ranks), a first dense layer, then MoE layers with a shared expert and grouped routing.
_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(_ATTN, intermediate_size=128, num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", dict(_ATTN, intermediate_size=128, num_hidden_layers=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        _ATTN, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        _ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(
        _ATTN, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)),
    "gpt_oss": ("GptOssConfig", dict(
        _ATTN, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 512})),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_attention_heads=4, num_key_value_heads=4)),
}


def tiny_family_config(family: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``family`` (a key of ``FAMILIES``) with ``vocab_size`` (the tokenizer's, so the
    model's vocabulary matches it); ``overrides`` replace fields."""
    if family not in FAMILIES:
        raise UserError(f"unknown model family '{family}'; expected one of {sorted(FAMILIES)}")
    import transformers

    cls_name, kwargs = FAMILIES[family]
    fields: dict[str, Any] = dict(vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=False)
    fields.update(kwargs)
    fields.update(overrides)
    return getattr(transformers, cls_name)(**fields)


def build_tiny_family(
    family: str,
    vocab_size: int,
    *,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A freshly initialised tiny model of ``family`` (``tiny_family_config``), fp32, deterministic for ``seed``."""
    return _init_model(tiny_family_config(family, vocab_size, **overrides), seed, pad_token_id, eos_token_id,
                       bos_token_id)


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


@contextmanager
def new_folder(out: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` (absent or empty) to write a folder into, renamed to ``out`` when the block
    ends and removed on any error: a failure leaves neither an empty nor a half-written ``out``."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty: a folder with files in it is the caller's error
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
