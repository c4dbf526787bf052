"""Load a script of ``bench/`` as a module (the scripts are not a package): ``load_bench("rl_sweep")``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

_BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py``, executed as a fresh module named ``bench_<name>``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod

