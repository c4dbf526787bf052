"""The optimizer settings every trainer shares (`OptimConfig`, `k3post.trainer.build_optimizer` reads them) and RL's
(`PolicyOptimConfig`, ``rl.optim``: the optimizer with its schedule and gradient clip)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.ranges import ranged

__all__ = ["LR_SCHEDULES", "OPTIMIZERS", "OptimConfig", "PolicyOptimConfig", "check_keep_last"]

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "linear")


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


@dataclass
class PolicyOptimConfig(OptimConfig):
    """RL's and MOPD's optimizer (``rl.optim``): `OptimConfig` (``name``, ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``momentum``) with ``lr_schedule`` ("constant", or "linear" decay to ``lr / steps`` at the last
    step, `lr_at`) and ``grad_clip`` (max global grad norm; <= 0 disables)."""

    lr: float = ranged(1e-4, ge=0)
    lr_schedule: str = "constant"
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of the optimizer step that follows ``step`` finished steps of ``steps``: ``lr``
        ("constant"), or ``lr · (1 − step / steps)`` ("linear": from ``lr`` at the first step down to ``lr / steps``
        at the last)."""
        if self.lr_schedule == "linear" and steps > 0:
            return self.lr * max(0.0, 1.0 - step / steps)
        return self.lr
