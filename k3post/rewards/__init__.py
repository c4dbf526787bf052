"""Reward shaping on top of the verifiers' rewards (SPEC §3.3, §3.4).

* ``effort``: reasoning-effort control: per-problem budgets b0(x) from the cold-start model
  (``estimate_budgets``, cached in a ``BudgetTable``), the −1 over-budget override
  (``effort_override``) and the max → high → low ``Curriculum``.

Shape legend: none here (see each module).
"""

from k3post.rewards.effort import (
    BudgetTable,
    Curriculum,
    CurriculumStage,
    EffortConfig,
    budget_limit,
    effort_override,
    estimate_b0,
    estimate_budgets,
    group_override,
)

__all__ = [
    "BudgetTable",
    "Curriculum",
    "CurriculumStage",
    "EffortConfig",
    "budget_limit",
    "effort_override",
    "estimate_b0",
    "estimate_budgets",
    "group_override",
]
