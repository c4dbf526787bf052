"""`k3post sft` on a user's saved HF model is reproducible (issue 30 §4): the XTML special tokens the model's
tokenizer lacks are added and their embedding rows initialised from the global RNG (transformers'
``resize_token_embeddings`` draws them), so the run seeds (``run.seed``) before loading the model. Two runs in
one process (the RNG between them is in another state) give bit-identical weights and losses, and a run
killed after a checkpoint and resumed equals the uninterrupted one bit for bit: same machine, same threads, the
same operations in the same order, so no tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from k3post.cli import main
from k3post.metrics import read_metrics
from k3post.models import load_model, save_model
from k3post.tokenizer import SPECIAL_TOKENS
from tests.test_sft import _records, _write

ARGS = ["sft.steps=4", "sft.rows_per_batch=2", "sft.save_every=2", "sft.log_every=1", "sft.progress=false",
        "sft.lr=2e-3", "sft.warmup_steps=1", "sft.max_len=512", "qat.enabled=false"]


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> Path:
    """A saved Qwen3-MoE with a byte-level BPE of its own: no XTML tokens, no pad token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = [str(m.get("content") or "") for r in _records(30) for m in r["messages"]]
    backend.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert not set(SPECIAL_TOKENS) & set(tok.get_vocab())
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
                         num_experts_per_tok=2)
    torch.manual_seed(0)
    return save_model(Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("user") / "model", tok)


def _sft(root: Path, name: str, model: Path, data: Path) -> int:
    cfg = root / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    with pytest.warns(UserWarning, match="added XTML special tokens"):
        return main(["sft", str(cfg), f"run.root={root}", f"run.name={name}", f"model.path={model}",
                     f"sft.train_file={data}", *ARGS])


def _same(a: Path, b: Path) -> None:
    wa, wb = load_model(a).state_dict(), load_model(b).state_dict()
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _losses(run: Path) -> list[float]:
    return [r["step_loss"] for r in read_metrics(run / "metrics.jsonl", "sft")]


def test_sft_on_a_user_model_is_bit_identical_and_resumes_exactly(user_model, tmp_path, monkeypatch) -> None:
    import k3post.checkpoint as ck

    data = _write(tmp_path, _records(40))
    assert _sft(tmp_path, "a", user_model, data) == 0
    torch.rand(123)  # the global RNG moves on between the runs, as anything else in a process may move it
    assert _sft(tmp_path, "b", user_model, data) == 0
    _same(tmp_path / "a" / "sft" / "final", tmp_path / "b" / "sft" / "final")
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b") and len(_losses(tmp_path / "a")) == 4

    real = ck.save_checkpoint

    def save_then_die(root, step, *a, **kw):  # noqa: ANN001, ANN202
        path = real(root, step, *a, **kw)
        if step == 2:
            raise KeyboardInterrupt("killed after the step-2 checkpoint")
        return path

    monkeypatch.setattr(ck, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _sft(tmp_path, "c", user_model, data)
    monkeypatch.setattr(ck, "save_checkpoint", real)
    torch.rand(7)
    assert _sft(tmp_path, "c", user_model, data) == 0
    _same(tmp_path / "a" / "sft" / "final", tmp_path / "c" / "sft" / "final")
    assert _losses(tmp_path / "c") == _losses(tmp_path / "a")
