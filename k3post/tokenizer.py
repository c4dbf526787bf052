"""Byte-level BPE tokenizer with the XTML special tokens (SPEC §1).

XTML needs four reserved tokens, each exactly one id (`<|open|>`, `<|close|>`,
`<|sep|>`, `<|end_of_msg|>`), plus a pad token. This module

- trains a small byte-level BPE for the tiny models (`train_tokenizer`), with
  digits split one per token and the reserved tokens at ids 0..4;
- loads one back (`load_tokenizer`) or patches a real model's tokenizer so it has
  the reserved tokens (`ensure_xtml_tokens`);
- encodes *text* so that it never yields a special id (`encode_text`): user text
  that spells `<|end_of_msg|>` becomes ordinary byte-level tokens, which is what
  keeps a conversation from forging message boundaries;
- decodes ids back to text exactly (`decode`), with special tokens written
  literally and no whitespace clean-up.

For a byte-level tokenizer without a normalizer (the one trained here),
``decode(tok, encode_text(tok, s)) == s`` for every unicode string ``s``.
"""

from __future__ import annotations

import json
import re
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from k3post.errors import UserError

__all__ = [
    "SPECIAL_TOKENS",
    "PAD_TOKEN",
    "ALL_SPECIAL_TOKENS",
    "IMAGE_TOKEN",
    "train_tokenizer",
    "lexicon_corpus",
    "load_tokenizer",
    "ensure_xtml_tokens",
    "encode_text",
    "decode",
    "text_offsets",
    "special_ids",
]

SPECIAL_TOKENS: tuple[str, str, str, str] = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
"""The four XTML reserved tokens, in SPEC order: open, close, sep, end of message."""

PAD_TOKEN: str = "<|pad|>"
"""Padding token; never appears inside a rendered context."""

ALL_SPECIAL_TOKENS: tuple[str, ...] = (*SPECIAL_TOKENS, PAD_TOKEN)
"""XTML tokens plus pad, in the id order `train_tokenizer` gives them (0..4)."""

IMAGE_TOKEN: str = "<|kimi_image_placeholder|>"
"""The K3 encoder's image placeholder: one id standing for each image content part. `train_tokenizer`
gives it id 5; a foreign tokenizer needs it only to render images."""

_TRAINED_SPECIALS: tuple[str, ...] = (*ALL_SPECIAL_TOKENS, IMAGE_TOKEN)


def _check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError unless vocab_size leaves room for the specials and all 256 bytes."""
    minimum = len(_TRAINED_SPECIALS) + 256
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be an int >= {minimum} ({len(_TRAINED_SPECIALS)} special tokens + 256 byte tokens), "
            f"got {vocab_size!r}"
        )


def lexicon_corpus(words: Iterable[str], repeats: int) -> list[str]:
    """Extra tokenizer-training text that makes each of ``words`` (names, name parts, titles) frequent
    enough for BPE to merge it into few tokens: every word ``repeats`` times as its own text, with and
    without a leading space (how names appear mid-sentence and right after an XTML separator). Each is a
    separate text, so no merge learns a pair across two lexicon words. ``repeats`` 0 gives nothing.

    The built-in families list their words (`lexicon()`; `k3post.envs.families.lexicon` gathers them):
    with the plain corpus a 1024-token BPE spent its merges on the XTML structure and split
    "Quordel University" into 12 tokens (docs/decisions.md, "The full recipe").
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be a non-negative int, got {repeats!r}")
    out: list[str] = []
    for w in dict.fromkeys(words):
        if not isinstance(w, str) or not w.strip():
            raise ValueError(f"lexicon words must be non-empty strings, got {w!r}")
        out += [w, " " + w] * repeats
    return out


_SPECIAL_SPLIT = re.compile("|".join(re.escape(t) for t in _TRAINED_SPECIALS))


def _between_specials(corpus: Iterable[str]) -> Iterator[str]:
    """The text runs of each corpus text between special-token spellings: what `encode_text` will encode
    (XTML encodes the text between special ids on its own), so no merge spans a special token."""
    for text in corpus:
        for run in _SPECIAL_SPLIT.split(str(text)):
            if run:
                yield run


def _without_special_merges(backend: Tokenizer) -> Tokenizer:
    """``backend`` without any merge whose result spells a special token: BPE could otherwise build
    ``<|close|>`` from text pieces and give text the special id (a forged structure token). Found by the
    check in `special_ids` on a demo tokenizer whose corpus spelled the tokens (docs/decisions.md)."""
    spec = json.loads(backend.to_str())
    merges = spec["model"]["merges"]
    pair = (lambda m: m.split(" ", 1)) if merges and isinstance(merges[0], str) else (lambda m: m)
    kept = [m for m in merges if "".join(pair(m)) not in _TRAINED_SPECIALS]
    if len(kept) == len(merges):
        return backend
    spec["model"]["merges"] = kept
    return Tokenizer.from_str(json.dumps(spec))


def train_tokenizer(
    corpus: Iterable[str],
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    *,
    word_boundaries: bool = True,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with the XTML special tokens.

    Pre-tokenization splits every digit into its own piece, then applies GPT-2
    style byte-level splitting (no prefix space); the decoder is byte-level, so
    every byte sequence is representable and decoding is exact. The special
    tokens get ids ``0..4`` in the order of `ALL_SPECIAL_TOKENS`, the image placeholder
    `IMAGE_TOKEN` id 5; the 256 byte symbols come next, merges fill the rest of ``vocab_size``.

    Args:
        corpus: training texts (iterated once).
        vocab_size: target vocabulary size, at least 262. The trainer may stop
            short of it on a small corpus (no more merges to learn).
        out_dir: if given, the tokenizer is saved there so that
            ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads it.
        word_boundaries: True splits text at GPT-2 word boundaries before BPE (merges
            never cross a space). False lets merges span words, so text that recurs
            verbatim in every sample (XTML headers, the thinking-effort body) becomes a
            few tokens; the tiny demo uses it to spend its compute on the answer.
            Digits are split individually either way.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad_token="<|pad|>"`` and
        ``eos_token="<|end_of_msg|>"``; the other XTML tokens are additional
        special tokens.
    """
    _check_vocab_size(vocab_size)
    if isinstance(corpus, str):
        raise ValueError("corpus must be an iterable of strings, not a single string")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=word_boundaries),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_TRAINED_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_between_specials(corpus), trainer=trainer)
    backend = _without_special_merges(backend)
    for i, tok in enumerate(_TRAINED_SPECIALS):
        assert backend.token_to_id(tok) == i, f"special token {tok} not at id {i}"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=SPECIAL_TOKENS[3],
        additional_special_tokens=[*SPECIAL_TOKENS[:3], IMAGE_TOKEN],
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer(path: str | Path, *, require_xtml: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved by `train_tokenizer` (or any HF tokenizer directory / hub id).

    A foreign tokenizer (a real model's) may lack the XTML tokens: pass it to
    `ensure_xtml_tokens` together with the model. With ``require_xtml=True`` a
    missing XTML token is a `UserError` (exit 2) naming ``k3post add-tokens``, which does that on disk.
    """
    p = Path(path)
    if not p.exists() and str(path).startswith((".", "/")):
        raise ValueError(f"tokenizer path {str(path)!r} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if require_xtml:
        missing = _missing_tokens(tokenizer)
        if missing:
            raise UserError(
                f"{path}: the tokenizer lacks the XTML tokens {missing} as single ids; `k3post add-tokens {path} "
                "OUT_DIR` writes a copy with them added and the model's embeddings resized (then use OUT_DIR; "
                "`k3post sft` with model.path adds them itself; in Python: "
                "k3post.tokenizer.ensure_xtml_tokens(tokenizer, model))"
            )
    return tokenizer


def _single_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """The id of ``token`` if it is one whole vocabulary entry, else None."""
    vocab = tokenizer.get_vocab()
    tid = vocab.get(token)
    if tid is None:
        return None
    return int(tid)


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The tokenizer's own pad id, else the id of ``<|pad|>`` if it has one, else None."""
    if tokenizer.pad_token is not None and tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return _single_id(tokenizer, PAD_TOKEN)


def _missing_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """XTML tokens that are not single ids of ``tokenizer``, plus ``<|pad|>`` when it has no pad at all."""
    missing = [t for t in SPECIAL_TOKENS if _single_id(tokenizer, t) is None]
    return missing + ([PAD_TOKEN] if _pad_id(tokenizer) is None else [])


def special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Map each XTML token to its id, `PAD_TOKEN` to the pad id (the tokenizer's own pad token when it has
    one, e.g. K3's, else ``<|pad|>``), and `IMAGE_TOKEN` to its id where the tokenizer has it.

    ValueError if an XTML token or a pad is missing, or if text can spell an XTML token's id (the token is
    an ordinary vocabulary entry rather than a special one, so user text could forge structure)."""
    out: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        tid = _single_id(tokenizer, tok)
        if tid is None:
            raise ValueError(
                f"tokenizer has no single id for {tok!r}; call ensure_xtml_tokens(tokenizer, model)"
            )
        if tid in encode_text(tokenizer, tok):
            raise ValueError(
                f"tokenizer: the text {tok!r} encodes to its own id {tid}, so user text could forge XTML "
                "structure; register it as a special token (tokenizer.add_special_tokens)"
            )
        out[tok] = tid
    pad = _pad_id(tokenizer)
    if pad is None:
        raise ValueError("tokenizer has no pad token and no <|pad|>; call ensure_xtml_tokens(tokenizer, model)")
    out[PAD_TOKEN] = pad
    image = _single_id(tokenizer, IMAGE_TOKEN)
    if image is not None:
        out[IMAGE_TOKEN] = image
    return out


def ensure_xtml_tokens(tokenizer: PreTrainedTokenizerBase, model: Any | None = None) -> list[str]:
    """Make sure every XTML token is one special id of ``tokenizer`` and that it has a pad token.

    Tokens already present under their K3 names (a K3 tokenizer) are used as they are, and the tokenizer's
    own pad token is kept: nothing is added and the embeddings are not resized. Missing XTML tokens are
    added as special tokens (so they are never split), and ``<|pad|>`` only when the tokenizer has no pad
    token (it becomes the pad); if any were added and a ``model`` is given, its embeddings are resized with
    ``model.resize_token_embeddings(len(tokenizer))``. A ``warnings.warn`` names the added tokens, since
    their embeddings start untrained.

    Returns:
        The tokens that were added, in `ALL_SPECIAL_TOKENS` order (empty when
        nothing was missing).
    """
    missing = _missing_tokens(tokenizer)
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = PAD_TOKEN
    still = _missing_tokens(tokenizer)
    assert not still, f"failed to add XTML tokens {still}"
    if missing:
        msg = f"added XTML special tokens {missing} to the tokenizer (new, untrained embeddings)"
        if model is not None:
            old = int(model.get_input_embeddings().weight.shape[0])
            if len(tokenizer) > old:
                model.resize_token_embeddings(len(tokenizer))
                msg += f"; resized model embeddings {old} -> {len(tokenizer)}"
        warnings.warn(msg, UserWarning, stacklevel=2)
    try:
        _TEXT_BACKENDS.pop(tokenizer, None)
    except TypeError:
        pass
    return missing


# Per-tokenizer clone of the backend with `encode_special_tokens=True`: added
# special tokens are then matched as plain text. A clone (rather than toggling
# the flag on the shared backend) keeps `encode_text` thread-safe and leaves
# the tokenizer's own behaviour untouched.
_TEXT_BACKENDS: "weakref.WeakKeyDictionary[Any, tuple[int, Tokenizer]]" = weakref.WeakKeyDictionary()


def _text_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The never-special backend clone for ``tokenizer``, or None for slow tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    size = len(tokenizer)
    try:
        cached = _TEXT_BACKENDS.get(tokenizer)
    except TypeError:  # not weak-referenceable / hashable
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    clone = Tokenizer.from_str(backend.to_str())
    clone.encode_special_tokens = True
    try:
        _TEXT_BACKENDS[tokenizer] = (size, clone)
    except TypeError:
        pass
    return clone


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode ``text`` as ordinary tokens: never a special id, no BOS/EOS added.

    A string that spells ``<|end_of_msg|>`` (or any other special token) is
    split into ordinary byte-level tokens, so text from users, tools or
    documents cannot forge XTML structure.
    """
    if not isinstance(text, str):
        raise ValueError(f"encode_text expects a str, got {type(text).__name__}")
    if text == "":
        return []
    clone = _text_backend(tokenizer)
    if clone is not None:
        # encode_batch releases the GIL while it runs (encode does not): a server tokenising a long
        # prompt in a worker thread keeps its event loop going
        ids = list(clone.encode_batch([text], add_special_tokens=False)[0].ids)
    else:
        ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return ids


def text_offsets(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[int]:
    """``out[k] = len(decode(tokenizer, ids[:k]))``: where each token starts in the decoded text (the
    legacy completions ``text_offset``). Linear when every token decodes alone to whole characters whose
    lengths add up to the whole text's (byte-level BPE, ASCII or whole UTF-8 tokens); otherwise (a
    character split across tokens) each prefix is decoded, as the definition says."""
    pieces = [decode(tokenizer, [t]) for t in ids]
    if not any("\ufffd" in p for p in pieces) and sum(map(len, pieces)) == len(decode(tokenizer, ids)):
        out, pos = [], 0
        for p in pieces:
            out.append(pos)
            pos += len(p)
        return out
    return [len(decode(tokenizer, ids[:k])) for k in range(len(ids))]


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Decode ``ids`` exactly: special tokens written literally, no space clean-up.

    Incomplete UTF-8 at the end of ``ids`` (a character split across tokens)
    decodes to U+FFFD; decode whole segments when exactness matters.
    """
    ids = [int(i) for i in ids]
    if not ids:
        return ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
