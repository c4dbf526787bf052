"""Environment workers on Ray (``distributed.roles.env_workers`` > 0): every episode's environment (its
tools, sandbox and verifier) runs in an `EnvWorkerActor` on an env-worker bundle, where the CPUs are; the
rollout's `AgentLoop` holds a `RemoteEnvironment` in its place.

    with RayCluster(cfg.distributed) as cluster, remote_environments(cluster, sandbox=cfg.sandbox):
        ...                      every `k3post.rollout.evaluation.make_env` in this process is remote

**The seam** is the environment factory (`k3post.rollout.evaluation.make_env`, which the `Rollout`, the
evaluation and the budgets call): `remote_environments` installs `EnvWorkerPool.environment`, so the agent
loop, the scheduler and the stage loops do not change. A `RemoteEnvironment` has the interface the agent
loop uses (``reset``, ``step``, ``verify``, ``tool_specs``, ``state_dict``, ``load_state_dict``, ``close``);
each call is one Ray call to its worker, which builds the family's environment
(`k3post.envs.families.registry.local_env`) and keeps it live between calls. New episodes are dealt
round-robin over the workers. A worker imports no torch: it runs environments only.

**Faults.** Every ``reset`` and ``step`` returns the episode's ``state_dict`` (sandbox snapshot included)
with its result, and the `RemoteEnvironment` keeps it: that is the episode's saved state. When a call finds
its worker dead (Ray restarts it up to ``distributed.env_max_restarts`` times) or restarted without the
episode, the episode is loaded from its saved state on the next worker (the restarted one, with a single
worker) and the call is retried: up to ``distributed.env_retries`` times per call. A step re-runs from the
state before it with the same message, so a deterministic environment answers it as the lost worker
would have. Past the retries the call raises `k3post.envs.env.EnvironmentLost` (an infrastructure error):
the agent loop ends the episode with finish "infra", kind ``env_lost`` (reward None, the verdict naming the
worker), so it is counted (``infra/env_lost`` in the step metrics), never dropped silently, and never a
reward: the loop masks it out of its group (`k3post.loop`). A new episode whose ``reset`` finds every
worker dead fails the run (there is nowhere to run it).

Shape legend: none (messages and JSON states).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from k3post.config.sandbox import SandboxConfig, apply_sandbox_config
from k3post.envs.env import EnvironmentLost, StepResult
from k3post.envs.families.registry import local_env
from k3post.envs.task import Task, Verdict
from k3post.envs.tools import ToolSpec

__all__ = ["EnvWorkerActor", "EnvWorkerPool", "RemoteEnvironment", "remote_environments"]

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class EnvWorkerActor:
    """Live environments of many episodes, keyed by the episode's key (module doc). Every method but
    ``reset`` and ``info`` answers ``(False, None)`` when the episode is not here (this worker was restarted
    since), else ``(True, result)``."""

    def __init__(self, sandbox: SandboxConfig | None = None) -> None:
        # no torch here: the environments are tools, sandboxes and verifiers (their children run the agent's
        # code); a worker that imported the rollout would pay ~2 s of a core at every (re)start for nothing
        if sandbox is not None:
            apply_sandbox_config(sandbox)
        self.envs: dict[str, Any] = {}
        self.calls = 0
        self._aio = asyncio.new_event_loop()

    def reset(self, key: str, task: dict[str, Any]) -> tuple[list[dict[str, Any]], list[ToolSpec], dict[str, Any]]:
        """A new episode of ``task``: its initial messages, its tools (without handlers) and its state."""
        self.calls += 1
        t = Task.from_dict(task)
        env = local_env(t)
        messages = self._aio.run_until_complete(env.reset(t))
        self.envs[key] = env
        return messages, [dataclasses.replace(s, handler=None) for s in env.tool_specs()], env.state_dict()

    def load(self, key: str, state: Mapping[str, Any]) -> None:
        """The episode ``key`` from its saved state (a pause, or a worker lost)."""
        self.calls += 1
        env = local_env(Task.from_dict(state["task"]))
        env.load_state_dict(state)
        self.envs[key] = env

    def step(self, key: str, message: dict[str, Any], external_calls: int) -> tuple[bool, Any]:
        """``env.step(message)`` and the state after it."""
        self.calls += 1
        env = self.envs.get(key)
        if env is None:
            return False, None
        result = self._aio.run_until_complete(env.step(message, external_calls=external_calls))
        return True, (result, env.state_dict())

    def verify(self, key: str) -> tuple[bool, Any]:
        self.calls += 1
        env = self.envs.get(key)
        return (False, None) if env is None else (True, env.verify())

    def close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        close = getattr(env, "close", None)
        if callable(close):
            close()

    def info(self) -> dict[str, Any]:
        """pid, live episodes, calls served since this (re)start, whether Ray restarted this actor."""
        with warnings.catch_warnings():  # ray 2.60 warns about its own use of a deprecated API in there
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        return {"pid": os.getpid(), "live": len(self.envs), "calls": self.calls, "restarted": restarted}


class EnvWorkerPool:
    """`EnvWorkerActor` s on the env-worker slots of a cluster (``distributed.roles.env_workers``), and the
    episodes' retry policy. Picklable: a Ray task (an expert job) can take it along."""

    def __init__(self, actors: list[Any], *, retries: int) -> None:
        if not actors:
            raise ValueError("distributed.roles.env_workers is 0: there is no environment worker")
        self.actors = list(actors)
        self.retries = retries
        self._next = 0
        self._keys = itertools.count()
        self.stats = {"episodes": 0, "retries": 0, "lost": 0}

    @classmethod
    def start(cls, cluster: Any, *, sandbox: SandboxConfig | None = None) -> EnvWorkerPool:
        """One worker per env-worker slot of ``cluster`` (a `k3post.distributed.ray_cluster.RayCluster`),
        restarted by Ray up to ``distributed.env_max_restarts`` times."""
        d = cluster.cfg
        actors = [EnvWorkerActor.options(**cluster.options("env_workers", i), max_restarts=d.env_max_restarts)
                  .remote(sandbox) for i in range(cluster.size("env_workers"))]
        return cls(actors, retries=d.env_retries)

    def __getstate__(self) -> dict[str, Any]:
        return {"actors": self.actors, "retries": self.retries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["actors"], retries=state["retries"])  # type: ignore[misc]

    def environment(self, task: Task) -> RemoteEnvironment:
        """The environment factory (`k3post.rollout.agent_loop.EnvFactory`): a remote environment of ``task``."""
        return RemoteEnvironment(self, task)

    def assign(self) -> int:
        """The worker of a new episode (round-robin)."""
        i = self._next
        self._next = (i + 1) % len(self.actors)
        return i

    def new_key(self) -> str:
        return f"{os.getpid()}-{id(self)}-{next(self._keys)}"

    def info(self, *, wait_s: float = 120.0) -> list[dict[str, Any]]:
        """Each worker's `EnvWorkerActor.info`. A worker Ray is still restarting answers
        ``ActorUnavailableError`` (the restart is under way, not a failure): it is asked again until it answers
        or ``wait_s`` has passed (then the error is raised)."""
        deadline = time.monotonic() + wait_s
        out = []
        for a in self.actors:
            while True:
                try:
                    out.append(ray.get(a.info.remote()))
                    break
                except ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        return out

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


class RemoteEnvironment:
    """One episode's environment in an `EnvWorkerActor` (module doc): the `k3post.envs.env.Environment`
    calls the agent loop makes, each retried from the episode's saved state when its worker was lost."""

    def __init__(self, pool: EnvWorkerPool, task: Task) -> None:
        self.pool = pool
        self.task = task
        self.key = pool.new_key()
        self.worker = pool.assign()
        self._state: dict[str, Any] | None = None  # after the last reset / step: the saved state
        self._specs: list[ToolSpec] = []
        self._load = False  # the worker does not hold the episode yet: load the saved state first

    def _call(self, what: str, method: str, *args: Any) -> Any:
        """``method(key, *args)`` on the episode's worker; after a lost worker (dead, or restarted without the
        episode) the saved state is loaded on the next worker and the call retried (``pool.retries`` times)."""
        tries = 0
        while True:
            actor = self.pool.actors[self.worker]
            try:
                if self._load:
                    ray.get(actor.load.remote(self.key, self._state))
                    self._load = False
                out = ray.get(getattr(actor, method).remote(self.key, *args))
                if method == "reset":
                    return out
                found, value = out
                if found:
                    return value
                lost = "it was restarted and no longer holds the episode"
            except RayActorError as e:
                lost = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            where = f"env worker {self.worker} ({what} of task {self.task.id!r})"
            if tries >= self.pool.retries:
                self.pool.stats["lost"] += 1
                raise EnvironmentLost(f"{where} was lost: {lost}; distributed.env_retries={self.pool.retries} "
                                      "retries used")
            tries += 1
            self.pool.stats["retries"] += 1
            log.warning("%s was lost (%s): retrying from the episode's saved state on env worker %d (retry %d of %d)",
                        where, lost, (self.worker + 1) % len(self.pool.actors), tries, self.pool.retries)
            self.worker = (self.worker + 1) % len(self.pool.actors)
            self._load = self._state is not None  # a reset starts afresh

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self.pool.stats["episodes"] += 1
        messages, self._specs, self._state = self._call("reset", "reset", task.to_dict())
        return messages

    async def step(self, message: dict[str, Any], *, external_calls: int = 0) -> StepResult:
        if self._state is None:
            raise ValueError("step() before reset(): start an episode with `await env.reset(task)` first")
        result, self._state = self._call("a step", "step", dict(message), external_calls)
        return result

    def verify(self) -> Verdict:
        if self._state is None:
            raise ValueError("verify() before reset(): there is no episode to verify")
        return self._call("the verification", "verify")

    def tool_specs(self) -> list[ToolSpec]:
        return list(self._specs)

    def state_dict(self) -> dict[str, Any]:
        """The state saved after the last reset / step (no call to the worker)."""
        if self._state is None:
            raise ValueError("state_dict() before reset(): there is no episode to save")
        return self._state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume an episode saved by `state_dict` (a paused trajectory): loaded on the worker at the next call."""
        self._state = dict(state)
        self.task = Task.from_dict(state["task"])
        self._load = True

    def close(self) -> None:
        if not self._load and self._state is not None and self.pool.actors:
            self.pool.actors[self.worker].close.remote(self.key)  # not waited for: a dead worker holds nothing


@contextmanager
def remote_environments(cluster: Any, *, sandbox: SandboxConfig | None = None) -> Iterator[EnvWorkerPool | None]:
    """With env workers on ``cluster`` (``distributed.roles.env_workers`` > 0): start them and make every
    environment this process builds through `k3post.rollout.evaluation.make_env` a `RemoteEnvironment` on
    them, until the block ends (then they are killed). Without: nothing changes (yields None)."""
    from k3post.rollout.evaluation import env_placement

    if cluster.size("env_workers") == 0:
        yield None
        return
    pool = EnvWorkerPool.start(cluster, sandbox=sandbox)
    cluster.env_pool = pool
    try:
        with env_placement(pool.environment):
            yield pool
    finally:
        cluster.env_pool = None
        try:  # every process's episodes (this one's, and Ray tasks' such as expert jobs), by worker
            served: Any = [i["calls"] for i in ray.get([a.info.remote() for a in pool.actors], timeout=30)]
        except (RayActorError, ray.exceptions.GetTimeoutError):
            served = "unknown (a worker is not answering)"
        log.info("env workers: %s here; calls served per worker since its last start: %s", pool.stats, served)
        pool.close()
