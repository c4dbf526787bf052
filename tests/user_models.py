"""A newcomer's model folder: a tiny `transformers` model of some family saved with a tokenizer of the user's
own (a byte-level BPE with `<s>` / `</s>` and none of the XTML tokens)."""

from __future__ import annotations

from pathlib import Path


def user_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "What is 12 + 30? It is 42.", "def f(x):\n    return x"]
    core.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")


def save_user_model(family: str, folder: Path) -> Path:
    """``family`` as `k3post.models.FAMILIES` builds it (tiny, seed 0), saved with `user_tokenizer()` into
    ``folder`` by plain `save_pretrained`."""
    from k3post.models import build_tiny_family

    tok = user_tokenizer()
    model = build_tiny_family(family, len(tok), seed=0, eos_token_id=tok.eos_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
