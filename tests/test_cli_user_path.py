"""Issue 34: the user-model path through the `k3post` command line (findings the issue lists, one test each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "numpy", "fastapi", "ray")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_help_imports_no_torch_or_transformers():
    """`k3post --help` and each sub-command's --help build the parser without the ML stack (was 6.4 s: transformers)."""
    code = (
        "import sys, contextlib, io\n"
        "from k3post.cli import main\n"
        "for argv in (['--help'], ['sft', '--help'], ['serve', '--help'], ['tasks', 'list', '--help'], ['synth', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (argv, e.code)\n"
        "    assert 'usage: k3post' in out.getvalue(), argv\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"--help imported {r.stdout.strip()}"
