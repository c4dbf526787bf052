"""The numerics-sensitive tests pass under another CPU's kernels too (issue 13: green on AVX-512, red on an
AVX2-only EPYC). PyTorch and MKL pick their kernels by CPU capability; forcing AVX2 on this machine runs
the kernels an AVX2-only machine runs, so these tests run again in a child process with
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (conftest.py caps oneDNN to match). Skipped where
the CPU runs AVX2 kernels already (the default run is that check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SENSITIVE = [
    "tests/test_engine.py",  # engine vs HF log-probs, with and without MX QAT
    "tests/test_agent_loop.py",  # memorised greedy episodes, KV reuse, the pause-between-turns scenario
    "tests/test_sft.py::test_bf16_autocast_trains",  # bf16 flash attention on CPU
]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT", "NO AVX"),
                    reason="the CPU runs AVX2 kernels already: the default run is this check")
def test_sensitive_tests_pass_with_avx2_kernels():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "AVX2"  # the setting really changes the kernels
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SENSITIVE], cwd=root, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
