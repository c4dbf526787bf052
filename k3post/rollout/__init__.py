"""Rollout engines behind one narrow protocol (STYLE.md point 6).

* ``engine``: the protocol (``RolloutEngine``, ``SteppableEngine``), ``SamplingParams``,
  ``GenerationRequest`` / ``GenerationResult`` / ``KVState`` and the counter-based sampler.
* ``embedded``: ``EmbeddedEngine``, continuous batching in pure PyTorch over an HF model.
* ``kv_cache``: the engine's static slot KV cache.
* ``adapters``: ``VLLMEngine`` and ``SGLangEngine`` (optional, GPU, lazy imports).

Shape legend: none here (see each module).
"""

from k3post.rollout.adapters import SGLangEngine, VLLMEngine
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    KVState,
    RolloutEngine,
    SamplingParams,
    SteppableEngine,
    sample_from_logits,
    token_uniform,
)
from k3post.rollout.kv_cache import SlotKVCache

__all__ = [
    "EmbeddedEngine",
    "VLLMEngine",
    "SGLangEngine",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "KVState",
    "RolloutEngine",
    "SteppableEngine",
    "SamplingParams",
    "SlotKVCache",
    "sample_from_logits",
    "token_uniform",
]
