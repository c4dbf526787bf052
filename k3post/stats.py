"""Uncertainty of pass rates: pure functions of counts.

* `wilson_interval(k, n)`: the 95% Wilson score interval of a pass rate k / n (Wilson 1927). Unlike the
  normal approximation it stays inside [0, 1] and is sound at k = 0 or k = n:

      p = k / n,  d = 1 + z²/n
      center = (p + z² / 2n) / d,  half = z · sqrt(p(1 − p)/n + z² / 4n²) / d

* `paired_change(before, after)`: one model vs another on the SAME tasks (pass / fail per task). With
  b = tasks only `before` passes and c = tasks only `after` passes:
  - Δ = (c − b) / n, the change in pass rate;
  - its 95% interval by Newcombe's method 10 (Newcombe 1998, "Improved confidence intervals for the
    difference between binomial proportions based on paired data"), from the two Wilson intervals and
    the phi correlation of the 2×2 table;
  - the exact two-sided McNemar test: under "no change" the b + c discordant tasks split 50/50,
    p = min(1, 2 · P[Binomial(b + c, ½) ≤ min(b, c)]);
  - a verdict: "higher" / "lower" when p < 0.05, else "no significant change".
* `paired_ratio(change)`: the ratio after / before of the same paired table, R = (a + c) / (a + b), with
  the delta-method interval on the log scale for matched pairs (Nam & Blackwelder 2002):
      Var(ln R) ≈ (b + c) / ((a + b)(a + c)),   R · exp(± z · sqrt(Var))
  with ½ added to b, c, a + b and a + c when any of them is 0 (Haldane), so the interval stays finite.

* `paired_mean_change(before, after)`: one model vs another on the SAME tasks, each task scored by a number (the
  share of its k sampled episodes that passed: avg@k). With d_i = after_i − before_i:
  - Δ = mean d, with the 95% interval Δ ± z · sd(d) / sqrt(n) (normal approximation of the mean of n
    independent task differences; n is the held-out set, 400 in the demo);
  - the two-sided paired sign-flip permutation test: under "no change" each d_i is as likely −d_i, so
    p = (1 + #{draws with |mean(s · d)| ≥ |Δ|}) / (1 + draws), s uniform in {−1, +1}ⁿ, 10,000 seeded draws
    (deterministic; p cannot go below 1 / 10,001);
  - the verdict as `paired_change`'s.

Shape legend: none (counts and lists of booleans or per-task scores).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["wilson_interval", "mcnemar_exact", "paired_change", "paired_mean_change", "paired_ratio", "format_rate"]

Z95 = 1.959963984540054  # the 97.5% quantile of the standard normal


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (module doc); (0, 1) when n = 0."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs (1.0 when there are none)."""
    if b < 0 or c < 0:
        raise ValueError(f"need b, c >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def paired_change(before: Sequence[bool], after: Sequence[bool], alpha: float = 0.05) -> dict[str, Any]:
    """Pass rate change from ``before`` to ``after`` on the same tasks, in the same order (module doc):
    ``{"n", "before", "after", "delta", "ci95": [lo, hi], "b", "c", "p_value", "verdict"}``."""
    if len(before) != len(after):
        raise ValueError(f"paired outcomes need the same tasks: {len(before)} before, {len(after)} after")
    n = len(before)
    a = sum(1 for x, y in zip(before, after) if x and y)
    b = sum(1 for x, y in zip(before, after) if x and not y)
    c = sum(1 for x, y in zip(before, after) if y and not x)
    d = n - a - b - c
    if n == 0:
        return {"n": 0, "before": float("nan"), "after": float("nan"), "delta": 0.0, "ci95": [-1.0, 1.0], "b": 0, "c": 0,
                "p_value": 1.0, "verdict": "no significant change"}
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n)
    l2, u2 = wilson_interval(a + c, n)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    delta = p2 - p1
    lo = delta - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    hi = delta + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    p = mcnemar_exact(b, c)
    verdict = ("higher" if delta > 0 else "lower") if p < alpha else "no significant change"
    return {"n": n, "before": p1, "after": p2, "delta": delta, "ci95": [max(-1.0, lo), min(1.0, hi)], "b": b, "c": c,
            "p_value": p, "verdict": verdict}


def paired_mean_change(before: Sequence[float], after: Sequence[float], alpha: float = 0.05, *, draws: int = 10_000,
                       seed: int = 0) -> dict[str, Any]:
    """Mean per-task score change from ``before`` to ``after`` on the same tasks, in the same order (module doc):
    ``{"n", "before", "after", "delta", "ci95": [lo, hi], "p_value", "draws", "verdict"}``."""
    import numpy as np

    if len(before) != len(after):
        raise ValueError(f"paired scores need the same tasks: {len(before)} before, {len(after)} after")
    n = len(before)
    if n == 0:
        return {"n": 0, "before": float("nan"), "after": float("nan"), "delta": 0.0, "ci95": [-1.0, 1.0],
                "p_value": 1.0, "draws": 0, "verdict": "no significant change"}
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    delta = float(d.mean())
    half = Z95 * float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
    signs = np.random.default_rng(seed).integers(0, 2, size=(draws, n), dtype=np.int8) * 2 - 1
    null = np.abs(signs @ d) / n
    p = (1 + int((null >= abs(delta) - 1e-12).sum())) / (1 + draws) if delta else 1.0
    verdict = ("higher" if delta > 0 else "lower") if p < alpha else "no significant change"
    return {"n": n, "before": float(np.mean(before)), "after": float(np.mean(after)), "delta": delta,
            "ci95": [delta - half, delta + half], "p_value": p, "draws": draws, "verdict": verdict}


def paired_ratio(change: dict[str, Any], z: float = Z95) -> dict[str, Any]:
    """The ratio after / before of a `paired_change` table and its 95% interval (module doc):
    ``{"ratio", "ci95": [lo, hi]}``; ratio nan and interval [0, inf] when ``before`` passed nothing."""
    n, b, c = change["n"], change["b"], change["c"]
    before, after = round(change["before"] * n) if n else 0, round(change["after"] * n) if n else 0
    if before == 0:
        return {"ratio": float("nan"), "ci95": [0.0, math.inf]}
    ratio = after / before
    cells = [b, c, before, after]
    if min(cells) == 0:
        b, c, before, after = (x + 0.5 for x in cells)
    half = z * math.sqrt((b + c) / (before * after))
    est = after / before
    return {"ratio": ratio, "ci95": [est * math.exp(-half), est * math.exp(half)]}


def format_rate(rate: float, n: int) -> str:
    """``"0.510 [0.441, 0.579] n=200"``: a pass rate over n tasks with its 95% Wilson interval."""
    if n == 0:
        return "n=0"
    k = int(round(rate * n))
    lo, hi = wilson_interval(k, n)
    return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}] n={n}"
