"""Stage 2 RL (SPEC §3): one readable loop, from an SFT checkpoint to one (domain, effort) expert.

    for step in 1..steps:
        groups  = scheduler.run_iteration()               partial rollout: λ, resume-first, staleness (§3.2);
                                                          repeated until at least one group has all K samples
        r       = verifier reward, or the GRM tournament  non-verifiable families (§3.4)
        r'      = effort override: −1 if T(y) > τ_e·b0(x) (§3.3)
        A       = r' − mean_group(r')                     zero-variance groups train with A = 0 (τ·ℓ² only); the mean
                                                          over the valid samples: infrastructure failures (and
                                                          groups the judge could not score) are masked out
        loss    = policy_loss over every sampled token     behaviour log-probs from the engine (§3.1)
        optimizer step; engine.update_weights()           co-located: same tensors, version bump
        metrics; checkpoint (weights, optimizer, scheduler with paused trajectories, KV pool)

The loop itself (rollout, trainer step, weight push, checkpoints) is `k3post.loop`, shared with MOPD;
this module is RL's signal and `train_rl` (its config is `k3post.config.rl`, its task streams
`k3post.envs.families.streams`). With the embedded engine (``rl.rollout.engine.kind``) the engine shares the trainer's model (co-located, one process): the optimizer updates the parameters in
place and the push bumps the policy version, so tokens sampled after the step carry the new version. With QAT applied to the model, the engine and the trainer run the
same MX fake-quantized expert forward (§5): the train/rollout log-prob gap is logged every step.

Exact resume: a checkpoint holds the weights, the optimizer, the scheduler state (paused and
finished-but-undispatched trajectories with their env / sandbox state, the prompt queue), the KV
pool's tensors (paused KV is moved to the pool first) and the engine version; the sampling is
counter-based, so a resumed run reproduces the uninterrupted one (tested by killing a run).

Shape legend: none here (the math lives in k3post/algos and k3post/policy_step.py).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3post.algos.advantages import group_advantages_from_groups
from k3post.config.rl import RLConfig
from k3post.envs.families.streams import domain_families, eval_tasks, train_tasks
from k3post.envs.task import Task
from k3post.metrics import MetricsLogger
from k3post.loop import Signal, StageLog, train_policy
from k3post.policy_step import TokenSequence
from k3post.rewards.effort import BudgetTable, add_floors, floor_applies, group_override
from k3post.rewards.judge import GroupScorer, group_rewards
from k3post.rollout.evaluation import evaluate_episodes, reference_effort_tokens, reference_turn_tokens
from k3post.rollout.trajectory import Group
from k3post.xtml import XTML

log = logging.getLogger("k3post.rl")  # the name users filter on, kept when the module moved to stages/

__all__ = ["RLResult", "rl_signal", "train_rl", "check_turn_caps", "sampled_eval", "select_by_pass"]

@dataclass
class RLResult:
    """What one RL run returns: the final step, its per-step rows (read back from the metrics file) and the
    held-out evaluation."""

    steps: int
    metrics: StageLog
    eval: dict[str, Any]
    resumed_from: int | None
    seconds: float


def rl_signal(budgets: BudgetTable, cfg: RLConfig, scorer: GroupScorer | None = None) -> Signal:
    """The RL signal (SPEC §3): verifier or GRM reward → effort override → group advantage."""
    def signal(groups: Sequence[Group]) -> tuple[list[TokenSequence], dict[str, float]]:
        seqs, rows, adv = _score(groups, scorer, budgets, cfg)
        return seqs, {**rows, **adv}
    return signal


def sampled_eval(engine: Any, xtml: XTML, held_out: Sequence[Any], cfg: RLConfig, effort: str) -> dict[str, Any]:
    """The held-out tasks run ``cfg.eval_samples`` times each at ``cfg.rollout.temperature`` (avg@k), with the same
    per-episode seeds for every model evaluated (the SFT model's "before" row and each expert: paired samples)."""
    return evaluate_episodes(engine, xtml, held_out, effort=effort, max_tokens=cfg.eval_max_tokens,
                             temperature=cfg.rollout.temperature, samples=cfg.eval_samples, seed=_SAMPLED_EVAL_SEED + cfg.seed,
                             progress=f"held-out avg@{cfg.eval_samples}" if cfg.progress else None)


_SAMPLED_EVAL_SEED = 9_001  # not a training seed: the sampled held-out episodes share no seed with rollouts


def check_turn_caps(cfg: RLConfig, tokenizer: Any, family_names: Sequence[str], *, n: int = 8) -> int:
    """Warn when ``cfg.rollout.max_tokens`` or ``cfg.eval_max_tokens`` (tokens per assistant turn) is below the
    longest turn of the families' reference solutions at ``cfg.effort`` (measured on ``n`` tasks per
    family): such a cap truncates a correct episode, so those tasks cannot pass at that effort. Returns
    that longest turn."""
    longest = reference_turn_tokens(XTML(tokenizer), train_tasks(family_names, n, difficulty=cfg.difficulty, seed=cfg.seed),
                                    cfg.effort)
    for key, cap in (("rollout.max_tokens", cfg.rollout.max_tokens), ("eval_max_tokens", cfg.eval_max_tokens)):
        if cap < longest:
            log.warning("rl.%s = %d (%s @ %s) is below the longest reference assistant turn, %d tokens: a correct "
                        "episode would be cut off; raise it (e.g. rl.domain_overrides.%s.%s)",
                        key, cap, cfg.domain, cfg.effort, longest, cfg.domain, key)
    return longest


def train_rl(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: RLConfig,
    out_dir: str | Path,
    *,
    budgets: BudgetTable,
    scorer: GroupScorer | None = None,
    metrics: MetricsLogger | None = None,
    stage: str = "rl",
    resume: bool = True,
    stop_after: int | None = None,
    evaluate: bool = True,
) -> RLResult:
    """Train ``model`` in place with RL on ``cfg.domain`` at ``cfg.effort`` (module doc), then
    evaluate it on held-out tasks of the same families at the same effort.

    ``budgets`` must hold b0 of every training task (`estimate_budgets`); ``scorer`` rewards the
    non-verifiable families (the GRM)."""
    t_start = time.perf_counter()
    fams = domain_families(cfg.domain, cfg.families, with_judge=scorer is not None)
    tasks = train_tasks(fams, cfg.n_tasks, difficulty=cfg.difficulty, seed=cfg.seed)
    missing = [t.id for t in tasks if t not in budgets]
    if missing:
        raise ValueError(f"the budget table lacks b0 for {len(missing)} training tasks (e.g. {missing[:3]}); run estimate_budgets")
    if floor_applies(cfg.effort, cfg.effort_control):  # limits never below the task's reference solution (EffortConfig)
        xtml = XTML(tokenizer)
        if n := add_floors(budgets, tasks, lambda t, e: reference_effort_tokens(xtml, t, e), [cfg.effort]):
            log.info("%s.%s: budget floors of %d tasks from their reference solutions at %s effort", cfg.domain,
                     cfg.effort, n, cfg.effort)
    tasks = select_by_pass(tasks, budgets, cfg)
    check_turn_caps(cfg, tokenizer, fams)
    step, rows, resumed_from, pl = train_policy(
        model, tokenizer, cfg, out_dir, tasks=tasks, signal=rl_signal(budgets, cfg, scorer), metrics=metrics,
        stage=stage, resume=resume, stop_after=stop_after,
    )
    result_eval: dict[str, Any] = {}
    try:
        if evaluate and step >= cfg.steps:
            held_out = eval_tasks(fams, cfg.eval_n, difficulty=cfg.difficulty)
            if cfg.progress:
                log.info("held-out evaluation: %d tasks of %s at %s effort, greedy, up to %d tokens per turn",
                         len(held_out), ", ".join(fams), cfg.effort, cfg.eval_max_tokens)
            xtml = XTML(tokenizer)
            result_eval = evaluate_episodes(pl.engine, xtml, held_out, effort=cfg.effort, max_tokens=cfg.eval_max_tokens,
                                            progress="held-out eval" if cfg.progress else None)
            if cfg.eval_samples:
                result_eval["sampled"] = sampled_eval(pl.engine, xtml, held_out, cfg, cfg.effort)
    finally:
        pl.close()
    return RLResult(step, rows, result_eval, resumed_from, time.perf_counter() - t_start)


def select_by_pass(tasks: Sequence[Task], budgets: BudgetTable, cfg: RLConfig) -> list[Task]:
    """The training tasks whose pass fraction in their b0 samples (`BudgetTable.pass_fraction`) lies in
    [``cfg.train_pass_min``, ``cfg.train_pass_max``], in their order; all of them when the range is [0, 1].
    When none is left: all of them with a warning under ``cfg.train_pass_empty`` = "all", else a ValueError naming
    the settings."""
    lo, hi = cfg.train_pass_min, cfg.train_pass_max
    if lo <= 0 and hi >= 1:
        return list(tasks)
    kept = [t for t in tasks if lo <= budgets.pass_fraction(t) <= hi]
    n_samples = len(next(iter(budgets.entries.values())).samples.correct) if len(budgets) else 0
    if not kept:
        what = (f"rl.train_pass_min / rl.train_pass_max = {lo} / {hi}: none of the {len(tasks)} training tasks of "
                f"{cfg.domain} has a b0 pass fraction in that range ({n_samples} samples each)")
        if cfg.train_pass_empty == "all":
            log.warning("%s.%s: %s; rl.train_pass_empty=all: training on all %d tasks (their groups start without "
                        "variance)", cfg.domain, cfg.effort, what, len(tasks))
            return list(tasks)
        raise ValueError(f"{what}; widen it, raise rl.n_tasks, or set rl.train_pass_empty=all to train on every task")
    log.info("%s.%s trains on %d of %d tasks: those the cold-start model solves in [%g, %g] of their %d b0 samples",
             cfg.domain, cfg.effort, len(kept), len(tasks), lo, hi, n_samples)
    return kept


def _score(
    groups: Sequence[Group], scorer: GroupScorer | None, budgets: BudgetTable, cfg: RLConfig
) -> tuple[list[TokenSequence], dict[str, float], dict[str, float]]:
    """Rewards → effort override → group advantages → training sequences, with step metrics."""
    rewards_in, rewards_out, valid = [], [], []
    sums = {"violation_rate": 0.0, "mean_tokens": 0.0, "mean_ratio": 0.0}  # group_override's metrics x group size
    for g in groups:
        r = group_rewards(g, scorer)
        if r is None:  # the judge could not answer: no reward, every sample masked
            r = [0.0] * len(g.trajectories)
        for t, rv in zip(g.trajectories, r):  # the GRM's reward replaces the format gate's
            if t.infra is None:
                t.reward = rv
        ok = g.valid
        keep = [t for t in g.trajectories if t.infra is None]
        out: Iterator[float] = iter(())
        if keep:  # the effort override and its metrics over the valid samples
            r2, m = group_override(dataclasses.replace(g, trajectories=keep), budgets, cfg.effort, cfg.effort_control)
            out = iter(float(x) for x in r2)
            for k in sums:
                sums[k] += m[k] * len(keep)
        rewards_in.append([x for x, v in zip(r, ok) if v])
        rewards_out.append([next(out) if v else 0.0 for v in ok])
        valid.append(ok)
    adv = group_advantages_from_groups(rewards_out, normalize_std=cfg.loss.normalize_std, valid=valid)
    seqs: list[TokenSequence] = []
    for g, a_g, skip, ok in zip(groups, adv.advantages, adv.skip, valid):
        if skip and cfg.loss.skip_zero_variance:
            continue
        for t, a, v in zip(g.trajectories, a_g, ok):
            if v:  # an infrastructure failure is not in the loss
                seqs.append(TokenSequence(list(t.token_ids), list(t.trainable), list(t.logprobs),
                                          [a if m else 0.0 for m in t.trainable], list(t.versions),
                                          list(t.kv_versions), t.routes_tensor()))
    flat_in = [x for r in rewards_in for x in r]
    n = len(flat_in)
    nan = float("nan")
    rows = {
        "reward": statistics.fmean(flat_in) if n else nan,
        "pass_rate": sum(x >= 1.0 for x in flat_in) / n if n else nan,
        "reward_after_override": statistics.fmean(x for r, ok in zip(rewards_out, valid) for x, v in zip(r, ok) if v)
        if n else nan,
        "effort_tokens": sums["mean_tokens"] / n if n else nan,
        "budget_violation_rate": sums["violation_rate"] / n if n else 0.0,
        "effort_ratio": sums["mean_ratio"] / n if n else nan,
    }
    trained = sum(any(ok) and not (skip and cfg.loss.skip_zero_variance) for ok, skip in zip(valid, adv.skip))
    zero = sum(skip and any(ok) for ok, skip in zip(valid, adv.skip))  # a group the judge could not score is not one
    adv_stats = {"zero_variance_groups": float(zero), "trained_groups": float(trained)}
    return seqs, rows, adv_stats
