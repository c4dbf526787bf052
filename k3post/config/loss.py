"""The policy loss's settings (``rl.loss``; `k3post.algos.policy_loss` and the RL signal read them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from k3post.config.ranges import ranged

__all__ = ["LossConfig"]


@dataclass
class LossConfig:
    """The policy loss (SPEC §3.1) and how advantages enter it.

    ``log_ratio_min`` / ``log_ratio_max``: the K2.5 band α, β of the log-ratio gradient mask; ``tau``: the quadratic
    regulariser; ``clip_eps_low`` / ``clip_eps_high``: PPO/DAPO clipping (inf = off); ``stop_gradient_ratio``
    (CISPO), ``sequence_ratio`` (GSPO), ``seq_mean`` (sequence-mean aggregation: each episode's token mean, averaged
    over the step's episodes). E.g. DAPO: ``log_ratio_min=-.inf log_ratio_max=.inf tau=0 clip_eps_low=0.2
    clip_eps_high=0.28``.
    ``normalize_std``: group advantages divided by the group's reward std (GRPO). ``skip_zero_variance``: drop groups
    whose rewards are all equal from the loss (DAPO's dynamic-sampling shortcut). Off by default: SPEC §3.1 applies
    τ·ℓ² to every sampled token and N counts them all, so such groups train with advantage 0 (only the regulariser
    acts on their possibly stale tokens).
    """

    log_ratio_min: float = ranged(-math.log(2.0), le=0, inf_ok=True)
    log_ratio_max: float = ranged(math.log(2.0), ge=0, inf_ok=True)
    tau: float = ranged(0.01, ge=0)
    clip_eps_low: float = ranged(math.inf, ge=0, inf_ok=True)
    clip_eps_high: float = ranged(math.inf, ge=0, inf_ok=True)
    stop_gradient_ratio: bool = False
    sequence_ratio: bool = False
    seq_mean: bool = False
    normalize_std: bool = False
    skip_zero_variance: bool = False

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """The `k3post.algos.policy_loss.policy_loss` parameters (the advantage settings stay with the signal)."""
        return {"log_ratio_min": self.log_ratio_min, "log_ratio_max": self.log_ratio_max, "tau": self.tau,
                "clip_eps_low": self.clip_eps_low, "clip_eps_high": self.clip_eps_high,
                "stop_gradient_ratio": self.stop_gradient_ratio, "sequence_ratio": self.sequence_ratio,
                "seq_mean": self.seq_mean}
