"""What every benchmark under bench/ shares: interleaved repeats, their statistics, and a record of the
machine's state, so that a ratio is printed with its spread and the conditions it was measured under.

    arms = {"baseline": run_baseline, "k3post": run_k3post}      # each returns its own seconds (or None: timed here)
    times = interleaved(arms, repeats=5, warmup=1)               # round-robin: b, k, b, k, ... (order rotated)
    out = {"machine": machine_state(), **ratio_summary("speedup", times["baseline"], times["k3post"])}
    print(json.dumps(out))

A ratio's headline is the ratio of medians; ``<key>_min`` / ``<key>_max`` are the smallest and largest
ratio of paired repeats (repeat i of one arm against repeat i of the other, run back to back), so a
machine that was busy during one repeat shows as spread, not as a shifted median.

Shape legend: none.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["machine_state", "interleaved", "summary", "ratio_summary"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_state() -> dict[str, Any]:
    """Load averages, CPU, core count, torch threads and kernel capability, library versions: JSON-able."""
    import torch

    state: dict[str, Any] = {
        "loadavg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
    }
    for env in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS"):
        if os.environ.get(env):
            state[env] = os.environ[env]
    try:
        import transformers

        state["transformers"] = transformers.__version__
    except ImportError:
        pass
    return state


def interleaved(
    arms: Mapping[str, Callable[[], float | None]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every arm ``warmup`` times (untimed), then ``repeats`` rounds in which each arm runs once, the
    order rotated every round; returns each arm's seconds per repeat. An arm that returns a number reports
    its own timing (e.g. a step timed inside a longer call); one that returns None is timed here."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            got = arms[name]()
            out[name].append(float(got) if got is not None else time.perf_counter() - t0)
    return out


def summary(key: str, xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """``key_median``, ``key_min``, ``key_max`` (times ``scale``) and ``key_n``."""
    if not xs:
        raise ValueError(f"{key}: no measurements")
    return {f"{key}_median": statistics.median(xs) * scale, f"{key}_min": min(xs) * scale,
            f"{key}_max": max(xs) * scale, f"{key}_n": float(len(xs))}


def ratio_summary(key: str, numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """``key`` = median(numerator) / median(denominator), with ``key_min`` / ``key_max`` over the paired
    repeats (numerator[i] / denominator[i]) and ``key_n``."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"{key}: need paired repeats, got {len(numerator)} and {len(denominator)}")
    paired = [a / b for a, b in zip(numerator, denominator)]
    return {key: statistics.median(numerator) / statistics.median(denominator), f"{key}_min": min(paired),
            f"{key}_max": max(paired), f"{key}_n": float(len(paired))}
