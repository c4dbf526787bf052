"""Reading YAML config files with errors that name the file (shared by `k3post.config` and `k3post.synth.mix`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path, what: str = "config file", error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The top-level mapping of a YAML file (empty file → {}).

    Raises `error` naming the file when it is missing, is not UTF-8 or not valid YAML (a key given twice
    in one mapping included), or its top level is not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {p}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not valid UTF-8 at byte {e.start}") from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise error(f"{p}: invalid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise error(f"{p}: top level must be a mapping, got {type(tree).__name__}")
    return tree
