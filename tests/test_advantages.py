"""Group advantages (SPEC §3.1): hand-derived golden values, zero-variance groups, token broadcast.

Shape legend: G responses per group, B groups or sequences, T token positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algos import expand_to_tokens, group_advantages, group_advantages_from_groups


def test_mean_baseline_golden():
    # mean(1, 0, 0, 1) = 0.5 → A = ±0.5; no std division by default.
    adv_G, zero = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert adv_G.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert zero.shape == () and not zero


def test_std_normalised_golden():
    # deviations ±0.5; Bessel std = sqrt((4 · 0.25) / 3) = 1/√3 → A = ±0.5 / (1/√3 + eps).
    adv_G, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), normalize_std=True)
    a = 0.5 / (1 / math.sqrt(3) + 1e-6)
    assert adv_G.tolist() == pytest.approx([a, -a, -a, a], rel=1e-12)
    # parity with the usual torch expression
    r = torch.tensor([0.2, 1.0, -3.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, normalize_std=True, eps=0.0)[0], (r - r.mean()) / r.std())


def test_batched_groups_and_zero_variance():
    # row 0: mean 1 → [1, −1, 0]; rows 1, 2: all equal → zero variance, advantages exactly 0 even though
    # the float32 mean of (0.9, 0.9, 0.9) is 0.9 + 6e-8 (without the override, / (std + 1e-6) would give
    # ≈ −0.06); integer rewards become float32.
    r_BG = torch.tensor([[2.0, 0.0, 1.0], [3.0, 3.0, 3.0], [0.9, 0.9, 0.9]])
    adv_BG, zero_B = group_advantages(r_BG, normalize_std=True)
    assert zero_B.tolist() == [False, True, True] and int(zero_B.sum()) == 2
    assert adv_BG[0].tolist() == pytest.approx([1.0, -1.0, 0.0], rel=1e-5)  # Bessel std of (2, 0, 1) is 1
    assert torch.equal(adv_BG[1:], torch.zeros(2, 3))
    adv_int, _ = group_advantages(torch.tensor([[1, 0]]))
    assert adv_int.dtype == torch.float32 and adv_int.tolist() == [[0.5, -0.5]]


def test_from_groups_golden():
    # [1, 0] → ±0.5; [3] (one response) and [0.1]*3 have zero variance (float64 mean(0.1, 0.1, 0.1) is
    # 0.1 + 1.4e-17, the override makes it exactly 0); [0, 1, 2] → mean 1 → [−1, 0, 1].
    out = group_advantages_from_groups([[1.0, 0.0], [3.0], [0.1, 0.1, 0.1], [0.0, 1.0, 2.0]])
    assert out.advantages == [[0.5, -0.5], [0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 1.0]]
    assert out.num_zero_variance == 2
    assert out.skip == [False, True, True, False]


def test_expand_to_tokens_golden():
    adv_BT = expand_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert adv_BT.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]


def test_user_errors():
    with pytest.raises(ValueError, match="G >= 1"):
        group_advantages(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="G >= 1"):
        group_advantages_from_groups([[1.0], []])
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(3), eps=-1.0)
    with pytest.raises(ValueError, match="adv_B"):
        expand_to_tokens(torch.zeros(3), torch.ones(2, 4))
