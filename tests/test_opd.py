"""opd_reward (SPEC §4): hand-derived golden values, stop-gradient, and use as advantages in policy_loss.

Shape legend: B sequences, T token positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algos import opd_reward, policy_loss

INF = math.inf


def _inputs():
    # teacher − student = 1, −8, −1 at the valid tokens; the pad holds inf − (−inf).
    teacher = torch.tensor([[-1.0, -9.0, -2.0, INF]])
    student = torch.tensor([[-2.0, -1.0, -1.0, -INF]])
    return teacher, student, torch.tensor([[1, 1, 1, 0]])


def test_opd_reward_golden():
    # clip to ±5: [1, −5, −1], pad 0. mean reward −5/3; clip_frac 1/3 (only −8);
    # reverse KL estimate = mean(student − teacher) = (−1 + 8 + 1) / 3 = 8/3 (unclipped).
    teacher, student, mask = _inputs()
    reward_BT, m = opd_reward(teacher, student, mask)
    assert reward_BT.tolist() == [[1.0, -5.0, -1.0, 0.0]]
    assert m["mean_reward"] == pytest.approx(-5 / 3)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["reverse_kl"] == pytest.approx(8 / 3)
    assert m["num_tokens"] == 3.0


def test_outcome_advantage_added_with_weight():
    # w_orm 2 · A_outcome 0.5 = +1 at every valid token: [2, −4, 0], pad stays 0; r_max 6 keeps −8 → −6.
    teacher, student, mask = _inputs()
    reward_BT, m = opd_reward(teacher, student, mask, outcome_advantages_B=torch.tensor([0.5]), w_orm=2.0)
    assert reward_BT.tolist() == [[2.0, -4.0, 0.0, 0.0]]
    assert m["mean_reward"] == pytest.approx(-2 / 3)
    reward6_BT, _ = opd_reward(teacher, student, mask, r_max=6.0)
    assert reward6_BT.tolist() == [[1.0, -6.0, -1.0, 0.0]]


def test_reward_carries_no_gradient():
    teacher, student, mask = _inputs()
    student = student.clone().requires_grad_()
    teacher = teacher.clone().requires_grad_()
    reward_BT, _ = opd_reward(teacher, student, mask)
    assert not reward_BT.requires_grad and reward_BT.grad_fn is None
    # Used as advantages in the K2.5 loss with ℓ = 0 (behaviour = student): j = e^0·r − 0 = r, so
    # loss = −mean(r) = 5/3 and d loss / d logp = −r / N = −[1, −5, −1] / 3, pad 0.
    logp_BT = torch.where(mask.bool(), student.detach(), 0.0).requires_grad_()
    loss, _ = policy_loss(logp_BT, logp_BT.detach(), reward_BT, mask)
    loss.backward()
    assert loss.item() == pytest.approx(5 / 3)
    torch.testing.assert_close(logp_BT.grad, torch.tensor([[-1 / 3, 5 / 3, 1 / 3, 0.0]]))


def test_user_errors():
    teacher, student, mask = _inputs()
    with pytest.raises(ValueError, match="shape"):
        opd_reward(teacher, student[:, :3], mask)
    with pytest.raises(ValueError, match="r_max"):
        opd_reward(teacher, student, mask, r_max=0.0)
