"""Names the whole package shares, defined once (stdlib only: the configs validate against them without
importing torch or a stage).

    EFFORTS          thinking-effort levels, in the order low, high, max (XTML ``thinking-effort``)
    DEFAULT_EFFORT   the effort of a think-mode context that names none: ``max``, as the shipped K3 encoder
    DOMAINS          task domains (SPEC §0): one RL expert per domain and effort level
    MX_FORMAT_NAMES  the MX element formats `k3post.quant.mx.MX_FORMATS` implements
    Policy           what an episode calls for the assistant's turn: ``policy(messages, tools)``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EFFORTS", "DEFAULT_EFFORT", "DOMAINS", "MX_FORMAT_NAMES", "Policy"]

EFFORTS: tuple[str, ...] = ("low", "high", "max")
DEFAULT_EFFORT: str = "max"
DOMAINS: tuple[str, ...] = ("general", "agents", "coding")
MX_FORMAT_NAMES: tuple[str, ...] = ("fp4_e2m1", "fp8_e4m3", "fp8_e5m2")

Policy = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Any]
"""``policy(messages, tools) -> assistant message`` (a dict), or an awaitable of one (an async policy: an engine or an
OpenAI-compatible endpoint behind it). The one policy type of the package: episodes, families' reference and wrong
policies, synthesis teachers and the GRM judge all take it."""
