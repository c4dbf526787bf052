"""Policy-gradient loss on sampled tokens (SPEC §3.1): the K2.5 loss and its relatives, one code path.

Shape legend: B sequences (responses), T token positions (right-padded); valid tokens have mask_BT != 0.

Per valid token (ref_logp = old_logp_BT when given, else behavior_logp_BT):

    ℓ    = logp − ref_logp                                  token log-ratio
    ℓ_r  = ℓ, or mean_t ℓ over the sequence (sequence_ratio, GSPO), the log of the ratio r = exp(ℓ_r)
    r̄    = clamp(r, 1 − clip_eps_low, 1 + clip_eps_high)
    m    = 1[log_ratio_min ≤ ℓ_r ≤ log_ratio_max]           K2.5 gradient mask (any sign of A)
    w    = min(ρ, is_cap) · 1[is_min ≤ ρ ≤ is_max],  ρ = exp(old_logp − behavior_logp)   TIS / MIS weight
           (w = 1 when old_logp_BT is None)
    pg   = min(r·A, r̄·A),   or  sg(r̄)·A·logp  when stop_gradient_ratio (CISPO)
    j    = w · m · pg − tau · ℓ²
    loss = −Σ j / D      D = N valid tokens (token-mean); or, with seq_mean, the mean over non-empty sequences
                         of Σ_t j / n_b (seq-mean-token-mean); token_normalizer replaces N or n_b by a constant.

Variants (every other argument at its default unless named):

    K2.5 (default)      log_ratio_min=−log 2, log_ratio_max=log 2, tau=0.01; no clip, no IS weight.
    PPO / GRPO          log_ratio_min=−inf, log_ratio_max=inf, tau=0, clip_eps_low=clip_eps_high=0.2
                        (GRPO's own aggregation: seq_mean=True).
    DAPO clip-higher    as PPO with clip_eps_low=0.2, clip_eps_high=0.28 (token-mean).
    Dr.GRPO             as GRPO with seq_mean=True, token_normalizer=L (a constant, e.g. the generation budget)
                        and advantages without std division (group_advantages(normalize_std=False)).
    CISPO               stop_gradient_ratio=True, clip_eps_low=inf, clip_eps_high=ε (band off, tau=0).
    GSPO                sequence_ratio=True, clip_eps_low=3e-4, clip_eps_high=4e-4, seq_mean=True (band off, tau=0).
    TIS                 old_logp_BT=trainer's recomputed π_old, is_cap=C (e.g. 2); with old_logp_BT and the
                        is_* defaults the full, untruncated weight ρ applies.
    MIS                 old_logp_BT=..., is_min=lo, is_max=hi (tokens with ρ outside [lo, hi] get w = 0).
    Gradient accumulation: token_normalizer = the valid-token count of the whole optimizer step.

Decisions: the band mask m and the clip act on ℓ_r (sequence level under GSPO); the quadratic term always
uses the token ℓ. The IS weight w scales only the policy-gradient term; MIS-dropped tokens still count in N,
so the loss scale does not depend on how many were dropped. Inputs are cast to float32. Pads may hold any
value (inf, nan): they are replaced by zero before any arithmetic, so their loss contribution and gradient
are exactly zero. With no valid token the loss is 0 (still attached to the graph).

Sources: Kimi K2.5 / K3 reports (the per-token mask and quadratic regulariser); PPO, Schulman et al. 2017
(arXiv 1707.06347); GRPO, DeepSeekMath (arXiv 2402.03300); DAPO (arXiv 2503.14476); Dr.GRPO (arXiv
2503.20783); CISPO, MiniMax-M1 (arXiv 2506.13585); GSPO (arXiv 2507.18071); TIS, Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"; MIS, masked importance sampling as in
verl's rollout correction.
"""

from __future__ import annotations

import math

import torch

__all__ = ["policy_loss"]

LOG2 = math.log(2.0)


def policy_loss(
    logp_BT: torch.Tensor,
    behavior_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    log_ratio_min: float = -LOG2,
    log_ratio_max: float = LOG2,
    tau: float = 0.01,
    clip_eps_low: float = math.inf,
    clip_eps_high: float = math.inf,
    stop_gradient_ratio: bool = False,
    sequence_ratio: bool = False,
    old_logp_BT: torch.Tensor | None = None,
    is_cap: float = math.inf,
    is_min: float = 0.0,
    is_max: float = math.inf,
    seq_mean: bool = False,
    token_normalizer: float | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (a 0-d tensor to minimise) and detached float metrics; see the module docstring for the formula.

    logp_BT carries the gradient (current policy); behavior_logp_BT (the rollout engine's log-probs),
    advantages_BT and old_logp_BT are treated as constants. Metrics: masked_frac (valid tokens outside the
    band or the clip range), mean_abs_log_ratio / max_abs_log_ratio (token |ℓ|), train_rollout_logp_gap
    (mean |logp − behavior_logp|), num_tokens, entropy (when entropy_BT is given), is_weight_mean and
    is_dropped_frac (when old_logp_BT is given).
    """
    _check(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, old_logp_BT, entropy_BT)
    if log_ratio_min > log_ratio_max or tau < 0 or clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError("need log_ratio_min <= log_ratio_max, tau >= 0 and clip_eps_low, clip_eps_high >= 0")
    if is_cap <= 0 or not 0 <= is_min <= is_max or (token_normalizer is not None and token_normalizer <= 0):
        raise ValueError("need is_cap > 0, 0 <= is_min <= is_max and token_normalizer > 0")

    valid_BT = mask_BT.bool()
    logp_BT = _zero_pads(logp_BT, valid_BT)
    behavior_BT = _zero_pads(behavior_logp_BT, valid_BT).detach()
    ref_BT = behavior_BT if old_logp_BT is None else _zero_pads(old_logp_BT, valid_BT).detach()
    adv_BT = _zero_pads(advantages_BT, valid_BT).detach()
    n_B = valid_BT.sum(-1)

    log_ratio_BT = logp_BT - ref_BT  # exactly 0 at pads
    ratio_log_BT = log_ratio_BT
    if sequence_ratio:
        seq_B = log_ratio_BT.sum(-1) / n_B.clamp_min(1)
        ratio_log_BT = torch.where(valid_BT, seq_B[:, None].expand_as(log_ratio_BT), 0.0)
    ratio_BT = ratio_log_BT.exp()
    clipped_BT = ratio_BT.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    in_band_BT = (ratio_log_BT >= log_ratio_min) & (ratio_log_BT <= log_ratio_max)

    if stop_gradient_ratio:
        pg_BT = clipped_BT.detach() * adv_BT * logp_BT
    else:
        pg_BT = torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    weight_BT = torch.ones_like(ref_BT)
    if old_logp_BT is not None:
        rho_BT = (ref_BT - behavior_BT).exp()
        weight_BT = rho_BT.clamp(max=is_cap) * ((rho_BT >= is_min) & (rho_BT <= is_max))
    j_BT = torch.where(valid_BT & in_band_BT, weight_BT * pg_BT, 0.0) - tau * log_ratio_BT.square()

    if seq_mean:
        per_seq_B = j_BT.sum(-1) / (n_B.clamp_min(1) if token_normalizer is None else token_normalizer)
        loss = -per_seq_B.sum() / (n_B > 0).sum().clamp_min(1)
    else:
        loss = -j_BT.sum() / (n_B.sum().clamp_min(1) if token_normalizer is None else token_normalizer)

    with torch.no_grad():
        num = n_B.sum().clamp_min(1)
        abs_lr_BT = log_ratio_BT.abs()
        outside_BT = valid_BT & (~in_band_BT | (clipped_BT != ratio_BT))
        metrics = {
            "masked_frac": float(outside_BT.sum() / num),
            "mean_abs_log_ratio": float(abs_lr_BT.sum() / num),
            "max_abs_log_ratio": float(abs_lr_BT.amax()) if abs_lr_BT.numel() else 0.0,
            "train_rollout_logp_gap": float((logp_BT - behavior_BT).abs().sum() / num),
            "num_tokens": float(n_B.sum()),
        }
        if entropy_BT is not None:
            metrics["entropy"] = float(_zero_pads(entropy_BT, valid_BT).sum() / num)
        if old_logp_BT is not None:
            metrics["is_weight_mean"] = float(torch.where(valid_BT, weight_BT, 0.0).sum() / num)
            metrics["is_dropped_frac"] = float((valid_BT & (weight_BT == 0)).sum() / num)
    return loss, metrics


def _zero_pads(x_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """float32 copy of x with every pad replaced by 0 (torch.where: no inf/nan from pads reaches the math)."""
    return torch.where(valid_BT, x_BT.float(), 0.0)


def _check(logp_BT: torch.Tensor, *others: torch.Tensor | None) -> None:
    if logp_BT.dim() != 2:
        raise ValueError(f"logp_BT must be [B, T], got shape {tuple(logp_BT.shape)}")
    for x in others:
        if x is not None and x.shape != logp_BT.shape:
            raise ValueError(f"every per-token tensor must have shape {tuple(logp_BT.shape)}, got {tuple(x.shape)}")
