"""Load a script of ``bench/`` as a module (the scripts are not a package): ``load_bench("rl_sweep")``; run one as a
command and read its last line's JSON: ``run_bench("exact_mode", "--repeats", "1")``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from types import ModuleType

_BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py``, executed as a fresh module named ``bench_<name>``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def run_bench(name: str, *args: str, timeout: float = 600) -> Any:
    """``python bench/<name>.py ARGS`` from the repository root (an error when it fails), its last line as JSON."""
    out = subprocess.run([sys.executable, str(_BENCH / f"{name}.py"), *args], capture_output=True, text=True,
                         cwd=_BENCH.parent, timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
