"""Stage 1 SFT trainer settings (`k3post.stages.sft.train_sft` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.optim import check_keep_last
from k3post.constants import DOMAINS, EFFORTS
from k3post.config.ranges import ranged

__all__ = ["SFTConfig"]


@dataclass
class SFTConfig:
    """Stage 1 trainer settings."""

    train_file: str | None = None  # SFT JSONL; None in the demo (it writes its own)
    max_len: int = ranged(2048, ge=1)  # longest sample; a longer one is an error (or a counted skip)
    pack_len: int = ranged(256, ge=1)  # packed row length; a sample longer than this gets a row of its own
    rows_per_batch: int = ranged(8, ge=1)  # packed rows per micro-batch (a micro-batch holds <= rows_per_batch * pack_len tokens)
    grad_accum: int = ranged(1, ge=1)  # micro-batches per optimizer step
    steps: int = ranged(3000, ge=1)  # optimizer steps (the demo's: at 3,000 general.max RL gains greedily and agents pass at high; docs/decisions.md, issue 31 §steps3000)
    lr: float = ranged(5e-3, ge=0)
    min_lr_ratio: float = ranged(0.1, ge=0, le=1)  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = ranged(30, ge=0)
    weight_decay: float = ranged(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables
    precision: str = "fp32"  # fp32 | bf16 (bf16 autocast over fp32 master weights)
    save_every: int = ranged(200, ge=1)  # checkpoint every N steps (and at the end)
    keep_last: int = 2  # checkpoints kept on disk (>= 1); older ones are deleted after a newer one is complete
    log_every: int = ranged(10, ge=1)
    on_bad_sample: str = "error"  # error | skip (skips are counted and logged)
    mode: str = "think"  # XTML mode: think | instruct
    progress: bool = True  # tqdm progress bar
    device: str = "cpu"  # where the trainer runs: cpu | cuda | cuda:N (no CUDA: an error, never a silent CPU run); the model comes back to its own device after training
    mtp_weight: float = ranged(0.0, ge=0)  # weight of the MTP head's next-next-token loss (k3post.spec.mtp); 0 = no MTP head
    mtp_start_fraction: float = ranged(0.0, ge=0, lt=1)  # the MTP loss is on from step int(fraction * steps); earlier: no loss, no gradient to the head
    mtp_lr_scale: float = ranged(1.0, gt=0)  # the MTP head's learning rate as a multiple of the SFT schedule's (its own AdamW parameter group)
    mtp_detach: bool = True  # the MTP loss trains the head only (the trunk's hidden state, embedding and LM head read detached, the head's gradient clipped apart): the model's weights are those of the same SFT without the head (EAGLE's frozen target). false: DeepSeek-V3's joint training, the MTP gradient reaching the trunk (docs/decisions.md, issue 31 §mtp)
    replay_induction: int = ranged(0, ge=0)  # induction rows (k3post.stages.pretrain.induction_samples, pretrain.seq_len tokens) mixed into the SFT samples: copying rehearsed while SFT teaches the formats (docs/decisions.md, issue 31 §replay)
    select: str = "last"  # the SFT model: last (the final step) | validation (the kept checkpoint that passes most validation tasks at select_effort, k3post.recipes.select; needs keep_last >= 2)
    select_domains: list[str] = field(default_factory=lambda: ["general", "agents", "coding"])  # domains the validation score averages
    select_effort: str = "max"  # the effort the checkpoints are scored at (greedy, as the experts' "before" rows)
    select_n: int = ranged(64, ge=1)  # validation tasks per domain and checkpoint

    def __post_init__(self) -> None:
        check_keep_last(self.keep_last, "sft.keep_last")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"sft.precision must be fp32 or bf16, got {self.precision!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"sft.betas must be two numbers in [0, 1), got {list(self.betas)!r}")
        if self.select not in ("last", "validation"):
            raise ValueError(f"sft.select must be last or validation, got {self.select!r}")
        if not self.select_domains or set(self.select_domains) - set(DOMAINS):
            raise ValueError(f"sft.select_domains must be a non-empty list of {list(DOMAINS)}, got {list(self.select_domains)!r}")
        if self.select_effort not in EFFORTS:
            raise ValueError(f"sft.select_effort must be one of {list(EFFORTS)}, got {self.select_effort!r}")
        if self.select == "validation" and self.keep_last < 2:
            raise ValueError(f"sft.select=validation chooses between the kept checkpoints, but sft.keep_last is {self.keep_last}: "
                             "keep at least 2 (e.g. sft.keep_last=6 with sft.save_every=200 covers the last 1,000 steps)")
        if self.on_bad_sample not in ("error", "skip"):
            raise ValueError(f"sft.on_bad_sample must be error or skip, got {self.on_bad_sample!r}")
        if self.mode not in ("think", "instruct"):
            raise ValueError(f"sft.mode must be think or instruct, got {self.mode!r}")
