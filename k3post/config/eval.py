"""Held-out evaluation settings (`k3post.recipes.evaluate` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.ranges import ranged
from k3post.config.rollout import EngineConfig

__all__ = ["EvalConfig"]


@dataclass
class EvalConfig:
    """Held-out evaluation settings."""

    efforts: list[str] = field(default_factory=lambda: ["max", "high", "low"])
    max_new_tokens: int = ranged(96, ge=1)
    batch_size: int = ranged(64, ge=1)  # engine slots: above the engine's dense_moe_max_tokens (64) decode steps take the slower HF MoE path (measured 11 s vs 28 s for 200 prompts)
    n_examples: int = ranged(3, ge=0)  # completions kept per effort for the report
    temperature: float = ranged(0.0, ge=0)  # 0: greedy; > 0: one sample per task, i.e. pass@1 at this temperature
    seed: int = 0  # sampling seed when temperature > 0 (task i uses request_seed(seed, str(i)))
    engine: EngineConfig = field(default_factory=EngineConfig)  # embedded, or http with launch (the model evaluated is frozen)
