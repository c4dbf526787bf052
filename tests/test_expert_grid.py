"""The 3 × 3 experts table (`expert_grid`): each domain's checks against the recipe's targets, by hand."""

from __future__ import annotations

from k3post.recipes.experts import GridTargets, expert_grid, format_expert_grid


def _cell(domain, effort, *, sft=0.3, after=0.4, verdict="higher", tokens=10.0, viol=0.0, n=120):
    return {"domain": domain, "effort": effort, "n": n, "pass_rate": after, "pass_ci95": [after - 0.05, after + 0.05],
            "sft_pass_rate": sft, "change": {"verdict": verdict, "p_value": 0.01}, "mean_effort_tokens": tokens,
            "final_violation_rate": viol}


def test_expert_grid_checks_each_domain_against_the_targets():
    """general meets every target: SFT 0.30 ≥ 0.25 on n 120; RL higher; T 4 < 8 < 20 and 4 ≤ 0.4·20 = 8;
    violations ≤ 0.03. coding: SFT 0.20 < 0.25, RL no change, T 9 > 0.4·20 = 8 (order still 9 < 12 < 20),
    a violation rate 0.05 > 0.03. agents: only max trained: its own checks count, the others are n/a."""
    t = {"general": (4, 8, 20), "coding": (9, 12, 20)}
    table = {"experts": {}}
    for d, (lo, hi, mx) in t.items():
        for e, tok in (("low", lo), ("high", hi), ("max", mx)):
            kw = {"tokens": tok}
            if d == "coding":
                kw |= {"sft": 0.2, "verdict": "no significant change", "viol": 0.05 if e == "low" else 0.0}
            table["experts"][f"{d}.{e}"] = _cell(d, e, **kw)
    table["experts"]["agents.max"] = _cell("agents", "max", n=16)
    g = expert_grid(table)
    assert list(g["domains"]) == ["general", "agents", "coding"]  # the constants' order, not insertion order
    assert g["domains"]["general"]["checks"] == {"sft_pass_at_max": True, "rl_beats_sft_at_max": True,
                                                 "effort_order": True, "low_vs_max_tokens": True, "violations": True}
    assert g["domains"]["coding"]["checks"] == {"sft_pass_at_max": False, "rl_beats_sft_at_max": False,
                                                "effort_order": True, "low_vs_max_tokens": False, "violations": False}
    # n = 16 < 100: the SFT pass does not count however high; RL higher counts
    assert g["domains"]["agents"]["checks"] == {"sft_pass_at_max": False, "rl_beats_sft_at_max": True,
                                                "effort_order": None, "low_vs_max_tokens": None, "violations": None}
    assert g["ok"] is False
    only_general = {"experts": {k: v for k, v in table["experts"].items() if k.startswith("general")}}
    assert expert_grid(only_general)["ok"] is True
    assert expert_grid(only_general, GridTargets(sft_pass_min=0.35))["ok"] is False  # 0.30 < 0.35
    text = format_expert_grid(g)
    assert "(not trained)" in text and "sft_pass_at_max MISS" in text and "effort_order n/a" in text
    assert "0.400 [0.35,0.45] SFT 0.300 ↑ T  20.0 v 0.00" in text
    assert expert_grid({"experts": {}})["ok"] is False  # nothing trained meets nothing
