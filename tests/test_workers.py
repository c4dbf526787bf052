"""k3post.workers: the pipeline's worker processes start from a fork server that preloaded the stages, in the
environment their parent has when it starts them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from k3post import workers

_ROOT = Path(__file__).resolve().parents[1]


def _loaded(names: list[str]) -> dict[str, bool]:
    return {n: n in sys.modules for n in names}


def _env(key: str) -> str | None:
    return os.environ.get(key)


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(), reason="no forkserver")
def test_a_worker_starts_with_the_stages_imported_and_a_spawned_one_without(monkeypatch):
    names = ["torch", "transformers", *workers.PRELOAD]
    monkeypatch.delenv(workers.START_ENV, raising=False)
    assert workers.start_method() == "forkserver"
    with workers.worker_pool(1) as pool:
        assert pool.apply(_loaded, (names,)) == {n: True for n in names}
    # the control: a fresh interpreter imports only what unpickling the task needs (this test module)
    monkeypatch.setenv(workers.START_ENV, "spawn")
    with workers.worker_pool(1) as pool:
        assert pool.apply(_loaded, (names,)) == {n: False for n in names}


def test_a_worker_sees_the_environment_its_parent_has_when_it_starts(monkeypatch):
    """The server keeps the environment it started with; each worker gets its parent's of the moment."""
    monkeypatch.setenv("K3POST_TEST_WORKER_VAR", "first")
    with workers.worker_pool(1) as pool:  # starts the server (if no earlier test did), with "first"
        assert pool.apply(_env, ("K3POST_TEST_WORKER_VAR",)) == "first"
    monkeypatch.setenv("K3POST_TEST_WORKER_VAR", "second")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with workers.worker_pool(1) as pool:
        assert pool.apply(_env, ("K3POST_TEST_WORKER_VAR",)) == "second"
        assert pool.apply(_env, ("OMP_NUM_THREADS",)) == "3"
    monkeypatch.delenv("K3POST_TEST_WORKER_VAR")
    q = workers.worker_context().Queue()
    p = workers.worker_process(_put_env, ("K3POST_TEST_WORKER_VAR", q))
    p.start()
    assert q.get(timeout=120) is None
    p.join(timeout=60)
    assert p.exitcode == 0


def _put_env(key: str, q) -> None:
    q.put(os.environ.get(key))


def test_an_unknown_start_method_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(workers.START_ENV, "fork")
    with pytest.raises(ValueError, match="K3POST_WORKER_START='fork'.*forkserver"):
        workers.worker_context()


def test_worker_pool_keeps_its_initializer(monkeypatch):
    with pytest.raises(TypeError, match="initializer"):
        workers.worker_pool(1, initializer=print)


_CUDA_SPY = """
import torch, importlib, json
calls = []
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device"):
    def spy(*a, _n=name, _f=getattr(torch.cuda, name), **k):
        calls.append(_n)
        return _f(*a, **k)
    setattr(torch.cuda, name, spy)
from k3post.workers import PRELOAD
for m in PRELOAD:
    importlib.import_module(m)
print(json.dumps(calls))
"""


def test_the_preload_never_touches_cuda():
    """The server forks every worker: had importing `PRELOAD` asked CUDA anything (``is_available`` initialises the
    driver), a worker on a GPU machine would inherit a driver state that does not survive a fork."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _CUDA_SPY], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
