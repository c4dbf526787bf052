"""Dataset mixing by domain and effort (SPEC §2): weighted, seeded, ready for ``k3post sft``.

Samples are grouped by ``domain/effort``. A weight key is ``domain/effort``, ``domain`` (any
effort), ``*/effort`` (any domain) or ``*``; the most specific key that matches a group gives its
weight, and a group no key matches gets weight 0 (left out) unless ``weights`` is empty (all 1).
The mixed dataset has ``n`` samples, split across groups in proportion to their weights by the
largest-remainder method; a group gives its share without replacement while it can, and cycles
through fresh seeded shuffles of itself when its share exceeds its size (upsampling). The
output is shuffled. Everything is a pure function of (inputs, weights, n, seed).

A mix config file (YAML)::

    inputs: [data/general.jsonl, data/agents.jsonl]
    out: data/mix.jsonl
    n: 5000
    seed: 0
    weights: {"general/low": 1.0, "general": 2.0, "*/max": 0.5}

The output is JSON lines with the SFT keys, loadable by ``k3post sft`` and by Hugging Face
``datasets.load_dataset("json", data_files="data/mix.jsonl", split="train")``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from k3post.errors import UserError, user_input
from k3post.io import read_jsonl, write_jsonl
from k3post.yamlio import read_yaml_mapping

__all__ = ["MixConfig", "group_key", "group_weight", "allocate", "mix", "mix_files", "load_mix_config"]


@dataclass
class MixConfig:
    """A mix: input JSONL files, output, size, seed and ``domain/effort`` weights (see the module docstring)."""

    inputs: list[str] = field(default_factory=list)
    out: str = ""
    n: int = 0  # 0: the total size of the inputs
    seed: int = 0
    weights: dict[str, float] = field(default_factory=dict)


def group_key(sample: Mapping[str, Any]) -> str:
    """``domain/effort`` of a sample (``?`` for a missing part)."""
    return f"{sample.get('domain') or '?'}/{sample.get('effort') or '?'}"


def _check_weights(weights: Mapping[str, float]) -> None:
    for k, w in weights.items():
        if not isinstance(k, str) or not k or k.count("/") > 1:
            raise UserError(f"weights: bad key {k!r}; use 'domain/effort', 'domain', '*/effort' or '*'")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise UserError(f"weights['{k}']: must be a non-negative number, got {w!r}")


def group_weight(weights: Mapping[str, float], key: str) -> float:
    """The weight of group ``domain/effort`` under ``weights`` (most specific key wins; 1 when ``weights`` is empty)."""
    if not weights:
        return 1.0
    domain, effort = key.split("/", 1)
    for k in (key, domain, f"*/{effort}", "*"):
        if k in weights:
            return float(weights[k])
    return 0.0


def allocate(sizes: Mapping[str, int], weights: Mapping[str, float], n: int) -> dict[str, int]:
    """How many samples each group gives: ``n`` split by weight, largest remainder, ties by name.

    Example: sizes {a: 10, b: 10}, weights {a: 2, b: 1}, n = 10 → exact shares 6.67 and 3.33 →
    floors 6 and 3, one left over goes to the larger remainder (a) → {a: 7, b: 3}.
    """
    w = {g: group_weight(weights, g) for g in sizes if sizes[g] > 0}
    total = sum(w.values())
    if n > 0 and total <= 0:
        raise UserError(f"weights {dict(weights)} give every group {sorted(sizes)} weight 0; nothing to mix")
    exact = {g: n * w[g] / total for g in w} if total > 0 else {g: 0.0 for g in w}
    out = {g: int(v) for g, v in exact.items()}
    left = n - sum(out.values())
    for g in sorted(exact, key=lambda g: (-(exact[g] - out[g]), g))[:left]:
        out[g] += 1
    return out


def mix(samples: Sequence[Mapping[str, Any]], weights: Mapping[str, float] | None = None, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """A weighted, shuffled mix of ``n`` samples (default: as many as given) by ``domain/effort``."""
    weights = dict(weights or {})
    _check_weights(weights)
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(group_key(s), []).append(dict(s))
    if n is None or n == 0:
        n = len(samples)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise UserError(f"n must be a non-negative int, got {n!r}")
    counts = allocate({g: len(v) for g, v in groups.items()}, weights, n)
    rng = random.Random(f"mix|{seed}")
    out: list[dict[str, Any]] = []
    for g in sorted(counts):
        pool = groups[g]
        take = counts[g]
        while take > 0:
            order = list(range(len(pool)))
            rng.shuffle(order)
            out += [pool[i] for i in order[:take]]
            take -= min(take, len(pool))
    rng.shuffle(out)
    return out


def mix_files(
    inputs: Sequence[str | Path], out: str | Path, weights: Mapping[str, float] | None = None, n: int | None = None, seed: int = 0
) -> tuple[Path, dict[str, int]]:
    """Mix the samples of JSONL ``inputs`` into ``out`` (atomically); returns the path and per-group counts."""
    if not inputs:
        raise UserError("mix: no input files given")
    samples: list[dict[str, Any]] = []
    with user_input():  # a missing or malformed input file, a bad weight: the user's input (exit 2)
        for p in inputs:
            samples += read_jsonl(p)
        mixed = mix(samples, weights, n, seed)
    return write_jsonl(out, mixed), dict(sorted(Counter(group_key(s) for s in mixed).items()))


def load_mix_config(path: str | Path) -> MixConfig:
    """Read a YAML mix config; an unknown key or a wrong type is a ValueError naming the file and key."""
    p = Path(path)
    tree = read_yaml_mapping(p, "mix config")
    known = {f.name for f in fields(MixConfig)}
    for k in tree:
        if k not in known:
            import difflib

            close = difflib.get_close_matches(str(k), sorted(known), n=1)
            raise UserError(f"{p}: unknown mix config key '{k}'" + (f" (did you mean '{close[0]}'?)" if close else "") + f"; known: {sorted(known)}")
    cfg = MixConfig()
    if "inputs" in tree:
        if not isinstance(tree["inputs"], list) or not all(isinstance(x, str) for x in tree["inputs"]):
            raise UserError(f"{p}: 'inputs' must be a list of file paths")
        cfg.inputs = [str((p.parent / x) if not Path(x).is_absolute() and not Path(x).exists() else x) for x in tree["inputs"]]
    if "out" in tree:
        if not isinstance(tree["out"], str):
            raise UserError(f"{p}: 'out' must be a file path")
        cfg.out = tree["out"]
    for k in ("n", "seed"):
        if k in tree:
            if isinstance(tree[k], bool) or not isinstance(tree[k], int) or (k == "n" and tree[k] < 0):
                raise UserError(f"{p}: '{k}' must be a {'non-negative ' if k == 'n' else ''}integer, got {tree[k]!r}")
            setattr(cfg, k, tree[k])
    if "weights" in tree:
        if not isinstance(tree["weights"], dict):
            raise UserError(f"{p}: 'weights' must be a mapping of 'domain/effort' to a number")
        try:
            _check_weights(tree["weights"])
        except ValueError as e:
            raise UserError(f"{p}: {e}") from None
        cfg.weights = {str(k): float(v) for k, v in tree["weights"].items()}
    return cfg
