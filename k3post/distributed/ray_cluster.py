"""Ray orchestration (``distributed.enabled = true``; the ``k3post[distributed]`` extra): one placement group
of bundles, role groups placed on it, and the actors the stages use through their usual seams.

    with RayCluster(cfg.distributed) as cluster:              ray.init + one placement group (`plan_placement`)
        on_ranks(fsdp, fn, cfg, followers=lambda: RayFollowers(cluster))   trainer ranks > 0 as `TrainerRankActor` s
        train_experts(sft, rl, out, cluster=cluster)          the nine (domain, effort) jobs as chained Ray tasks
        pool = RayTeacherPool(cluster, experts)               MOPD teachers, each on a bundle of its own
        urls = cluster.engine_servers(model_dir)              engine servers: `Rollout` talks to them over http
        judges = cluster.engine_servers(judge_dir, role="judges")   GRM judges: frozen engine servers, scored over http
        remote_environments(cluster)                          env workers (`k3post.distributed.env_workers`)

The CLI opens one `RayCluster` for a command (`k3post sft|rl|experts|mopd ... distributed.enabled=true`); the
stage code finds it with `cluster_for`, so every role of the command is in the one placement group.

**Role groups** (`k3post.config.distributed.RolesConfig`): trainers, engines, env_workers, teachers, judges.
``layout = colocated``: trainer rank i and engine i share bundle i (the weights stay on the node); the other
roles have bundles of their own. ``disaggregated``: every member has a bundle of its own. A bundle has
``cpus_per_bundle`` CPUs, split evenly between the members sharing it.

**The stage loops do not change.** Trainer rank r > 0 is a `TrainerRankActor` on trainer slot r running
`k3post.trainer.ranks.serve_rank` (the same follower loop as a local rank process); rank 0 is the driver,
which runs the stage and hands it the sharded trainer (`k3post.trainer.build_trainer`). An engine server is an
`EngineServerActor` running the ``k3post serve`` engine API on a port of its node; the stage's `Rollout` is an
``engine.kind = http`` client of its URL (`engine_config`). Teachers answer `TeacherPool.score` calls
(`RayTeacherPool` is a `TeacherPool` for `k3post.stages.mopd.opd_signal`). Expert jobs call
`k3post.recipes.experts.train_domain_experts` in a Ray worker. Environments run in `EnvWorkerActor` s behind
`k3post.rollout.evaluation.make_env`. A GRM judge (``rl.judge`` a model folder, ``distributed.roles.judges`` > 0)
is the same `EngineServerActor`, frozen (it refuses weight updates), on a judges bundle; every GRM scorer of
the command is an `EngineJudge` over the ``http`` engine of those servers (`k3post.rewards.judge.build_group_scorer`).

**Faults.** A killed engine-server actor is restarted by Ray (``engine_max_restarts``) on the same port with
the weights it last loaded (each loaded version is kept in the actor's state folder; a judge's are its
checkpoint's); the `HTTPEngine`
client retries the calls that failed meanwhile, resubmitting each in-flight request from its last known
continuation, so counter-based sampling draws the tokens it would have drawn (none lost, none twice).
An expert job whose worker dies is retried ``task_retries`` times and resumes from its checkpoints. A
trainer-rank actor is not restarted by Ray: rank 0 notices the death at its next collective and restarts the
whole rank group, the stage resuming from its last checkpoint (``distributed.fsdp.max_restarts``,
`k3post.trainer.ranks.on_ranks`). A killed environment worker: `k3post.distributed.env_workers`.

Shape legend: none (no tensors here).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3post.config.distributed import ROLES, DistributedConfig, FSDPConfig
from k3post.config.rollout import EngineConfig

__all__ = ["Placement", "plan_placement", "cluster_for", "RayCluster", "RayFollowers", "TrainerRankActor",
           "EngineServerActor", "TeacherActor", "RayTeacherPool"]

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding k3post/: Ray workers import this tree


@dataclass(frozen=True)
class Placement:
    """The placement group's bundles and, per role, each member's (bundle index, CPUs)."""

    bundles: list[dict[str, float]]
    slots: dict[str, list[tuple[int, float]]]

    @property
    def cpus(self) -> float:
        return sum(b["CPU"] for b in self.bundles)


def plan_placement(cfg: DistributedConfig) -> Placement:
    """Bundles and role slots of ``cfg`` (module doc):

        colocated:      n = max(trainers, engines) shared bundles, trainer i and engine i on bundle i;
                        then env_workers, teachers, judges, one bundle each
        disaggregated:  one bundle per member of every role, in the order of `ROLES`
    Each member gets ``cpus_per_bundle / (members on its bundle)`` CPUs."""
    size = {r: getattr(cfg.roles, r) for r in ROLES}
    members: list[list[tuple[str, int]]] = []  # per bundle: (role, member index)
    own = list(ROLES)
    if cfg.layout == "colocated":
        shared = max(size["trainers"], size["engines"])
        members = [[(r, i) for r in ("trainers", "engines") if i < size[r]] for i in range(shared)]
        own = [r for r in ROLES if r not in ("trainers", "engines")]
    for r in own:
        members += [[(r, i)] for i in range(size[r])]
    slots: dict[str, list[tuple[int, float]]] = {r: [(-1, 0.0)] * size[r] for r in ROLES}
    for b, occupants in enumerate(members):
        for r, i in occupants:
            slots[r][i] = (b, cfg.cpus_per_bundle / len(occupants))
    return Placement([{"CPU": float(cfg.cpus_per_bundle)} for _ in members], slots)


def _init_kwargs(cfg: DistributedConfig, api_key: str) -> dict[str, Any]:
    """`ray.init` arguments: the workers import the same k3post tree as this process (PYTHONPATH) and hold the
    engine servers' API key (``K3POST_API_KEY``, which `k3post.rollout.http_engine.HTTPEngine` sends)."""
    path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    kw: dict[str, Any] = {"runtime_env": {"env_vars": {"PYTHONPATH": path, "K3POST_API_KEY": api_key}},
                          "include_dashboard": False, "logging_level": logging.WARNING}
    if cfg.address == "local":
        if cfg.num_cpus:
            kw["num_cpus"] = cfg.num_cpus
    else:
        kw["address"] = cfg.address
    return kw


_ACTIVE: list[RayCluster] = []  # the clusters open as context managers in this process, innermost last


@contextmanager
def cluster_for(cfg: DistributedConfig) -> Iterator[RayCluster]:
    """The run's cluster: the one this process has open as a context manager (the CLI opens it before the
    trainer ranks start, so the stage places its actors in the same placement group), else a new one of
    ``cfg``, closed at the end."""
    if _ACTIVE:
        yield _ACTIVE[-1]
        return
    with RayCluster(cfg) as cluster:
        yield cluster


class RayCluster:
    """A connection to Ray and the run's placement group (module doc); a context manager.

    Joins the Ray session already open in this process, if any (it is then left open on `close`), else
    starts one per ``cfg.address``. ``startup_s``: seconds from the constructor's start until the placement
    group was ready (Ray start-up overhead). ValueError when the group needs more CPUs than the cluster has."""

    def __init__(self, cfg: DistributedConfig, *, ready_timeout_s: float = 120.0) -> None:
        t0 = time.perf_counter()
        self.cfg = cfg
        self.placement = plan_placement(cfg)
        self.owns_ray = not ray.is_initialized()
        # the engine servers bind the node's address: they require this key, which the driver, the workers and
        # so every `HTTPEngine` of the run send (K3POST_API_KEY; the user's own when set)
        self.api_key = os.environ.get("K3POST_API_KEY") or secrets.token_urlsafe(32)
        self._set_key = "K3POST_API_KEY" not in os.environ
        os.environ["K3POST_API_KEY"] = self.api_key
        if self.owns_ray:
            ray.init(**_init_kwargs(cfg, self.api_key))
        job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
        # a session whose workers lack the key (started elsewhere): each task / actor gets it
        self._key_env = ({} if job_env.get("K3POST_API_KEY") == self.api_key
                         else {"runtime_env": {"env_vars": {"K3POST_API_KEY": self.api_key}}})
        have = float(ray.cluster_resources().get("CPU", 0.0))
        if self.placement.cpus > have + 1e-9:
            self.close()
            raise ValueError(f"distributed: the placement group needs {self.placement.cpus:g} CPUs "
                             f"({len(self.placement.bundles)} bundles x distributed.cpus_per_bundle "
                             f"{cfg.cpus_per_bundle:g}), the cluster has {have:g}")
        self.pg = placement_group(self.placement.bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0
        self._actors: list[Any] = []
        self.env_pool: Any = None  # the env workers' pool while `remote_environments` runs
        log.info("ray: %d bundles (%s layout, %g CPUs) ready in %.1f s", len(self.placement.bundles), cfg.layout,
                 self.placement.cpus, self.startup_s)

    def size(self, role: str) -> int:
        return len(self.placement.slots[role])

    def options(self, role: str, member: int) -> dict[str, Any]:
        """``.options(...)`` placing a task or actor on member ``member`` (modulo the group size) of ``role``."""
        slots = self.placement.slots[role]
        if not slots:
            raise ValueError(f"distributed.roles.{role} is 0: nothing can be placed in that role")
        bundle, cpus = slots[member % len(slots)]
        out: dict[str, Any] = {"num_cpus": cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle)}
        out.update(self._key_env)
        return out

    def run_chains(self, fn: Callable[..., Any], chains: Sequence[Sequence[tuple[Any, ...]]]) -> list[Any]:
        """Chain c runs ``fn(*args, prev)`` for each ``args`` of ``chains[c]`` in order (``prev``: the previous
        call's result, None first) as Ray tasks on trainer slot c; the chains run in parallel; with env workers
        started (`k3post.distributed.env_workers.remote_environments`) the tasks' environments run on them.
        Returns each chain's last result."""
        task = ray.remote(_with_envs)
        last = []
        for c, chain in enumerate(chains):
            prev: Any = None
            for args in chain:  # an ObjectRef argument is resolved first: the chain's order
                prev = task.options(**self.options("trainers", c), max_retries=self.cfg.task_retries).remote(
                    self.env_pool, fn, *args, prev)
            last.append(prev)
        return ray.get(last)

    def engine_servers(self, model_dir: str | Path, state_root: str | Path, *, role: str = "engines",
                       n: int | None = None, **server: Any) -> list[Any]:
        """``n`` (default: the role's size) `EngineServerActor` s for ``model_dir`` on the slots of ``role``,
        restarted up to ``engine_max_restarts`` times; ``state_root/<member>-<i>`` (``engine-0``, ``judge-0``)
        keeps each one's port (and weights). ``role``: "engines" serve the policy (they take its weight
        pushes); any other role ("judges") serves a frozen model: its servers refuse weight updates.
        ``server``: `EngineServerActor` settings. Returns the actor handles (`urls` gives the URLs)."""
        n = self.size(role) if n is None else n
        member = role.removesuffix("s")
        actors = [EngineServerActor.options(**self.options(role, i), max_restarts=self.cfg.engine_max_restarts,
                                            max_task_retries=-1)
                  .remote(str(model_dir), str(Path(state_root) / f"{member}-{i}"), frozen=role != "engines",
                          api_key=self.api_key, **server)
                  for i in range(n)]
        self._actors += actors
        return actors

    def close(self) -> None:
        """Kill the actors started here, remove the placement group, shut Ray down if this object started it."""
        for a in getattr(self, "_actors", []):
            ray.kill(a, no_restart=True)
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        if getattr(self, "_set_key", False) and os.environ.get("K3POST_API_KEY") == self.api_key:
            del os.environ["K3POST_API_KEY"]
            self._set_key = False

    def kill(self, actors: Sequence[Any]) -> None:
        """Kill ``actors`` (started here) for good, before the cluster closes."""
        for a in actors:
            ray.kill(a, no_restart=True)
        self._actors = [a for a in self._actors if all(a is not b for b in actors)]

    def __enter__(self) -> RayCluster:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self.close()


def _with_envs(env_pool: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a Ray task, its environments on ``env_pool``'s workers when there is one."""
    if env_pool is None:
        return fn(*args)
    from k3post.rollout.evaluation import env_placement

    with env_placement(env_pool.environment):
        return fn(*args)


def urls(actors: Sequence[Any]) -> list[str]:
    """The base URLs of engine-server actors."""
    return ray.get([a.url.remote() for a in actors])


def engine_config(actors: Sequence[Any], base: EngineConfig | None = None, *, restart_s: float = 30.0) -> EngineConfig:
    """``base`` as an http client of ``actors``' servers, with enough retries (backoff 0.5 s doubling to 4 s)
    to outlast ``restart_s`` seconds of an actor's restart."""
    base = base if base is not None else EngineConfig()
    retries, waited, backoff = 0, 0.0, 0.5
    while waited < restart_s:
        waited += min(backoff * 2**retries, 8 * backoff)
        retries += 1
    return replace(base, kind="http", urls=urls(actors), retries=max(base.retries, retries), backoff_s=backoff,
                   launch=0)


# --------------------------------------------------------------------------- trainer ranks


@ray.remote(num_cpus=0, max_restarts=0)
class TrainerRankActor:
    """Trainer rank r > 0 of a command on Ray: `k3post.trainer.ranks.serve_rank` in an actor on trainer
    slot r (it joins rank 0's process group and follows its trainer until ``stop``). Not restarted by Ray:
    rank 0 restarts the whole group (`k3post.trainer.ranks.on_ranks`)."""

    def serve(self, rank: int, world: int, init_method: str, fsdp: FSDPConfig, threads: int) -> None:
        from k3post.trainer.ranks import serve_rank

        serve_rank(rank, world, init_method, fsdp, threads)

    def pid(self) -> int:
        return os.getpid()


class RayFollowers:
    """`k3post.trainer.ranks.Followers` as `TrainerRankActor` s: rank r on the cluster's trainer slot r
    (slot 0 is rank 0's: the driver). Rank 0 listens on this node's IP."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster = cluster
        self.host = ray.util.get_node_ip_address()
        self.actors: list[Any] = []
        self.refs: list[Any] = []

    def start(self, world: int, init_method: str, fsdp: FSDPConfig, threads: int) -> None:
        have = self.cluster.size("trainers")
        if have < world:
            raise ValueError(f"distributed.fsdp.ranks={world} needs a trainer slot per rank, but "
                             f"distributed.roles.trainers is {have}")
        self.actors = [TrainerRankActor.options(**self.cluster.options("trainers", r)).remote() for r in range(1, world)]
        self.refs = [a.serve.remote(r, world, init_method, fsdp, threads) for r, a in enumerate(self.actors, 1)]

    def lost(self, wait_s: float) -> list[str]:
        """The ranks whose actor died (its ``serve`` call ended in an error), waiting up to ``wait_s``."""
        ready, _ = ray.wait(self.refs, num_returns=1, timeout=wait_s)
        dead = []
        for r, ref in enumerate(self.refs, 1):
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                    dead.append(f"rank {r} (its actor returned before the command ended)")
                except Exception as e:  # noqa: BLE001 - which error says how it died
                    dead.append(f"rank {r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return dead

    def join(self) -> None:
        ray.get(self.refs)
        self.terminate()

    def terminate(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


# --------------------------------------------------------------------------- engine servers


def _port_in(state: Path, host: str) -> int:
    """The port this server used before (a restart binds it again), else a free one, recorded."""
    f = state / "port"
    if f.is_file():
        return int(f.read_text())
    with socket.socket() as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    f.write_text(str(port))
    return port


def _keep_loaded_weights(engine: Any, state: Path) -> None:
    """Restore the newest weight version kept in ``state/weights`` into ``engine`` (a restart), then keep
    every version the engine loads from now on there (one version: ``DiskSync(keep=1)``)."""
    from k3post.distributed.weight_sync import DiskSync, apply_weights, engine_qat, latest_on_disk, load_from_disk, named_weights

    root = state / "weights"
    latest = latest_on_disk(root) if root.is_dir() else None
    if latest is not None:
        manifest, items = load_from_disk(latest)
        apply_weights(engine, items, manifest.version, qat=manifest.qat)
        log.warning("engine server restarted: weights of version %d restored from %s", manifest.version, latest)
    sync = DiskSync(root, shard_mb=512, qat=engine_qat(engine), keep=1)
    update = engine.update_weights

    def update_and_keep(named: Any, version: int | None = None) -> int:
        new = int(update(named, version=version))
        sync.push(named_weights(engine.model), new)
        return new
    engine.update_weights = update_and_keep


def _refuse_weights(engine: Any) -> None:
    """Make ``engine`` (a frozen model's: a GRM judge) refuse every weight update: the engine API's weight
    routes (disk and broadcast alike load through ``update_weights``) answer 400 and it keeps its weights."""

    def refuse(named: Any, version: int | None = None) -> int:
        raise ValueError("this engine server holds a frozen model (a GRM judge): it takes no weight updates")
    engine.update_weights = refuse


@ray.remote(num_cpus=0)
class EngineServerActor:
    """One ``k3post serve`` engine server (the engine API of `k3post.serve.engine_api`) inside a Ray actor,
    on a port of its node (module doc: restarts keep the port and the weights). ``frozen``: it serves a model
    that is not trained (a GRM judge): weight updates are refused, a restart reloads ``model_dir``. ``api_key``:
    required, since the node's address is reachable from other machines (`RayCluster.engine_servers` passes
    the run's key, which its clients send)."""

    def __init__(self, model_dir: str, state_dir: str, *, max_batch_size: int = 32, max_model_len: int | None = None,
                 qat: bool = False, seed: int = 0, threads: int = 1, ready_timeout_s: float = 120.0,
                 frozen: bool = False, api_key: str | None = None) -> None:
        import torch
        import uvicorn

        from k3post.serve.cli import build_server

        torch.set_num_threads(threads)
        state = Path(state_dir)
        state.mkdir(parents=True, exist_ok=True)
        self.restarts = sum(1 for _ in state.glob("start-*"))
        (state / f"start-{self.restarts}").write_text(str(os.getpid()))
        host = ray.util.get_node_ip_address()
        port = _port_in(state, host)
        from k3post.serve.cli import check_exposure

        check_exposure(host, api_key, False)  # the node's address: never without a key
        app = build_server(model_dir, max_batch_size=max_batch_size, max_model_len=max_model_len, qat=qat, seed=seed,
                           torch_threads=threads, api_key=api_key)
        self.engine = app.state.server.runner.engine
        self.frozen = frozen
        if frozen:
            _refuse_weights(self.engine)
        else:
            _keep_loaded_weights(self.engine, state)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True, name="engine-server").start()
        deadline = time.monotonic() + ready_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine server on {host}:{port} did not start within {ready_timeout_s} s")
            time.sleep(0.05)
        self._url = f"http://{host}:{port}"

    def url(self) -> str:
        return self._url

    def info(self) -> dict[str, Any]:
        """pid, restarts so far (0 on the first start), the engine's weight version, whether it is frozen, and
        the id of the placement group it runs in (Ray's runtime context)."""
        return {"pid": os.getpid(), "restarts": self.restarts, "version": int(self.engine.version), "url": self._url,
                "frozen": self.frozen, "placement_group": ray.get_runtime_context().get_placement_group_id()}


# --------------------------------------------------------------------------- MOPD teachers


@ray.remote(num_cpus=0)
class TeacherActor:
    """A `k3post.rollout.teachers.TeacherPool` of some experts in a Ray actor: log-prob scoring on its own bundle."""

    def __init__(self, experts: dict[str, str], **pool: Any) -> None:
        import torch

        from k3post.rollout.teachers import TeacherPool

        torch.set_num_threads(1)
        self.pool = TeacherPool(experts, **pool)

    def score(self, expert: str, ids: list[list[int]], positions: list[list[int]]) -> list[list[float]]:
        return self.pool.score(expert, ids, positions)

    def stats(self) -> dict[str, int]:
        return dict(self.pool.stats)


class RayTeacherPool:
    """The `k3post.rollout.teachers.TeacherPool` interface over `TeacherActor` s: the experts (sorted by name) are
    dealt round-robin over the ``teachers`` slots, one actor per slot used, each with ``max_resident``
    of its experts in memory. `score_all` asks every actor at once. `model` loads an expert in this
    process (the evaluation samples it here). ``stats`` sums the actors' counters and this process's."""

    def __init__(self, cluster: RayCluster, experts: Mapping[str, str], *, max_resident: int = 3,
                 dtype: str = "float32", qat: Any = None, batch_tokens: int = 8192) -> None:
        from k3post.rollout.teachers import TeacherPool

        n = cluster.size("teachers")
        if n == 0:
            raise ValueError("distributed.roles.teachers is 0: MOPD on Ray places each teacher on a teachers bundle")
        names = sorted(experts)
        kw = {"max_resident": max_resident, "dtype": dtype, "qat": qat, "batch_tokens": batch_tokens}
        self._local = TeacherPool(experts, **{**kw, "max_resident": 1})  # checks every spec here, first
        self.experts = dict(experts)
        groups = [{e: experts[e] for e in names[i::n]} for i in range(min(n, len(names)))]
        self._actors = [TeacherActor.options(**cluster.options("teachers", i)).remote(g, **kw) for i, g in enumerate(groups)]
        self._owner = {e: a for g, a in zip(groups, self._actors) for e in g}

    @property
    def names(self) -> list[str]:
        return sorted(self.experts)

    @property
    def stats(self) -> dict[str, int]:
        out = dict(self._local.stats)
        for s in ray.get([a.stats.remote() for a in self._actors]):
            for k, v in s.items():
                out[k] = out.get(k, 0) + v
        return out

    def _owner_of(self, expert: str) -> Any:
        if expert not in self._owner:
            raise ValueError(f"no teacher for expert {expert!r}; configured: {self.names}")
        return self._owner[expert]

    def score(self, expert: str, ids: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[list[float]]:
        return ray.get(self._owner_of(expert).score.remote(expert, [list(s) for s in ids], [list(p) for p in positions]))

    def score_all(self, jobs: Mapping[str, tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]]) -> dict[str, list[list[float]]]:
        refs = {e: self._owner_of(e).score.remote(e, [list(s) for s in ids], [list(p) for p in pos])
                for e, (ids, pos) in jobs.items()}
        return dict(zip(refs, ray.get(list(refs.values()))))

    def model(self, expert: str) -> Any:
        return self._local.model(expert)

    def close(self) -> None:
        self._local.close()
        for a in self._actors:
            ray.kill(a, no_restart=True)
        self._actors = []
