"""Reward shaping on top of the verifiers' rewards (SPEC §3.3, §3.4).

* ``effort``: reasoning-effort control: per-problem budgets b0(x) from the cold-start model
  (``estimate_budgets``, cached in a ``BudgetTable``), the −1 over-budget override
  (``effort_override``) and the max → high → low ``Curriculum``.
* ``grm``: the agentic generative reward model (SPEC §3.4): ``GRMJudgeEnv`` (the judge's tools and
  its enforced 4-step protocol), ``tournament_rewards`` (K-group win rates with the σ·ℓ0 length
  guard), judge backends ``PolicyJudge`` (any episode policy; ``from_url`` for an OpenAI-compatible
  endpoint) and ``EngineJudge`` (a local checkpoint on the embedded engine via ``AgentLoop``),
  ``GRMJudge`` (the synth ``Judge`` protocol) and ``GroupGRM`` (the RL loop's group scorer).

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
from k3post.rewards.grm import (
    Candidate,
    EngineJudge,
    GRMJudge,
    GRMJudgeEnv,
    GroupGRM,
    JudgeBackend,
    PolicyJudge,
    TournamentResult,
    TournamentStats,
    estimate_l0,
    judge_task,
    tournament_rewards,
    trajectory_candidate,
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
    "Candidate",
    "EngineJudge",
    "GRMJudge",
    "GRMJudgeEnv",
    "GroupGRM",
    "JudgeBackend",
    "PolicyJudge",
    "TournamentResult",
    "TournamentStats",
    "estimate_l0",
    "judge_task",
    "tournament_rewards",
    "trajectory_candidate",
]
