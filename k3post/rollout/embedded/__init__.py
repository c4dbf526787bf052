"""The embedded rollout engine: `engine.EmbeddedEngine` (continuous batching, prefix sharing, pause / resume, KV
export / import, speculative decoding) over one of two forwards, `forward.LeanForward` (a Llama-style decoder op for
op, over a slot KV cache) or `k3post.rollout.hf_forward.HFForward` (the model's own forward, for every other
causal LM); `forward.lean_blocker` says which one a model gets. With ``exact=True`` it runs `exact.ExactForward`, the
batch-invariant forward whose log-probs the trainer recomputes bit for bit (``rl.rollout.exact``)."""

from k3post.rollout.embedded.engine import EmbeddedEngine
from k3post.rollout.embedded.forward import LEAN_MODEL_TYPES, LeanForward, lean_blocker

__all__ = ["EmbeddedEngine", "LEAN_MODEL_TYPES", "LeanForward", "lean_blocker"]
