"""The SFT data config (`k3post.data` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.ranges import ranged
from k3post.constants import EFFORTS

__all__ = ["DataConfig"]


@dataclass
class DataConfig:
    """The demo's SFT data: reference-teacher trajectories through the synthesis + verification pipeline."""

    eval_family: str = "general.arithmetic"  # single-turn family the held-out pass rate is measured on
    n_train: int = ranged(1500, ge=0)  # training tasks of eval_family (each solved at every effort)
    n_per_family: int = ranged(2, ge=0)  # training tasks of every other built-in family (each at every effort)
    # training tasks of the families named here instead of n_per_family: coding.write_function and agents.search get
    # enough samples for the SFT model to pass some of their tasks, so their RL starts with reward variance; coding
    # 200: with 100 the model wrote its training data's constants (coding.max 0.08 greedy), with 200 it copies them
    # from the task (0.35), with 300 0.82, each step costing arithmetic and search (docs/decisions.md, issue 31 §coding)
    family_tasks: dict[str, int] = field(default_factory=lambda: {"coding.write_function": 200, "agents.search": 200})
    # efforts of the families named here (those of them in `efforts`; none: no samples), instead of `efforts`: the demo's
    # agents.search samples at high and low, where the tiny model learns whole episodes (docs/decisions.md, issue 31 §agents)
    family_efforts: dict[str, list[str]] = field(default_factory=lambda: {"agents.search": ["high", "low"]})
    # families whose tasks are dealt to their efforts in turn (task i solved at effort i mod k only) instead of each
    # task solved at every effort: as many samples from k times the tasks, so k times the distinct constants to copy
    deal_efforts: list[str] = field(default_factory=list)
    n_eval: int = ranged(400, ge=0)  # held-out eval_family tasks, disjoint from training (400: a +5-point change is detectable)
    difficulty: int = ranged(1, ge=1)
    efforts: list[str] = field(default_factory=lambda: ["max", "high", "low"])
    # share of each effort among eval_family's training samples (k3post.synth.mix; `*/max` style keys);
    # empty keeps one sample per task and effort
    effort_mix: dict[str, float] = field(default_factory=lambda: {"*/max": 0.6, "*/high": 0.25, "*/low": 0.15})
    corpus_per_family: int = ranged(6, ge=0)  # tasks per family (x3 efforts) in the tokenizer's training corpus
    # a kg_tasks.jsonl of `k3post synth-tasks`: agents.search draws its tasks from it instead of generated graphs
    search_tasks: str = ""
    # the GRM judge learns to judge (k3post.rewards.judging): reference pairs whose better answer is known, each
    # giving two scripted judge episodes (the reference as A and as B) in the SFT data; 0: none
    judge_tasks: int = ranged(0, ge=0)
    # held-out pairs (disjoint from those and from the judged families' SFT tasks), each judged in both orders by
    # the SFT model after SFT, when it was taught to judge or is RL's judge (rl.judge: policy); 0: no evaluation
    judge_eval: int = ranged(50, ge=0)

    def __post_init__(self) -> None:
        from k3post.envs.families.registry import get_family  # torch-free (the task families only)

        def known(key: str, name: str) -> None:  # an unknown family is an error naming the key it was given under
            try:
                get_family(name)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None

        for name, n in dict(self.family_tasks).items():
            known(f"data.family_tasks.{name}", name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"data.family_tasks.{name}: must be a non-negative integer, got {n!r}")
        if self.eval_family in self.family_tasks:
            raise ValueError(f"data.family_tasks.{self.eval_family}: the eval family's task count is data.n_train")
        for name, efforts in dict(self.family_efforts).items():
            known(f"data.family_efforts.{name}", name)
            if isinstance(efforts, str) or not efforts or not set(efforts) <= set(EFFORTS):
                raise ValueError(f"data.family_efforts.{name}: a non-empty list of efforts out of {list(EFFORTS)}, "
                                 f"got {efforts!r}")
        for name in self.deal_efforts:
            known("data.deal_efforts", name)
            if name == self.eval_family:
                raise ValueError(f"data.deal_efforts: {name} is the eval family, whose efforts are weighted by data.effort_mix")
        if self.eval_family in self.family_efforts:
            raise ValueError(f"data.family_efforts.{self.eval_family}: the eval family's efforts are data.efforts "
                             "(weighted by data.effort_mix)")

    def tasks_of(self, family: str) -> int:
        """Training tasks of ``family``: ``n_train`` for the eval family, else ``family_tasks`` or ``n_per_family``."""
        if family == self.eval_family:
            return self.n_train
        return int(self.family_tasks.get(family, self.n_per_family))

    def efforts_of(self, family: str) -> list[str]:
        """Efforts of ``family``'s training samples: those of ``efforts`` that ``family_efforts`` names for it (none:
        the family gets no samples), else ``efforts``."""
        own = self.family_efforts.get(family)
        return list(self.efforts) if own is None else [e for e in self.efforts if e in own]
