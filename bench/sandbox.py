"""Benchmark: overhead of one sandboxed ``python -c pass`` vs a plain subprocess.

Usage::

    python bench/sandbox.py [--runs 30] [--backend auto] [--flags="-I -S"]

Both sides run the same interpreter (the one visible inside the sandbox view,
normally ``/usr/bin/python3``), so the difference is the sandbox's own cost
(namespace setup, bind mounts, rlimits, pipe handling).  The last line printed
is a JSON object with ``sandbox_exec_median_ms``, ``sandbox_exec_p95_ms``,
``plain_exec_median_ms``, ``plain_exec_p95_ms``, ``overhead_median_ms``,
``backend``, ``python``, ``flags`` and ``runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import warnings

from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.envs.sandbox.host import _inner_python


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values``."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def bench(runs: int, backend: str, flags: list[str]) -> dict[str, object]:
    """Time ``runs`` sandboxed and ``runs`` plain executions; return the summary."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    python, _prefix = _inner_python()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sb = Sandbox(limits=SandboxLimits(wall_s=30), backend=backend)
    with sb:
        # warm-up (page cache, backend probe)
        for _ in range(3):
            sb.run(["python", *flags, "-c", "pass"])
            subprocess.run([python, *flags, "-c", "pass"], check=True)
        boxed: list[float] = []
        plain: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            res = sb.run(["python", *flags, "-c", "pass"])
            boxed.append((time.perf_counter() - t0) * 1000.0)
            if not res.ok:
                raise RuntimeError(f"sandboxed run failed: {res}")
            t0 = time.perf_counter()
            subprocess.run([python, *flags, "-c", "pass"], check=True, capture_output=True)
            plain.append((time.perf_counter() - t0) * 1000.0)
        used = sb.backend
    return {
        "sandbox_exec_median_ms": round(statistics.median(boxed), 2),
        "sandbox_exec_p95_ms": round(_percentile(boxed, 95), 2),
        "plain_exec_median_ms": round(statistics.median(plain), 2),
        "plain_exec_p95_ms": round(_percentile(plain, 95), 2),
        "overhead_median_ms": round(statistics.median(boxed) - statistics.median(plain), 2),
        "backend": used,
        "python": python,
        "flags": flags,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: print human-readable lines, then the JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--backend", default="auto", choices=["auto", "bwrap", "unshare", "rlimit"])
    ap.add_argument("--flags", default="", help='interpreter flags as one string, e.g. --flags="-I -S"')
    args = ap.parse_args(argv)
    summary = bench(args.runs, args.backend, args.flags.split())
    print(
        f"backend={summary['backend']} sandboxed median {summary['sandbox_exec_median_ms']} ms "
        f"(p95 {summary['sandbox_exec_p95_ms']} ms), plain median {summary['plain_exec_median_ms']} ms"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
