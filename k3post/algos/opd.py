"""On-policy distillation reward (SPEC §4, MOPD): a per-token advantage from the teacher.

Shape legend: B sequences (student samples), T token positions (right-padded); valid tokens have mask_BT != 0.

    r_t = clip( sg( log π_teacher(y_t | x, y_<t) − log π_student(y_t | e, x, y_<t) ), −r_max, r_max )
          + w_orm · A_outcome(y)                      (optional outcome advantage, broadcast to the tokens)

y is the student's own sample, so the mean of (student − teacher) over its tokens is the single-sample (k1)
estimate of the reverse KL(π_student ‖ π_teacher); r_t is its negative per token, clipped. The reward is
used as advantages_BT of `policy_loss` (K2.5 mask + quadratic regulariser), so the RL trainer and partial
rollout run unchanged. Defaults (ours, SPEC §4): r_max = 5, w_orm = 0.
Source: Kimi K3 report §4 (MOPD); on-policy distillation as in prime-rl's algo/opd.py and tinker-cookbook.
"""

from __future__ import annotations

import torch

from k3post.algos.advantages import expand_to_tokens

__all__ = ["opd_reward"]


def opd_reward(
    teacher_logp_BT: torch.Tensor,
    student_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    r_max: float = 5.0,
    outcome_advantages_B: torch.Tensor | None = None,
    w_orm: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token reward_BT (float32, no grad, exactly 0 at pads whatever they hold) and float metrics:
    mean_reward (over valid tokens, outcome term included), clip_frac (valid tokens with |teacher − student|
    > r_max), reverse_kl (mean of student − teacher, unclipped), num_tokens."""
    if teacher_logp_BT.dim() != 2 or not teacher_logp_BT.shape == student_logp_BT.shape == mask_BT.shape:
        raise ValueError(
            "teacher_logp_BT, student_logp_BT and mask_BT must share one [B, T] shape, got "
            f"{tuple(teacher_logp_BT.shape)}, {tuple(student_logp_BT.shape)}, {tuple(mask_BT.shape)}"
        )
    if r_max <= 0:
        raise ValueError(f"r_max must be > 0, got {r_max}")
    with torch.no_grad():
        valid_BT = mask_BT.bool()
        gap_BT = torch.where(valid_BT, teacher_logp_BT.float() - student_logp_BT.float(), 0.0)
        reward_BT = gap_BT.clamp(-r_max, r_max)
        if outcome_advantages_B is not None:
            reward_BT = reward_BT + w_orm * expand_to_tokens(outcome_advantages_B.float(), valid_BT)
        num = valid_BT.sum().clamp_min(1)
        metrics = {
            "mean_reward": float(reward_BT.sum() / num),
            "clip_frac": float((gap_BT.abs() > r_max).sum() / num),
            "reverse_kl": float(-gap_BT.sum() / num),
            "num_tokens": float(valid_BT.sum()),
        }
    return reward_BT, metrics
