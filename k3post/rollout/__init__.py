"""Rollout engines behind one narrow protocol (STYLE.md point 6).

* ``engine``: the protocol (``RolloutEngine``, ``SteppableEngine``), ``SamplingParams``,
  ``GenerationRequest`` / ``GenerationResult`` / ``KVState`` and the counter-based sampler.
* ``embedded``: ``EmbeddedEngine``, continuous batching in pure PyTorch over an HF model.
* ``kv_cache``: the engine's static slot KV cache.
* ``http_engine``: ``HTTPEngine``, the steppable protocol over ``k3post serve`` engine servers
  (routing, pause = abort + continuation, retries and re-routing on dead servers).
* ``adapters``: ``VLLMEngine`` and ``SGLangEngine`` (optional, GPU, lazy imports).
* ``trajectory``: ``Trajectory`` (per-token trainable mask, behaviour log-probs, policy versions) and ``Group``.
* ``agent_loop``: ``AgentLoop``, multi-turn episodes over the engine with the XTML multi-turn extension.
* ``kv_pool``: ``KVPool``, the byte-budgeted LRU CPU pool of paused trajectories' KV caches.
* ``scheduler``: ``PartialRolloutScheduler`` (SPEC §3.2).
* ``speculative``: speculative decoding in ``EmbeddedEngine`` (``Drafter``, ``SpeculativeConfig``); ``model_drafter``: ``ModelDrafter``.

Shape legend: none here (see each module).
"""

from k3post.rollout.adapters import SGLangEngine, VLLMEngine
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    KVState,
    RolloutEngine,
    ScoringEngine,
    SamplingParams,
    SteppableEngine,
    sample_from_logits,
    token_uniform,
)
from k3post.rollout.http_engine import EngineUnavailableError, HTTPEngine
from k3post.rollout.kv_cache import SlotKVCache
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.model_drafter import ModelDrafter
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.rollout.speculative import Drafter, SpeculativeConfig
from k3post.rollout.trajectory import Group, Trajectory

__all__ = [
    "Drafter",
    "ModelDrafter",
    "SpeculativeConfig",
    "AgentLoop",
    "Group",
    "KVPool",
    "PartialRolloutScheduler",
    "Trajectory",
    "EmbeddedEngine",
    "HTTPEngine",
    "EngineUnavailableError",
    "VLLMEngine",
    "SGLangEngine",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "KVState",
    "RolloutEngine",
    "ScoringEngine",
    "SteppableEngine",
    "SamplingParams",
    "SlotKVCache",
    "sample_from_logits",
    "token_uniform",
]
