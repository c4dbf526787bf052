"""MXFP4 / bf16 export: gpt-oss block layout, exact reload, transformers' own decoder agrees."""

import copy
import json

import pytest
import torch

from k3post.cli import main
from k3post.models import build_tiny_moe, save_model
from k3post.quant.export import load_mxfp4_export, pack_mxfp4, unpack_mxfp4
from k3post.quant.mx import fake_quant_mx
from k3post.quant.qat import QATConfig, apply_qat

VOCAB = 300


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    model = build_tiny_moe(VOCAB, seed=1, num_hidden_layers=2)
    with torch.no_grad():  # non-trivial expert magnitudes spread over many scales
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(torch.logspace(-3, 1, 128)[None, :, None])
    save_model(model, d / "m")
    return d / "m", model


def test_block_layout_and_roundtrip():
    # hand-built row: K = 64 → 2 blocks. block 0 = [6, -0.5, 0...] (amax 6 → shared exp 0, scale byte 127)
    w = torch.zeros(1, 1, 64)
    w[0, 0, 0], w[0, 0, 1] = 6.0, -0.5
    w[0, 0, 32] = 0.25  # block 1: amax 0.25 → floor(log2 .25) - 2 = -4 → byte 123; 0.25/2^-4 = 4 → code 6
    blocks, scales = pack_mxfp4(w)
    assert blocks.shape == (1, 1, 2, 16) and scales.shape == (1, 1, 2)
    assert scales.tolist() == [[[127, 123]]]
    # 6.0 = code 0b0111 (low nibble, even element), -0.5 = sign|0b001 = 0b1001 (high nibble)
    assert blocks[0, 0, 0, 0].item() == (0b1001 << 4) | 0b0111
    assert blocks[0, 0, 1, 0].item() == 0b0110
    assert torch.equal(unpack_mxfp4(blocks, scales), w)


def test_transformers_decoder_agrees(ckpt):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, model = ckpt
    for layer in model.model.layers:
        for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            blocks, scales = pack_mxfp4(w.detach())
            hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
            assert torch.equal(hf, fake_quant_mx(w.detach(), "fp4_e2m1", 32, -1))


def test_mxfp4_export_reproduces_qat_forward(ckpt, tmp_path):
    path, model = ckpt
    assert main(["export", str(path), str(tmp_path / "ex")]) == 0
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert "model.layers.0.self_attn.q_proj" in cfg["quantization_config"]["modules_to_not_convert"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ex" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.down_proj_blocks").shape == (8, 128, 2, 16)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    exported = load_mxfp4_export(tmp_path / "ex")
    # reference: the source's QAT forward with its non-expert weights rounded to bf16 as exported
    ref = build_tiny_moe(VOCAB, seed=1, num_hidden_layers=2)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if ".experts." not in n:
                p.copy_(p.to(torch.bfloat16).float())
    apply_qat(ref, QATConfig())
    ref.eval()
    x = torch.randint(0, VOCAB, (3, 21))
    with torch.no_grad():
        assert torch.equal(exported(x).logits, ref(x).logits)


def test_float32_rest_equals_source_qat_forward_exactly(ckpt, tmp_path):
    path, model = ckpt
    assert main(["export", str(path), str(tmp_path / "ex32"), "--rest-dtype", "float32"]) == 0
    exported = load_mxfp4_export(tmp_path / "ex32")
    ref = build_tiny_moe(VOCAB, seed=1, num_hidden_layers=2)
    ref.load_state_dict(model.state_dict())
    apply_qat(ref, QATConfig())
    ref.eval()
    x = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        assert torch.equal(exported(x).logits, ref(x).logits)


def test_bf16_export_and_errors(ckpt, tmp_path):
    path, _ = ckpt
    assert main(["export", str(path), str(tmp_path / "b"), "--format", "bf16"]) == 0
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert m.dtype == torch.bfloat16
    assert main(["export", str(path), str(tmp_path / "b")]) == 2  # non-empty output folder: refused
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "c")]) == 2


@pytest.fixture(scope="module")
def family_exports(tmp_path_factory):
    """family -> (source model, its MXFP4 export folder) for gpt-oss and DeepSeek-V3 (rest in fp32)."""
    from k3post.models import build_tiny_family
    from k3post.quant.export import export_model

    d = tmp_path_factory.mktemp("fam")
    out = {}
    for fam in ("gpt_oss", "deepseek_v3"):
        model = build_tiny_family(fam, VOCAB, seed=2)
        save_model(model, d / fam)
        out[fam] = (model, export_model(d / fam, d / f"{fam}-mx", rest_dtype="float32"))
    return out


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_family_export_dequantizes_to_the_qat_weights(family_exports, family):
    """The exported experts dequantize to exactly the weights the QAT forward fake-quantizes, and the
    reloaded export runs the source's QAT forward bit for bit (non-expert weights kept in fp32)."""
    from k3post.quant.qat import quantized_expert_weights

    model, path = family_exports[family]
    ref = copy.deepcopy(model)
    apply_qat(ref, QATConfig())
    want = quantized_expert_weights(ref)
    assert len(want) == {"gpt_oss": 6, "deepseek_v3": 4}[family]  # every MoE layer's gate_up and down
    exported = load_mxfp4_export(path)
    got = dict(exported.named_parameters())
    for name, w in want.items():
        assert torch.equal(got[name], w), name
        assert not torch.equal(w, dict(model.named_parameters())[name])  # really quantized
    x = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        assert torch.equal(exported(x).logits, ref.eval()(x).logits)


def test_gpt_oss_export_has_the_native_checkpoint_layout(family_exports):
    """gpt-oss holds its experts transposed ([E, D, 2F] gate/up interleaved, [E, F, D] down); its MXFP4
    checkpoints store ``*_blocks`` [E, rows, K/32, 16] and ``*_scales`` [E, rows, K/32] of the [E, rows, K]
    transpose, which transformers' ``convert_moe_packed_tensors`` turns back into the in-memory layout."""
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from k3post.quant.qat import quantized_expert_weights

    model, path = family_exports["gpt_oss"]
    E, D, F = model.config.num_local_experts, model.config.hidden_size, model.config.intermediate_size
    ref = copy.deepcopy(model)
    apply_qat(ref, QATConfig())
    want = quantized_expert_weights(ref)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name, w in want.items():
            blocks, scales = f.get_tensor(f"{name}_blocks"), f.get_tensor(f"{name}_scales")
            rows, K = (2 * F, D) if name.endswith("gate_up_proj") else (D, F)
            assert blocks.shape == (E, rows, K // 32, 16) and blocks.dtype == torch.uint8
            assert scales.shape == (E, rows, K // 32) and scales.dtype == torch.uint8
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), w)
            assert name not in keys
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias").shape == (E, 2 * F)


def test_transformers_loads_the_gpt_oss_export(family_exports):
    """transformers' own MXFP4 loader (dequantizing on CPU) reads the export into the QAT weights."""
    import accelerate  # noqa: F401  (transformers' MXFP4 loader needs it; a dev dependency, so CI runs this)
    from transformers import AutoModelForCausalLM

    from k3post.quant.qat import quantized_expert_weights

    model, path = family_exports["gpt_oss"]
    ref = copy.deepcopy(model)
    apply_qat(ref, QATConfig())
    hf = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    for name, w in quantized_expert_weights(ref).items():
        assert torch.equal(hf[name].float(), w)
