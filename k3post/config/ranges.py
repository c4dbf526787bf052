"""Value ranges of config fields, declared on the field and checked when a config loads.

    steps: int = ranged(1500, ge=1)                       # an integer >= 1
    lr: float = ranged(5e-3, ge=0)                        # a finite number >= 0
    lambda_: float = ranged(0.7, gt=0, le=1)              # in (0, 1]
    clip_eps_low: float = ranged(math.inf, ge=0, inf_ok=True)

`check_ranges(cfg)` walks a config tree (dataclasses in dataclasses) and raises `RangeError` (a
ValueError) naming the dotted key, the range and the value of the first field outside its range;
`check_range` checks one value against a field's range (``rl.domain_overrides`` values). NaN is never in
a range; ±inf only where ``inf_ok`` says so (an "off" setting, e.g. no PPO clipping).

Shape legend: none.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Range", "RangeError", "ranged", "check_range", "check_ranges", "field_range"]


class RangeError(ValueError):
    """A config value outside its field's declared range; ``key`` is its dotted name."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Range:
    """Bounds of a number: ``ge`` / ``gt`` (lower, closed / open), ``le`` / ``lt`` (upper); ``inf_ok``
    admits ±inf (the lower and upper bounds still apply)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    inf_ok: bool = False

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return False
        if math.isinf(value) and not self.inf_ok:
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if lo is not None and hi is not None:
            text = f"in {lo}, {hi}"
        elif lo is not None:
            text = f"{'>=' if self.ge is not None else '>'} {lo[1:]}"
        elif hi is not None:
            text = f"{'<=' if self.le is not None else '<'} {hi[:-1]}"
        else:
            text = "a number"
        return text + (" (inf allowed)" if self.inf_ok else "")


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, inf_ok: bool = False) -> Any:
    """A dataclass field with ``default`` and its range in the metadata (module doc)."""
    return dataclasses.field(default=default, metadata={"range": Range(ge, gt, le, lt, inf_ok)})


def field_range(cls: type, name: str) -> Range | None:
    """The declared range of field ``name`` of dataclass ``cls`` (None: none declared)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("range")
    return None


def check_range(key: str, value: Any, rng: Range | None) -> None:
    """RangeError naming ``key`` when ``value`` is outside ``rng`` (no range: nothing to check)."""
    if rng is not None and not rng.contains(value):
        kind = "an integer" if isinstance(value, int) and not isinstance(value, bool) else "a number"
        raise RangeError(key, f"{key} must be {kind} {rng}, got {value!r}" if str(rng)[0] in "<>"
                         else f"{key} must be {rng}, got {value!r}")


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Check every field with a declared range in the config tree ``cfg`` (module doc)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        check_range(f"{prefix}{f.name}", value, f.metadata.get("range"))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_ranges(value, f"{prefix}{f.name}.")
