"""Stage 2 RL (SPEC §3): one readable loop, from an SFT checkpoint to one (domain, effort) expert.

    for step in 1..steps:
        groups  = scheduler.run_iteration()               partial rollout: λ, resume-first, staleness (§3.2);
                                                          repeated until at least one group has all K samples
        r       = verifier reward, or the GRM tournament  non-verifiable families (§3.4)
        r'      = effort override: −1 if T(y) > τ_e·b0(x) (§3.3)
        A       = r' − mean_group(r')                     zero-variance groups train with A = 0 (τ·ℓ² only)
        loss    = policy_loss over every sampled token     behaviour log-probs from the engine (§3.1)
        optimizer step; engine.update_weights()           co-located: same tensors, version bump
        metrics; checkpoint (weights, optimizer, scheduler with paused trajectories, KV pool)

The engine shares the trainer's model (co-located, one process): the optimizer updates the
parameters in place and ``update_weights({})`` bumps the policy version, so tokens sampled after
the step carry the new version. With QAT applied to the model, the engine and the trainer run the
same MX fake-quantized expert forward (§5): the train/rollout log-prob gap is logged every step.

Exact resume: a checkpoint holds the weights, the optimizer, the scheduler state (paused and
finished-but-undispatched trajectories with their env / sandbox state, the prompt queue), the KV
pool's tensors (paused KV is moved to the pool first) and the engine version; the sampling is
counter-based, so a resumed run reproduces the uninterrupted one (tested by killing a run).

Shape legend: none here (the math lives in k3post/algos and k3post/policy_step.py).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from k3post.algos.advantages import group_advantages_from_groups
from k3post.checkpoint import latest_checkpoint, load_trainer_state, load_weights_into, save_checkpoint
from k3post.envs.families.registry import families, get_family
from k3post.errors import StepFailed
from k3post.envs.task import DOMAINS, Task
from k3post.metrics import MetricsLogger
from k3post.models import load_model
from k3post.policy_step import TokenSequence, policy_step
from k3post.rewards.effort import BudgetTable, EffortConfig, group_override
from k3post.rewards.grm import EngineJudge, GroupGRM, PolicyJudge, estimate_l0, trajectory_candidate
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import SamplingParams
from k3post.rollout.evaluation import evaluate_episodes, make_env, reference_turn_tokens, run_episodes
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.rollout.trajectory import Group, outcome_metrics
from k3post.xtml import EFFORTS, XTML

log = logging.getLogger(__name__)

__all__ = ["RLConfig", "RLResult", "GroupScorer", "Signal", "PolicyLoop", "domain_families", "train_tasks", "eval_tasks", "loss_kwargs",
           "rl_signal", "train_policy", "train_rl", "check_turn_caps", "rollout_gap"]

# seeds of the task streams: training prompts and held-out evaluation never share a seed
_TRAIN_SEED, _EVAL_SEED = 7_000, 9_000
# a step runs at most this many partial-rollout iterations to complete a group (each completes >= λ·N·K samples)
_MAX_EMPTY_ITERATIONS = 64


@dataclass
class RLConfig:
    """Settings of one RL run (one domain at one effort) and of `k3post experts`.

    Rollout: ``n_prompts`` × ``k`` per iteration, ``lambda_`` and ``max_staleness`` (SPEC §3.2),
    ``temperature``, ``max_tokens`` per assistant turn, ``slots`` (engine batch), ``kv_pool_mb``.
    Loss (SPEC §3.1): ``log_ratio_min`` / ``log_ratio_max`` (the K2.5 band α, β), ``tau`` (the quadratic
    regulariser), ``clip_eps_low`` / ``clip_eps_high`` (PPO/DAPO clipping; inf = off),
    ``stop_gradient_ratio`` (CISPO), ``sequence_ratio`` (GSPO), ``seq_mean`` (sequence-mean aggregation);
    e.g. DAPO: ``log_ratio_min=-.inf log_ratio_max=.inf tau=0 clip_eps_low=0.2 clip_eps_high=0.28``.
    ``skip_zero_variance``: drop groups whose rewards are all equal from the loss (DAPO's dynamic-sampling
    shortcut). Off by default: SPEC §3.1 applies τ·ℓ² to every sampled token and N counts them all, so such
    groups train with advantage 0 (only the regulariser acts on their possibly stale tokens).
    Tasks: ``families``, the families trained in each domain (a domain with none listed trains all its
    verifiable families, plus the non-verifiable ones when a ``judge`` is set), ``difficulty``, ``n_tasks`` training prompts per family (cycled), ``eval_n``
    held-out tasks per family.
    Judge (SPEC §3.4): ``judge`` = "" (none), "policy" (the cold-start checkpoint through the embedded
    engine), a local checkpoint folder, or an OpenAI-compatible base URL (``judge_model`` names the
    served model); ``grm_sigma`` the length guard σ (ℓ0 measured on the cold-start model).
    Effort control (SPEC §3.3): ``effort`` and ``effort_control`` (τ per effort and domain, the b0
    estimate's samples and quantile, the curriculum order).
    Experts: ``domains``, each trained through ``effort_control.curriculum`` for ``steps`` per effort;
    ``domain_overrides`` sets numeric fields per domain (e.g. ``{agents: {steps: 4, eval_n: 24}}``:
    agentic episodes cost far more than arithmetic ones), see `for_domain`.
    ``init``: the checkpoint RL starts from (empty: the run folder's ``sft/final``).
    """

    init: str = ""
    domain: str = "general"
    effort: str = "max"
    families: list[str] = field(default_factory=lambda: ["general.arithmetic", "agents.search", "coding.write_function"])
    steps: int = 40
    n_prompts: int = 8
    k: int = 8
    lambda_: float = 0.7
    max_staleness: int = 4
    temperature: float = 1.0
    max_tokens: int = 128
    max_model_len: int = 2048
    slots: int = 32
    kv_pool_mb: int = 64
    difficulty: int = 1
    n_tasks: int = 320
    eval_n: int = 400
    eval_max_tokens: int = 128
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192
    log_ratio_min: float = -math.log(2.0)
    log_ratio_max: float = math.log(2.0)
    tau: float = 0.01
    clip_eps_low: float = math.inf
    clip_eps_high: float = math.inf
    stop_gradient_ratio: bool = False
    sequence_ratio: bool = False
    seq_mean: bool = False
    normalize_std: bool = False
    skip_zero_variance: bool = False
    judge: str = ""
    judge_model: str = ""
    grm_sigma: float = 1.5
    effort_control: EffortConfig = field(default_factory=EffortConfig)
    domains: list[str] = field(default_factory=lambda: ["general", "agents", "coding"])
    domain_overrides: dict[str, dict[str, float]] = field(default_factory=lambda: {
        "agents": {"steps": 16, "n_prompts": 2, "n_tasks": 8, "eval_n": 16, "max_tokens": 192, "eval_max_tokens": 192},
        "coding": {"steps": 16, "n_prompts": 2, "n_tasks": 8, "eval_n": 32, "max_tokens": 384, "eval_max_tokens": 384},
    })
    save_every: int = 10
    seed: int = 0
    progress: bool = True


    def __post_init__(self) -> None:
        if self.effort not in EFFORTS:
            raise ValueError(f"rl.effort must be one of {EFFORTS}, got {self.effort!r}")
        for key, ds in (("rl.domain", [self.domain]), ("rl.domains", list(self.domains)),
                        ("rl.domain_overrides", list(self.domain_overrides))):
            bad = [d for d in ds if d not in DOMAINS]
            if bad:
                raise ValueError(f"{key}: unknown domain(s) {bad}; expected {DOMAINS}")
        for d in self.domain_overrides:
            self._overrides(d)

    def _overrides(self, domain: str) -> dict[str, int | float]:
        """``domain_overrides[domain]`` cast to the fields' types (ValueError naming a non-numeric or
        non-integer setting)."""
        types = {f.name: type(getattr(self, f.name)) for f in fields(self)}
        over: dict[str, int | float] = {}
        for key, value in dict(self.domain_overrides.get(domain, {})).items():
            if types.get(key) not in (int, float) or key == "seed":
                raise ValueError(f"rl.domain_overrides.{domain}.{key}: not a numeric RL setting")
            if types[key] is int and float(value) != int(value):
                raise ValueError(f"rl.domain_overrides.{domain}.{key}: must be an integer, got {value}")
            over[key] = types[key](value)
        return over

    def for_domain(self, domain: str) -> "RLConfig":
        """This config with ``domain`` set and its ``domain_overrides`` applied (each value cast to
        the field's type)."""
        return replace(self, domain=domain, **self._overrides(domain))


@dataclass
class RLResult:
    """What one RL run returns: the final step, per-step history and the held-out evaluation."""

    steps: int
    history: list[dict[str, float]]
    eval: dict[str, Any]
    resumed_from: int | None
    seconds: float


GroupScorer = Callable[[Group], list[float]]
"""Rewards of the K samples of a finished group for a non-verifiable family (the GRM)."""


def domain_families(domain: str, names: Sequence[str] = (), *, with_judge: bool = False) -> list[str]:
    """The families one RL run of ``domain`` trains on: those of ``names`` that belong to the domain
    (every name must be a registered family), else every verifiable family of ``domain`` (plus its
    non-verifiable ones ``with_judge``)."""
    named = [get_family(n) for n in names]  # an unknown name is a ValueError listing the families
    mine = [f.name for f in named if f.domain == domain and (f.verifiable or with_judge)]
    if mine:
        return mine
    fams = [f.name for f in families(domain) if f.verifiable or with_judge]
    if not fams:
        raise ValueError(f"domain {domain!r} has no {'families' if with_judge else 'verifiable families'}")
    return fams


def _interleave(per_family: list[list[Task]]) -> list[Task]:
    out = []
    for row in zip(*per_family):
        out.extend(row)
    return out


def train_tasks(family_names: Sequence[str], n: int, *, difficulty: int, seed: int = 0) -> list[Task]:
    """``n`` training tasks per family, interleaved (family 1, family 2, ..., family 1, ...)."""
    return _interleave([get_family(f).generate(n, seed=_TRAIN_SEED + seed, difficulty=difficulty) for f in family_names])


def eval_tasks(family_names: Sequence[str], n: int, *, difficulty: int) -> list[Task]:
    """``n`` held-out tasks per family (a seed the training stream never uses)."""
    return _interleave([get_family(f).generate(n, seed=_EVAL_SEED, difficulty=difficulty) for f in family_names])


def loss_kwargs(cfg: RLConfig) -> dict[str, Any]:
    """The `policy_loss` parameters of ``cfg`` (see `k3post.algos.policy_loss` for each variant's setting)."""
    return {"log_ratio_min": cfg.log_ratio_min, "log_ratio_max": cfg.log_ratio_max, "tau": cfg.tau,
            "clip_eps_low": cfg.clip_eps_low, "clip_eps_high": cfg.clip_eps_high,
            "stop_gradient_ratio": cfg.stop_gradient_ratio, "sequence_ratio": cfg.sequence_ratio, "seq_mean": cfg.seq_mean}


def build_group_scorer(
    cfg: RLConfig, cold_start: str | Path, tokenizer: Any, family_names: Sequence[str], *, qat: bool = False
) -> GroupScorer | None:
    """The GRM scorer of ``cfg.judge`` for the non-verifiable families among ``family_names`` (None
    when there are none or no judge is set). ℓ0 of each such family is the median response length
    (`trajectory_candidate`) of the cold-start model on 16 of its training tasks at ``cfg.effort``."""
    judged = [f for f in family_names if not get_family(f).verifiable]
    if not judged or not cfg.judge:
        return None
    if cfg.judge.startswith(("http://", "https://")):
        if not cfg.judge_model:
            raise ValueError("rl.judge is a URL: set rl.judge_model to the served model's name")
        judge: Any = PolicyJudge.from_url(cfg.judge, cfg.judge_model)
    else:
        path = Path(cold_start) if cfg.judge == "policy" else Path(cfg.judge)
        if not (path / "config.json").is_file():
            raise ValueError(f"rl.judge: {path} is not a model folder (config.json missing)")
        judge = EngineJudge.from_checkpoint(path, qat=qat, max_batch_size=cfg.slots, seed=cfg.seed)
    xtml = XTML(tokenizer)
    engine = EmbeddedEngine(load_model(cold_start), tokenizer, max_batch_size=cfg.slots, seed=cfg.seed)
    l0 = {}
    for fam in judged:
        per_task = run_episodes(engine, xtml, train_tasks([fam], 16, difficulty=cfg.difficulty, seed=cfg.seed),
                                effort=cfg.effort, max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed)
        l0[fam] = estimate_l0([trajectory_candidate(ts[0], xtml).length or 0 for ts in per_task])
    log.info("GRM judge %s, l0 %s", cfg.judge, l0)
    return GroupGRM(judge, xtml, l0=l0, sigma=cfg.grm_sigma, seed=cfg.seed)


def group_rewards(group: Group, scorer: GroupScorer | None) -> list[float]:
    """r(x, y_j) of a finished group: the verifier's reward, or the GRM's for a non-verifiable family."""
    fam = get_family(group.task["family"])
    if fam.verifiable:
        return group.rewards
    if scorer is None:
        raise ValueError(f"family {fam.name} is non-verifiable: set rl.judge to reward it with the GRM")
    return [float(r) for r in scorer(group)]


Signal = Callable[[Sequence[Group]], tuple[list[TokenSequence], dict[str, float]]]
"""Dispatched groups → training sequences (per-token advantages) and step metrics: the only part
of the loop that differs between RL (`rl_signal`) and MOPD (k3post/mopd.py)."""


def rl_signal(budgets: BudgetTable, cfg: RLConfig, scorer: GroupScorer | None = None) -> Signal:
    """The RL signal (SPEC §3): verifier or GRM reward → effort override → group advantage."""
    def signal(groups: Sequence[Group]) -> tuple[list[TokenSequence], dict[str, float]]:
        seqs, rows, adv = _score(groups, scorer, budgets, cfg)
        return seqs, {**rows, **adv}
    return signal


class PolicyLoop:
    """The objects of the loop (engine, agent loop, KV pool, scheduler, optimizer) and its body:
    `step` is one iteration of the module doc, `save` / `load` a checkpoint with exact resume.
    `train_policy` drives it; benchmarks time `step` on their own prompts."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: RLConfig,
        *,
        signal: Signal,
        effort_fn: Callable[[Task], str | None] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.cfg, self.signal = model, tokenizer, cfg, signal
        self.engine = EmbeddedEngine(model, tokenizer, max_batch_size=cfg.slots, max_model_len=cfg.max_model_len,
                                     seed=cfg.seed)
        self.loop = AgentLoop(self.engine, XTML(tokenizer), make_env,
                              sampling=SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens),
                              effort=cfg.effort, effort_fn=effort_fn)
        self.pool = KVPool(cfg.kv_pool_mb << 20)
        self.sched = PartialRolloutScheduler(self.loop, n_prompts=cfg.n_prompts, k=cfg.k, lambda_=cfg.lambda_,
                                             max_staleness=cfg.max_staleness, seed=cfg.seed, kv_pool=self.pool)
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                     eps=1e-8)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.loss_kwargs = loss_kwargs(cfg)
        self.step_no, self.cursor = 0, 0
        self.history: list[dict[str, float]] = []
        self.last_groups: list[Group] = []  # the groups the last step trained on

    def step(self, tasks: Sequence[Task]) -> dict[str, float]:
        """One step: top the prompt queue up to N from the stream cycling over ``tasks``, run
        partial-rollout iterations until at least one group has completed (with few prompts and λ < 1
        an iteration can end before any group has all K samples; the weights do not change in between),
        the signal, one policy step, the version bump. Returns (and records) the step's metrics, with
        the time of each part."""
        t0 = time.perf_counter()
        groups: list[Group] = []
        iterations = 0
        while not groups:  # an iteration that completes no whole group leaves nothing to train on: run another
            if iterations == _MAX_EMPTY_ITERATIONS:
                raise RuntimeError(f"{iterations} partial-rollout iterations completed no group of {self.cfg.k} samples "
                                   f"(rl.n_prompts={self.cfg.n_prompts}, rl.lambda_={self.cfg.lambda_})")
            while self.sched.num_pending_prompts < self.cfg.n_prompts:
                self.sched.add_prompts([tasks[self.cursor % len(tasks)]])
                self.cursor += 1
            groups = self.sched.run_iteration()
            iterations += 1
        t1 = time.perf_counter()
        seqs, sig = self.signal(groups)
        t2 = time.perf_counter()
        train_m = policy_step(self.model, self.opt, seqs, pad_id=self.pad_id, loss_kwargs=self.loss_kwargs,
                              micro_batch_tokens=self.cfg.micro_batch_tokens, grad_clip=self.cfg.grad_clip,
                              version=self.engine.version)
        self.model.eval()  # once here, not a train/eval switch inside every engine step (~13% of generation time)
        version = self.engine.update_weights({})
        t3 = time.perf_counter()
        self.step_no += 1
        stale = [x for g in groups for x in g.staleness()]
        rec = {**sig, **{f"train/{k}": v for k, v in train_m.items()},
               "version": float(version), "groups": float(len(groups)), "iterations": float(iterations), "rollout_s": t1 - t0, "score_s": t2 - t1,
               "update_s": t3 - t2, "step_s": t3 - t0, "kv_hit_rate": self.sched.kv_hit_rate(),
               "paused": float(len(self.sched.paused())), "mean_staleness": statistics.fmean(stale) if stale else 0.0,
               **outcome_metrics([t for g in groups for t in g.trajectories])}
        self.history.append(rec)
        self.last_groups = groups
        return rec

    def save(self, ckpt_root: Path) -> Path:
        """Checkpoint: weights, optimizer, scheduler (paused trajectories), KV pool tensors, version."""
        self.sched.offload_kv()
        return save_checkpoint(ckpt_root, self.step_no, self.model, self.tokenizer, {
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "kv_pool": self.pool.tensor_state(),
            "engine_version": self.engine.version, "cursor": self.cursor, "history": self.history,
            "config": asdict(self.cfg),
        })

    def load(self, ckpt: Path) -> None:
        """Restore a checkpoint written by `save` (into a loop built with the same config)."""
        state = load_trainer_state(ckpt)
        load_weights_into(self.model, ckpt)
        self.engine.refresh_weights()
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.pool.load_tensor_state(state["kv_pool"])
        if state["engine_version"] > self.engine.version:
            self.engine.update_weights({}, version=state["engine_version"])
        self.step_no, self.cursor, self.history = int(state["step"]), int(state["cursor"]), list(state["history"])

    def close(self) -> None:
        self.loop.close()


def train_policy(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: RLConfig,
    out_dir: str | Path,
    *,
    tasks: Sequence[Task],
    signal: Signal,
    effort_fn: Callable[[Task], str | None] | None = None,
    metrics: MetricsLogger | None = None,
    stage: str = "rl",
    resume: bool = True,
    stop_after: int | None = None,
) -> tuple[int, list[dict[str, float]], int | None, EmbeddedEngine, AgentLoop]:
    """The loop of the module doc over a prompt stream cycling through ``tasks``, trained with
    ``signal``; each prompt is rendered at ``effort_fn(task)`` (default: ``cfg.effort``). Returns
    (final step, per-step history, the step resumed from, the engine, its agent loop); the caller
    closes the loop. ``stop_after`` ends this call after that many steps (tests kill and resume)."""
    if not tasks:
        raise ValueError("train_policy needs at least one training task")
    ckpt_root = Path(out_dir) / "checkpoints"
    pl = PolicyLoop(model, tokenizer, cfg, signal=signal, effort_fn=effort_fn)
    resumed_from = None
    ckpt = latest_checkpoint(ckpt_root) if resume else None
    if ckpt is not None:
        pl.load(ckpt)
        resumed_from = pl.step_no
        if metrics is not None:
            metrics.truncate(stage, pl.step_no)
        log.info("resumed %s from %s (step %d)", stage, ckpt, pl.step_no)
    bar = tqdm(total=cfg.steps, initial=pl.step_no, desc=stage, disable=not cfg.progress, dynamic_ncols=True,
               mininterval=1.0)
    end = cfg.steps if stop_after is None else min(cfg.steps, pl.step_no + stop_after)
    while pl.step_no < end:
        try:
            rec = pl.step(tasks)
        except Exception as e:  # name the stage and the step; the cause is chained
            raise StepFailed(stage, pl.step_no + 1, e) from e
        if metrics is not None:
            metrics.log(stage, pl.step_no, rec)
        bar.update(1)
        bar.set_postfix({k: f"{rec[k]:.2f}" for k in ("reward", "effort_tokens", "opd_reward") if k in rec})
        if pl.step_no % cfg.save_every == 0 or pl.step_no == cfg.steps:
            pl.save(ckpt_root)
    bar.close()
    return pl.step_no, pl.history, resumed_from, pl.engine, pl.loop


def rollout_gap(history: Sequence[Mapping[str, float]], prefix: str = "train/") -> dict[str, float]:
    """The train–rollout log-prob gap over a run's steps (`policy_step`'s ``rollout_gap_*``): the token-weighted
    mean and the max of |log π_trainer − log π_engine| over the sampled tokens each step trained with the
    weights that sampled them, and how many tokens that was."""
    n = sum(h.get(f"{prefix}rollout_gap_tokens", 0.0) for h in history)
    total = sum(h[f"{prefix}rollout_gap_mean"] * h[f"{prefix}rollout_gap_tokens"] for h in history
                if h.get(f"{prefix}rollout_gap_tokens", 0.0) > 0)
    return {"mean": total / n if n else float("nan"), "max": max((h.get(f"{prefix}rollout_gap_max", 0.0) for h in history),
                                                             default=float("nan")), "tokens": n}


def check_turn_caps(cfg: RLConfig, tokenizer: Any, family_names: Sequence[str], *, n: int = 8) -> int:
    """Warn when ``cfg.max_tokens`` or ``cfg.eval_max_tokens`` (tokens per assistant turn) is below the
    longest turn of the families' reference solutions at ``cfg.effort`` (measured on ``n`` tasks per
    family): such a cap truncates a correct episode, so those tasks cannot pass at that effort. Returns
    that longest turn."""
    longest = reference_turn_tokens(XTML(tokenizer), train_tasks(family_names, n, difficulty=cfg.difficulty, seed=cfg.seed),
                                    cfg.effort)
    for key in ("max_tokens", "eval_max_tokens"):
        if getattr(cfg, key) < longest:
            log.warning("rl.%s = %d (%s @ %s) is below the longest reference assistant turn, %d tokens: a correct "
                        "episode would be cut off; raise it (e.g. rl.domain_overrides.%s.%s)",
                        key, getattr(cfg, key), cfg.domain, cfg.effort, longest, cfg.domain, key)
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
    check_turn_caps(cfg, tokenizer, fams)
    step, history, resumed_from, engine, loop = train_policy(
        model, tokenizer, cfg, out_dir, tasks=tasks, signal=rl_signal(budgets, cfg, scorer), metrics=metrics,
        stage=stage, resume=resume, stop_after=stop_after,
    )
    result_eval: dict[str, Any] = {}
    try:
        if evaluate and step >= cfg.steps:
            result_eval = evaluate_episodes(engine, XTML(tokenizer), eval_tasks(fams, cfg.eval_n, difficulty=cfg.difficulty),
                                            effort=cfg.effort, max_tokens=cfg.eval_max_tokens)
    finally:
        loop.close()
    return RLResult(step, history, result_eval, resumed_from, time.perf_counter() - t_start)


def _score(
    groups: Sequence[Group], scorer: GroupScorer | None, budgets: BudgetTable, cfg: RLConfig
) -> tuple[list[TokenSequence], dict[str, float], dict[str, float]]:
    """Rewards → effort override → group advantages → training sequences, with step metrics."""
    rewards_in, rewards_out = [], []
    sums = {"violation_rate": 0.0, "mean_tokens": 0.0, "mean_ratio": 0.0}  # group_override's metrics x group size
    for g in groups:
        r = group_rewards(g, scorer)
        for t, rv in zip(g.trajectories, r):  # the GRM's reward replaces the format gate's
            t.reward = rv
        r2, m = group_override(g, budgets, cfg.effort, cfg.effort_control)
        rewards_in.append(r)
        rewards_out.append([float(x) for x in r2])
        for k in sums:
            sums[k] += m[k] * len(r)
    adv = group_advantages_from_groups(rewards_out, normalize_std=cfg.normalize_std)
    seqs: list[TokenSequence] = []
    for g, a_g, skip in zip(groups, adv.advantages, adv.skip):
        if skip and cfg.skip_zero_variance:
            continue
        for t, a in zip(g.trajectories, a_g):
            seqs.append(TokenSequence(list(t.token_ids), list(t.trainable), list(t.logprobs),
                                      [a if m else 0.0 for m in t.trainable], list(t.versions)))
    flat_in = [x for r in rewards_in for x in r]
    n = len(flat_in)
    nan = float("nan")
    rows = {
        "reward": statistics.fmean(flat_in) if n else nan,
        "pass_rate": sum(x >= 1.0 for x in flat_in) / n if n else nan,
        "reward_after_override": statistics.fmean(x for r in rewards_out for x in r) if n else nan,
        "effort_tokens": sums["mean_tokens"] / n if n else nan,
        "budget_violation_rate": sums["violation_rate"] / n if n else 0.0,
        "effort_ratio": sums["mean_ratio"] / n if n else nan,
    }
    trained = len(groups) - (adv.num_zero_variance if cfg.skip_zero_variance else 0)
    adv_stats = {"zero_variance_groups": float(adv.num_zero_variance), "trained_groups": float(trained)}
    return seqs, rows, adv_stats
