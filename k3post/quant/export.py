"""Deployment export of a trained MoE: packed MXFP4 experts (gpt-oss layout) or plain bf16 (SPEC §6.1).

MXFP4 layout, for every routed-expert weight ``W`` of shape [E, rows, K] (K = the GEMM reduction dim,
as used in ``F.linear(x, W[e])``)::

    <name>_blocks   uint8 [E, rows, K/32, 16]   two E2M1 codes per byte, low nibble = even element
    <name>_scales   uint8 [E, rows, K/32]       E8M0 exponent + 127

This is the layout of gpt-oss checkpoints, which transformers' ``convert_moe_packed_tensors`` decodes
(it returns the transposed [E, K, rows] that gpt-oss keeps in memory). Experts a model holds transposed
(gpt-oss: ``gate_up_proj`` [E, D, 2F] with gate / up interleaved along 2F, ``down_proj`` [E, F, D]) are
written as their [E, rows, K] transpose, so a k3post gpt-oss export has the names and shapes of an
original gpt-oss checkpoint and transformers' own MXFP4 loader reads it (tested); biases stay in
``rest_dtype``. Everything else is saved in
bf16 (``rest_dtype``), and ``config.json`` gets
``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.

``load_mxfp4_export`` rebuilds the model with the dequantized expert weights and re-applies QAT (the
MXFP8 expert-input quantization, and weight fake-quant, which is the identity on MXFP4-grid weights).
Its forward equals the QAT forward of the source checkpoint whose non-expert weights are rounded to
``rest_dtype`` — bit for bit on CPU (tested). With ``rest_dtype=float32`` it equals the source's QAT
forward exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from k3post.errors import UserError
from k3post.models import load_model, new_folder, torch_dtype
from k3post.quant.mx import dequantize_mx, pack_fp4, quantize_mx, unpack_fp4
from k3post.quant.qat import QATConfig, _find_expert_modules, _fused_up_name, apply_qat

BLOCK = 32
WEIGHTS_FILE = "model.safetensors"


def expert_weights(model: PreTrainedModel) -> dict[str, bool]:
    """Qualified names of the fused 3-D routed-expert weights -> True when the model holds them
    transposed, [E, K, rows] (gpt-oss), False for [E, rows, K] (Qwen3-MoE, Mixtral, DeepSeek-V3)."""
    names: dict[str, bool] = {}
    for name, module, kind in _find_expert_modules(model):
        if kind != "fused":
            raise ValueError(f"{name}: MXFP4 export supports fused 3-D expert weights only (found per-expert Linear layers)")
        transposed = bool(getattr(module, "is_transposed", False))
        names.update({f"{name}.{_fused_up_name(module)}": transposed, f"{name}.down_proj": transposed})
    if not names:
        raise ValueError(f"{type(model).__name__}: no routed-expert weights found to export")
    return names


def pack_mxfp4(w_ERK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, K] float → (blocks uint8 [E, rows, K/32, 16], scales uint8 [E, rows, K/32])."""
    E, R, K = w_ERK.shape
    if K % BLOCK:
        raise ValueError(f"reduction dim {K} is not a multiple of {BLOCK}")
    codes_ERK, scales_ERG = quantize_mx(w_ERK.float(), "fp4_e2m1", BLOCK, -1)
    blocks = pack_fp4(codes_ERK).reshape(E, R, K // BLOCK, BLOCK // 2)
    return blocks.contiguous(), scales_ERG.reshape(E, R, K // BLOCK).contiguous()


def unpack_mxfp4(blocks_ERG16: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_mxfp4`: → [E, rows, K] in `dtype`."""
    E, R, G, half = blocks_ERG16.shape
    if half != BLOCK // 2 or scales_ERG.shape != (E, R, G):
        raise ValueError(f"bad MXFP4 shapes: blocks {tuple(blocks_ERG16.shape)}, scales {tuple(scales_ERG.shape)}")
    codes = unpack_fp4(blocks_ERG16.reshape(E, R, G * half))
    return dequantize_mx(codes, scales_ERG, "fp4_e2m1", BLOCK, -1, dtype=dtype)


def export_model(ckpt: str | Path, out: str | Path, *, fmt: str = "mxfp4", rest_dtype: str = "bfloat16") -> Path:
    """`k3post export`: write `ckpt` as an MXFP4 (experts) + `rest_dtype` folder, or all-bf16 (`fmt="bf16"`)."""
    src, dst = Path(ckpt), Path(out)
    if fmt not in ("mxfp4", "bf16"):
        raise UserError(f"unknown export format '{fmt}'; expected mxfp4 or bf16")
    if dst.exists() and any(dst.iterdir()):
        raise UserError(f"{dst}: output folder exists and is not empty")
    rest = torch_dtype(rest_dtype)
    model = load_model(src)
    experts: dict[str, bool] = {}
    if fmt == "mxfp4":
        try:
            experts = expert_weights(model)
        except ValueError as e:  # a dense model (or per-expert Linear layers): nothing to pack, nothing written
            raise UserError(f"{src}: cannot export as MXFP4: {e} (MXFP4 packs the routed experts of an MoE model); "
                            f"export a dense model with --format bf16") from None
    with new_folder(dst) as tmp:  # renamed into place at the end: a failure leaves no empty or half folder
        if fmt == "bf16":
            model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        else:
            _export_mxfp4(model, tmp, rest, experts)
        for f in src.iterdir():  # tokenizer and generation files travel with the weights
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json", "chat_template.jinja")):
                shutil.copy2(f, tmp / f.name)
    return dst


def _export_mxfp4(model: PreTrainedModel, dst: Path, rest: torch.dtype, experts: dict[str, bool]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, p in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if name in experts:  # a transposed [E, K, rows] weight is packed as its [E, rows, K] transpose
            blocks, scales = pack_mxfp4(p.detach().transpose(1, 2) if experts[name] else p.detach())
            tensors[f"{name}_blocks"] = blocks
            tensors[f"{name}_scales"] = scales
        else:
            tensors[name] = p.detach().to(rest).contiguous()
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt", "k3post": "mxfp4-export"})
    cfg = model.config.to_dict()
    not_converted = sorted({n.rsplit(".", 1)[0] for n in tensors if not n.endswith(("_blocks", "_scales"))})
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    cfg["torch_dtype"] = str(rest).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def load_mxfp4_export(path: str | Path, *, qat: QATConfig | None = None) -> PreTrainedModel:
    """Load an MXFP4 export into a float32 model with QAT applied (the forward the model was trained with)."""
    p = Path(path)
    raw = json.loads((p / "config.json").read_text())
    if (raw.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        raise ValueError(f"{p}/config.json: not an MXFP4 export (no quantization_config.quant_method=mxfp4)")
    raw.pop("quantization_config")
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k not in ("transformers_version",)})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = load_file(str(p / WEIGHTS_FILE))
    transposed = expert_weights(model)
    state: dict[str, Any] = {}
    for name, t in sd.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            w_ERK = unpack_mxfp4(t, sd[f"{base}_scales"])
            state[base] = w_ERK.transpose(1, 2).contiguous() if transposed.get(base) else w_ERK
        elif not name.endswith("_scales"):
            state[name] = t.float()
    expected = set(model.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    if set(state) != expected:
        raise ValueError(f"{p}: tensors do not match the model (missing {sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]})")
    model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    apply_qat(model, qat or QATConfig())
    return model.eval()
