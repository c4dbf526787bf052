"""k3post.stats: Wilson intervals, the exact McNemar test and the paired change (golden values by hand,
properties, and a paired bootstrap as a reference for Newcombe's interval)."""

from __future__ import annotations

import math
import random

import pytest

from k3post.stats import format_rate, mcnemar_exact, paired_change, wilson_interval

Z = 1.959963984540054


def test_wilson_golden():
    # k = 0: the interval is [0, z² / (n + z²)]; k = n: [n / (n + z²), 1]
    assert wilson_interval(0, 10) == pytest.approx((0.0, Z * Z / (10 + Z * Z)))
    assert wilson_interval(10, 10) == pytest.approx((10 / (10 + Z * Z), 1.0))
    # k = 5, n = 10: center 0.5, half = z sqrt(0.025 + z²/400) / (1 + z²/10) = 0.2634...
    half = Z * math.sqrt(0.025 + Z * Z / 400) / (1 + Z * Z / 10)
    assert wilson_interval(5, 10) == pytest.approx((0.5 - half, 0.5 + half))
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_wilson_narrows_with_n_and_contains_the_rate():
    for n in (10, 100, 400):
        lo, hi = wilson_interval(n // 2, n)
        assert lo < 0.5 < hi
    widths = [wilson_interval(n // 5, n)[1] - wilson_interval(n // 5, n)[0] for n in (25, 100, 400)]
    assert widths[0] > widths[1] > widths[2] and widths[2] < 0.08  # n = 400 detects a few points


def test_mcnemar_golden():
    # P[Bin(6, 1/2) <= 0] = 1/64, two-sided 1/32; P[Bin(10, 1/2) <= 2] = 56/1024, two-sided 0.109375
    assert mcnemar_exact(0, 6) == pytest.approx(1 / 32)
    assert mcnemar_exact(8, 2) == pytest.approx(0.109375)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_paired_change_verdicts_and_symmetry():
    before = [True] * 50 + [False] * 50
    after = [True] * 45 + [False] * 5 + [True] * 15 + [False] * 35  # b = 5, c = 15
    up = paired_change(before, after)
    assert (up["b"], up["c"], up["delta"]) == (5, 15, pytest.approx(0.1))
    assert up["p_value"] == pytest.approx(2 * sum(math.comb(20, i) for i in range(6)) / 2**20)
    assert up["verdict"] == "higher" and up["ci95"][0] > 0
    down = paired_change(after, before)
    assert down["verdict"] == "lower" and down["ci95"] == pytest.approx([-up["ci95"][1], -up["ci95"][0]])
    same = paired_change(before, before)
    assert same["delta"] == 0 and same["verdict"] == "no significant change" and same["ci95"][0] <= 0 <= same["ci95"][1]
    small = paired_change([False] * 10, [True] * 2 + [False] * 8)  # 2 of 10: p = 0.5
    assert small["verdict"] == "no significant change" and small["p_value"] == 0.5
    with pytest.raises(ValueError, match="same tasks"):
        paired_change([True], [True, False])


def test_newcombe_interval_agrees_with_a_paired_bootstrap():
    rng = random.Random(0)
    before = [rng.random() < 0.4 for _ in range(400)]
    after = [x if rng.random() < 0.8 else rng.random() < 0.55 for x in before]
    res = paired_change(before, after)
    deltas = []
    for _ in range(4000):
        idx = [rng.randrange(400) for _ in range(400)]
        deltas.append(sum(after[i] for i in idx) / 400 - sum(before[i] for i in idx) / 400)
    deltas.sort()
    boot = (deltas[100], deltas[3899])
    assert res["ci95"][0] == pytest.approx(boot[0], abs=0.01) and res["ci95"][1] == pytest.approx(boot[1], abs=0.01)


def test_format_rate():
    assert format_rate(0.51, 100) == "0.510 [0.413, 0.606] n=100"
    assert format_rate(0.0, 0) == "n=0"


def test_paired_mean_change_golden():
    """By hand: d = [.5, −.5, 1, 0]: Δ = 0.25, sd = sqrt(1.25 / 3), half-width 1.96 · sd / 2; the exact sign-flip p is
    6/8 = 0.75 (|Σ s·d| ≥ 1 for 6 of the 8 sign patterns of the non-zero entries). Five tasks all +1: exact p = 2/32.
    The Monte-Carlo p (10,000 draws) is within 4 binomial standard errors (≤ 0.02) of the exact one."""
    from k3post.stats import Z95, paired_mean_change

    r = paired_mean_change([0.5, 0.5, 0.0, 0.25], [1.0, 0.0, 1.0, 0.25])
    assert r["delta"] == pytest.approx(0.25) and r["n"] == 4
    half = Z95 * math.sqrt(1.25 / 3) / 2
    assert r["ci95"] == pytest.approx([0.25 - half, 0.25 + half])
    assert r["p_value"] == pytest.approx(0.75, abs=0.02) and r["verdict"] == "no significant change"
    up = paired_mean_change([0.0] * 5, [1.0] * 5)
    assert up["p_value"] == pytest.approx(2 / 32, abs=0.01) and up["ci95"] == [1.0, 1.0]
    assert paired_mean_change([0.2] * 50, [0.2] * 50)["p_value"] == 1.0
    many = paired_mean_change([0.5] * 40, [0.25] * 40)
    assert many["verdict"] == "lower" and many["p_value"] == pytest.approx(1 / 10_001)
    with pytest.raises(ValueError, match="same tasks"):
        paired_mean_change([0.1], [0.1, 0.2])
