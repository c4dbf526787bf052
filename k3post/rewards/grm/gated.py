"""A rule gate times a judged quality: the reward of a family that declares a GRM candidate
(`k3post.envs.families.common.FamilyBase.grm_candidate`, e.g. ``agents.data_report``'s narrative behind its four
checked deliverables). The family says what is judged; the judging (`judge_task`, `run_judgements`) and the backend
that runs it are this layer's, so no family imports a reward.

Shape legend: none.
"""

from __future__ import annotations

from typing import Any

from k3post.envs.families.common import prompt_text
from k3post.envs.families.registry import get_family
from k3post.envs.task import FinalState, Task, Verdict
from k3post.rewards.grm.protocol import Candidate, judge_task
from k3post.rewards.grm.backends import run_judgements

__all__ = ["judged_reward"]


def judged_reward(task: Task, final: FinalState, backend: Any, *, max_retries: int = 1) -> tuple[float, Verdict, float | None]:
    """(reward, rule verdict, quality): reward = gate · q, with gate the rule verdict's reward and
    q = Σ_c w_c s_c / (10 Σ_c w_c) ∈ [0, 1] from one GRM judgement (`judge_task`, run by ``backend``, a
    `JudgeBackend`) of the candidate the task's family declares, against the task's prompt. A failed gate returns 0
    without a judge call (q None); a judgement still invalid after ``max_retries`` retries gives q = 0. ValueError
    for a family that declares no candidate."""
    family = get_family(task.family)
    hook = family.grm_candidate(task, final)
    if hook is None:
        raise ValueError(f"{family.name} declares no GRM candidate (FamilyBase.grm_candidate): its verifier is its reward")
    verdict, candidate = hook
    if candidate is None:
        return 0.0, verdict, None
    text, artifacts = candidate
    jt = judge_task(prompt_text(task), [Candidate(text, dict(artifacts))], task_id=f"grm-{task.id}", domain=task.domain)
    (res,) = run_judgements(backend, [jt], max_retries)
    if res.verdict is None:
        return 0.0, verdict, 0.0
    q = min(1.0, max(0.0, res.verdict.components["total.A"] / res.verdict.components["max_total"]))
    return verdict.reward * q, verdict, q
