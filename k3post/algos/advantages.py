"""Group-relative advantages (SPEC §3.1) and their broadcast to tokens.

Shape legend: G responses in one group (the K samples of one prompt), B groups or sequences, T token positions.

    A_j = r_j − mean_k r_k                         (K2.5 / K3 / Dr.GRPO: no std division, no critic)
    A_j = (r_j − mean_k r_k) / (std_k r_k + eps)   (GRPO: normalize_std=True; std with Bessel's correction,
                                                    as TRL and verl compute it)

A group whose rewards are all equal has zero variance: it carries no learning signal, its advantages are
set to exactly 0 (the float mean of equal values need not equal them), and it is counted and skipped by the
trainer (SPEC §3.1).

Masked groups (``valid``): a sample whose infrastructure failed (`k3post.rollout.trajectory.Trajectory.infra`)
has no reward of the policy's making. The mean (and std) are over the valid samples only, the invalid ones
get advantage exactly 0 and the caller leaves them out of the loss; a group with fewer than two valid samples
has zero variance. Source: GRPO, DeepSeekMath (arXiv 2402.03300); Dr.GRPO (arXiv 2503.20783).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["GroupAdvantages", "expand_to_tokens", "group_advantages", "group_advantages_from_groups"]


def group_advantages(
    rewards_G_or_BG: torch.Tensor, *, normalize_std: bool = False, eps: float = 1e-6, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of one group [G] or of B equal-size groups [B, G], plus the zero-variance flag per group.

    ``valid`` (bool, the rewards' shape; default all True) masks samples out (module doc): mean and std over
    the valid ones, advantage 0 for the others (whatever their reward, NaN included).

    Returns (advantages, zero_variance): advantages has the rewards' shape (float; integer rewards become
    float32); zero_variance is a bool tensor of shape [] for [G] input, [B] for [B, G]; its sum is the count.
    A group of one (valid) response has zero variance.
    """
    if rewards_G_or_BG.dim() not in (1, 2) or rewards_G_or_BG.shape[-1] == 0:
        raise ValueError(f"rewards must be [G] or [B, G] with G >= 1, got shape {tuple(rewards_G_or_BG.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards_G_or_BG if rewards_G_or_BG.is_floating_point() else rewards_G_or_BG.float()
    if valid is None:
        adv = r - r.mean(-1, keepdim=True)
        if normalize_std and r.shape[-1] > 1:
            adv = adv / (r.std(-1, keepdim=True) + eps)
        zero_variance = (r == r[..., :1]).all(-1)
        return torch.where(zero_variance[..., None], 0.0, adv), zero_variance
    if valid.shape != r.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor of the rewards' shape {tuple(r.shape)}, got "
                         f"{valid.dtype} {tuple(valid.shape)}")
    rv = torch.where(valid, r, 0.0)  # invalid rewards (any value) never reach the statistics
    n = valid.sum(-1, keepdim=True)
    mean = rv.sum(-1, keepdim=True) / n.clamp(min=1)
    adv = torch.where(valid, r - mean, 0.0)
    if normalize_std:
        var = (adv * adv).sum(-1, keepdim=True) / (n - 1).clamp(min=1)  # Bessel, over the valid samples
        adv = torch.where(n > 1, adv / (var.sqrt() + eps), adv)
    first = torch.where(valid, rv, torch.inf).amin(-1, keepdim=True)  # any valid reward (inf when none)
    zero_variance = (~valid | (rv == first)).all(-1) | (n[..., 0] < 2)
    return torch.where(zero_variance[..., None] | ~valid, 0.0, adv), zero_variance


@dataclass(frozen=True)
class GroupAdvantages:
    """Per-group advantages of groups of any sizes; ``skip[i]`` is True for a zero-variance group."""

    advantages: list[list[float]]
    num_zero_variance: int
    skip: list[bool]


def group_advantages_from_groups(
    rewards: Sequence[Sequence[float]], *, normalize_std: bool = False, eps: float = 1e-6,
    valid: Sequence[Sequence[bool]] | None = None,
) -> GroupAdvantages:
    """`group_advantages` for a list of groups (reward lists, possibly of different sizes), in float64;
    ``valid``: per group, the mask of `group_advantages` (default: every sample valid)."""
    if valid is not None and [len(v) for v in valid] != [len(g) for g in rewards]:
        raise ValueError("valid must hold one flag per reward of each group")
    masks: list[torch.Tensor | None] = ([None] * len(rewards) if valid is None
                                        else [torch.tensor([bool(x) for x in v], dtype=torch.bool) for v in valid])
    per_group = [group_advantages(torch.tensor(g, dtype=torch.float64), normalize_std=normalize_std, eps=eps, valid=m)
                 for g, m in zip(rewards, masks)]
    skip = [bool(zero) for _, zero in per_group]
    return GroupAdvantages([adv.tolist() for adv, _ in per_group], sum(skip), skip)


def expand_to_tokens(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """advantages_BT[b, t] = adv_B[b] where mask_BT[b, t] != 0, else exactly 0."""
    if adv_B.dim() != 1 or mask_BT.dim() != 2 or adv_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(f"need adv_B [B] and mask_BT [B, T], got {tuple(adv_B.shape)} and {tuple(mask_BT.shape)}")
    adv_B = adv_B if adv_B.is_floating_point() else adv_B.float()
    return torch.where(mask_BT.bool(), adv_B[:, None], 0.0)
