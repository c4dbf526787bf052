"""k3post.spec.losses: golden values worked by hand, the reduced-vocabulary rule, and the properties SPEC §6.2
and the issue name (0 at q = p, finite as α → 0, λ carries no gradient, the gradient of LK_α is that of α)."""

from __future__ import annotations

import math

import pytest
import torch

from k3post.spec.losses import ALPHA_FLOOR, acceptance, draft_loss


def logits(*probs: float) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (log-probabilities)."""
    return torch.tensor(probs, dtype=torch.float64).log()


P = logits(0.5, 0.3, 0.2)
Q = logits(0.2, 0.5, 0.3)
# by hand: α = min(.5,.2) + min(.3,.5) + min(.2,.3) = 0.7
#          KL(p‖q) = .5 ln 2.5 + .3 ln .6 + .2 ln(2/3) = 0.458145 − 0.153248 − 0.081093 = 0.223804
ALPHA, KL = 0.7, 0.5 * math.log(2.5) + 0.3 * math.log(0.6) + 0.2 * math.log(2 / 3)


def test_golden_values_full_vocabulary() -> None:
    assert acceptance(P, Q).item() == pytest.approx(ALPHA, abs=1e-12)
    a = draft_loss(P, Q, kind="lk_alpha")
    assert a.loss.item() == pytest.approx(-math.log(0.7), abs=1e-6) and a.alpha == pytest.approx(ALPHA, abs=1e-6)
    k = draft_loss(P, Q, kind="kl")
    assert k.loss.item() == pytest.approx(KL, abs=1e-6) and KL == pytest.approx(0.223804, abs=1e-6)
    # LK_λ with η = 1: λ = e^−0.7 = 0.496585; 0.496585·0.223804 + 0.503415·0.3 = 0.262163
    h = draft_loss(P, Q, kind="lk_lambda", eta=1.0)
    assert h.lam == pytest.approx(math.exp(-0.7), abs=1e-6)
    assert h.loss.item() == pytest.approx(0.262163, abs=1e-6)


def test_reduced_vocabulary_alpha_unrenormalised_kl_renormalised() -> None:
    """Target p = [.4, .3, .2, .1]; the draft predicts target ids [0, 2] with q = [.6, .4].
    α = min(.4, .6) + min(.2, .4) = 0.6 (the 0.4 of mass on ids 1 and 3 can never be accepted);
    KL uses p renormalised on {0, 2}: [2/3, 1/3] → 2/3 ln((2/3)/.6) + 1/3 ln((1/3)/.4) = 0.009467."""
    p, q, ids = logits(0.4, 0.3, 0.2, 0.1), logits(0.6, 0.4), torch.tensor([0, 2])
    assert acceptance(p, q, ids).item() == pytest.approx(0.6, abs=1e-12)
    out = draft_loss(p, q, kind="kl", draft_ids=ids)
    want = 2 / 3 * math.log((2 / 3) / 0.6) + 1 / 3 * math.log((1 / 3) / 0.4)
    assert out.loss.item() == pytest.approx(want, abs=1e-7) and want == pytest.approx(0.009467, abs=1e-6)
    assert draft_loss(p, q, kind="lk_alpha", draft_ids=ids).loss.item() == pytest.approx(-math.log(0.6), abs=1e-7)
    # even a draft equal to the renormalised target cannot exceed the target's mass on its vocabulary
    best = draft_loss(p, logits(2 / 3, 1 / 3), kind="lk_alpha", draft_ids=ids)
    assert best.alpha == pytest.approx(0.6, abs=1e-7) and best.kl == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="draft_ids"):
        draft_loss(p, q)


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda", "kl"])
def test_zero_at_q_equal_p(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 11, generator=g)
    out = draft_loss(x, x.clone(), kind=kind)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6) and out.alpha == pytest.approx(1.0, abs=1e-6)


def test_finite_as_alpha_goes_to_zero() -> None:
    """Disjoint supports (α → 0): every loss and its gradient stay finite."""
    for gap in (10.0, 40.0, 200.0):
        p = torch.tensor([[gap, 0.0, 0.0, -gap]])
        q = torch.tensor([[-gap, 0.0, 0.0, gap]], requires_grad=True)
        for kind in ("lk_alpha", "lk_lambda", "kl"):
            out = draft_loss(p, q, kind=kind)
            out.loss.backward()
            assert math.isfinite(out.loss.item()) and torch.isfinite(q.grad).all(), (gap, kind)
            q.grad = None
        assert draft_loss(p, q, kind="lk_alpha").loss.item() <= -math.log(ALPHA_FLOOR) * (1 + 1e-6)  # the floor (fp32)


def test_lambda_carries_no_gradient() -> None:
    """∂LK_λ/∂q = λ·∂KL/∂q − (1 − λ)·∂α/∂q with λ a constant: the autograd gradient equals that
    combination of the KL and α gradients taken separately (a λ with gradient adds a −η·λ·∂α·(KL − (1−α))
    term and fails this)."""
    g = torch.Generator().manual_seed(1)
    p = torch.randn(6, 9, generator=g)
    q0 = torch.randn(6, 9, generator=g)

    def grad(kind: str) -> tuple[torch.Tensor, float]:
        q = q0.clone().requires_grad_(True)
        out = draft_loss(p, q, kind=kind, eta=2.0)
        out.loss.backward()
        return q.grad, out.lam

    g_h, _ = grad("lk_lambda")
    q = q0.clone().requires_grad_(True)
    alpha_N = acceptance(p, q)
    lam_N = torch.exp(-2.0 * alpha_N.detach())
    kl_N = (torch.softmax(p, -1) * (torch.log_softmax(p, -1) - torch.log_softmax(q, -1))).sum(-1)
    (lam_N * kl_N + (1 - lam_N) * (1 - alpha_N)).mean().backward()
    assert torch.allclose(g_h, q.grad, atol=1e-6)


def test_lk_alpha_gradient_raises_acceptance() -> None:
    """One gradient step on LK_α raises α (the loss optimises acceptance directly); masked positions get no
    gradient."""
    g = torch.Generator().manual_seed(2)
    p = torch.randn(4, 16, generator=g)
    q = torch.randn(4, 16, generator=g, requires_grad=True)
    mask = torch.tensor([True, True, False, True])
    out = draft_loss(p, q, mask, kind="lk_alpha")
    out.loss.backward()
    assert torch.all(q.grad[2] == 0) and out.n == 3
    with torch.no_grad():
        stepped = q - 0.5 * q.grad
    assert acceptance(p[mask], stepped[mask]).mean() > acceptance(p[mask], q[mask].detach()).mean()


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        draft_loss(P, Q, kind="ce")
    with pytest.raises(ValueError, match="different positions"):
        draft_loss(P[None], Q[None].expand(2, 3))
    with pytest.raises(ValueError, match="mask has shape"):
        draft_loss(P[None], Q[None], torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="eta"):
        draft_loss(P, Q, kind="lk_lambda", eta=float("nan"))
