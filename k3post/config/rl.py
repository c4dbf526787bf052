"""Settings of one RL run and of `k3post experts` (`k3post.stages.rl` reads them), with the views the loop's
seams take: `RLConfig.rollout_config`, `RLConfig.optim_config` and `loss_kwargs`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from collections.abc import Mapping
from typing import Any

from k3post.config.effort import EffortConfig
from k3post.config.optim import OptimConfig, check_keep_last
from k3post.config.ranges import check_range, field_range, ranged
from k3post.config.rollout import RESUME_KV, ROUTING_REPLAY, EngineConfig, RolloutConfig
from k3post.constants import DOMAINS, EFFORTS
from k3post.urls import is_url

__all__ = ["AGENTS_RL_SETTING", "CODING_RL_SETTING", "GENERAL_MAX_SETTING", "LR_SCHEDULES", "RLConfig", "default_domain_overrides",
           "domain_override_args", "loss_kwargs"]

LR_SCHEDULES = ("constant", "linear")
TRAIN_PASS_EMPTY = ("error", "all")
JUDGE_FALLBACKS = ("fail", "format_gate")
CHOICE_OVERRIDES: dict[str, tuple[str, ...]] = {"lr_schedule": LR_SCHEDULES, "train_pass_empty": TRAIN_PASS_EMPTY,
                                                "resume_kv": RESUME_KV, "routing_replay": ROUTING_REPLAY}
# the loss switches an expert may set for itself (domain_overrides), besides the numeric fields
BOOL_OVERRIDES: tuple[str, ...] = ("normalize_std", "skip_zero_variance", "seq_mean", "sequence_ratio", "stop_gradient_ratio")
"""The settings other than numbers that ``domain_overrides`` may set, with their choices."""


_CURRICULUM_ROLLOUTS: dict[str, Any] = {"temperature": 0.5, "train_pass_min": 0.01, "train_pass_empty": "all",
                                        "lambda_": 1, "max_staleness": 0}
"""How the demo's agents and coding experts and `CODING_RL_SETTING` roll out and pick their tasks: T 0.5, the tasks b0
solved at least once (every task, with a warning, when it solved none), on-policy. `AGENTS_RL_SETTING` starts from it and
samples at T 1 over a larger pool (issue 31 §agents25)."""


def default_domain_overrides() -> dict[str, dict[str, Any]]:
    """`RLConfig.domain_overrides`' default: the agents and coding experts' sizes (their episodes cost far more)."""
    return {
        # 256: the search references think at max in every turn (issue 31 §effort), up to ~230 tokens a turn with the
        # demo's tokenizer (configs/full.yaml's lexicon tokenizer: ~140, so it keeps 192)
        # eval_n 32: the SFT model passes some agents.search episodes now (issue 31 §agents)
        # T 0.5, the tasks b0 solved (of 64), on-policy (issue 31 §agentslearn: with the SFT models of then, at T 1 70-90 %
        # of the episodes ended malformed and the demo's agents.low fell 7 -> 2 of 32); AGENTS_RL_SETTING's T 1 over a
        # 768-task pool (§agents25) costs its b0 alone ~8 minutes of one core, more than the demo's agents experts
        "agents": {"steps": 16, "n_prompts": 2, "n_tasks": 64, "eval_n": 32, "max_tokens": 256, "eval_max_tokens": 256,
                   **_CURRICULUM_ROLLOUTS},
        # the same rollouts, 4 prompts a step at lr 2e-4 decaying linearly, 64 held-out tasks: from an SFT model that
        # passes 31 % (200 SFT tasks of coding.write_function, the demo's data) coding.max's 16 steps went 0.31 -> 0.67
        # (n 64, p 6e-6; issue 31 §coding)
        "coding": {"steps": 16, "n_prompts": 4, "n_tasks": 64, "eval_n": 64, "max_tokens": 384, "eval_max_tokens": 384,
                   **_CURRICULUM_ROLLOUTS, "lr": 2e-4, "lr_schedule": "linear"},
    }


GENERAL_MAX_SETTING: dict[str, dict[str, Any]] = {
    "general": {"n_tasks": 1280, "eval_n": 800, "slots": 256},
    "general.max": {"n_prompts": 32, "lr": 2e-4, "lr_schedule": "linear", "lambda_": 1, "max_staleness": 0, "eval_samples": 8},
}
"""What `k3post demo` / `rl` / `experts` (the recipe's ``rl``, `k3post.config.K3Config`) add for general.max: 32 prompts a
step, each prompt once (40 × 32 = 1,280 tasks), lr 2e-4 decaying linearly, on-policy, and held-out avg@8 at T 1
beside greedy (the expected reward RL optimises; greedy outcomes churn), on 800 held-out tasks: at 400 a gain of
+0.015 resolved in about half the runs (docs/decisions.md, issue 31 §power). It raised general.max's held-out avg@8 in
every one of 25 runs over eight demo SFT models (docs/decisions.md, issue 31 §seeds, §demo, §levers). General's engines
decode 256 sequences at once (its episodes are short: b0's 5,120 and the held-out 7,200 fill them): general.max from the
demo's SFT model in 333 s instead of 455 s, the same learning (docs/decisions.md, issue 32 §slots). A bare
`RLConfig` (the library's, MOPD's) does not carry it."""


AGENTS_RL_SETTING: dict[str, dict[str, Any]] = {
    "agents": {"n_prompts": 4, "n_tasks": 768, "eval_n": 100, **_CURRICULUM_ROLLOUTS, "temperature": 1.0,
               "train_pass_max": 0.75, "lr": 6e-4, "lr_schedule": "linear"},
    "agents.max": {"steps": 64, "eval_samples": 4},
}
"""The agents setting that makes RL beat its SFT start (docs/decisions.md, issue 31 §agents25): rollouts at T 1, a
curriculum of the tasks b0's 4 samples solved sometimes but not always (1-3 of 4) out of a pool of 768, so each of the
256 groups (4 a step, on-policy, 64 steps) is a task seen about once; lr 6e-4 decaying linearly; held-out avg@4 at the
rollout temperature on 100 tasks beside greedy. From the demo's 2,000-step seed-0 SFT model (search at max is not in its
data, and there its episodes hardly vary at T 0.5: 2.9-3.2 of a step's 4 groups without reward variance) held-out avg@4
went 0.185 -> 0.265 (p 0.005; 0.2575, p 0.016 with every task b0 solved at least once), greedy 0.27 -> 0.30. The
earlier setting (T 0.5, 192 tasks, lr 2e-4: 0.11 -> 0.25 from the SFT model of 2026-12-04, issue 31 §agentslearn) did
not move this model (§slow24). It costs ~20 minutes of one core for agents.max (b0 over 768 tasks ~8.5 min), so the
demo keeps its smaller agents experts (`default_domain_overrides`); configs/full.yaml and the slow test
`tests/test_rl_learns.py` use it."""


CODING_RL_SETTING: dict[str, dict[str, Any]] = {
    "coding": {"n_prompts": 4, "n_tasks": 256, "eval_n": 200, **_CURRICULUM_ROLLOUTS, "lr": 2e-4, "lr_schedule": "linear"},
    "coding.max": {"steps": 64, "eval_samples": 4},
}
"""`AGENTS_RL_SETTING`'s recipe for coding (docs/decisions.md, issue 31 §coding): T 0.5 rollouts on the tasks b0 solved,
4 a step on-policy, lr 2e-4 decaying linearly, 64 steps, held-out avg@4 at T 0.5 beside greedy on 200 tasks. From the
SFT model trained on 200 coding.write_function tasks (seed 0, the demo's data) coding.max went 0.32 -> 0.77 greedy and
0.37 -> 0.69 avg@4 (n 200, p 0.0001); from the older model trained on 100 tasks (0.07 greedy: it wrote the right kind of
function with the constants of its training data) 0.034 -> 0.056 avg@4 (96 steps over 384 tasks, p 0.034). ~21 minutes
of one core for coding.max; configs/full.yaml uses it."""


def domain_override_args(setting: dict[str, dict[str, Any]]) -> list[str]:
    """``setting`` (expert or domain → fields) as command-line overrides, ``rl.domain_overrides.<key>.<field>=<value>``,
    each merged into the config's entry for that key instead of replacing it."""
    return [f"rl.domain_overrides.{key}.{name}={value}" for key, fields in setting.items() for name, value in fields.items()]


@dataclass
class RLConfig:
    """Settings of one RL run (one domain at one effort) and of `k3post experts`.

    Rollout: ``n_prompts`` × ``k`` per iteration, ``lambda_`` and ``max_staleness`` (SPEC §3.2),
    ``temperature``, ``max_tokens`` per assistant turn, ``slots`` (engine batch), ``kv_pool_mb``, ``resume_kv``
    (`RolloutConfig`: what a trajectory paused across a weight update resumes from), ``routing_replay``
    ("off" | "measure" | "rollout-routes", `k3post.routing_replay`: the engine records each position's experts,
    the trainer counts the positions it routes differently and, with "rollout-routes", routes them as recorded),
    ``exact`` (the engine and the trainer's log-prob values run one batch-invariant forward, so every behaviour log-prob
    equals the trainer's bit for bit, `k3post.rollout.embedded.exact`; fails closed where it cannot hold; needs
    ``resume_kv`` "reprefill"),
    ``draft`` (an EAGLE-3 export: speculative decoding in rollout, and the draft trained online on the policy's
    rollouts, ``draft_steps`` optimizer steps at ``draft_lr`` after every RL step, 0: frozen; `k3post.spec.online`).
    Loss (SPEC §3.1): ``log_ratio_min`` / ``log_ratio_max`` (the K2.5 band α, β), ``tau`` (the quadratic
    regulariser), ``clip_eps_low`` / ``clip_eps_high`` (PPO/DAPO clipping; inf = off),
    ``stop_gradient_ratio`` (CISPO), ``sequence_ratio`` (GSPO), ``seq_mean`` (sequence-mean aggregation);
    e.g. DAPO: ``log_ratio_min=-.inf log_ratio_max=.inf tau=0 clip_eps_low=0.2 clip_eps_high=0.28``.
    ``skip_zero_variance``: drop groups whose rewards are all equal from the loss (DAPO's dynamic-sampling
    shortcut). Off by default: SPEC §3.1 applies τ·ℓ² to every sampled token and N counts them all, so such
    groups train with advantage 0 (only the regulariser acts on their possibly stale tokens).
    Tasks: ``families``, the families trained in each domain (a domain with none listed trains all its
    verifiable families, plus the non-verifiable ones when a ``judge`` is set), ``difficulty``, ``n_tasks`` training prompts per family (cycled), ``eval_n``
    held-out tasks per family, evaluated greedily and, with ``eval_samples`` = k > 0, also k times each at
    ``temperature`` (avg@k: the expected reward RL optimises, paired per task with the SFT model's, same seeds).
    Prompt selection: with ``train_pass_min`` > 0 or ``train_pass_max`` < 1 the expert trains only on the
    training tasks whose pass fraction in their b0 samples (the cold-start model's, `rewards.effort`) lies in
    [train_pass_min, train_pass_max]: a prompt the model never or always solves gives a group without variance,
    which carries no policy gradient (difficulty curriculum; set per expert like ``lr``). When none is in the range
    (a cold-start model that solves none of them), ``train_pass_empty`` says what happens: "error" (the default) fails
    the expert naming the settings; "all" trains on every task, with a warning in the log (an explicit opt-in: every
    group then starts without variance, as without the curriculum).
    Optimiser: ``lr`` with ``lr_schedule`` ("constant", or "linear" decay to ``lr / steps`` at the last step).
    Judge (SPEC §3.4): ``judge`` = "" (none), "policy" (the cold-start checkpoint through the embedded
    engine), a local checkpoint folder, or an OpenAI-compatible base URL (``judge_model`` names the
    served model); ``grm_sigma`` the length guard σ (ℓ0 measured on the cold-start model).
    Judge gate: with ``judge_min_agreement`` > 0 the judge first judges ``judge_gate_pairs`` held-out reference
    pairs in both orders (`k3post.rewards.judging.gate_judge`: the better answer known, one attempt each, as RL
    samples it); when it agrees with the known better answer on fewer than that share of its judgements,
    ``judge_fallback`` says what happens: "fail" (the default) fails the domain's experts with the measured
    rates; "format_gate" rewards the judged families with their own verifier (for general.writing the rule-based
    format gate) instead of the judge, an explicit opt-in logged as a warning and recorded in the experts'
    table (``judge_gate``). A judge that always prefers A agrees on exactly half the judgements.
    Effort control (SPEC §3.3): ``effort`` and ``effort_control`` (τ per effort and domain, the b0
    estimate's samples and quantile, the curriculum order).
    Experts: ``domains``, each trained through ``effort_control.curriculum`` for ``steps`` per effort;
    ``domain_overrides`` sets numeric fields (and ``lr_schedule`` and the loss switches of ``BOOL_OVERRIDES``) per domain (e.g. ``{agents: {steps: 4, eval_n: 24}}``:
    agentic episodes cost far more than arithmetic ones) and, under a ``domain.effort`` key, per expert
    (e.g. ``{agents.low: {steps: 12}}``, applied after the domain's); an expert key may not change what
    defines the domain's task sets (``n_tasks``, ``eval_n``, ``difficulty``: b0 and the "before" row are
    shared by its three experts). ``eval_samples`` may be set per expert (e.g. ``{general.max: {eval_samples: 8}}``:
    avg@k where the paired test is wanted, not at every effort); the "before" row then holds the SFT model's avg@k
    at exactly those efforts, with each expert's own k, temperature and seed. See `for_domain`.
    ``init``: the checkpoint RL starts from (empty: the run folder's ``sft/final``).
    Infrastructure failures (`k3post.errors.InfrastructureError`: an env worker lost, the sandbox, the
    browser or the GRM judge unavailable; RL and MOPD, `k3post.loop`): such samples are masked out of their
    group; a group left with fewer than ``infra_min_valid`` valid samples (capped at ``k``) is run again
    (a fresh group of the same prompt) up to ``infra_retries`` times, then dropped; a step whose share of
    such samples exceeds ``infra_max_rate`` raises (the infrastructure is broken, not the policy).
    """

    init: str = ""
    domain: str = "general"
    effort: str = "max"
    families: list[str] = field(default_factory=lambda: ["general.arithmetic", "agents.search", "coding.write_function"])
    steps: int = ranged(40, ge=0)  # 0: the demo skips the stage
    n_prompts: int = ranged(8, ge=1)
    k: int = ranged(8, ge=1)
    lambda_: float = ranged(0.7, gt=0, le=1)
    max_staleness: int = ranged(4, ge=0)
    temperature: float = ranged(1.0, ge=0)
    max_tokens: int = ranged(128, ge=1)
    max_model_len: int = ranged(2048, ge=1)
    slots: int = ranged(32, ge=1)
    kv_pool_mb: int = ranged(64, ge=0)
    resume_kv: str = "reuse"
    routing_replay: str = "off"
    exact: bool = False
    draft: str = ""
    draft_steps: int = ranged(2, ge=0)
    draft_lr: float = ranged(3e-4, gt=0)
    difficulty: int = ranged(1, ge=1)
    n_tasks: int = ranged(320, ge=1)
    eval_n: int = ranged(400, ge=0)
    eval_max_tokens: int = ranged(128, ge=1)
    eval_samples: int = ranged(0, ge=0)
    train_pass_min: float = ranged(0.0, ge=0, le=1)
    train_pass_max: float = ranged(1.0, ge=0, le=1)
    train_pass_empty: str = "error"
    lr: float = ranged(1e-4, ge=0)
    lr_schedule: str = "constant"
    weight_decay: float = ranged(0.0, ge=0)
    grad_clip: float = 1.0
    micro_batch_tokens: int = ranged(8192, ge=1)
    log_ratio_min: float = ranged(-math.log(2.0), le=0, inf_ok=True)
    log_ratio_max: float = ranged(math.log(2.0), ge=0, inf_ok=True)
    tau: float = ranged(0.01, ge=0)
    clip_eps_low: float = ranged(math.inf, ge=0, inf_ok=True)
    clip_eps_high: float = ranged(math.inf, ge=0, inf_ok=True)
    stop_gradient_ratio: bool = False
    sequence_ratio: bool = False
    seq_mean: bool = False
    normalize_std: bool = False
    skip_zero_variance: bool = False
    judge: str = ""
    judge_model: str = ""
    grm_sigma: float = ranged(1.5, gt=0)
    judge_min_agreement: float = ranged(0.0, ge=0, le=1)
    judge_gate_pairs: int = ranged(25, ge=1)
    judge_fallback: str = "fail"
    effort_control: EffortConfig = field(default_factory=EffortConfig)
    domains: list[str] = field(default_factory=lambda: ["general", "agents", "coding"])
    domain_overrides: dict[str, dict[str, Any]] = field(default_factory=lambda: default_domain_overrides())
    infra_min_valid: int = ranged(2, ge=1)
    infra_retries: int = ranged(1, ge=0)
    infra_max_rate: float = ranged(0.5, ge=0, le=1)
    save_every: int = ranged(10, ge=1)
    keep_last: int = 2  # checkpoints kept on disk (>= 1); older ones are deleted after a newer one is complete
    seed: int = 0
    progress: bool = True
    device: str = "cpu"
    optimizer: str = "adamw"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        check_keep_last(self.keep_last, "rl.keep_last")
        self.domain_overrides = _flatten_expert_keys(self.domain_overrides)
        if is_url(self.judge) and not self.judge_model:
            raise ValueError("rl.judge is a URL: set rl.judge_model to the served model's name")
        if self.effort not in EFFORTS:
            raise ValueError(f"rl.effort must be one of {EFFORTS}, got {self.effort!r}")
        if self.train_pass_min > self.train_pass_max:
            raise ValueError(f"rl.train_pass_min ({self.train_pass_min}) must be <= rl.train_pass_max ({self.train_pass_max})")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"rl.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.resume_kv not in RESUME_KV:
            raise ValueError(f"rl.resume_kv must be one of {RESUME_KV}, got {self.resume_kv!r}")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"rl.routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}")
        if self.exact and self.resume_kv != "reprefill":
            raise ValueError("rl.exact=true needs rl.resume_kv=reprefill: a token sampled over KV kept from older weights "
                             "equals no recomputation under the new ones")
        if self.judge_fallback not in JUDGE_FALLBACKS:
            raise ValueError(f"rl.judge_fallback must be one of {JUDGE_FALLBACKS}, got {self.judge_fallback!r}")
        if self.train_pass_empty not in TRAIN_PASS_EMPTY:
            raise ValueError(f"rl.train_pass_empty must be one of {TRAIN_PASS_EMPTY}, got {self.train_pass_empty!r}")
        stage_keys = [k for k in self.domain_overrides if "." in k]
        for key, ds in (("rl.domain", [self.domain]), ("rl.domains", list(self.domains)),
                        ("rl.domain_overrides", [k.split(".", 1)[0] for k in self.domain_overrides])):
            bad = [d for d in ds if d not in DOMAINS]
            if bad:
                raise ValueError(f"{key}: unknown domain(s) {bad}; expected {DOMAINS}")
        for k in stage_keys:
            effort = k.split(".", 1)[1]
            if effort not in EFFORTS:
                raise ValueError(f"rl.domain_overrides.{k}: unknown effort {effort!r}; expected one of {EFFORTS}")
            shared = sorted(set(self.domain_overrides[k]) & {"n_tasks", "eval_n", "difficulty"})
            if shared:
                raise ValueError(f"rl.domain_overrides.{k}: {shared} define the domain's task sets, shared by its "
                                 f"experts; set them under rl.domain_overrides.{k.split('.', 1)[0]}")
        for d in self.domain_overrides:
            over = {**self._overrides(d.split(".", 1)[0]), **self._overrides(d)}
            lo, hi = over.get("train_pass_min", self.train_pass_min), over.get("train_pass_max", self.train_pass_max)
            if lo > hi:
                raise ValueError(f"rl.domain_overrides.{d}: train_pass_min ({lo}) must be <= train_pass_max ({hi})")

    def _overrides(self, domain: str) -> dict[str, int | float | str]:
        """``domain_overrides[domain]`` cast to the fields' types (ValueError naming a non-numeric or
        non-integer setting, or one outside the field's range)."""
        types = {f.name: type(getattr(self, f.name)) for f in fields(self)}
        over: dict[str, int | float | str] = {}
        for key, value in dict(self.domain_overrides.get(domain, {})).items():
            if key in CHOICE_OVERRIDES:
                if value not in CHOICE_OVERRIDES[key]:
                    raise ValueError(f"rl.domain_overrides.{domain}.{key}: must be one of {CHOICE_OVERRIDES[key]}, "
                                     f"got {value!r}")
                over[key] = str(value)
                continue
            if types.get(key) is bool and key in BOOL_OVERRIDES:
                if not isinstance(value, bool) and str(value).lower() not in ("true", "false"):
                    raise ValueError(f"rl.domain_overrides.{domain}.{key}: must be true or false, got {value!r}")
                over[key] = value if isinstance(value, bool) else str(value).lower() == "true"
                continue
            if types.get(key) not in (int, float) or key == "seed":
                raise ValueError(f"rl.domain_overrides.{domain}.{key}: not a numeric RL setting")
            try:  # a YAML or command-line value such as 2e-4 may arrive as text
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"rl.domain_overrides.{domain}.{key}: must be a number, got {value!r}") from None
            if types[key] is int and number != int(number):
                raise ValueError(f"rl.domain_overrides.{domain}.{key}: must be an integer, got {value}")
            over[key] = types[key](number)
            check_range(f"rl.domain_overrides.{domain}.{key}", over[key], field_range(type(self), key))
        return over

    def rollout_config(self) -> RolloutConfig:
        """The rollout seam's settings (`k3post.rollout.factory.Rollout`)."""
        engine = self.engine
        if self.draft:  # the rollout drafts with the draft the loop trains online (k3post.spec.online)
            if engine.draft and engine.draft != self.draft:
                raise ValueError(f"rl.draft ({self.draft}) and rl.engine.draft ({engine.draft}) name different drafts: "
                                 "set rl.draft only (it sets the engine's)")
            engine = replace(engine, draft=self.draft)
        return RolloutConfig(n_prompts=self.n_prompts, k=self.k, lambda_=self.lambda_, max_staleness=self.max_staleness,
                             temperature=self.temperature, max_tokens=self.max_tokens, max_model_len=self.max_model_len,
                             slots=self.slots, kv_pool_mb=self.kv_pool_mb, effort=self.effort, seed=self.seed,
                             engine=engine, resume_kv=self.resume_kv,
                             record_routes=self.routing_replay != "off", exact=self.exact)

    def lr_at(self, step: int) -> float:
        """The learning rate of the optimizer step that follows ``step`` finished steps: ``lr`` ("constant"), or
        ``lr · (1 − step / steps)`` ("linear": from ``lr`` at the first step down to ``lr / steps`` at the last)."""
        if self.lr_schedule == "linear" and self.steps > 0:
            return self.lr * max(0.0, 1.0 - step / self.steps)
        return self.lr

    def optim_config(self) -> OptimConfig:
        """The trainer's optimizer (AdamW betas 0.9 / 0.95, eps 1e-8 unless ``optimizer`` is sgd)."""
        return OptimConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay)

    def loss_kwargs(self) -> dict[str, Any]:
        """The `policy_loss` parameters (`loss_kwargs`)."""
        return loss_kwargs(self)

    def for_domain(self, domain: str, effort: str | None = None) -> "RLConfig":
        """This config with ``domain`` set and its ``domain_overrides`` applied (each value cast to
        the field's type); with ``effort``, also ``effort`` set and the ``domain.effort`` overrides on top."""
        if effort is None:
            return replace(self, domain=domain, **self._overrides(domain))
        return replace(self, domain=domain, effort=effort, **{**self._overrides(domain), **self._overrides(f"{domain}.{effort}")})


def _flatten_expert_keys(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{general: {max: {lr: 1e-4}, n_tasks: 64}}`` (how ``rl.domain_overrides.general.max.lr=1e-4`` on the command
    line and a nested YAML mapping arrive) as ``{general: {n_tasks: 64}, general.max: {lr: 1e-4}}``. A value set both
    ways takes the nested one: the command line can only write that form, and it overrides the config file's.
    ValueError naming the key when a domain's or an expert's entry is not a mapping of settings."""
    out: dict[str, dict[str, Any]] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, values in dict(overrides).items():
        own = out.setdefault(key, {})
        for k, v in _settings(f"rl.domain_overrides.{key}", values).items():
            if k in EFFORTS and "." not in key:
                nested.setdefault(f"{key}.{k}", {}).update(_settings(f"rl.domain_overrides.{key}.{k}", v))
            else:
                own[k] = v
    for key, values in nested.items():
        out.setdefault(key, {}).update(values)
    return out


def _settings(key: str, values: Any) -> dict[str, Any]:
    """``values`` (a mapping of settings, or nothing) as a dict; ValueError naming ``key`` otherwise."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{key}: expected a mapping of RL settings (e.g. {{steps: 16}}), got {values!r}")
    return dict(values)


def loss_kwargs(cfg: RLConfig) -> dict[str, Any]:
    """The `policy_loss` parameters of ``cfg`` (see `k3post.algos.policy_loss` for each variant's setting)."""
    return {"log_ratio_min": cfg.log_ratio_min, "log_ratio_max": cfg.log_ratio_max, "tau": cfg.tau,
            "clip_eps_low": cfg.clip_eps_low, "clip_eps_high": cfg.clip_eps_high,
            "stop_gradient_ratio": cfg.stop_gradient_ratio, "sequence_ratio": cfg.sequence_ratio, "seq_mean": cfg.seq_mean}
