"""The task streams of the policy stages (RL, MOPD): which families a domain trains on, the training
prompts and the held-out evaluation tasks, each a pure function of its arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k3post.envs.families.registry import families, get_family
from k3post.envs.task import Task

__all__ = ["VALIDATION_SEED", "domain_families", "train_tasks", "eval_tasks"]

# seeds of the task streams: training prompts and held-out evaluation never share a seed
_TRAIN_SEED, _EVAL_SEED = 7_000, 9_000
VALIDATION_SEED = 9_500
"""Generation seed of ``eval_tasks(..., split="validation")``: neither the training streams' (7,000 + run seed), the SFT data's (the run
seed) nor the held-out tests' (9,000)."""


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


def _interleave(per_family: list[list[Any]]) -> list[Any]:
    """One item of each family in turn, for as many rounds as the shortest family has items."""
    out = []
    for row in zip(*per_family):
        out.extend(row)
    return out


def train_tasks(family_names: Sequence[str], n: int, *, difficulty: int, seed: int = 0,
                weights: Sequence[int] | None = None) -> list[Task]:
    """``n`` training tasks per family, interleaved (family 1, family 2, ..., family 1, ...). With ``weights`` (one
    whole number per family; default 1 each) family i gives ``weights[i]`` tasks in every round, and ``n ·
    weights[i]`` in all."""
    weights = [1] * len(family_names) if weights is None else list(weights)
    if len(weights) != len(family_names) or any(w < 1 for w in weights):
        raise ValueError(f"train_tasks: one weight >= 1 per family, got {weights} for {list(family_names)}")
    streams = [get_family(f).generate(n * w, seed=_TRAIN_SEED + seed, difficulty=difficulty)
               for f, w in zip(family_names, weights)]
    rounds = _interleave([[ts[i:i + w] for i in range(0, len(ts), w)] for ts, w in zip(streams, weights)])
    return [t for chunk in rounds for t in chunk]


def eval_tasks(family_names: Sequence[str], n: int, *, difficulty: int, split: str = "test") -> list[Task]:
    """``n`` held-out tasks per family (a seed the training stream never uses). ``split="validation"``: as many
    tasks of another held-out seed (`VALIDATION_SEED`), for choosing between models without touching the test."""
    if split not in ("test", "validation"):
        raise ValueError(f"eval_tasks: split is 'test' or 'validation', got {split!r}")
    seed = _EVAL_SEED if split == "test" else VALIDATION_SEED
    return _interleave([get_family(f).generate(n, seed=seed, difficulty=difficulty) for f in family_names])
