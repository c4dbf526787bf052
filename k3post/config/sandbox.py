"""Settings of the code sandbox (`k3post.envs.sandbox`) that runs model-written code."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SandboxConfig", "apply_sandbox_config"]

_BACKENDS = ("auto", "bwrap", "unshare", "rlimit")


@dataclass
class SandboxConfig:
    """How model-written code is isolated.

    The sandbox reads these through environment variables (so worker processes inherit them):
    `apply_sandbox_config` sets ``K3POST_SANDBOX_BACKEND`` and ``K3POST_ALLOW_WEAK_ISOLATION``.
    """

    backend: str = "auto"  # auto: bwrap, else unshare namespaces, else refuse; or force one of bwrap / unshare / rlimit
    allow_weak_isolation: bool = False  # true: where no namespace backend works, run with rlimits only (host files readable, network open), logged on every run and flagged in results

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"sandbox.backend must be one of {_BACKENDS}, got {self.backend!r}")


def apply_sandbox_config(cfg: SandboxConfig) -> None:
    """Export ``cfg`` to the environment the sandbox reads; defaults leave the environment as it is."""
    if cfg.backend != "auto":
        os.environ["K3POST_SANDBOX_BACKEND"] = cfg.backend
    if cfg.allow_weak_isolation:
        os.environ["K3POST_ALLOW_WEAK_ISOLATION"] = "1"
