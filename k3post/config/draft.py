"""`k3post draft` settings: an EAGLE-3 draft for a frozen target, trained with the LK loss (SPEC §6.2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.optim import check_keep_last
from k3post.config.ranges import ranged
from k3post.constants import EFFORTS

__all__ = ["DRAFT_LOSSES", "DraftConfig"]

DRAFT_LOSSES: tuple[str, ...] = ("lk_alpha", "lk_lambda", "kl")  # the losses of k3post.spec.losses


@dataclass
class DraftConfig:
    """Draft-stage settings.

    Data: the target's own episodes (`k3post.spec.data`) on ``n_per_family`` training tasks of each of
    ``families`` at each of ``efforts``, sampled at ``temperature`` with at most ``max_tokens`` per turn.
    Model: fused target layers ``aux_layers`` (k3post's numbering, `k3post.spec.eagle3`; empty: (1, L//2, L−1),
    the states stock vLLM / SGLang record; ids they cannot record, such as L, the final layer's output, are an
    input error unless ``nonstock_export``, which exports for an engine that records them), ``draft_vocab``
    target ids (0: the whole vocabulary). Training: ``loss`` (``lk_alpha``, the K3
    loss; ``lk_lambda`` with ``eta``; ``kl``, the baseline) over ``ttt_steps`` unrolled steps weighted
    ``step_decay``^i, AdamW at ``lr`` with cosine decay, ``batch_size`` samples of at most ``max_len`` tokens a
    step (``length_bucket`` batches' worth of an epoch's shuffled samples sorted by length before they are cut
    into batches, so a batch pads to a near length; 1: plain random batches), checkpoints every ``save_every`` steps (exact resume). The defaults are the demo's CPU sizing (about a
    minute per draft on 2 cores); the report's 7-step unroll (EAGLE-3) is ``ttt_steps=7``."""

    target: str = ""  # target model folder; empty: the run's MOPD student, else its SFT model
    mtp: str = ""  # MTP head to start from: a folder with mtp.safetensors; empty: the target's, else the run's SFT model's; "none": the target's last layer
    families: list[str] = field(default_factory=list)  # empty: every built-in family
    efforts: list[str] = field(default_factory=lambda: list(EFFORTS))
    n_per_family: int = 4
    max_tokens: int = 64
    temperature: float = 1.0
    aux_layers: list[int] = field(default_factory=list)
    nonstock_export: bool = False  # allow aux_layers stock vLLM / SGLang cannot record (the export then serves only on a patched engine)
    draft_vocab: int = 0
    loss: str = "lk_alpha"
    eta: float = 3.0
    ttt_steps: int = 5
    step_decay: float = 0.8
    steps: int = 75  # with length_bucket 8: 0.9x the time of 60 random-batch steps, higher held-out alpha (decisions issue 32 §padding)
    lr: float = 1e-3
    min_lr_ratio: float = ranged(0.1, ge=0, le=1)
    warmup_steps: int = ranged(10, ge=0)
    weight_decay: float = ranged(0.0, ge=0)
    grad_clip: float = 1.0
    batch_size: int = 8
    max_len: int = 768
    length_bucket: int = 8  # each epoch's shuffled samples, in runs of this many batches, are sorted by length before batching (less padding); 1: random batches
    save_every: int = 30
    keep_last: int = 2  # checkpoints kept on disk (>= 1); older ones are deleted after a newer one is complete
    log_every: int = 10
    progress: bool = True

    def __post_init__(self) -> None:
        check_keep_last(self.keep_last, "draft.keep_last")
        if self.loss not in DRAFT_LOSSES:
            raise ValueError(f"draft.loss must be one of {DRAFT_LOSSES}, got {self.loss!r}")
        bad = [e for e in self.efforts if e not in EFFORTS]
        if bad or not self.efforts:
            raise ValueError(f"draft.efforts must be a non-empty list of {EFFORTS}, got {self.efforts!r}")
        if len(self.aux_layers) not in (0, 3):
            raise ValueError(f"draft.aux_layers lists 3 layer ids (low, middle, high) or none, got {self.aux_layers!r}")
        for key in ("n_per_family", "max_tokens", "ttt_steps", "steps", "batch_size", "max_len", "length_bucket",
                    "save_every", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"draft.{key} must be >= 1, got {getattr(self, key)!r}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft.draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        if not 0 < self.step_decay <= 1 or self.eta < 0 or self.lr <= 0 or self.temperature <= 0:
            raise ValueError("draft: 0 < step_decay <= 1, eta >= 0, lr > 0 and temperature > 0 are required")
