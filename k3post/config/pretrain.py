"""Stage 0 settings: causal-LM pretraining of the base model on the generated corpus (`k3post.stages.pretrain`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.optim import check_keep_last
from k3post.config.ranges import ranged

__all__ = ["PretrainConfig"]


@dataclass
class PretrainConfig:
    """Stage 0 trainer, corpus, cache and probe settings."""

    steps: int = ranged(2400, ge=1)  # optimizer steps on the corpus (8 x 128 tokens each), after induction_steps
    n_docs: int = ranged(4000, ge=1)  # generated documents (k3post.synth.corpus), cycled over epochs
    seq_len: int = ranged(128, ge=16)  # a document is cut at this many tokens; rows are packed to it (512: no copying by step 2,400)
    rows_per_batch: int = ranged(8, ge=1)  # packed rows per optimizer step
    lr: float = ranged(3e-3, ge=0)
    min_lr_ratio: float = ranged(0.1, ge=0, le=1)  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = ranged(30, ge=0)
    weight_decay: float = ranged(0.0, ge=0)
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables
    recall_share: float = ranged(0.45, ge=0, le=1)  # chance, at each turn of a document, to restate something introduced earlier
    recent_share: float = ranged(0.7, ge=0, le=1)  # share of restatements of a recent segment (a short copy distance) instead of any earlier one
    induction_steps: int = ranged(4000, ge=0)  # at most this many steps on induction rows (a random token span repeated) before the corpus steps; 0: none (docs/decisions.md, issue 31 §copy)
    induction_target: float = ranged(0.9, ge=0, le=1)  # phase 1 stops once held-out induction accuracy reaches it (checked every induction_check_every steps, constant lr); 0: run all induction_steps on a cosine
    induction_check_every: int = ranged(200, ge=1)
    save_every: int = ranged(100, ge=1)  # checkpoint every N steps (and at the end)
    keep_last: int = 2
    log_every: int = ranged(10, ge=1)
    progress: bool = True  # tqdm progress bar
    cache: bool = True  # reuse / store the base in the cache folder, keyed by the settings' content hash
    cache_dir: str = ""  # "" = $K3POST_CACHE, else ~/.cache/k3post; bases live in <cache_dir>/bases/<hash>/
    probe_names: int = ranged(48, ge=1)  # held-out names the copy probe restates at each distance
    probe_distances: list[int] = field(default_factory=lambda: [20, 100, 300])  # tokens back

    def __post_init__(self) -> None:
        check_keep_last(self.keep_last, "pretrain.keep_last")
        if not self.probe_distances or any(isinstance(d, bool) or not isinstance(d, int) or d < 16 for d in self.probe_distances):
            raise ValueError(f"pretrain.probe_distances must be a non-empty list of integers >= 16, got {list(self.probe_distances)!r}")
