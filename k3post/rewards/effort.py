"""Reasoning-effort control (SPEC §3.3, issue 7 part 2): per-problem budgets b0(x), the −1
reward override, and the max → high → low curriculum.

The override of a sample y of problem x trained at effort e in domain d:

    r'(x, y) = −1           if T(y) > s_(d,e) · b0(x)
               r(x, y)      otherwise

    s_(d,e) = τ_(d,e)                  for e = high, low
    s_(d,max) = min(τ_(d,max), cap)    (the absolute cap of max: T(y) ≤ cap · b0(x))

with τ from `EffortConfig` (defaults **(ours)**: τ_max = 2.0, cap = 4, τ_high = 1.0,
τ_low = 0.4; per-domain overrides in ``domain_tau``). Since b0 ≥ 0,
min(τ·b0, cap·b0) = min(τ, cap)·b0, so one scale per (domain, effort) covers both.

T(y) is `Trajectory.effort_tokens`: thinking tokens for general tasks, every sampled output
token across turns (reasoning, responses, tool-call arguments; tool results are env tokens)
for the agentic domains "agents" and "coding".

b0(x) is estimated once from the cold-start model (`estimate_budgets`): K samples of x at
the RL rollouts' temperature (``rl.rollout.temperature``, 1 by default) with the effort message of the estimated effort (``max``) rendered exactly as
the rollout renders it (`AgentLoop(effort=...)` → the XTML ``thinking-effort`` option
message), then

    b0(x) = max(min_b0, Q_q({T(y) : y correct}))                when x has a correct sample
          = max(min_b0, median{T(y) : y correct, y of family F(x)})  when none is correct
          = max(min_b0, median{T(y) : y of family F(x)})      when no sample of F(x) is correct

Q_q is the q-quantile with linear interpolation (torch.quantile / numpy "linear": with the
n values sorted, h = (n−1)·q, Q = x_⌊h⌋ + (h − ⌊h⌋)(x_⌊h⌋+1 − x_⌊h⌋)), q = 0.9 **(ours)**;
the median is Q_0.5. Departures **(ours)**, beyond SPEC:

* the third line: a family none of whose samples is correct (an untrained cold-start
  model) falls back to the median over all its samples, so every task gets a budget;
* ``min_b0`` (default 1 token): a problem whose correct samples did not think at all would
  get b0 = 0, a limit of 0 and an undefined T/b0; the floor keeps b0 > 0;
* a sample is correct when the env verified it (a verdict exists: the episode ended, not
  cut by length / context / malformed output) and its reward is ≥ ``correct_reward`` (1.0);
  a sample whose infrastructure failed (``Trajectory.infra``) is no sample at all.

The limit of a reduced effort (high, low) never falls below a floor when ``EffortConfig.reference_floor`` (default
on, **ours**): T of the task's own scripted reference solution at that effort
(`k3post.rollout.evaluation.reference_effort_tokens`), so limit = max(s_(d,e) · b0(x), floor_e(x)): the budget of
effort e admits the solution the SFT data taught for e. ``max`` keeps τ_max · b0 (`floor_applies`). For
agentic tasks T counts every output token, tool-call syntax and arguments included, and a τ_low · b0 below what the
calls alone take leaves no correct answer inside the budget: the demo's agents.search needs 259-269 tokens at low
effort against a limit of 105, and its high reference 296-321 against 262 (decisions, issue 31 §floor).

`BudgetTable` caches the estimate per task (key: `Task.content_hash`, the SHA-256 of the
task's canonical JSON) with every sample's T(y) and correctness, as JSON written atomically
(temporary file + ``os.replace``). A b0, once estimated, is frozen: estimating new tasks
later recomputes the family medians over all stored samples for the new tasks only.

Shape legend: N samples (trajectories) scored together.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3post.constants import EFFORTS
from k3post.config.effort import EffortConfig
from k3post.envs.env import Environment
from k3post.envs.families.common import check_effort
from k3post.errors import InfrastructureError
from k3post.envs.task import DOMAINS, Task
from k3post.rollout.engine import SteppableEngine
from k3post.rollout.evaluation import make_env, run_episodes
from k3post.rollout.trajectory import Group, Trajectory
from k3post.io import write_jsonl
from k3post.xtml import XTML

__all__ = [
    "add_floors",
    "budget_summary",
    "floor_applies",
    "EffortConfig",
    "effort_scale",
    "budget_limit",
    "override_rewards",
    "effort_override",
    "group_override",
    "quantile",
    "estimate_b0",
    "family_medians",
    "is_correct",
    "task_key",
    "TaskSamples",
    "BudgetEntry",
    "BudgetTable",
    "BUDGET_TABLE_VERSION",
    "estimate_budgets",
    "CurriculumStage",
    "Curriculum",
]

log = logging.getLogger("k3post.effort")

BUDGET_TABLE_VERSION = 1


# =========================================================================== config (k3post.config.effort)


def effort_scale(effort: str, domain: str, cfg: EffortConfig) -> float:
    """s_(d,e): τ of ``effort`` in ``domain`` (the domain override, else the global τ), and
    for ``max`` min(τ, max_cap). The limit of a problem is s · b0."""
    check_effort(effort)
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    tau = float(dict(cfg.domain_tau).get(domain, {}).get(effort, getattr(cfg, f"tau_{effort}")))
    return min(tau, float(cfg.max_cap)) if effort == "max" else tau


def floor_applies(effort: str, cfg: EffortConfig) -> bool:
    """Whether the reference floor bounds the limit of ``effort``: with ``cfg.reference_floor``, at the reduced
    efforts (high, low), whose τ · b0 can fall under every correct answer. Not at max: its limit is τ_max · b0 ≥ 2 ×
    what the model's own correct answers take (b0 is their 0.9-quantile), and a floor at the max reference (coding's
    is 513–742 tokens against 2 · b0 ≈ 284) lifts the pressure off long failing answers: on demo seed 1 coding.max
    ended at 0.203 with it against 0.469 without (decisions, issue 31 §floor)."""
    check_effort(effort)
    return bool(cfg.reference_floor) and effort != "max"


def budget_limit(b0: float, effort: str, domain: str, cfg: EffortConfig, floor: float = 0.0) -> float:
    """The token limit of a problem with budget ``b0``: τ_e · b0, and min(τ_max · b0,
    max_cap · b0) for ``max``; with ``cfg.reference_floor`` never below ``floor`` (T of the task's reference
    solution at ``effort``, `BudgetTable.floor`). A sample is over budget when T(y) > limit."""
    if isinstance(b0, bool) or not isinstance(b0, (int, float)) or not math.isfinite(b0) or b0 < 0:
        raise ValueError(f"b0 must be a finite number >= 0, got {b0!r}")
    limit = effort_scale(effort, domain, cfg) * float(b0)
    return max(limit, float(floor)) if floor_applies(effort, cfg) else limit


# =========================================================================== the override (pure)


def override_rewards(
    rewards_N: torch.Tensor, tokens_N: torch.Tensor, b0_N: torch.Tensor, scale: float,
    floor_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """r'_i = −1 if T_i > max(scale · b0_i, floor_i) else r_i (SPEC §3.3; the floor is ours).

    Args:
        rewards_N: rewards r(x_i, y_i).
        tokens_N: T(y_i) (`Trajectory.effort_tokens`).
        b0_N: b0(x_i) of each sample's problem, > 0.
        scale: s_(d,e) (`effort_scale`).
        floor_N: the smallest limit of each sample's problem (`BudgetTable.floor`); None: no floor.

    Returns:
        (rewards'_N in the dtype of ``rewards_N``, metrics): ``violation_rate`` (fraction of
        the N samples over their limit), ``mean_tokens`` (mean T), ``mean_ratio`` (mean of
        T_i / b0_i), all means over the N samples. Comparisons run in float64.
    """
    if not (rewards_N.dim() == tokens_N.dim() == b0_N.dim() == 1) or not (
        rewards_N.shape == tokens_N.shape == b0_N.shape
    ):
        raise ValueError(
            f"rewards, tokens and b0 must be 1-D of one length, got {tuple(rewards_N.shape)}, "
            f"{tuple(tokens_N.shape)}, {tuple(b0_N.shape)}"
        )
    if rewards_N.numel() == 0:
        raise ValueError("no samples to score")
    t_N = tokens_N.to(torch.float64)
    b_N = b0_N.to(torch.float64)
    if bool((b_N <= 0).any()) or not bool(torch.isfinite(b_N).all()):
        raise ValueError(f"every b0 must be finite and > 0, got {b0_N.tolist()}")
    if bool((t_N < 0).any()):
        raise ValueError(f"token counts must be >= 0, got {tokens_N.tolist()}")
    limit_N = float(scale) * b_N
    if floor_N is not None:
        if floor_N.shape != b_N.shape:
            raise ValueError(f"floors must be 1-D of the samples' length, got {tuple(floor_N.shape)}")
        limit_N = torch.maximum(limit_N, floor_N.to(torch.float64))
    over_N = t_N > limit_N
    out_N = torch.where(over_N, torch.full_like(rewards_N, -1.0), rewards_N)
    metrics = {
        "violation_rate": float(over_N.to(torch.float64).mean()),
        "mean_tokens": float(t_N.mean()),
        "mean_ratio": float((t_N / b_N).mean()),
    }
    return out_N, metrics


def effort_override(
    rewards: torch.Tensor | Sequence[float],
    tokens: torch.Tensor | Sequence[int],
    b0s: torch.Tensor | Sequence[float],
    effort: str,
    domain: str,
    cfg: EffortConfig,
    floors: torch.Tensor | Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`override_rewards` at the limit of (``domain``, ``effort``) under ``cfg``: rewards
    of samples with T(y) > `budget_limit` become −1 (``floors`` apply where `floor_applies`).
    Returns (rewards'_N, metrics)."""
    rewards_N = torch.as_tensor(rewards, dtype=torch.float32) if not isinstance(rewards, torch.Tensor) else rewards
    return override_rewards(
        rewards_N,
        torch.as_tensor(tokens, dtype=torch.float64),
        torch.as_tensor(b0s, dtype=torch.float64),
        effort_scale(effort, domain, cfg),
        torch.as_tensor(floors, dtype=torch.float64) if floors is not None and floor_applies(effort, cfg) else None,
    )


def group_override(
    group: Group, table: "BudgetTable", effort: str, cfg: EffortConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """`effort_override` of the K samples of one finished group: r from the trajectories,
    T = `Trajectory.effort_tokens`, b0 and the floor of the group's task from ``table``, the task's domain."""
    task = Task.from_dict(group.task)
    b0 = table.b0(task)
    tokens = [t.effort_tokens() for t in group.trajectories]
    floors = [table.floor(task, effort)] * len(tokens) if floor_applies(effort, cfg) else None
    return effort_override(group.rewards, tokens, [b0] * len(tokens), effort, task.domain, cfg, floors)


# =========================================================================== the b0 estimator (pure)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation (torch.quantile / numpy "linear"): sorted
    x_0..x_(n−1), h = (n−1)·q, Q = x_⌊h⌋ + (h − ⌊h⌋)·(x_(⌊h⌋+1) − x_⌊h⌋)."""
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ValueError(f"quantile q must be in [0, 1], got {q!r}")
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("quantile of no values")
    h = (len(xs) - 1) * float(q)
    lo = math.floor(h)
    if lo + 1 >= len(xs):
        return xs[-1]
    return xs[lo] + (h - lo) * (xs[lo + 1] - xs[lo])


def estimate_b0(
    token_counts_correct: Sequence[int], family_median: float | None, *, q: float = 0.9, min_b0: float = 1.0
) -> float:
    """b0(x) = max(min_b0, Q_q(T of x's correct samples)), or max(min_b0, family_median)
    when x has no correct sample (see the module doc)."""
    if token_counts_correct:
        value = quantile(token_counts_correct, q)
    elif family_median is None:
        raise ValueError("no correct sample and no family median: b0 cannot be estimated")
    else:
        value = float(family_median)
    return max(float(min_b0), value)


@dataclass
class TaskSamples:
    """The cold-start samples of one task: its family, T(y) of each sample and whether each
    was correct."""

    family: str
    tokens: list[int]
    correct: list[bool]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.correct) or not self.tokens:
            raise ValueError(f"TaskSamples: need as many correctness flags as token counts (>= 1), got {self.tokens}, {self.correct}")
        self.tokens = [int(t) for t in self.tokens]
        self.correct = [bool(c) for c in self.correct]

    @property
    def correct_tokens(self) -> list[int]:
        """T(y) of the correct samples."""
        return [t for t, c in zip(self.tokens, self.correct) if c]


def family_medians(samples: Iterable[TaskSamples]) -> dict[str, tuple[float, str]]:
    """family -> (median, source): the median T over the family's correct samples (source
    ``"family_correct"``), or over all its samples when none is correct (``"family_all"``)."""
    correct: dict[str, list[int]] = {}
    every: dict[str, list[int]] = {}
    for s in samples:
        correct.setdefault(s.family, []).extend(s.correct_tokens)
        every.setdefault(s.family, []).extend(s.tokens)
    return {
        f: (quantile(correct[f], 0.5), "family_correct") if correct[f] else (quantile(every[f], 0.5), "family_all")
        for f in every
    }


def is_correct(traj: Trajectory, correct_reward: float = 1.0) -> bool:
    """A finished trajectory the env verified (it has a verdict) with reward ≥ ``correct_reward``."""
    return traj.done and traj.verdict is not None and float(traj.reward or 0.0) >= correct_reward


def task_key(task: Task) -> str:
    """The cache key of a task: `Task.content_hash` (SHA-256 of its canonical JSON)."""
    return task.content_hash()


# =========================================================================== the cached table


@dataclass
class BudgetEntry:
    """One task's budget: b0, where it came from (``"correct"``, ``"family_correct"`` or
    ``"family_all"``) and the samples it was estimated from."""

    b0: float
    source: str
    samples: TaskSamples
    floors: dict[str, float] = field(default_factory=dict)  # effort -> T of the task's reference solution at it

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        s = self.samples
        out = {"b0": self.b0, "source": self.source, "family": s.family, "tokens": list(s.tokens), "correct": list(s.correct)}
        if self.floors:
            out["floors"] = dict(sorted(self.floors.items()))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BudgetEntry":
        """Inverse of `to_dict`."""
        b0 = float(data["b0"])
        if not (math.isfinite(b0) and b0 > 0) or data["source"] not in ("correct", "family_correct", "family_all"):
            raise ValueError(f"bad budget entry {dict(data)!r}")
        floors = data.get("floors", {})
        if not isinstance(floors, Mapping) or any(
                e not in EFFORTS or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                for e, v in floors.items()):
            raise ValueError(f"bad budget floors in {dict(data)!r}")
        return cls(b0, str(data["source"]), TaskSamples(str(data["family"]), list(data["tokens"]), list(data["correct"])),
                   {str(e): float(v) for e, v in floors.items()})


class BudgetTable:
    """task key -> b0, with the samples behind each estimate and the family medians.

    Args:
        settings: how the budgets were estimated (effort, K, seed, max_tokens, q, ...);
            `estimate_budgets` refuses a cached table estimated under other settings.
    """

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        self.settings: dict[str, Any] = json.loads(json.dumps(dict(settings or {})))
        self.entries: dict[str, BudgetEntry] = {}
        self.medians: dict[str, tuple[float, str]] = {}

    # ------------------------------------------------------------------ lookup
    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, task_or_key: object) -> bool:
        key = task_key(task_or_key) if isinstance(task_or_key, Task) else task_or_key
        return key in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def b0(self, task_or_key: Task | str) -> float:
        """b0 of a task (or its key); ValueError when it was never estimated."""
        key = task_key(task_or_key) if isinstance(task_or_key, Task) else task_or_key
        entry = self.entries.get(key)
        if entry is None:
            what = f"task {task_or_key.id!r} ({task_or_key.family})" if isinstance(task_or_key, Task) else f"task key {key!r}"
            raise ValueError(f"{what} has no b0 in the budget table; estimate it first (estimate_budgets)")
        return entry.b0

    def floor(self, task_or_key: Task | str, effort: str) -> float:
        """The task's budget floor at ``effort`` (`EffortConfig.reference_floor`): T of its reference solution at
        that effort, 0 when the reference does not solve it; ValueError when the task was never estimated or that
        floor never computed (`add_floors`, `estimate_budgets` with ``floor``)."""
        check_effort(effort)
        self.b0(task_or_key)  # the error for a task without an entry
        key = task_key(task_or_key) if isinstance(task_or_key, Task) else task_or_key
        floor = self.entries[key].floors.get(effort)
        if floor is None:
            raise ValueError(f"task key {key!r} has no budget floor at {effort} effort in the table; add_floors or "
                             "estimate_budgets(floor=...) computes it")
        return floor

    def pass_fraction(self, task_or_key: Task | str) -> float:
        """The share of a task's b0 samples that were correct (the cold-start model's pass rate on it);
        ValueError when it was never estimated."""
        self.b0(task_or_key)  # the error for a task without an entry
        key = task_key(task_or_key) if isinstance(task_or_key, Task) else task_or_key
        c = self.entries[key].samples.correct
        return sum(c) / len(c)

    def b0s(self, tasks: Sequence[Task]) -> torch.Tensor:
        """b0 of each task, [N] float64."""
        return torch.tensor([self.b0(t) for t in tasks], dtype=torch.float64)

    # ------------------------------------------------------------------ estimation
    def add_samples(self, samples: Mapping[str, TaskSamples], *, q: float, min_b0: float,
                    floor: float | None = None) -> None:
        """Estimate b0 of new tasks (keys not yet in the table) from their samples.

        The family medians are recomputed over every stored sample plus the new ones; the b0
        of tasks already in the table stay as they were (estimated once). ``floor``: the new tasks' budget floor at
        every effort, given by hand (a table whose b0 are given by hand, in tests and benches); None: computed later
        (`add_floors`)."""
        new = {k: s for k, s in samples.items() if k not in self.entries}
        self.medians = family_medians([e.samples for e in self.entries.values()] + list(new.values()))
        for key, s in new.items():
            median, fallback = self.medians[s.family]
            correct = s.correct_tokens
            self.entries[key] = BudgetEntry(
                estimate_b0(correct, median, q=q, min_b0=min_b0), "correct" if correct else fallback, s,
                {} if floor is None else dict.fromkeys(EFFORTS, float(floor)),
            )

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "version": BUDGET_TABLE_VERSION,
            "settings": json.loads(json.dumps(self.settings)),
            "family_medians": {f: {"median": m, "source": s} for f, (m, s) in sorted(self.medians.items())},
            "entries": {k: e.to_dict() for k, e in sorted(self.entries.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BudgetTable":
        """Inverse of `to_dict`."""
        if not isinstance(data, Mapping) or data.get("version") != BUDGET_TABLE_VERSION:
            raise ValueError(f"not a budget table of version {BUDGET_TABLE_VERSION}")
        table = cls(data["settings"])
        table.medians = {f: (float(m["median"]), str(m["source"])) for f, m in data["family_medians"].items()}
        table.entries = {str(k): BudgetEntry.from_dict(e) for k, e in data["entries"].items()}
        return table

    def save(self, path: str | Path) -> Path:
        """Write the table as one JSON document, atomically (temporary file, fsync, rename)."""
        return write_jsonl(path, [self.to_dict()])

    @classmethod
    def load(cls, path: str | Path) -> "BudgetTable":
        """Read a table written by `save`; ValueError naming the file when it is corrupt."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"{p}: no budget table file")
        try:
            return cls.from_dict(json.loads(p.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{p}: corrupt budget table ({type(e).__name__}: {e}); delete it to re-estimate") from e


# =========================================================================== estimation with the cold-start model


def estimate_budgets(
    engine: SteppableEngine,
    tasks: Sequence[Task],
    *,
    xtml: XTML,
    samples_per_task: int,
    seed: int,
    max_tokens: int,
    effort: str = "max",
    q: float = 0.9,
    min_b0: float = 1.0,
    correct_reward: float = 1.0,
    temperature: float = 1.0,
    env_factory: Callable[[Task], Environment] | None = None,
    path: str | Path | None = None,
    progress: bool = False,
    floor: Callable[[Task, str], int | None] | None = None,
    floor_efforts: Sequence[str] = EFFORTS,
) -> BudgetTable:
    """b0 of every task from the cold-start model behind ``engine`` (SPEC §3.3).

    Runs ``samples_per_task`` episodes per task through `AgentLoop` at ``temperature`` (the RL rollouts' own, so
    the pass fractions of `BudgetTable.pass_fraction` are the policy's as RL samples it) with
    ``max_tokens`` per turn and the ``thinking-effort`` message of ``effort``; records
    T(y) = `Trajectory.effort_tokens` and `is_correct` of each; estimates b0 as in the
    module doc. Sample j of a task samples with ``trajectory_seed(seed, g, j)``, g from the
    task key, so a task's samples do not depend on which other tasks are estimated with it.

    A sample cut at ``max_tokens`` counts T(y) up to the cut (a lower bound; such samples
    are never correct), so give ``max_tokens`` room above the model's usual length.

    With ``path``: a table already there is loaded and only tasks it lacks are run (none:
    nothing runs); the table is then saved back. A table estimated under other settings is
    a ValueError naming the file.

    With ``progress``: a log line saying what runs and how much (tasks x samples), and a progress bar over the
    episodes.

    With ``floor`` ((task, effort) -> T of its reference solution at that effort, None when it does not solve the
    task: `k3post.rollout.evaluation.reference_effort_tokens`): every task's budget floor at each of ``floor_efforts``
    is computed where the table lacks it (a table saved before floors existed gets them without re-running the
    cold-start model).
    """
    check_effort(effort)
    if isinstance(samples_per_task, bool) or not isinstance(samples_per_task, int) or samples_per_task < 1:
        raise ValueError(f"samples_per_task must be a positive int, got {samples_per_task!r}")
    settings = {
        "effort": effort, "samples_per_task": samples_per_task, "seed": int(seed), "max_tokens": int(max_tokens),
        "quantile": float(q), "min_b0": float(min_b0), "correct_reward": float(correct_reward),
    }
    if not temperature >= 0:
        raise ValueError(f"b0's temperature must be >= 0 (0: greedy), got {temperature!r}")
    if temperature != 1.0:  # recorded only when not the default, so tables estimated before it keep loading
        settings["temperature"] = float(temperature)
    table = BudgetTable(settings)
    if path is not None and Path(path).exists():
        table = BudgetTable.load(path)
        if table.settings != settings:
            raise ValueError(
                f"{path}: budget table estimated with {table.settings}, asked for {settings}; "
                "delete it or give another path"
            )
    todo: dict[str, Task] = {}
    for task in tasks:
        key = task_key(task)
        if key not in table and key not in todo:
            todo[key] = task
    if not todo:
        if floor is not None and add_floors(table, tasks, floor, floor_efforts) and path is not None:
            table.save(path)
        return table
    keys = list(todo)
    if progress:
        log.info("b0 budgets: %d tasks x %d samples of the cold-start model at %s effort and temperature %g, up to %d "
                 "tokens per turn%s", len(keys), samples_per_task, effort, temperature, max_tokens,
                 f" (cached in {path})" if path is not None else "")
    per_task = run_episodes(
        engine, xtml, [todo[k] for k in keys], effort=effort, max_tokens=max_tokens, temperature=temperature,
        samples=samples_per_task, seed=seed, env_factory=env_factory or make_env,
        group_ids=[int(k[:12], 16) for k in keys], progress="b0 budgets" if progress else None,
    )
    # an episode whose infrastructure failed (Trajectory.infra) is no sample of the cold-start model
    trajs: dict[str, list[Trajectory]] = {k: [t for t in ts if t.infra is None] for k, ts in zip(keys, per_task)}
    lost = [todo[k].id for k, ts in trajs.items() if not ts]
    if lost:
        raise InfrastructureError(f"b0: every cold-start sample of {len(lost)} tasks (e.g. {lost[:3]}) failed for "
                                  "infrastructure reasons (see the log); nothing was estimated")
    table.add_samples(
        {
            key: TaskSamples(todo[key].family, [t.effort_tokens() for t in ts], [is_correct(t, correct_reward) for t in ts])
            for key, ts in trajs.items()
        },
        q=q,
        min_b0=min_b0,
    )
    if floor is not None:
        add_floors(table, tasks, floor, floor_efforts)
    if path is not None:
        table.save(path)
    return table


def budget_summary(table: BudgetTable, domain: str, cfg: EffortConfig) -> dict[str, Any]:
    """What the budgets of ``domain`` are, for the report: the tasks, the median b0, and per effort the median limit
    (`budget_limit`, floors applied where `floor_applies`), the median floor and how many tasks' limits the
    floor raised above τ_e · b0."""
    entries = list(table.entries.values())
    if not entries:
        return {"tasks": 0}
    out: dict[str, Any] = {"tasks": len(entries), "median_b0": quantile([e.b0 for e in entries], 0.5),
                           "reference_floor": bool(cfg.reference_floor), "efforts": {}}
    for effort in EFFORTS:
        scale = effort_scale(effort, domain, cfg)
        floors = [e.floors.get(effort, 0.0) for e in entries]
        limits = [budget_limit(e.b0, effort, domain, cfg, f) for e, f in zip(entries, floors)]
        out["efforts"][effort] = {"median_limit": quantile(limits, 0.5), "median_floor": quantile(floors, 0.5),
                                  "raised_by_floor": sum(lim > scale * e.b0 for e, lim in zip(entries, limits))}
    return out


def add_floors(table: BudgetTable, tasks: Sequence[Task], floor: Callable[[Task, str], int | None],
               efforts: Sequence[str] = EFFORTS) -> int:
    """`EffortConfig.reference_floor`'s floors: compute the floor at each of ``efforts`` of every task of ``tasks``
    whose entry lacks it (``floor(task, effort)``; None, a reference that fails: 0); how many were computed."""
    n = 0
    for task in tasks:
        entry = table.entries[task_key(task)]
        for effort in efforts:
            if effort not in entry.floors:
                value = floor(task, effort)
                entry.floors[effort] = float(value) if value is not None else 0.0
                n += 1
    return n


# =========================================================================== the curriculum


@dataclass(frozen=True)
class CurriculumStage:
    """One RL stage: train ``expert`` (domain d at effort e) starting from ``init_from``
    (the SFT checkpoint for the first stage of a domain, else the previous stage's expert),
    with the override scale s_(d,e) = ``scale``."""

    domain: str
    effort: str
    init_from: str
    expert: str
    scale: float


class Curriculum:
    """The per-domain effort curriculum (SPEC §3.3): for each domain, the efforts of
    ``cfg.curriculum`` (default max → high → low), each continuing from the previous expert.

    Args:
        domains: the domains to train, in order.
        cfg: the effort config (order and τ).
        init: what the first stage of each domain starts from (the SFT checkpoint).

    Iterating yields `CurriculumStage`; experts are named ``"<domain>.<effort>"``.
    """

    def __init__(self, domains: Sequence[str], cfg: EffortConfig, *, init: str = "sft") -> None:
        domains = list(domains)
        if not domains or len(set(domains)) != len(domains) or any(d not in DOMAINS for d in domains):
            raise ValueError(f"domains must be distinct domains of {DOMAINS}, got {domains!r}")
        self.stages: list[CurriculumStage] = []
        for d in domains:
            prev = init
            for e in cfg.curriculum:
                stage = CurriculumStage(d, e, prev, f"{d}.{e}", effort_scale(e, d, cfg))
                self.stages.append(stage)
                prev = stage.expert

    def __iter__(self) -> Iterator[CurriculumStage]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)
