"""Shared pytest fixtures: a small XTML tokenizer trained once per session."""

from __future__ import annotations

import os
import sys

# Bytecode: where PYTHONDONTWRITEBYTECODE is set (container images often set it; this project's sessions run with
# it; whether CI does is not known), every Python process of the run compiled k3post, and pytest rewrote every test
# module, from source: each xdist worker's collection (16.5 CPU-s, 10 with the bytecode written) and each of the ~45
# processes that import the pipeline (Ray actors, fork servers, CLI and bench subprocesses: ~0.4 CPU-s each).
# The test run writes bytecode, as Python does by default, into the tree's __pycache__ folders (gitignored);
# the processes it starts inherit the setting. Read before the workers start (this file is an initial conftest).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

# Emulating an AVX2-only CPU on an AVX-512 / AMX machine (ATEN_CPU_CAPABILITY=avx2, as CI on another machine
# would run): oneDNN must be capped to the same ISA, else torch 2.13's bf16 CPU flash attention (L >= 128)
# takes oneDNN's AMX packing path from an AVX2 kernel and raises "pack_vnni2 is only supported when avx512
# is supported" (a real AVX2 CPU never reaches that path; docs/decisions.md). Read when oneDNN first runs.
if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default") and "ONEDNN_MAX_CPU_ISA" not in os.environ:
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2" if os.environ["ATEN_CPU_CAPABILITY"].lower() == "avx2" else "SSE41"

# pytest-xdist (pyproject.toml runs the suite on one worker per core): each worker, and every process its tests start,
# runs one torch thread (`run.threads: 0` then plans one, `k3post.threads`), so the workers together never keep more
# threads busy than there are cores (idle-spinning OpenMP threads of one worker would slow the other: issue 32)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
from transformers import PreTrainedTokenizerFast

from k3post.tokenizer import train_tokenizer

_CORPUS = [
    "Hello! How are you today? I'm fine, thanks.",
    "The quick brown fox jumps over the lazy dog 1234567890 times.",
    'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n    return a + b\n',
    "for i in range(10):\n    print(i * 2)\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": true}}',
    '[{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]',
    "Let me think step by step about the problem before answering.",
    "The answer is 42. The tool returned an error; retrying with different arguments.",
    "Grüße aus München — café, naïve, déjà vu.",
    "日本語のテキストと中文文本。",
    "Emoji: 🙂 👍 and math: ∑ x² ≤ ∞",
    'message role="user" role="assistant" role="tool" tool="python" index="1"',
    'argument key="code" type="string" think response tools call json',
]


MAX_WORKERS = 4
"""The most pytest-xdist workers ``-n auto`` starts: the Ray, server and multi-rank tests start processes of their own,
and on a large machine more workers than this queue on the same few long test files."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use (its CPU affinity, not the machine's count), at most
    `MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session")
def xtml_tokenizer() -> PreTrainedTokenizerFast:
    """A ~400-token byte-level BPE with the XTML special tokens at ids 0..4."""
    return train_tokenizer(_CORPUS * 3, vocab_size=400)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (engine and server tests: stable on a shared 2-core machine), the
    commands they run included (OMP_NUM_THREADS=1: `run.threads: 0` then plans one thread, `k3post.threads`);
    the previous thread count and environment are restored afterwards."""
    import os

    import torch

    n, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(n)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="session")
def warm_policy_trained(xtml_tokenizer, tmp_path_factory):
    """(model, torch RNG state after training): `tests/test_rl.py`'s ``warm_policy`` (120 SFT steps of a tiny MoE
    on general.arithmetic at max effort, one torch thread) trained once per pytest worker, not once per module that
    uses it (test_rl, test_fsdp_stages, test_ray: ~7 s each). ``warm_policy`` hands each module a deep copy and sets
    the torch RNG state the training left, so a module sees what training it in place gave (the training is
    deterministic and draws from neither Python's nor NumPy's global generator)."""
    import torch

    from k3post.data import Sample, render_record
    from k3post.envs.families.registry import get_family
    from k3post.models import build_tiny_moe
    from k3post.stages.sft import SFTConfig, train_sft
    from k3post.synth.pipeline import synthesize
    from k3post.xtml import XTML

    tok = xtml_tokenizer
    x = XTML(tok)
    recs = synthesize(get_family("general.arithmetic"), effort="max", n=200, seed=1)
    samples = [Sample(*render_record(x, r), source=str(i)) for i, r in enumerate(recs)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=x.eom_id,
                               hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               moe_intermediate_size=64, num_experts=4, intermediate_size=128)
        cfg = SFTConfig(steps=120, lr=1e-2, pack_len=512, rows_per_batch=4, progress=False, log_every=1000,
                        save_every=10_000)
        train_sft(model, tok, samples, cfg, tmp_path_factory.mktemp("sft"), resume=False)
    finally:
        torch.set_num_threads(n)
    return model, torch.get_rng_state()


_AET_EVALUATIONS: dict[str, tuple[list, bool]] = {}  # session-wide: key = the checked tree + the scenarios


def _evaluate_once(real, cache):
    """`aet.evaluate` (``real``) run once per distinct (checked tree, scenarios) in ``cache``: a repeat returns
    the first run's result.

    The key is everything `evaluate` reads (the `verification_tree` of the files, which already holds the task's
    initial and protected files, and the scenarios; the limits are constants), so a hit is the same hidden
    verification of the same programs on the same inputs. Tests that verify a reference solution at three efforts,
    or several hacks that leave the checked tree as it started, pay for it once; each distinct tree still runs. A
    result with a run that timed out (or found the verification time spent: ``exit code None``) is not kept, so a
    slow moment on a loaded machine is not served again to the next check of that tree.
    """
    import json

    from k3post.envs.families.aet.core import verification_tree

    def evaluate(metadata, files, scenarios):
        key = json.dumps([verification_tree(metadata, files), list(scenarios)], sort_keys=True)
        if key in cache:
            reasons, weak = cache[key]
            return list(reasons), weak
        reasons, weak = real(metadata, files, scenarios)
        if not any(r is not None and "exit code None" in r for r in reasons):  # a timed-out run is not kept
            cache[key] = (list(reasons), weak)
        return list(reasons), weak

    return evaluate


@pytest.fixture
def aet_evaluate_once(monkeypatch):
    """AET hidden / public verification memoised for one test (`_evaluate_once`); not for the isolation tests,
    which must run every program they plant."""
    import k3post.envs.families.aet.core as aet

    monkeypatch.setattr(aet, "evaluate", _evaluate_once(aet.evaluate, _AET_EVALUATIONS))


@pytest.fixture(scope="module")
def aet_evaluate_once_module():
    """`aet_evaluate_once` for a module-scoped fixture."""
    import k3post.envs.families.aet.core as aet

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aet, "evaluate", _evaluate_once(aet.evaluate, _AET_EVALUATIONS))
        yield


_BROWSER_RUNS: dict[str, object] = {}  # session-wide: key = the files, the runs and the options


@pytest.fixture(scope="module")
def webdev_browser_once_module():
    """coding.webdev's browser runs (`browser.run_browser` as the family calls it: verification and the preview
    tool) memoised for a module: a repeat of the same files, runs and options returns the first result. For tests
    of what drives the family (the agent loop's fuzz), not of the browser: the webdev tests run every page they
    check. A run that failed as a whole (timeout, memory, crash) is not kept."""
    import copy
    import json

    import k3post.envs.families.webdev.family as webdev

    real = webdev.run_browser

    def run_browser(files, runs, **kw):
        key = json.dumps([files, runs, kw], sort_keys=True)
        if key not in _BROWSER_RUNS:
            res = real(files, runs, **kw)
            if res.error is not None:
                return res
            _BROWSER_RUNS[key] = res
        return copy.deepcopy(_BROWSER_RUNS[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(webdev, "run_browser", run_browser)
        yield


def pytest_addoption(parser):
    parser.addoption("--inject-bug", action="store", default=None, dest="inject_bug",
                     help="tests/test_learning.py: plant a bug in the library (loss_mask, advantage_sign, override_off, "
                          "teacher_student) to show the learning checks catch it")


@pytest.fixture(scope="module")
def tiny_agent_policy(xtml_tokenizer):
    """(model, tokenizer, xtml): an untrained 1-layer Qwen3-MoE (hidden 32, 2 experts, 4,096 positions) over
    `xtml_tokenizer`, in eval mode: the policy of the partial-rollout bench tests."""
    from k3post.models import build_tiny_moe
    from k3post.xtml import XTML

    tok = xtml_tokenizer
    xtml = XTML(tok)
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id, hidden_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           moe_intermediate_size=32, intermediate_size=64, num_experts=2, max_position_embeddings=4096)
    return model.eval(), tok, xtml
