"""Reading YAML config files with errors that name the file (shared by `k3post.config` and `k3post.synth.mix`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml_mapping(path: str | Path, what: str = "config file", error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The top-level mapping of a YAML file (empty file → {}).

    Raises `error` naming the file when it is missing, is not valid YAML, or its top level is not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {p}")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise error(f"{p}: invalid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise error(f"{p}: top level must be a mapping, got {type(tree).__name__}")
    return tree
