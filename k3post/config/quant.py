"""MX quantization-aware training settings (`k3post.quant.qat.apply_qat` reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from k3post.constants import MX_FORMAT_NAMES

__all__ = ["QATConfig"]


@dataclass
class QATConfig:
    """MX quantization-aware training settings.

    Fields:
        enabled: apply QAT at all (False: ``apply_qat`` is a no-op returning []).
        weight_format: MX format of the routed-expert weights ("fp4_e2m1" = MXFP4).
        activation_format: MX format of the expert GEMM inputs ("fp8_e4m3" = MXFP8).
        block_size: elements sharing one E8M0 scale, along the reduction dim (OCP: 32).
    """

    enabled: bool = True
    weight_format: str = "fp4_e2m1"
    activation_format: str = "fp8_e4m3"
    block_size: int = 32

    def __post_init__(self) -> None:
        for field_name in ("weight_format", "activation_format"):
            value = getattr(self, field_name)
            if value not in MX_FORMAT_NAMES:
                raise ValueError(f"QATConfig.{field_name}={value!r} is not one of {sorted(MX_FORMAT_NAMES)}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise ValueError(f"QATConfig.block_size must be a positive int, got {self.block_size!r}")
