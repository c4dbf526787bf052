"""Scale-out settings (`k3post.distributed.fsdp.FSDPTrainer` reads ``distributed.fsdp``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MIXED_PRECISIONS", "FSDPConfig", "DistributedConfig"]

MIXED_PRECISIONS = ("fp32", "bf16")


@dataclass
class FSDPConfig:
    """The sharded trainer (PyTorch FSDP2, ``fully_shard``).

    Fields:
        ranks: trainer processes; each holds 1/ranks of every parameter, gradient and optimizer moment.
            1 is the single-process `k3post.trainer.Trainer`.
        mixed_precision: "fp32" (no policy) or "bf16": forward / backward in bf16 (the all-gathered
            parameters are cast), gradients reduced in fp32, fp32 master weights and optimizer state.
        cpu_offload: keep the sharded parameters, gradients and optimizer state on the CPU
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
    """

    ranks: int = 1
    mixed_precision: str = "fp32"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks < 1:
            raise ValueError(f"distributed.fsdp.ranks must be an int >= 1, got {self.ranks!r}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"distributed.fsdp.mixed_precision must be one of {MIXED_PRECISIONS}, "
                             f"got {self.mixed_precision!r}")


@dataclass
class DistributedConfig:
    """Settings of the multi-process modes."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
