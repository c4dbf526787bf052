"""Draft-model losses at temperature 1 (SPEC §6.2): the acceptance rate is what speculative decoding pays for.

With target distribution p and draft distribution q at one position, a drafted token is accepted with
probability α = Σ_x min(p(x), q(x)) (SPEC §6.2's rejection rule). The losses:

- ``lk_alpha``: LK_α = −log α, the K3 loss (no cross-entropy term): it maximises the acceptance rate itself.
- ``lk_lambda``: the adaptive hybrid LK_λ = λ·KL(p ‖ q) + (1 − λ)·(1 − α) with λ = exp(−η·α), α detached in λ
  (λ is a weight, never a path for gradients): far from the target (α small) it is mostly KL, whose gradient
  is informative everywhere; close to it (α large) mostly 1 − α.
- ``kl``: forward KL(p ‖ q), the baseline LK is measured against.

Reduced draft vocabulary: the draft predicts over V_d target ids (``draft_ids``, the ``t`` of ``d2t``). α sums
``min(p, q)`` over those ids with the target's *unrenormalised* p: mass the target puts outside the draft
vocabulary can never be accepted, so it must lower α. KL uses p renormalised over the draft vocabulary (a
distribution on the same support as q).

−log α is finite as α → 0: α is floored at ``ALPHA_FLOOR`` inside the log (documented departure: the
report's loss is unbounded there; a draft that puts no mass where the target does would otherwise give an
infinite loss and NaN gradients).

Shape legend: N positions (any leading shape, flattened), V target vocabulary, D draft vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3post.config.draft import DRAFT_LOSSES

__all__ = ["DRAFT_LOSSES", "ALPHA_FLOOR", "DraftLoss", "acceptance", "draft_loss"]

ALPHA_FLOOR = 1e-6
"""Smallest α inside −log α (LK_α stays ≤ −log 1e-6 ≈ 13.8 and its gradient finite)."""


@dataclass(frozen=True)
class DraftLoss:
    """A loss value (mean over the masked positions, with gradient) and its diagnostics (detached means):
    ``alpha`` the expected acceptance rate Σ min(p, q), ``kl`` KL(p ‖ q) (renormalised p on a reduced
    vocabulary), ``lam`` the hybrid's mean λ (0 for the other losses), ``n`` the positions counted."""

    loss: torch.Tensor
    alpha: float
    kl: float
    lam: float
    n: int


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _distributions(
    target_logits_NV: torch.Tensor, draft_logits_ND: torch.Tensor, draft_ids_D: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p on the draft ids, unrenormalised [N, D]; log q [N, D]; log p renormalised on the draft ids [N, D])."""
    logp_NV = torch.log_softmax(_at_least_fp32(target_logits_NV), dim=-1)
    logq_ND = torch.log_softmax(_at_least_fp32(draft_logits_ND), dim=-1)
    if draft_ids_D is None:
        if logp_NV.shape[-1] != logq_ND.shape[-1]:
            raise ValueError(f"draft logits have {logq_ND.shape[-1]} classes, target {logp_NV.shape[-1]}: "
                             "pass draft_ids for a reduced draft vocabulary")
        return logp_NV.exp(), logq_ND, logp_NV
    if draft_ids_D.shape != (logq_ND.shape[-1],):
        raise ValueError(f"draft_ids has shape {tuple(draft_ids_D.shape)}, expected ({logq_ND.shape[-1]},)")
    logp_ND = logp_NV.index_select(-1, draft_ids_D.to(logp_NV.device))
    return logp_ND.exp(), logq_ND, logp_ND - torch.logsumexp(logp_ND, dim=-1, keepdim=True)


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """α = Σ_x min(p(x), q(x)) per position (shape of the logits without the last dim), at temperature 1."""
    p, logq, _ = _distributions(target_logits.reshape(-1, target_logits.shape[-1]),
                                draft_logits.reshape(-1, draft_logits.shape[-1]), draft_ids)
    return torch.minimum(p, logq.exp()).sum(-1).reshape(draft_logits.shape[:-1])


def draft_loss(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "lk_alpha",
    eta: float = 3.0,
    draft_ids: torch.Tensor | None = None,
) -> DraftLoss:
    """The ``kind`` loss (module doc) averaged over the positions where ``mask`` is True.

    Args:
        target_logits: [..., V] the frozen target's logits (no gradient needed).
        draft_logits: [..., D] the draft's logits at the same positions (D = V, or the reduced vocabulary).
        mask: [...] bool, positions that count (None: all).
        kind: ``lk_alpha`` | ``lk_lambda`` | ``kl``.
        eta: LK_λ's η in λ = exp(−η·α) (our default 3: λ ≈ 0.74 at α = 0.1, 0.22 at α = 0.5, 0.05 at α = 1).
        draft_ids: [D] the target id of each draft class (reduced vocabulary), or None.
    """
    if kind not in DRAFT_LOSSES:
        raise ValueError(f"draft loss kind must be one of {DRAFT_LOSSES}, got {kind!r}")
    if not math.isfinite(eta) or eta < 0:
        raise ValueError(f"eta must be a finite number >= 0, got {eta!r}")
    if target_logits.shape[:-1] != draft_logits.shape[:-1]:
        raise ValueError(f"target logits {tuple(target_logits.shape)} and draft logits {tuple(draft_logits.shape)} "
                         "cover different positions")
    keep = (torch.ones(draft_logits.shape[:-1], dtype=torch.bool, device=draft_logits.device) if mask is None
            else mask.to(torch.bool))
    if keep.shape != draft_logits.shape[:-1]:
        raise ValueError(f"mask has shape {tuple(keep.shape)}, expected {tuple(draft_logits.shape[:-1])}")
    p_ND, logq_ND, logpn_ND = _distributions(target_logits[keep], draft_logits[keep], draft_ids)
    n = int(p_ND.shape[0])
    alpha_N = torch.minimum(p_ND, logq_ND.exp()).sum(-1)
    kl_N = (logpn_ND.exp() * (logpn_ND - logq_ND)).sum(-1)
    lam_N = torch.exp(-eta * alpha_N.detach()) if kind == "lk_lambda" else torch.zeros_like(alpha_N)
    if kind == "lk_alpha":
        per_N = -torch.log(alpha_N.clamp_min(ALPHA_FLOOR))
    elif kind == "lk_lambda":
        per_N = lam_N * kl_N + (1 - lam_N) * (1 - alpha_N)
    else:
        per_N = kl_N
    loss = per_N.mean() if n else draft_logits.sum() * 0.0
    mean = (lambda t: float(t.detach().mean()) if n else 0.0)
    return DraftLoss(loss=loss, alpha=mean(alpha_N), kl=mean(kl_N), lam=mean(lam_N), n=n)
