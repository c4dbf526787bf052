"""An OpenAI-compatible server over the embedded rollout engine (`k3post serve`).

* ``runner``: `EngineRunner`, the engine-owner thread (continuous batching) with an
  asyncio bridge (``submit`` / ``generate`` / ``abort``).
* ``app``: `create_app`, the FastAPI app: ``/v1/chat/completions`` (XTML: tools,
  ``tool_calls``, ``reasoning_content``, ``thinking_effort``, streaming), ``/v1/completions``,
  ``/v1/models``, ``/health``.
* ``cli``: ``add_serve_parser`` (``k3post serve MODEL_DIR``), `build_server`, `serve`.

Names are imported lazily: building the ``k3post`` parser imports no web framework.

Shape legend: none (no tensors here).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "EFFORT_CHOICES": "k3post.serve.app",
    "APIError": "k3post.serve.app",
    "ServeConfig": "k3post.serve.app",
    "create_app": "k3post.serve.app",
    "EngineRunner": "k3post.serve.runner",
    "TokenEvent": "k3post.serve.runner",
    "FinishEvent": "k3post.serve.runner",
    "ErrorEvent": "k3post.serve.runner",
    "add_serve_parser": "k3post.serve.cli",
    "build_server": "k3post.serve.cli",
    "serve": "k3post.serve.cli",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import on first use, so that `k3post.serve.cli` (the CLI parser) does not pull in FastAPI."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'k3post.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
