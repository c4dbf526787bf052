"""Settings of one RL run and of `k3post experts` (`k3post.stages.rl` reads them). Each component the loop builds has
its own section, which builds its part: ``rl.rollout`` (`RolloutConfig`, the rollout and its engine), ``rl.optim``
(`PolicyOptimConfig`, the trainer's optimizer) and ``rl.loss`` (`LossConfig`, the policy loss)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Any

from k3post.config.effort import EffortConfig
from k3post.config.loss import LossConfig
from k3post.config.optim import LR_SCHEDULES, PolicyOptimConfig, check_keep_last
from k3post.config.ranges import check_range, field_range, ranged
from k3post.config.rollout import RESUME_KV, ROUTING_REPLAY, RolloutConfig
from k3post.constants import DOMAINS, EFFORTS
from k3post.urls import is_url

__all__ = ["AGENTS_RL_SETTING", "CODING_RL_SETTING", "GENERAL_MAX_SETTING", "MOVED_KEYS", "RLConfig",
           "default_domain_overrides", "domain_override_args", "flat_settings"]

TRAIN_PASS_EMPTY = ("error", "all")
JUDGE_FALLBACKS = ("fail", "format_gate")
SECTIONS: dict[str, type] = {"rollout": RolloutConfig, "optim": PolicyOptimConfig, "loss": LossConfig}
"""``RLConfig``'s component sections, each built by its own dataclass."""
CHOICE_OVERRIDES: dict[str, tuple[str, ...]] = {"optim.lr_schedule": LR_SCHEDULES, "train_pass_empty": TRAIN_PASS_EMPTY,
                                                "rollout.resume_kv": RESUME_KV, "rollout.routing_replay": ROUTING_REPLAY}
# the loss switches an expert may set for itself (domain_overrides), besides the numeric fields
BOOL_OVERRIDES: tuple[str, ...] = ("loss.normalize_std", "loss.skip_zero_variance", "loss.seq_mean", "loss.sequence_ratio",
                                   "loss.stop_gradient_ratio")
"""The settings other than numbers that ``domain_overrides`` may set (dotted under their section), with their choices."""

MOVED_KEYS: dict[str, str] = {
    **{name: f"rollout.{name}" for name in ("n_prompts", "k", "lambda_", "max_staleness", "temperature", "max_tokens",
                                            "max_model_len", "slots", "kv_pool_mb", "resume_kv", "routing_replay",
                                            "exact", "engine")},
    **{name: f"optim.{name}" for name in ("lr", "lr_schedule", "weight_decay", "grad_clip")},
    "optimizer": "optim.name",
    **{name: f"loss.{name}" for name in ("log_ratio_min", "log_ratio_max", "tau", "clip_eps_low", "clip_eps_high",
                                         "stop_gradient_ratio", "sequence_ratio", "seq_mean", "normalize_std",
                                         "skip_zero_variance")},
}
"""An RL setting's key before the sections (k3post <= 2026-12-06: ``rl.lr``) → its key now (``rl.optim.lr``), for
the error that names it (`k3post.config.load_config`, ``domain_overrides``)."""


def _curriculum(**rollout: Any) -> dict[str, Any]:
    """How the demo's agents and coding experts and `CODING_RL_SETTING` roll out and pick their tasks: T 0.5, the tasks
    b0 solved at least once (every task, with a warning, when it solved none), on-policy; ``rollout`` adds to (or
    replaces) the rollout's part. `AGENTS_RL_SETTING` starts from it and samples at T 1 over a larger pool (issue 31
    §agents25)."""
    return {"rollout": {"temperature": 0.5, "lambda_": 1, "max_staleness": 0, **rollout},
            "train_pass_min": 0.01, "train_pass_empty": "all"}


def default_domain_overrides() -> dict[str, dict[str, Any]]:
    """`RLConfig.domain_overrides`' default: the agents and coding experts' sizes (their episodes cost far more)."""
    return {
        # 256: the search references think at max in every turn (issue 31 §effort), up to ~230 tokens a turn with the
        # demo's tokenizer (configs/full.yaml's lexicon tokenizer: ~140, so it keeps 192)
        # eval_n 32: the SFT model passes some agents.search episodes now (issue 31 §agents)
        # T 0.5, the tasks b0 solved (of 64), on-policy (issue 31 §agentslearn: with the SFT models of then, at T 1 70-90 %
        # of the episodes ended malformed and the demo's agents.low fell 7 -> 2 of 32); AGENTS_RL_SETTING's T 1 over a
        # 768-task pool (§agents25) costs its b0 alone ~8 minutes of one core, more than the demo's agents experts
        "agents": {"steps": 16, "n_tasks": 64, "eval_n": 32, "eval_max_tokens": 256,
                   **_curriculum(n_prompts=2, max_tokens=256)},
        # the same rollouts, 4 prompts a step at lr 2e-4 decaying linearly, 64 held-out tasks: from an SFT model that
        # passes 31 % (200 SFT tasks of coding.write_function, the demo's data) coding.max's 16 steps went 0.31 -> 0.67
        # (n 64, p 6e-6; issue 31 §coding)
        "coding": {"steps": 16, "n_tasks": 64, "eval_n": 64, "eval_max_tokens": 384,
                   **_curriculum(n_prompts=4, max_tokens=384), "optim": {"lr": 2e-4, "lr_schedule": "linear"}},
    }


GENERAL_MAX_SETTING: dict[str, dict[str, Any]] = {
    "general": {"n_tasks": 1280, "eval_n": 800, "rollout": {"slots": 256}},
    "general.max": {"rollout": {"n_prompts": 32, "lambda_": 1, "max_staleness": 0},
                    "optim": {"lr": 2e-4, "lr_schedule": "linear"}, "eval_samples": 8},
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
    "agents": {"n_tasks": 768, "eval_n": 100, **_curriculum(n_prompts=4, temperature=1.0), "train_pass_max": 0.75,
               "optim": {"lr": 6e-4, "lr_schedule": "linear"}},
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
    "coding": {"n_tasks": 256, "eval_n": 200, **_curriculum(n_prompts=4), "optim": {"lr": 2e-4, "lr_schedule": "linear"}},
    "coding.max": {"steps": 64, "eval_samples": 4},
}
"""`AGENTS_RL_SETTING`'s recipe for coding (docs/decisions.md, issue 31 §coding): T 0.5 rollouts on the tasks b0 solved,
4 a step on-policy, lr 2e-4 decaying linearly, 64 steps, held-out avg@4 at T 0.5 beside greedy on 200 tasks. From the
SFT model trained on 200 coding.write_function tasks (seed 0, the demo's data) coding.max went 0.32 -> 0.77 greedy and
0.37 -> 0.69 avg@4 (n 200, p 0.0001); from the older model trained on 100 tasks (0.07 greedy: it wrote the right kind of
function with the constants of its training data) 0.034 -> 0.056 avg@4 (96 steps over 384 tasks, p 0.034). ~21 minutes
of one core for coding.max; configs/full.yaml uses it."""


def domain_override_args(setting: dict[str, dict[str, Any]]) -> list[str]:
    """``setting`` (expert or domain → fields, a section's fields in a mapping of their own) as command-line
    overrides, ``rl.domain_overrides.<key>.<field>=<value>`` (``...<key>.<section>.<field>=<value>``), each merged
    into the config's entry for that key instead of replacing it."""
    return [f"rl.domain_overrides.{key}.{name}={value}" for key, values in setting.items()
            for name, value in flat_settings(f"rl.domain_overrides.{key}", values).items()]


@dataclass
class RLConfig:
    """Settings of one RL run (one domain at one effort) and of `k3post experts`.

    Components, each a section that builds its part: ``rollout`` (`RolloutConfig`: ``n_prompts`` × ``k`` per
    iteration, ``lambda_`` and ``max_staleness`` (SPEC §3.2), ``temperature``, ``max_tokens`` per assistant turn,
    ``slots``, ``kv_pool_mb``, ``resume_kv``, ``routing_replay``, ``exact`` and the ``engine``), ``optim``
    (`PolicyOptimConfig`: ``lr`` with ``lr_schedule``, ``weight_decay``, ``grad_clip``, the optimizer's ``name``) and
    ``loss`` (`LossConfig`: the policy loss of SPEC §3.1 and its variants, ``normalize_std``, ``skip_zero_variance``).
    ``micro_batch_tokens``: padded tokens per trainer forward.
    ``draft`` (an EAGLE-3 export: speculative decoding in rollout, and the draft trained online on the policy's
    rollouts, ``draft_steps`` optimizer steps at ``draft_lr`` after every RL step, 0: frozen; `k3post.spec.online`).
    Tasks: ``families``, the families trained in each domain (a domain with none listed trains all its
    verifiable families, plus the non-verifiable ones when a ``judge`` is set), ``difficulty``, ``n_tasks`` training
    prompts per family (cycled), ``eval_n`` held-out tasks per family, evaluated greedily and, with ``eval_samples`` =
    k > 0, also k times each at ``rollout.temperature`` (avg@k: the expected reward RL optimises, paired per task with
    the SFT model's, same seeds).
    Prompt selection: with ``train_pass_min`` > 0 or ``train_pass_max`` < 1 the expert trains only on the
    training tasks whose pass fraction in their b0 samples (the cold-start model's, `rewards.effort`) lies in
    [train_pass_min, train_pass_max]: a prompt the model never or always solves gives a group without variance,
    which carries no policy gradient (difficulty curriculum; set per expert like ``optim.lr``). When none is in the
    range (a cold-start model that solves none of them), ``train_pass_empty`` says what happens: "error" (the default)
    fails the expert naming the settings; "all" trains on every task, with a warning in the log (an explicit opt-in:
    every group then starts without variance, as without the curriculum).
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
    ``domain_overrides`` sets numeric fields (and the choices of ``CHOICE_OVERRIDES`` and the loss switches of
    ``BOOL_OVERRIDES``) per domain, a section's fields in a mapping of their own or dotted (e.g. ``{agents: {steps: 4,
    eval_n: 24, rollout: {max_tokens: 256}}}``: agentic episodes cost far more than arithmetic ones) and, under a
    ``domain.effort`` key, per expert (e.g. ``{agents.low: {steps: 12}}``, applied after the domain's); an expert key
    may not change what defines the domain's task sets (``n_tasks``, ``eval_n``, ``difficulty``: b0 and the "before"
    row are shared by its three experts). ``eval_samples`` may be set per expert (e.g. ``{general.max: {eval_samples:
    8}}``: avg@k where the paired test is wanted, not at every effort); the "before" row then holds the SFT model's
    avg@k at exactly those efforts, with each expert's own k, temperature and seed. See `for_domain`.
    ``init``: the checkpoint RL starts from (empty: the run folder's ``sft/final``).
    Infrastructure failures (`k3post.errors.InfrastructureError`: an env worker lost, the sandbox, the
    browser or the GRM judge unavailable; RL and MOPD, `k3post.loop`): such samples are masked out of their
    group; a group left with fewer than ``infra_min_valid`` valid samples (capped at ``rollout.k``) is run again
    (a fresh group of the same prompt) up to ``infra_retries`` times, then dropped; a step whose share of
    such samples exceeds ``infra_max_rate`` raises (the infrastructure is broken, not the policy).
    """

    init: str = ""
    domain: str = "general"
    effort: str = "max"
    families: list[str] = field(default_factory=lambda: ["general.arithmetic", "agents.search", "coding.write_function"])
    steps: int = ranged(40, ge=0)  # 0: the demo skips the stage
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: PolicyOptimConfig = field(default_factory=PolicyOptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    micro_batch_tokens: int = ranged(8192, ge=1)
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

    def __post_init__(self) -> None:
        check_keep_last(self.keep_last, "rl.keep_last")
        self.domain_overrides = _flatten_overrides(self.domain_overrides)
        if is_url(self.judge) and not self.judge_model:
            raise ValueError("rl.judge is a URL: set rl.judge_model to the served model's name")
        if self.effort not in EFFORTS:
            raise ValueError(f"rl.effort must be one of {EFFORTS}, got {self.effort!r}")
        if self.train_pass_min > self.train_pass_max:
            raise ValueError(f"rl.train_pass_min ({self.train_pass_min}) must be <= rl.train_pass_max ({self.train_pass_max})")
        if self.draft and self.rollout.engine.draft and self.rollout.engine.draft != self.draft:
            raise ValueError(f"rl.draft ({self.draft}) and rl.rollout.engine.draft ({self.rollout.engine.draft}) name "
                             "different drafts: set rl.draft only (it sets the engine's)")
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
        """``domain_overrides[domain]`` (dotted keys for a section's fields) cast to the fields' types (ValueError
        naming a non-numeric or non-integer setting, one outside the field's range, or a key from before the
        sections with its key now)."""
        over: dict[str, int | float | str] = {}
        for key, value in dict(self.domain_overrides.get(domain, {})).items():
            where = f"rl.domain_overrides.{domain}.{key}"
            if key in MOVED_KEYS:
                raise ValueError(f"{where}: moved to rl.domain_overrides.{domain}.{MOVED_KEYS[key]}")
            if key in CHOICE_OVERRIDES:
                if value not in CHOICE_OVERRIDES[key]:
                    raise ValueError(f"{where}: must be one of {CHOICE_OVERRIDES[key]}, got {value!r}")
                over[key] = str(value)
                continue
            section, _, name = key.rpartition(".")
            owner = getattr(self, section) if section in SECTIONS else self if not section else None
            kind = type(getattr(owner, name)) if owner is not None and hasattr(owner, name) else None
            if kind is bool and key in BOOL_OVERRIDES:
                if not isinstance(value, bool) and str(value).lower() not in ("true", "false"):
                    raise ValueError(f"{where}: must be true or false, got {value!r}")
                over[key] = value if isinstance(value, bool) else str(value).lower() == "true"
                continue
            if kind not in (int, float) or key == "seed":
                raise ValueError(f"{where}: not a numeric RL setting")
            try:  # a YAML or command-line value such as 2e-4 may arrive as text
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: must be a number, got {value!r}") from None
            if kind is int and number != int(number):
                raise ValueError(f"{where}: must be an integer, got {value}")
            over[key] = kind(number)
            check_range(where, over[key], field_range(type(owner), name))
        return over

    def with_settings(self, settings: Mapping[str, Any]) -> "RLConfig":
        """This config with ``settings`` set, written as under ``rl:`` in a config file: a section's fields in a
        mapping of their own or dotted (``{"steps": 4, "rollout": {"k": 4}, "optim.lr": 1e-3}``). The values are
        taken as given (a config file's are type- and range-checked when it loads); ValueError naming a key from
        before the sections with its key now, TypeError naming an unknown one.

            cfg = RLConfig(domain="general").with_settings({"steps": 4, "rollout": {"n_prompts": 3, "k": 4}})
        """
        flat: dict[str, Any] = {}
        for key, value in settings.items():
            if key in MOVED_KEYS:
                raise ValueError(f"RL setting {key!r} is now {MOVED_KEYS[key]!r}")
            if key in SECTIONS and isinstance(value, Mapping):
                flat.update({f"{key}.{name}": v for name, v in value.items()})
            else:
                flat[key] = value
        return self._with(flat)

    def _with(self, over: Mapping[str, Any], **top: Any) -> "RLConfig":
        """This config with ``over`` (dotted keys for a section's fields) and ``top`` set."""
        sections: dict[str, dict[str, Any]] = {}
        for key, value in over.items():
            section, _, name = key.rpartition(".")
            if section:
                sections.setdefault(section, {})[name] = value
            else:
                top[key] = value
        return replace(self, **top, **{s: replace(getattr(self, s), **values) for s, values in sections.items()})

    def setting(self, key: str) -> Any:
        """The value of ``key`` as `domain_overrides` and `with_settings` name it (``"steps"``, ``"rollout.k"``)."""
        section, _, name = key.rpartition(".")
        return getattr(getattr(self, section) if section else self, name)

    def rollout_config(self) -> RolloutConfig:
        """The rollout seam's settings (`k3post.rollout.factory.Rollout`): ``rollout``, its engine drafting with
        ``draft`` when set (the draft the loop trains online, `k3post.spec.online`)."""
        if self.draft:
            return replace(self.rollout, engine=replace(self.rollout.engine, draft=self.draft))
        return self.rollout

    def lr_at(self, step: int) -> float:
        """The learning rate of the optimizer step that follows ``step`` finished steps (`PolicyOptimConfig.lr_at`)."""
        return self.optim.lr_at(step, self.steps)

    def for_domain(self, domain: str, effort: str | None = None) -> "RLConfig":
        """This config with ``domain`` set and its ``domain_overrides`` applied (each value cast to
        the field's type); with ``effort``, also ``effort`` set and the ``domain.effort`` overrides on top."""
        if effort is None:
            return self._with(self._overrides(domain), domain=domain)
        return self._with({**self._overrides(domain), **self._overrides(f"{domain}.{effort}")}, domain=domain, effort=effort)


def _flatten_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{general: {max: {optim: {lr: 1e-4}}, n_tasks: 64}}`` (how ``rl.domain_overrides.general.max.optim.lr=1e-4`` on
    the command line and a nested YAML mapping arrive) as ``{general: {n_tasks: 64}, general.max: {optim.lr: 1e-4}}``.
    A value set both ways takes the nested one: the command line can only write that form, and it overrides the
    config file's. ValueError naming the key when a domain's or an expert's entry is not a mapping of settings."""
    out: dict[str, dict[str, Any]] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, values in dict(overrides).items():
        own = out.setdefault(key, {})
        for k, v in flat_settings(f"rl.domain_overrides.{key}", values).items():
            if k.split(".", 1)[0] in EFFORTS and "." not in key:
                effort, _, rest = k.partition(".")
                entry = nested.setdefault(f"{key}.{effort}", {})
                if rest:  # an expert's setting written dotted under its domain: {general: {max.optim.lr: ...}}
                    entry[rest] = v
                else:
                    entry.update(flat_settings(f"rl.domain_overrides.{key}.{k}", v))
            else:
                own[k] = v
    for key, values in nested.items():
        out.setdefault(key, {}).update(values)
    return out


def flat_settings(key: str, values: Any) -> dict[str, Any]:
    """``values`` (a mapping of settings, or nothing) as a dict, a section's mapping of fields as dotted keys
    (``{rollout: {k: 4}}`` → ``{rollout.k: 4}``; a value written both ways takes the nested one); ValueError naming
    ``key`` otherwise."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{key}: expected a mapping of RL settings (e.g. {{steps: 16}}), got {values!r}")
    out = {k: v for k, v in dict(values).items() if not isinstance(v, Mapping) or k in EFFORTS}
    for k, v in dict(values).items():
        if isinstance(v, Mapping) and k not in EFFORTS:
            if k not in SECTIONS:
                raise ValueError(f"{key}.{k}: not a section of RL settings (one of {sorted(SECTIONS)})")
            out.update({f"{k}.{name}": x for name, x in v.items()})
    return out
