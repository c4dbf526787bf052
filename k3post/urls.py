"""What counts as an endpoint: an ``http://`` or ``https://`` base URL (engine servers, OpenAI-compatible policies,
MOPD teachers, the GRM judge), as opposed to a local model folder. Torch-free: configs check it at load time."""

from __future__ import annotations

from typing import Any

__all__ = ["URL_SCHEMES", "is_url"]

URL_SCHEMES = ("http://", "https://")


def is_url(value: Any) -> bool:
    """True when ``value`` is a string naming an HTTP(S) endpoint (``http://`` or ``https://``, any case)."""
    return isinstance(value, str) and value.lower().startswith(URL_SCHEMES)
