"""Settings of one MOPD run (SPEC §4; `k3post.stages.mopd` reads them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from k3post.config.ranges import ranged
from k3post.config.rl import RLConfig
from k3post.config.rollout import RolloutConfig
from k3post.constants import DOMAINS, EFFORTS

__all__ = ["MOPDConfig", "effort_weights"]


def effort_weights(mix: Mapping[str, float]) -> list[tuple[str, float]]:
    """(effort, weight) of ``mix`` for every effort, in the order low, high, max (0 for an effort not
    named); ValueError for an unknown effort, a negative or non-finite weight, or a zero sum."""
    bad = [e for e in mix if e not in EFFORTS]
    if bad:
        raise ValueError(f"effort_mix: unknown efforts {bad}; expected some of {EFFORTS}")
    weights = [(e, float(mix.get(e, 0.0))) for e in EFFORTS]
    if any(not math.isfinite(w) or w < 0 for _, w in weights) or sum(w for _, w in weights) <= 0:
        raise ValueError(f"effort_mix needs finite weights >= 0 with a positive sum, got {dict(mix)}")
    return weights


def _default_mix() -> dict[str, float]:
    return {"max": 1 / 3, "high": 1 / 3, "low": 1 / 3}


@dataclass
class MOPDConfig:
    """Settings of one MOPD run (SPEC §4).

    ``experts``: expert name ``"domain.effort"`` → a local model folder, or an OpenAI-compatible base URL
    (``http://host:port`` or ``.../v1``; the request's ``model`` is the URL's ``#fragment`` if it has one,
    else the expert name). ``effort_mix``: effort → weight of the per-prompt effort draw (normalised).
    ``domains``: the domains prompts come from; ``families``: domain → its families (a domain left out:
    every verifiable family of it). ``domain_weights``: domain → how many prompts each of its families gives in
    every round of the prompt stream (default 1: the families take turns); e.g. ``{general: 4}`` for a domain
    whose episodes are short and whose teachers need many prompts to be matched. ``r_max``: R_max of the per-token reward; ``w_orm``: weight of the
    optional outcome advantage (group reward − group mean). ``max_resident``: local teachers held in CPU
    memory at once; ``teacher_dtype``: their dtype; ``teacher_batch_tokens``: padded tokens per teacher
    forward. ``teacher_sees_effort``: keep the thinking-effort message in the teacher's context (SPEC §4: no; default yes, because k3post's experts are trained with it, docs/decisions.md).
    ``rl``: the loop's settings (rollout, loss, steps, tasks per family, seed); its ``effort``, ``domain``
    and ``families`` are not used here.
    """

    experts: dict[str, str] = field(default_factory=dict)
    effort_mix: dict[str, float] = field(default_factory=_default_mix)
    domains: list[str] = field(default_factory=lambda: ["general", "agents", "coding"])
    families: dict[str, list[str]] = field(default_factory=dict)
    domain_weights: dict[str, int] = field(default_factory=dict)
    r_max: float = 5.0
    w_orm: float = 0.0
    max_resident: int = 3
    teacher_dtype: str = "float32"
    teacher_batch_tokens: int = ranged(8192, ge=1)
    teacher_sees_effort: bool = True  # departure from SPEC §4, see docs/decisions.md
    rl: RLConfig = field(default_factory=lambda: RLConfig(steps=24, rollout=RolloutConfig(n_prompts=6, k=4)))

    def __post_init__(self) -> None:
        """Reject a bad config when it loads (before any teacher is loaded or step run)."""
        try:
            effort_weights(self.effort_mix)
        except ValueError as e:
            raise ValueError(f"mopd.{e}") from None
        from k3post.config.model import DTYPES

        if self.teacher_dtype not in DTYPES:
            raise ValueError(f"mopd.teacher_dtype must be one of {list(DTYPES)}, got {self.teacher_dtype!r}")
        extra = sorted(set(self.families) - set(self.domains))
        if extra and not [d for d in extra if d not in DOMAINS]:
            raise ValueError(f"mopd.families names domains {extra} that are not in mopd.domains {list(self.domains)}")
        bad = [d for d in list(self.domains) + list(self.families) + list(self.domain_weights) if d not in DOMAINS]
        wrong = {d: w for d, w in self.domain_weights.items()
                 if not isinstance(w, int) or isinstance(w, bool) or w < 1}
        if wrong:
            raise ValueError(f"mopd.domain_weights must be whole numbers >= 1 (prompts per family and round), got {wrong}")
        if bad:
            raise ValueError(f"mopd.domains / mopd.families / mopd.domain_weights: unknown domain(s) {bad}; "
                             f"expected {DOMAINS}")
        if not (math.isfinite(self.r_max) and self.r_max > 0) or not self.w_orm >= 0 or self.max_resident < 1:
            raise ValueError(f"need mopd.r_max > 0, mopd.w_orm >= 0 and mopd.max_resident >= 1, got "
                             f"{self.r_max}, {self.w_orm}, {self.max_resident}")
