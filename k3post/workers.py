"""Worker processes of one command (the demo's SFT pair, the RL domain workers, the drafts, MOPD's teacher
worker, FSDP ranks, the engine servers of ``engine.launch``): started from a fork server that has imported
torch, transformers and k3post once.

A spawned child imports torch, transformers and the k3post stage it runs before it does any work: ~5 s of one
core each (`python -X importtime -c "import k3post.stages.rl"`), which the demo pays for nine children and the
test suite for hundreds. A fork server (`multiprocessing`'s ``forkserver`` start method) is a clean process,
started on the first worker, that imports `PRELOAD` and then forks each worker: a child starts with those
modules loaded and shares their pages. The server has run no torch op, so no OpenMP or inter-op thread pool
is forked half-made (the reason the pipeline never forks the command itself).

What a child sees is what a spawned one saw: the parent's ``sys.path``, working directory and main module
(multiprocessing sends them per child), and the parent's environment *at the time the child starts*
(`start_env`, applied first thing in the child: the server itself keeps the environment it was started
with, so a variable set later in the command, a thread plan's ``OMP_NUM_THREADS`` say, would otherwise be
lost).

``K3POST_WORKER_START=spawn`` starts every worker as a fresh interpreter instead (slower, for a platform
without ``forkserver``, or to rule the server out when debugging); the choice is logged once.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "PRELOAD",
    "START_ENV",
    "start_env",
    "start_method",
    "start_ranks",
    "worker_context",
    "worker_pool",
    "worker_process",
]

START_ENV = "K3POST_WORKER_START"
START_METHODS = ("forkserver", "spawn")

# every stage a worker runs: the server imports them once (each pulls torch and transformers)
PRELOAD: tuple[str, ...] = (
    "k3post.recipes.demo",
    "k3post.recipes.experts",
    "k3post.recipes.commands",
    "k3post.stages.mopd",
    "k3post.trainer.fsdp",
    "k3post.serve.app",  # engine servers a command launches (`k3post.serve.launch`)
)

_logged: list[str] = []


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``; `START_ENV` chooses (an unknown value is an
    error naming the variable)."""
    want = os.environ.get(START_ENV, "").strip()
    if want and want not in START_METHODS:
        raise ValueError(f"{START_ENV}={want!r}: expected one of {list(START_METHODS)}")
    method = want or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    if method not in _logged:
        _logged.append(method)
        why = f"{START_ENV}={want}" if want else "the platform's best"
        log.info("workers: started by %s (%s)%s", method, why,
                 f"; the server preloads {', '.join(PRELOAD)}" if method == "forkserver" else "")
    return method


def worker_context() -> Any:
    """The multiprocessing context every worker process of the pipeline starts from (module doc)."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first worker)
    return ctx


def start_env(env: Mapping[str, str]) -> None:
    """In a worker, first thing: the parent's environment as it was when the worker was started."""
    if dict(os.environ) != dict(env):
        os.environ.clear()
        os.environ.update(env)


def _call_with_env(env: Mapping[str, str], target: Callable[..., Any], *args: Any) -> Any:
    start_env(env)
    return target(*args)


def worker_pool(processes: int, **kwargs: Any) -> Any:
    """``Pool(processes, **kwargs)`` of the worker context, each worker in the parent's environment of now."""
    if "initializer" in kwargs:
        raise TypeError("worker_pool sets the initializer itself (start_env)")
    return worker_context().Pool(processes, initializer=start_env, initargs=(dict(os.environ),), **kwargs)


def worker_process(target: Callable[..., Any], args: tuple[Any, ...] = (), *, env: Mapping[str, str] | None = None,
                   **kwargs: Any) -> Any:
    """A ``Process`` of the worker context running ``target(*args)`` in the parent's environment of now, with
    ``env``'s variables set over it."""
    return worker_context().Process(target=_call_with_env, args=({**os.environ, **(env or {})}, target, *args),
                                    **kwargs)


def start_ranks(entry: Callable[..., Any], args: tuple[Any, ...], nprocs: int, *, join: bool) -> Any:
    """``torch.multiprocessing.start_processes`` of ``nprocs`` local ranks from the worker context: rank i runs
    ``entry(i, *args)`` in the parent's environment of now (its context, as the function returns it, when
    ``join`` is False)."""
    import torch.multiprocessing  # here: this module stays free of torch (a spawned worker imports only what it runs)

    worker_context()  # the server's preload set before torch starts it
    return torch.multiprocessing.start_processes(_rank_with_env, args=(dict(os.environ), entry, *args), nprocs=nprocs,
                                                 join=join, start_method=start_method())


def _rank_with_env(rank: int, env: Mapping[str, str], entry: Callable[..., Any], *args: Any) -> Any:
    start_env(env)
    return entry(rank, *args)
