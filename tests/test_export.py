"""MXFP4 / bf16 export: gpt-oss block layout, exact reload, transformers' own decoder agrees."""

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
