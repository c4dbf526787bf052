"""Which tokenizer and model a run starts from (`k3post.tokenizer`, `k3post.models` read these)."""

from __future__ import annotations

from dataclasses import dataclass

from k3post.config.ranges import ranged

__all__ = ["TokenizerConfig", "ModelConfig", "DTYPES"]

DTYPES = ("float32", "fp32", "bfloat16", "bf16")  # the names k3post.models.torch_dtype maps


@dataclass
class TokenizerConfig:
    """How the run gets its tokenizer."""

    path: str | None = None  # a saved tokenizer folder; None trains a byte-level BPE on the task corpus
    vocab_size: int = ranged(1024, ge=1)  # BPE vocabulary size when training one (special tokens included)
    # False lets BPE merges span words, so the text every sample repeats (XTML headers, the
    # thinking-effort body) shrinks to a few tokens; measured on the demo data: 140 → 95 tokens per sample
    word_boundaries: bool = False
    # > 0 adds every built-in family's lexicon (entity-name syllables, first names, titles) to the BPE corpus
    # this many times per word (k3post.tokenizer.lexicon_corpus), so names are a few tokens; 0 = off
    lexicon_repeats: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.lexicon_repeats, bool) or not isinstance(self.lexicon_repeats, int) or self.lexicon_repeats < 0:
            raise ValueError(f"tokenizer.lexicon_repeats must be an integer >= 0, got {self.lexicon_repeats!r}")


@dataclass
class ModelConfig:
    """Which model the run starts from."""

    path: str | None = None  # a local HF model folder (safetensors); None builds `preset` from scratch
    preset: str = "tiny"  # a key of k3post.models.PRESETS, used when path is None
    max_position_embeddings: int = ranged(2048, ge=1)
    dtype: str = "float32"  # master weight dtype: float32 | bfloat16

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
