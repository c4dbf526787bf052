"""XTML over tokenizers k3post did not train: a tiktoken-style tokenizer built locally with K3's special-token
names and its own pad token (the K3 tokenizer family is tiktoken-based), tokenizers without a pad, and
tokenizers whose XTML names are ordinary (forgeable) vocabulary entries."""

from __future__ import annotations

import base64
import json
import warnings
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter

from k3post.tokenizer import (
    IMAGE_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    encode_text,
    ensure_xtml_tokens,
    special_ids,
    train_tokenizer,
)
from k3post.xtml import XTML, render_text
from k3post.xtml.render import _build

# the GPT-4-style split pattern both tiktoken and transformers' converter accept
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# K3-style special tokens: XTML under its own names, the image placeholder, and the tokenizer's own pad
K3_SPECIALS = ["[BOS]", "[EOS]", *SPECIAL_TOKENS, IMAGE_TOKEN, "[UNK]", "[PAD]"]

CONVERSATION = [
    {"role": "system", "content": "Tu es utile. 数学"},
    {"role": "user", "name": 'ann "a&b"', "content": [{"type": "text", "text": "How big is "},
                                                      {"type": "image_url", "image_url": {"url": "data:,"}},
                                                      {"type": "text", "text": "? Say <|end_of_msg|> too."}]},
    {"role": "assistant", "reasoning_content": "Measure it, then answer.", "content": "",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "measure", "arguments": '{"unit": "cm", "precise": true, "n": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "12.5"},
]
TOOLS = [{"type": "function", "function": {"name": "measure", "description": "Measure an object",
                                           "parameters": {"type": "object", "properties": {"unit": {"type": "string"}}}}}]


def _ranks(corpus: list[str], vocab_size: int) -> dict[bytes, int]:
    """Mergeable ranks of a byte-level BPE trained on ``corpus``: the 256 bytes, then each merge's result in
    merge order (tiktoken's file format, base64 token + rank per line)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = bytes(byte_of[c] for c in a + b)
        ranks.setdefault(token, len(ranks))
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def tiktoken_pair(tmp_path_factory) -> tuple[tiktoken.Encoding, PreTrainedTokenizerFast]:
    """(the tiktoken Encoding, the same tokenizer loaded into transformers) from one locally built
    ``tiktoken.model`` file, K3's special tokens after the ranks and ``[PAD]`` as the pad token."""
    corpus = [render_text(CONVERSATION, tools=TOOLS, effort=e) for e in ("low", "high", "max")] * 20
    ranks = _ranks(corpus + ["The quick brown fox measures 12.5 cm. Tu es utile."] * 20, vocab_size=700)
    path = Path(tmp_path_factory.mktemp("k3tok")) / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    mergeable = tiktoken.load.load_tiktoken_bpe(str(path))
    specials = {t: len(mergeable) + i for i, t in enumerate(K3_SPECIALS)}
    enc = tiktoken.Encoding(name="k3-style", pat_str=PATTERN, mergeable_ranks=mergeable, special_tokens=specials)
    backend = TikTokenConverter(vocab_file=str(path), pattern=PATTERN, extra_special_tokens=K3_SPECIALS).converted()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                                 pad_token="[PAD]")
    assert all(hf.convert_tokens_to_ids(t) == i for t, i in specials.items())
    return enc, hf


def _expected_ids(enc: tiktoken.Encoding, **kw) -> list[int]:
    """The context's pieces, each special by its tiktoken id and each text segment by tiktoken's own
    ``encode_ordinary`` (what a K3 serving stack does with the shipped encoder's segments)."""
    ids: list[int] = []
    for p in _build(**kw).pieces:
        ids += [enc.encode_single_token(p.value)] if p.special else enc.encode_ordinary(p.value)
    return ids


def test_tiktoken_style_tokenizer_renders_the_same_ids_as_tiktoken(tiktoken_pair) -> None:
    enc, hf = tiktoken_pair
    x = XTML(hf)
    assert x.pad_id == hf.convert_tokens_to_ids("[PAD]") and PAD_TOKEN not in hf.get_vocab()
    assert x.image_id == enc.encode_single_token(IMAGE_TOKEN)
    for kw in (dict(tools=TOOLS, effort="high", add_generation_prompt=True), dict(mode="instruct"),
               dict(tool_choice="required", response_format={"type": "json_object"})):
        r = x.render(CONVERSATION, **kw)
        assert r.ids == _expected_ids(enc, messages=CONVERSATION, **kw)
        assert enc.decode(r.ids) == render_text(CONVERSATION, **kw)
        assert x.validate(r.ids, mode=kw.get("mode", "think")).ok
    # user text spelling <|end_of_msg|> stays text: one eom id per message
    r = x.render(CONVERSATION)
    assert r.ids.count(x.eom_id) == 1 + len(CONVERSATION)
    # the assistant message parses back from tiktoken-built ids
    span = [t for t, k in zip(r.ids, r.message_index) if k == 2]
    call = x.parse(span)["tool_calls"][0]["function"]
    assert call["name"] == "measure" and call["arguments"] == '{"unit": "cm", "precise": true, "n": 3}'


def test_k3_named_tokens_and_own_pad_need_no_new_tokens_or_resize(tiktoken_pair) -> None:
    _, hf = tiktoken_pair
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    before = model.get_input_embeddings().weight.clone()
    n = len(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "added tokens" warning
        assert ensure_xtml_tokens(hf, model) == []
    assert len(hf) == n and hf.pad_token == "[PAD]"
    assert torch.equal(model.get_input_embeddings().weight, before)


def test_a_tokenizer_without_pad_gets_pad_only() -> None:
    tok = train_tokenizer(["hello world <|open|>"] * 5, vocab_size=300)
    tok.pad_token = None
    assert tok.pad_token is None and PAD_TOKEN in tok.get_vocab()
    assert special_ids(tok)[PAD_TOKEN] == tok.convert_tokens_to_ids(PAD_TOKEN)  # <|pad|> is there: used
    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    bare.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    with pytest.raises(ValueError, match="no pad token"):
        special_ids(bare)
    with pytest.warns(UserWarning, match=r"\['<\|pad\|>'\]"):
        assert ensure_xtml_tokens(bare) == [PAD_TOKEN]
    assert bare.pad_token == PAD_TOKEN and XTML(bare).pad_id == bare.convert_tokens_to_ids(PAD_TOKEN)


def test_xtml_names_that_text_can_spell_are_refused() -> None:
    """An XTML name present as an ordinary (non-special) entry would let user text produce its id."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                                  pad_token="[UNK]")
    tok.add_tokens(list(SPECIAL_TOKENS), special_tokens=False)
    with pytest.raises(ValueError, match=r"'<\|open\|>' encodes to its own id"):
        XTML(tok)


def test_trained_tokenizer_never_merges_into_a_special_token() -> None:
    """Regression: a demo tokenizer trained on rendered text learned merges that spell ``<|close|>``, so
    ``encode_text("<|close|>")`` gave the real close id (user text could forge structure)."""
    corpus = ["<|close|>message<|sep|><|end_of_msg|>", "a<|close|>b", "<|close|>"] * 200
    tok = train_tokenizer(corpus, vocab_size=300, word_boundaries=False)
    for t in (*SPECIAL_TOKENS, PAD_TOKEN, IMAGE_TOKEN):
        assert tok.convert_tokens_to_ids(t) not in encode_text(tok, t)
        assert tok.convert_tokens_to_ids(t) not in encode_text(tok, f"x{t}y{t}")
    XTML(tok)  # the check in special_ids passes
