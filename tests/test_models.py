"""Tiny MoE construction, save → load bit-identical, init-model folder loads in plain transformers."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from k3post.cli import main
from k3post.models import build_tiny_moe, count_parameters, load_model, save_model


def test_tiny_preset_shapes():
    m = build_tiny_moe(512, "tiny")
    cfg = m.config
    assert cfg.num_experts >= 4 and cfg.moe_intermediate_size % 32 == 0 and cfg.hidden_size % 32 == 0
    assert 0.9e6 < count_parameters(m) < 1.2e6
    # deterministic init
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), build_tiny_moe(512, "tiny").parameters()))


def test_save_load_bit_identical(tmp_path):
    m = build_tiny_moe(300, "tiny", seed=3).eval()
    save_model(m, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    m2 = load_model(tmp_path / "m").eval()
    x = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_init_model_cli_folder_loads_with_plain_transformers(tmp_path):
    out = tmp_path / "tiny"
    assert main(["init-model", str(out), "--vocab-size", "300"]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(tok) == model.config.vocab_size
    for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    ids = tok("What is 12+34?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.shape[-1] == len(tok)
    # refusing to overwrite an existing model folder
    assert main(["init-model", str(out)]) == 2
