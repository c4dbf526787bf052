"""policy_loss: hand-derived golden values and gradients for every variant, plus parity and invariance checks.

Shape legend: B sequences, T token positions.

Conventions in the derivations: ℓ = logp − behavior_logp (or − old_logp), r = exp(ℓ), N valid tokens,
loss = −J, J = Σ j / N, so d loss / d logp_t = −(d j_t / d logp_t) / N.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algos import expand_to_tokens, policy_loss

INF, NAN = math.inf, math.nan
LN = math.log
OFF = dict(log_ratio_min=-INF, log_ratio_max=INF, tau=0.0)  # band and regulariser off
GRPO = dict(OFF, clip_eps_low=0.2, clip_eps_high=0.2)


def _run(logp, behavior, adv, mask, **kw):
    """Loss value, d loss / d logp and metrics for nested lists (one row per sequence)."""
    logp_BT = torch.tensor(logp, requires_grad=True)
    loss, metrics = policy_loss(logp_BT, torch.tensor(behavior), torch.tensor(adv), torch.tensor(mask), **kw)
    loss.backward()
    return loss.item(), logp_BT.grad, metrics


def _close(grad_BT, expected):
    torch.testing.assert_close(grad_BT, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_k25_default_golden():
    # behavior -1, -1, -2; ℓ = 0, ln 1.5 (in the band [−ln 2, ln 2]), −ln 4 (outside); token 3 is a pad holding
    # garbage (logp inf, advantage nan). A = 1, −2, 3; τ = 0.01; N = 3.
    #   j0 = 1·e^0·1 − 0                  = 1          dj0 = e^0·1 − 2τ·0            = 1
    #   j1 = 1.5·(−2) − 0.01·ln²1.5                    dj1 = 1.5·(−2) − 0.02·ln 1.5
    #   j2 = 0 (masked) − 0.01·ln²4                    dj2 = −0.02·(−ln 4) = 0.02·ln 4  (quadratic term only)
    loss, grad, m = _run([[-1.0, -1.0 + LN(1.5), -2.0 - LN(4), INF]], [[-1.0, -1.0, -2.0, 0.0]],
                         [[1.0, -2.0, 3.0, NAN]], [[1, 1, 1, 0]])
    j = [1.0, -3.0 - 0.01 * LN(1.5) ** 2, -0.01 * LN(4) ** 2]
    assert loss == pytest.approx(-sum(j) / 3, abs=1e-6)
    _close(grad, [[-1 / 3, -(-3.0 - 0.02 * LN(1.5)) / 3, -(0.02 * LN(4)) / 3, 0.0]])
    assert m["masked_frac"] == pytest.approx(1 / 3)
    assert m["mean_abs_log_ratio"] == pytest.approx((LN(1.5) + LN(4)) / 3, abs=1e-6)
    assert m["max_abs_log_ratio"] == pytest.approx(LN(4), abs=1e-6)
    assert m["train_rollout_logp_gap"] == pytest.approx(m["mean_abs_log_ratio"])
    assert m["num_tokens"] == 3.0
    assert "entropy" not in m and "is_weight_mean" not in m
    assert all(isinstance(v, float) for v in m.values())


def test_k25_band_edges_are_inclusive():
    # behavior 0 so ℓ = logp exactly: ℓ = ln 2 and −ln 2 sit on the band edges and keep the exp term.
    # τ = 0, A = 1: j = e^ℓ → J = (2 + 0.5) / 2, dj = e^ℓ → grads −2/2, −0.5/2.
    loss, grad, m = _run([[LN(2), -LN(2)]], [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]], tau=0.0)
    assert loss == pytest.approx(-1.25)
    _close(grad, [[-1.0, -0.25]])
    assert m["masked_frac"] == 0.0


def test_k25_zero_log_ratio_is_minus_mean_advantage():
    torch.manual_seed(0)
    behavior_BT = torch.randn(3, 5)
    adv_BT, mask_BT = torch.randn(3, 5), (torch.rand(3, 5) > 0.3).int()
    logp_BT = behavior_BT.clone().requires_grad_()
    loss, m = policy_loss(logp_BT, behavior_BT, adv_BT, mask_BT)
    loss.backward()
    n = mask_BT.sum()
    # ℓ = 0: j = e^0·A − 0 = A, dj = A.
    torch.testing.assert_close(loss, -(adv_BT * mask_BT).sum() / n)
    torch.testing.assert_close(logp_BT.grad, -adv_BT * mask_BT / n)
    assert m["masked_frac"] == 0.0 and m["mean_abs_log_ratio"] == 0.0


def test_grpo_clip_golden():
    # ε = 0.2: r̄ = clamp(r, 0.8, 1.2); j = min(r·A, r̄·A); dj = r·A when the min picks r·A, else 0. N = 4.
    #   r 1.5, A +1: min(1.5, 1.2)   = 1.2  clipped, dj 0
    #   r 1.5, A −1: min(−1.5, −1.2) = −1.5           dj −1.5
    #   r 0.5, A +1: min(0.5, 0.8)   = 0.5            dj 0.5
    #   r 0.5, A −1: min(−0.5, −0.8) = −0.8 clipped, dj 0
    # J = (1.2 − 1.5 + 0.5 − 0.8) / 4 = −0.15.
    loss, grad, m = _run([[LN(1.5), LN(1.5), LN(0.5), LN(0.5)]], [[0.0] * 4], [[1.0, -1.0, 1.0, -1.0]],
                         [[1, 1, 1, 1]], **GRPO)
    assert loss == pytest.approx(0.15, abs=1e-6)
    _close(grad, [[0.0, 1.5 / 4, -0.5 / 4, 0.0]])
    assert m["masked_frac"] == 1.0  # every ratio is outside [0.8, 1.2]


def test_dapo_clip_higher_golden():
    # ε_low 0.2, ε_high 0.28, A = +1: r 1.25 stays (1.25 < 1.28): j 1.25, dj 1.25; r 1.5 → 1.28, dj 0.
    # J = (1.25 + 1.28) / 2. With GRPO's ε_high 0.2 the first token would be clipped too (checked below).
    loss, grad, m = _run([[LN(1.25), LN(1.5)]], [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]],
                         **dict(GRPO, clip_eps_high=0.28))
    assert loss == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6)
    _close(grad, [[-1.25 / 2, 0.0]])
    assert m["masked_frac"] == 0.5
    _, grad_grpo, _ = _run([[LN(1.25), LN(1.5)]], [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]], **GRPO)
    _close(grad_grpo, [[0.0, 0.0]])


def test_cispo_golden():
    # ε_low inf (no lower bound), ε_high 0.28: j = sg(r̄)·A·logp, dj = r̄·A (every token keeps its gradient).
    #   logp −1,   r 1.5 → r̄ 1.28, A  1: j = −1.28, dj = 1.28
    #   logp −2,   r 0.5 → r̄ 0.5,  A  1: j = −1,    dj = 0.5
    #   logp −0.5, r 1   → r̄ 1,    A −2: j = 1,     dj = −2
    # J = (−1.28 − 1 + 1) / 3 = −1.28 / 3.
    logp = [[-1.0, -2.0, -0.5]]
    behavior = [[-1.0 - LN(1.5), -2.0 - LN(0.5), -0.5]]
    loss, grad, m = _run(logp, behavior, [[1.0, 1.0, -2.0]], [[1, 1, 1]],
                         **dict(OFF, stop_gradient_ratio=True, clip_eps_low=INF, clip_eps_high=0.28))
    assert loss == pytest.approx(1.28 / 3, abs=1e-6)
    _close(grad, [[-1.28 / 3, -0.5 / 3, 2 / 3]])
    assert m["masked_frac"] == pytest.approx(1 / 3)


def test_gspo_golden():
    # Sequence ratio s = exp(mean_t ℓ), clip ε 0.2 at sequence level, seq-mean-token-mean over 3 sequences.
    #   seq0 ℓ = ln 1.1, ln 1.1 (pad): s = 1.1, A +1 → j = 1.1 per token, seq mean 1.1;
    #        d s / d logp_t = s / n = 0.55 → dJ/dlogp_t = A·0.55 / 3 seqs
    #   seq1 ℓ = ln 4, 0, −ln 4: s = 1, A −1 → seq mean −1; dJ/dlogp_t = (−1)·(1/3) / 3
    #   seq2 ℓ = ln 1.5, ln 1.5 (pad): s = 1.5, A +1 → clipped to 1.2, no gradient
    # J = (1.1 − 1 + 1.2) / 3 = 1.3 / 3. The band is off, so ℓ = ±ln 4 is not masked.
    logp = [[LN(1.1), LN(1.1), INF], [LN(4), 0.0, -LN(4)], [LN(1.5), LN(1.5), NAN]]
    adv = expand_to_tokens(torch.tensor([1.0, -1.0, 1.0]), torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]]))
    loss, grad, m = _run(logp, [[0.0] * 3] * 3, adv.tolist(), [[1, 1, 0], [1, 1, 1], [1, 1, 0]],
                         **dict(GRPO, sequence_ratio=True, seq_mean=True))
    assert loss == pytest.approx(-1.3 / 3, abs=1e-6)
    _close(grad, [[-0.55 / 3, -0.55 / 3, 0.0], [1 / 9, 1 / 9, 1 / 9], [0.0, 0.0, 0.0]])
    assert m["masked_frac"] == pytest.approx(2 / 7)
    assert m["max_abs_log_ratio"] == pytest.approx(LN(4), abs=1e-6)  # token-level |ℓ|


def _tis_inputs():
    # behavior −1; ρ = exp(old − behavior) = 1.5, 4, 0.25; r = exp(logp − old) = 1, 1, 2; A = 1.
    behavior = [[-1.0, -1.0, -1.0]]
    old = [[-1.0 + LN(1.5), -1.0 + LN(4), -1.0 + LN(0.25)]]
    logp = [[old[0][0], old[0][1], old[0][2] + LN(2)]]
    return logp, behavior, old


def test_tis_golden():
    # w = min(ρ, 2) = 1.5, 2, 0.25; j = w·r·A = 1.5, 2, 0.5; dj = w·r·A; J = 4 / 3.
    logp, behavior, old = _tis_inputs()
    loss, grad, m = _run(logp, behavior, [[1.0] * 3], [[1, 1, 1]], **OFF,
                         old_logp_BT=torch.tensor(old), is_cap=2.0)
    assert loss == pytest.approx(-4 / 3, abs=1e-6)
    _close(grad, [[-1.5 / 3, -2 / 3, -0.5 / 3]])
    assert m["is_weight_mean"] == pytest.approx((1.5 + 2 + 0.25) / 3, abs=1e-6)
    assert m["is_dropped_frac"] == 0.0
    assert m["mean_abs_log_ratio"] == pytest.approx(LN(2) / 3, abs=1e-6)  # ℓ is against old_logp
    # gap is against the engine: |ln 1.5|, |ln 4|, |ln 0.25 + ln 2|
    assert m["train_rollout_logp_gap"] == pytest.approx((LN(1.5) + LN(4) + LN(2)) / 3, abs=1e-6)


def test_mis_golden():
    # keep ρ in [0.5, 2] with weight ρ: w = 1.5, 0 (ρ 4), 0 (ρ 0.25); J = 1.5 / 3 (dropped tokens still count in N).
    logp, behavior, old = _tis_inputs()
    loss, grad, m = _run(logp, behavior, [[1.0] * 3], [[1, 1, 1]], **OFF,
                         old_logp_BT=torch.tensor(old), is_min=0.5, is_max=2.0)
    assert loss == pytest.approx(-0.5, abs=1e-6)
    _close(grad, [[-0.5, 0.0, 0.0]])
    assert m["is_dropped_frac"] == pytest.approx(2 / 3)


def test_aggregation_golden():
    # ℓ = 0 → j = A. Valid A: seq0 [3], seq1 [0, 1, 2]; seq2 is all pad (does not count as a sequence).
    #   token-mean:               (3 + 0 + 1 + 2) / 4         = 1.5    dJ = A / 4
    #   seq-mean-token-mean:      (3/1 + 3/3) / 2             = 2      dJ = A / (n_b · 2)
    #   seq-mean-token-sum, L 4:  (3/4 + 3/4) / 2             = 0.75   dJ = A / (4 · 2)
    #   token sum / constant 5:   6 / 5                       = 1.2    dJ = A / 5
    logp, mask = [[0.0] * 3] * 3, [[1, 0, 0], [1, 1, 1], [0, 0, 0]]
    adv = [[3.0, NAN, NAN], [0.0, 1.0, 2.0], [NAN] * 3]
    a = torch.tensor([[3.0, 0, 0], [0, 1, 2], [0, 0, 0]])
    for kw, value, grad in [
        ({}, 1.5, a / 4),
        ({"seq_mean": True}, 2.0, a / torch.tensor([[2.0], [6.0], [1.0]])),
        ({"seq_mean": True, "token_normalizer": 4.0}, 0.75, a / 8),
        ({"token_normalizer": 5.0}, 1.2, a / 5),
    ]:
        loss, g, _ = _run(logp, logp, adv, mask, **OFF, **kw)
        assert loss == pytest.approx(-value), kw
        torch.testing.assert_close(g, -grad)


def _reference_grpo(logp_BT, behavior_BT, adv_BT, mask_BT, eps_low, eps_high):
    ratio_BT = torch.exp(logp_BT - behavior_BT)
    surr_BT = torch.min(ratio_BT * adv_BT, torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high) * adv_BT)
    return -(surr_BT * mask_BT).sum() / mask_BT.sum()


@pytest.mark.parametrize("eps_high", [0.2, 0.28])
def test_grpo_parity_with_reference(eps_high):
    torch.manual_seed(1)
    behavior_BT = -torch.rand(4, 7) * 3
    logp_BT = (behavior_BT + 0.4 * torch.randn(4, 7)).requires_grad_()
    adv_BT, mask_BT = torch.randn(4, 7), (torch.rand(4, 7) > 0.25).float()
    loss, _ = policy_loss(logp_BT, behavior_BT, adv_BT, mask_BT, **dict(GRPO, clip_eps_high=eps_high))
    (grad,) = torch.autograd.grad(loss, logp_BT)
    ref = _reference_grpo(logp_BT, behavior_BT, adv_BT, mask_BT, 0.2, eps_high)
    (ref_grad,) = torch.autograd.grad(ref, logp_BT)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)


VARIANTS = {
    "k25": {},
    "grpo": GRPO,
    "dr_grpo": dict(GRPO, seq_mean=True, token_normalizer=6.0),
    "cispo": dict(OFF, stop_gradient_ratio=True, clip_eps_low=INF, clip_eps_high=0.28),
    "gspo": dict(GRPO, sequence_ratio=True, seq_mean=True),
    "tis_mis": dict(is_cap=1.5, is_min=0.6, is_max=1.4),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_padding_invariance_and_zero_grad_at_pads(name):
    torch.manual_seed(2)
    B, T = 3, 5
    behavior_BT = -torch.rand(B, T) * 2
    logp_BT = behavior_BT + 0.5 * torch.randn(B, T)
    old_BT = behavior_BT + 0.3 * torch.randn(B, T)
    adv_BT, mask_BT = torch.randn(B, T), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    kw = dict(VARIANTS[name])
    old = old_BT if "is_cap" in kw else None

    def run(logp, behavior, adv, mask, old):
        leaf = logp.clone().requires_grad_()
        loss, m = policy_loss(leaf, behavior, adv, mask, old_logp_BT=old, **kw)
        loss.backward()
        return loss, leaf.grad, m

    loss, grad, m = run(logp_BT, behavior_BT, adv_BT, mask_BT, old)
    assert torch.isfinite(loss)
    # pads: garbage everywhere they appear, two extra pad columns and one extra pad row
    def pad(x_BT, value):
        x = torch.where(mask_BT.bool(), x_BT, value)
        return torch.cat([torch.cat([x, torch.full((B, 2), value)], 1), torch.full((1, T + 2), value)], 0)

    big_mask = pad(mask_BT.float(), 0.0)
    big_old = None if old is None else pad(old_BT, -INF)
    loss2, grad2, m2 = run(pad(logp_BT, INF), pad(behavior_BT, NAN), pad(adv_BT, NAN), big_mask, big_old)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2[:B, :T], grad)
    assert torch.equal(grad2[big_mask == 0], torch.zeros(int((big_mask == 0).sum())))
    assert m2 == pytest.approx(m)


def test_entropy_metric_and_bf16_inputs():
    # entropy: mean over valid tokens (the pad's nan is ignored): (1 + 3) / 2.
    logp_BT = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, m = policy_loss(logp_BT, logp_BT.detach(), torch.tensor([[2.0, 4.0, 0.0]]), torch.tensor([[1, 1, 0]]),
                          entropy_BT=torch.tensor([[1.0, 3.0, NAN]]))
    assert m["entropy"] == 2.0
    assert loss.dtype == torch.float32 and loss.item() == -3.0  # ℓ = 0 → −mean(A)
    loss.backward()
    assert logp_BT.grad.dtype == torch.bfloat16 and logp_BT.grad.tolist() == [[-1.0, -2.0, 0.0]]


def test_no_valid_tokens_gives_zero_loss_with_graph():
    logp_BT = torch.full((2, 3), INF, requires_grad=True)
    loss, m = policy_loss(logp_BT, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp_BT.grad, torch.zeros(2, 3)) and m["num_tokens"] == 0.0


def test_user_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(x, torch.zeros(2, 4), x, x)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="log_ratio_min"):
        policy_loss(x, x, x, x, log_ratio_min=1.0, log_ratio_max=0.0)
    with pytest.raises(ValueError, match="tau"):
        policy_loss(x, x, x, x, tau=-0.1)
    with pytest.raises(ValueError, match="is_min"):
        policy_loss(x, x, x, x, is_min=2.0, is_max=1.0)
    with pytest.raises(ValueError, match="token_normalizer"):
        policy_loss(x, x, x, x, token_normalizer=0.0)
