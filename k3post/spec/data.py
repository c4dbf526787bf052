"""The draft's training data (SPEC §6.2): the frozen target's own generations on the built-in task families.

A draft is judged by how often the target accepts its tokens, so it learns from what the target itself
writes, not from reference solutions. Each sample is one whole episode the target played (prompt, its
sampled turns, the environment's replies), with ``mask`` True where the target sampled the token: the draft
is trained to predict those positions, and sees the rest as context.

Files are JSONL, one sample a line, ``{"ids": [...], "mask": [0/1, ...], "family": str, "effort": str}``,
written atomically (`k3post.io.write_jsonl`) so a killed run re-generates or reuses a whole file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3post.envs.families.streams import train_tasks
from k3post.io import json_line, write_jsonl
from k3post.rollout.evaluation import run_episodes

__all__ = ["DraftSample", "target_generations", "save_samples", "load_samples", "token_counts"]


@dataclass(frozen=True)
class DraftSample:
    """One episode: token ids, ``mask`` True at tokens the target sampled, and where it came from."""

    ids: list[int]
    mask: list[bool]
    family: str = ""
    effort: str = ""

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.mask):
            raise ValueError(f"a draft sample has {len(self.ids)} ids but {len(self.mask)} mask entries")


def target_generations(
    engine: Any,
    xtml: Any,
    families: Sequence[str],
    *,
    n_per_family: int,
    efforts: Sequence[str],
    max_tokens: int,
    temperature: float = 1.0,
    difficulty: int = 1,
    seed: int = 0,
) -> list[DraftSample]:
    """Episodes the target (behind ``engine``) plays on ``n_per_family`` training tasks of each family at each
    effort, sampled at ``temperature`` (1: the distribution the draft's losses are defined at)."""
    if n_per_family < 1:
        raise ValueError(f"n_per_family must be >= 1, got {n_per_family}")
    out: list[DraftSample] = []
    for fam in families:
        tasks = train_tasks([fam], n_per_family, difficulty=difficulty, seed=seed)
        for j, effort in enumerate(efforts):
            per_task = run_episodes(engine, xtml, tasks, effort=effort, max_tokens=max_tokens, temperature=temperature,
                                    samples=1, seed=seed * 1000 + j, mode="think")
            out += [DraftSample(list(t.token_ids), [bool(m) for m in t.trainable], fam, effort)
                    for ts in per_task for t in ts]
    return out


def save_samples(samples: Sequence[DraftSample], path: str | Path) -> Path:
    """Write samples as JSONL (atomic)."""
    return write_jsonl(path, [{"ids": s.ids, "mask": [int(m) for m in s.mask], "family": s.family, "effort": s.effort}
                              for s in samples])


def load_samples(path: str | Path) -> list[DraftSample]:
    """Read a file `save_samples` wrote; a bad line is a ValueError naming ``file:line``."""
    out = []
    with Path(path).open("rb") as fh:
        for k, line in enumerate(fh, start=1):
            r = json_line(line, f"{path}:{k}")
            try:
                out.append(DraftSample([int(i) for i in r["ids"]], [bool(m) for m in r["mask"]],
                                       str(r.get("family", "")), str(r.get("effort", ""))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{k}: not a draft sample ({e})") from None
    return out


def token_counts(samples: Sequence[DraftSample]) -> Counter[int]:
    """How often the target sampled each token id (masked positions): what a reduced draft vocabulary keeps."""
    return Counter(i for s in samples for i, m in zip(s.ids, s.mask) if m)
