"""RL's judge (SPEC §3.4): the GRM that rewards the non-verifiable families of an RL stage, built from ``rl.judge``
(the cold-start model, a local checkpoint, or an OpenAI-compatible URL), gated on held-out reference pairs
(``rl.judge_min_agreement``), with ℓ0 of each judged family measured on the cold-start model; and a finished group's
rewards (`group_rewards`: the verifier's, or the judge's for a non-verifiable family). `k3post.stages.rl` trains with
what `build_group_scorer` returns and holds no judge code of its own.

Shape legend: none.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from k3post.config.rl import RLConfig
from k3post.config.rollout import EngineConfig
from k3post.envs.families.registry import get_family
from k3post.envs.families.streams import train_tasks
from k3post.errors import JudgeUnavailableError
from k3post.models import load_model
from k3post.rewards.grm import EngineJudge, GroupGRM, PolicyJudge, estimate_l0, trajectory_candidate
from k3post.rewards.judging import gate_judge, gate_summary
from k3post.rollout.evaluation import run_episodes
from k3post.rollout.factory import build_engine, close_engine
from k3post.rollout.trajectory import Group
from k3post.urls import is_url
from k3post.xtml import XTML

log = logging.getLogger("k3post.rl")  # RL's log: the judge's lines are the RL stage's

__all__ = ["GroupScorer", "VerifierScorer", "apply_judge_gate", "build_group_scorer", "group_rewards", "judge_model_dir",
           "judged_families"]


GroupScorer = Callable[[Group], list[float]]
"""Rewards of the K samples of a finished group for a non-verifiable family (the GRM)."""


def judged_families(cfg: RLConfig, family_names: Sequence[str]) -> list[str]:
    """The families among ``family_names`` the GRM judges: the non-verifiable ones, when ``cfg.judge`` is set."""
    return [f for f in family_names if not get_family(f).verifiable] if cfg.judge else []


def judge_model_dir(cfg: RLConfig, cold_start: str | Path) -> Path | None:
    """The model folder ``cfg.judge`` names ("policy": the cold-start model), None when it is a URL."""
    if is_url(cfg.judge):
        return None
    path = Path(cold_start) if cfg.judge == "policy" else Path(cfg.judge)
    if not (path / "config.json").is_file():
        raise ValueError(f"rl.judge: {path} is not a model folder (config.json missing)")
    return path


def build_group_scorer(
    cfg: RLConfig, cold_start: str | Path, tokenizer: Any, family_names: Sequence[str], *, qat: bool = False,
    judge_engine: EngineConfig | None = None,
) -> GroupScorer | None:
    """The GRM scorer of ``cfg.judge`` for the non-verifiable families among ``family_names`` (None
    when there are none or no judge is set). ℓ0 of each such family is the median response length
    (`trajectory_candidate`) of the cold-start model on 16 of its training tasks at ``cfg.effort``.
    ``judge_engine``: an ``http`` `EngineConfig` of servers holding the judge model (the judge actors of
    ``distributed.roles.judges``, `k3post.distributed.ray_cluster`): the judge decodes there, not in
    ``cfg.rollout.engine``; ℓ0 is measured here as always.

    With ``cfg.judge_min_agreement`` > 0 the judge passes its gate first (`gate_judge`); below it, the judge is
    closed and ``cfg.judge_fallback`` either raises ("fail") or returns a `VerifierScorer` ("format_gate"). The
    scorer's ``gate`` attribute holds the gate's result (None without a gate)."""
    judged = judged_families(cfg, family_names)
    if not judged:
        return None
    path = judge_model_dir(cfg, cold_start)
    if path is None:
        if judge_engine is not None:
            raise ValueError(f"rl.judge is a URL ({cfg.judge}): it has no judge servers of this run to decode on")
        if not cfg.judge_model:
            raise ValueError("rl.judge is a URL: set rl.judge_model to the served model's name")
        judge: Any = PolicyJudge.from_url(cfg.judge, cfg.judge_model)
    else:
        judge = EngineJudge.from_checkpoint(path, qat=qat, max_batch_size=cfg.rollout.slots, seed=cfg.seed,
                                            engine=judge_engine or cfg.rollout.engine, served=judge_engine is not None)
    gate = apply_judge_gate(judge, cfg, judged)
    if gate is not None and not gate["passed"]:
        return VerifierScorer(gate)
    xtml = XTML(tokenizer)
    scorer = GroupGRM(judge, xtml, sigma=cfg.grm_sigma, seed=cfg.seed)
    scorer.gate = gate
    try:
        engine = build_engine(load_model(cold_start), tokenizer, engine=cfg.rollout.engine,
                              role="GRM length baseline (cold-start model)", max_batch_size=cfg.rollout.slots, seed=cfg.seed)
        try:
            for fam in judged:
                per_task = run_episodes(engine, xtml, train_tasks([fam], 16, difficulty=cfg.difficulty, seed=cfg.seed),
                                        effort=cfg.effort, max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                                        seed=cfg.seed)
                scorer.l0[fam] = estimate_l0([trajectory_candidate(ts[0], xtml).length or 0 for ts in per_task])
        finally:
            close_engine(engine)
    except BaseException:
        scorer.close()
        raise
    log.info("GRM judge %s (%s), l0 %s", cfg.judge, f"on its servers {judge_engine.urls}" if judge_engine is not None
             else f"on an rl.rollout.engine of kind {cfg.rollout.engine.kind}" if path is not None else "behind its URL", scorer.l0)
    return scorer


def apply_judge_gate(judge: Any, cfg: RLConfig, judged: Sequence[str]) -> dict[str, Any] | None:
    """RL's judge gate (``cfg.judge_min_agreement`` > 0, else None): the `gate_judge` result of ``judge`` on the
    ``judged`` families. Below the threshold the judge is closed and, with ``cfg.judge_fallback`` "fail", a
    ValueError names the measured rates and both ways out; with "format_gate" a warning says the judged
    families are rewarded by their own verifier, and the (failed) result is returned."""
    if cfg.judge_min_agreement <= 0:
        return None
    try:
        gate = gate_judge(judge, judged, n_pairs=cfg.judge_gate_pairs, min_agreement=cfg.judge_min_agreement,
                          seed=cfg.seed, difficulty=cfg.difficulty)
    except BaseException:
        close_engine(judge)
        raise
    if gate["passed"]:
        log.info("GRM judge %s passes its gate: %s", cfg.judge, gate_summary(gate))
        return gate
    close_engine(judge)
    if cfg.judge_fallback != "format_gate":
        raise ValueError(f"rl.judge ({cfg.judge}) {gate_summary(gate)}: it would reward {', '.join(judged)} with "
                         "noise. Teach the judge more (data.judge_tasks) or set rl.judge_fallback: format_gate "
                         "to reward them with their own verifier instead")
    log.warning("GRM judge %s %s: %s rewarded by their own verifier (the format gate), not the judge "
                "(rl.judge_fallback: format_gate)", cfg.judge, gate_summary(gate), ", ".join(judged))
    return gate


class VerifierScorer:
    """The ``GroupScorer`` of ``rl.judge_fallback: format_gate``: a judged family's samples keep their own
    verifier's reward (for general.writing the rule-based format gate), because the judge failed its gate
    (``gate``: the `gate_judge` result that says so)."""

    def __init__(self, gate: dict[str, Any]) -> None:
        self.gate = gate

    def __call__(self, group: Group) -> list[float]:
        return group.rewards

    def close(self) -> None:
        """Nothing to release: the judge was closed when it failed its gate."""


def group_rewards(group: Group, scorer: GroupScorer | None) -> list[float] | None:
    """r(x, y_j) of a finished group: the verifier's reward, or the GRM's for a non-verifiable family (over
    its valid samples: those whose infrastructure failed are not shown to the judge, their entry is 0.0 and
    masked by the caller). None when the judge could not answer (`JudgeUnavailableError`): every sample is
    then marked ``infra = "judge"``, logged, and the group gets no reward."""
    fam = get_family(group.task["family"])
    if fam.verifiable:
        return group.rewards
    if scorer is None:
        raise ValueError(f"family {fam.name} is non-verifiable: set rl.judge to reward it with the GRM")
    keep = [t for t in group.trajectories if t.infra is None]
    try:
        scored = [float(r) for r in scorer(dataclasses.replace(group, trajectories=keep))] if keep else []
    except JudgeUnavailableError as e:
        log.warning("group %d (task %s): the GRM judge could not answer (%s); the group gets no reward",
                    group.group_id, group.task.get("id"), e)
        for t in group.trajectories:
            t.infra = t.infra or "judge"
            t.reward = None
        return None
    it = iter(scored)
    return [next(it) if t.infra is None else 0.0 for t in group.trajectories]
