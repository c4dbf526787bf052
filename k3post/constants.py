"""Names the whole package shares, defined once (stdlib only: the configs validate against them without
importing torch or a stage).

    EFFORTS          thinking-effort levels, in the order low, high, max (XTML ``thinking-effort``)
    DEFAULT_EFFORT   the effort of a think-mode context that names none: ``max``, as the shipped K3 encoder
    DOMAINS          task domains (SPEC §0): one RL expert per domain and effort level
    MX_FORMAT_NAMES  the MX element formats `k3post.quant.mx.MX_FORMATS` implements
"""

from __future__ import annotations

__all__ = ["EFFORTS", "DEFAULT_EFFORT", "DOMAINS", "MX_FORMAT_NAMES"]

EFFORTS: tuple[str, ...] = ("low", "high", "max")
DEFAULT_EFFORT: str = "max"
DOMAINS: tuple[str, ...] = ("general", "agents", "coding")
MX_FORMAT_NAMES: tuple[str, ...] = ("fp4_e2m1", "fp8_e4m3", "fp8_e5m2")
