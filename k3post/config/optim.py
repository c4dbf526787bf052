"""The optimizer settings SFT and RL share (`k3post.trainer.build_optimizer` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OPTIMIZERS", "OptimConfig", "check_keep_last"]

OPTIMIZERS = ("adamw", "sgd")


def check_keep_last(value: int, key: str) -> None:
    """ValueError naming ``key`` unless ``value`` is an int >= 1 (a stage's checkpoints kept on disk,
    `k3post.checkpoint.save_checkpoint`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1 (checkpoints kept on disk), got {value!r}")


@dataclass
class OptimConfig:
    """One optimizer: ``name`` (adamw | sgd), ``lr``, ``betas`` (AdamW), ``eps`` (AdamW), ``weight_decay``,
    ``momentum`` (SGD)."""

    name: str = "adamw"
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer name must be one of {OPTIMIZERS}, got {self.name!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0 or self.momentum < 0:
            raise ValueError("optimizer: lr >= 0, eps > 0, weight_decay >= 0 and momentum >= 0 are required")
