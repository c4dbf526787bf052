"""Benchmark: episodes/s of every registered task family with its reference solver, and sandbox exec overhead.

Usage::

    python bench/envs.py [--tasks 30] [--sandbox-runs 30] [--seed 0]

For each family (`k3post.envs.families.families()`; a family module that fails to import is
skipped with a note) it generates ``--tasks`` tasks (the difficulties among 1, 2, 3 it accepts, in turn), runs the
reference solver one episode at a time (efforts low, high, max in turn) and times the episodes,
verification included. It also times ``--sandbox-runs`` sandboxed ``python -c pass`` runs after
3 warm-up runs. The last line printed is a JSON object::

    {"episodes_per_s": {family: float}, "mean_reward": {family: float}, "episodes": {family: int},
     "sandbox_exec_median_ms": float, "sandbox_exec_p95_ms": float, "sandbox_backend": str,
     "timing_noise": {family: {"median": float, "max": float}}, "notes": [str]}

``timing_noise`` is there for families whose verdicts time code (``coding.kernel``): the median
absolute deviation of the paired log time ratios (agent vs expert) of the measurement kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any

from k3post.envs import run_episode_sync
from k3post.envs.families import registry
from k3post.constants import EFFORTS
from k3post.envs.families.registry import TaskFamily
from k3post.envs.sandbox import Sandbox, SandboxLimits

def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values``."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def load_families() -> tuple[list[TaskFamily], list[str]]:
    """All registered families, tolerating family modules that do not import (each noted)."""
    notes: list[str] = []
    try:
        return registry.families(), notes
    except Exception as e:  # noqa: BLE001 - a sibling module may be missing or broken; note it and go on
        notes.append(f"families() failed ({type(e).__name__}: {e}); importing family modules one by one")
    notes += [f"not benchmarked: {n}" for n in registry.load_builtin(skip_broken=True)]
    return [f for _, f in sorted(registry._FAMILIES.items())], notes


def _accepts(fam: TaskFamily, difficulty: int, seed: int) -> bool:
    """Whether ``fam`` generates tasks at ``difficulty`` (families may have fewer than 3 levels)."""
    try:
        fam.generate(1, seed=seed, difficulty=difficulty)
    except ValueError:
        return False
    return True


def bench_family(fam: TaskFamily, n_tasks: int, seed: int) -> dict[str, float]:
    """Episodes/s and mean reward of the reference solver on ``n_tasks`` tasks (difficulty and effort cycling).

    Generation is not timed; each episode includes env construction, the episode and verification.
    """
    levels = [d for d in (1, 2, 3) if _accepts(fam, d, seed)]
    if not levels:
        raise ValueError(f"{fam.name}: generate() accepts none of the difficulties 1, 2, 3")
    k = len(levels)
    per = [fam.generate(len(range(j, n_tasks, k)), seed=seed, difficulty=d) for j, d in enumerate(levels)]
    tasks = [per[i % k][i // k] for i in range(n_tasks)]
    rewards: list[float] = []
    noise: list[float] = []
    t0 = time.perf_counter()
    for i, task in enumerate(tasks):
        ep = run_episode_sync(fam.reference_policy(task, EFFORTS[i % 3]), fam.make_env(task), task)
        rewards.append(float(ep.reward) if ep.reward is not None else 0.0)
        if ep.verdict is not None and "noise" in ep.verdict.components:
            noise.append(float(ep.verdict.components["noise"]))
    dt = time.perf_counter() - t0
    out = {"episodes_per_s": len(tasks) / dt, "mean_reward": sum(rewards) / max(1, len(rewards)), "episodes": len(tasks)}
    if noise:  # families that time code (coding.kernel): the timing noise their verdicts measured
        out["timing_noise_median"] = statistics.median(noise)
        out["timing_noise_max"] = max(noise)
    return out


def bench_sandbox(runs: int) -> dict[str, Any]:
    """Median and p95 wall time (ms) of a sandboxed ``python -c pass``."""
    if runs < 1:
        raise ValueError(f"--sandbox-runs must be >= 1, got {runs}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sb = Sandbox(limits=SandboxLimits(wall_s=30))
    with sb:
        for _ in range(3):
            sb.run(["python", "-c", "pass"])
        times: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            res = sb.run(["python", "-c", "pass"])
            times.append((time.perf_counter() - t0) * 1000.0)
            if not res.ok:
                raise RuntimeError(f"sandboxed `python -c pass` failed: {res}")
        backend = sb.backend
    return {
        "sandbox_exec_median_ms": round(statistics.median(times), 2),
        "sandbox_exec_p95_ms": round(_percentile(times, 95), 2),
        "sandbox_backend": backend,
    }


def main() -> None:
    """Parse arguments, run both benchmarks, print per-family lines and the final JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=30, help="episodes per family (default 30)")
    ap.add_argument("--sandbox-runs", type=int, default=30, help="sandboxed `python -c pass` runs (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.tasks < 1:
        raise ValueError(f"--tasks must be >= 1, got {args.tasks}")
    fams, notes = load_families()
    out: dict[str, Any] = {"episodes_per_s": {}, "mean_reward": {}, "episodes": {}}
    for fam in fams:
        try:
            r = bench_family(fam, args.tasks, args.seed)
        except Exception as e:  # noqa: BLE001 - one broken family must not hide the others' numbers
            notes.append(f"{fam.name} failed: {type(e).__name__}: {e}")
            continue
        print(f"{fam.name:32s} {r['episodes_per_s']:8.2f} episodes/s  mean reward {r['mean_reward']:.3f}", flush=True)
        out["episodes_per_s"][fam.name] = round(r["episodes_per_s"], 3)
        out["mean_reward"][fam.name] = round(r["mean_reward"], 4)
        out["episodes"][fam.name] = r["episodes"]
        if "timing_noise_median" in r:
            out.setdefault("timing_noise", {})[fam.name] = {
                "median": round(r["timing_noise_median"], 4), "max": round(r["timing_noise_max"], 4)}
            print(f"{'':32s} timing noise (MAD of log time ratios) median {r['timing_noise_median']:.3f}, "
                  f"max {r['timing_noise_max']:.3f}", flush=True)
    out.update(bench_sandbox(args.sandbox_runs))
    out["notes"] = notes
    print(json.dumps(out))


if __name__ == "__main__":
    main()
