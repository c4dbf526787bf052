"""Reasoning-effort control settings (SPEC §3.3; `k3post.rewards.effort` reads them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from k3post.constants import DOMAINS, EFFORTS

__all__ = ["EffortConfig"]


@dataclass
class EffortConfig:
    """Reasoning-effort control (SPEC §3.3).

    Fields:
        tau_max / tau_high / tau_low: budget multiplier τ_e of each effort: a sample whose
            T(y) exceeds τ_e · b0(x) gets reward −1.
        max_cap: absolute cap of ``max``: its limit is min(τ_max, max_cap) · b0.
        domain_tau: per-domain overrides, domain -> effort -> τ (e.g.
            ``{"coding": {"max": 3.0}}``); efforts not named keep the global τ.
        b0_samples: K cold-start samples per task for the b0 estimate.
        b0_quantile: q of the estimate (quantile of T over a task's correct samples).
        min_b0: floor of every b0, in tokens (keeps limits and T/b0 defined).
        reference_floor: no limit of a reduced effort e (high, low) falls below T of the family's own scripted
            reference solution of the task at e: limit = max(s_e · b0, floor_e) **(ours, beyond SPEC)**; max keeps
            τ_max · b0 (a floor there let coding.max stay long and fail on demo seed 1). Without it a τ_low · b0
            under what the task's tool calls alone take makes every correct answer −1, and RL learns to fail
            short: in the demo agents.low fell 0.125 -> 0 (budget 105 tokens, every low reference 259-269),
            agents.high 0.156 -> 0.031 (budget 262, every high reference 296-321) and coding.low trained on
            groups that were all −1 (decisions, issue 31 §floor).
        curriculum: the order in which each domain's effort experts are trained; each stage
            continues from the previous one's expert, the first from the SFT checkpoint.
    """

    tau_max: float = 2.0
    tau_high: float = 1.0
    tau_low: float = 0.4
    max_cap: float = 4.0
    domain_tau: dict[str, dict[str, float]] = field(default_factory=dict)
    b0_samples: int = 4
    b0_quantile: float = 0.9
    min_b0: float = 1.0
    reference_floor: bool = True
    curriculum: list[str] = field(default_factory=lambda: ["max", "high", "low"])

    def __post_init__(self) -> None:
        for name in ("tau_max", "tau_high", "tau_low", "max_cap", "min_b0"):
            _check_positive(f"EffortConfig.{name}", getattr(self, name))
        for domain, taus in dict(self.domain_tau).items():
            if domain not in DOMAINS:
                raise ValueError(f"EffortConfig.domain_tau: unknown domain {domain!r}; expected one of {DOMAINS}")
            for effort, tau in dict(taus).items():
                if effort not in EFFORTS:
                    raise ValueError(f"EffortConfig.domain_tau.{domain}: unknown effort {effort!r}; expected one of {EFFORTS}")
                _check_positive(f"EffortConfig.domain_tau.{domain}.{effort}", tau)
        if isinstance(self.b0_samples, bool) or not isinstance(self.b0_samples, int) or self.b0_samples < 1:
            raise ValueError(f"EffortConfig.b0_samples must be a positive int, got {self.b0_samples!r}")
        if not (isinstance(self.b0_quantile, (int, float)) and 0.0 <= self.b0_quantile <= 1.0):
            raise ValueError(f"EffortConfig.b0_quantile must be in [0, 1], got {self.b0_quantile!r}")
        order = list(self.curriculum)
        if not order or len(set(order)) != len(order) or any(e not in EFFORTS for e in order):
            raise ValueError(f"EffortConfig.curriculum must list distinct efforts of {EFFORTS}, got {order!r}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
