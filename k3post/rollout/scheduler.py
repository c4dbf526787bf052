"""Partial rollout (SPEC §3.2): N prompts x K samples per iteration, stop at a fraction λ,
pause the rest, resume them first next time (issue 6 part 3).

One `PartialRolloutScheduler.run_iteration`:

1. **Resume first.** Paused trajectories go first, oldest first (by group id, then sample
   index). Their KV cache comes back from the engine (still resident: ``engine.resume``),
   else from the CPU `KVPool` (prefetched into the engine with the continuation request),
   else the context is re-prefilled (a miss; the same tokens, see below).
2. **Admission.** New prompts fill the active workload up to N·K trajectories, K samples
   per prompt: ``floor((N·K - paused) / K)`` prompts, from the prompt queue. **Staleness
   control**: no new prompt is admitted while the oldest sampled token of a paused
   trajectory is more than ``max_staleness`` versions behind ``engine.version``; then the
   iteration only resumes (paused trajectories are never dropped).
3. **Generate** with the `AgentLoop` (multi-turn episodes, env steps inline) until
   ``ceil(λ·N·K)`` trajectories have completed in this iteration (or nothing is left).
4. **Dispatch**: a group (the K samples of a prompt) is handed to training as soon as its K
   samples are all done, never before (the group baseline is always defined);
   ``on_group`` sees it at once, and ``run_iteration`` returns the groups of the iteration in
   completion order.
5. **Pause** the rest: in-engine requests are paused (tokens, log-probs, versions are kept
   in the `Trajectory`, the env's ``state_dict`` with its sandbox snapshot too); their KV
   stays engine-resident up to ``resident_kv_bytes`` and the least recently paused beyond
   that are evicted into the `KVPool` (write-back: the pool is written only on eviction;
   `offload_kv` evicts all, e.g. before a co-located train step). An engine with
   ``kv_transfer = False`` (`HTTPEngine`: servers over HTTP) keeps its paused requests'
   tokens only: they stay paused there (no byte budget, no ``export_kv``) and ``resume``
   re-prefills them on any server.

**Exactness.** Counter-based sampling makes every token a function of (trajectory seed,
turn, position, logits), and the engine's logits do not depend on batching, so a
trajectory's tokens are the same whatever the scheduling, pausing, KV hit or miss, as long
as the weights are the same. With ``λ = 1`` every admitted trajectory completes in its
iteration and the batches equal the synchronous ones (`AgentLoop.run`) for the same seed.
When the weights changed while a trajectory was paused, a KV hit continues from the KV
computed with the old weights (as a running request does in vLLM / SGLang and in
``EmbeddedEngine`` across ``update_weights``) and a miss re-prefills with the new weights;
``reuse_stale_kv=False`` discards stale KV so that both paths give the same tokens.
A new turn of a multi-turn episode starts from the KV the engine kept when the previous
turn stopped (`AgentLoop.turn_kv`, counted in ``kv_turn_hits``), prefilling only the env
tail; when the trajectory is paused before its next turn is submitted, that KV (already on CPU)
moves into the `KVPool` (``kv_turn_pooled``) and the resume prefetches it like any paused KV.

**Auto-throttling.** The number of trajectories handed to the engine at once (running +
queued there), C, adapts before every engine step:

    u = engine.kv_utilization()
    u > kv_high                                        -> C = max(c_min, floor(0.75 C))
    u < kv_low, backlog waiting, engine queue empty    -> C = min(c_max, C + max(1, C // 4))

with c_min = ``min_concurrency`` (default: the engine's slots), c_max =
``max_concurrency`` (default N·K), C starting at 2 x slots clamped to [c_min, c_max].
Multiplicative decrease under KV pressure, additive increase when the engine would idle.

**Persistence.** `state_dict` holds the paused and finished-but-undispatched trajectories,
the prompt queue, the group counter and the statistics (JSON); `save` writes it atomically
(temporary file + ``os.replace``) and `load` restores it into a scheduler over a fresh
engine, so a killed run resumes every trajectory (their KV is not saved: re-prefill).
Save right after the train step that consumed the dispatched groups (with the model
checkpoint): dispatched groups are then trained, the rest is in the state.

Shape legend: none (token lists only).
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3post.config.rollout import RolloutConfig
from k3post.envs.task import Task
from k3post.io import atomic_write
from k3post.rollout.agent_loop import AgentLoop, trajectory_seed
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.trajectory import Group, Trajectory

__all__ = ["PartialRolloutScheduler", "SCHEDULER_STATE_VERSION"]

SCHEDULER_STATE_VERSION = 1


@dataclass
class _Resident:
    """A paused request whose KV the engine still holds."""

    request_id: str
    nbytes: int
    version: int  # engine version at pause time
    has_kv: bool


def _kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K and V of one position over all layers (2 * layers * kv_heads * head_dim * itemsize)."""
    cache = getattr(engine, "cache", None)
    if cache is not None and all(hasattr(cache, a) for a in ("num_layers", "num_kv_heads", "head_dim", "dtype")):
        itemsize = int(getattr(cache.dtype, "itemsize", 4))
        return 2 * int(cache.num_layers) * int(cache.num_kv_heads) * int(cache.head_dim) * itemsize
    cfg = engine.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4


class PartialRolloutScheduler:
    """Partial rollout over an `AgentLoop` (its engine, XTML and env factory).

    Args:
        loop: the agent loop (engine + envs).
        n_prompts: N, prompts per iteration.
        k: K, samples per prompt.
        lambda_: λ in (0, 1], the fraction of N·K completions that ends an iteration.
        max_staleness: admission bound in policy versions (>= 0).
        seed: run seed; sample j of group g samples with ``trajectory_seed(seed, g, j)``.
        kv_pool: the CPU KV pool (None: evicted KV is dropped, resumes re-prefill).
        resident_kv_bytes: most bytes of paused KV left inside the engine (0: every pause
            evicts at once into the pool).
        reuse_stale_kv: resume from KV computed with older weights (see the module doc).
        min_concurrency / max_concurrency: bounds of the auto-throttle (module doc).
        kv_high / kv_low: KV-utilisation thresholds of the auto-throttle.
    """

    def __init__(
        self,
        loop: AgentLoop,
        *,
        n_prompts: int,
        k: int,
        lambda_: float = RolloutConfig.lambda_,
        max_staleness: int = RolloutConfig.max_staleness,
        seed: int = 0,
        kv_pool: KVPool | None = None,
        resident_kv_bytes: int = 0,
        reuse_stale_kv: bool = True,
        min_concurrency: int | None = None,
        max_concurrency: int | None = None,
        kv_high: float = 0.9,
        kv_low: float = 0.6,
    ) -> None:
        if not isinstance(loop, AgentLoop):
            raise ValueError(f"loop must be an AgentLoop, got {type(loop).__name__}")
        for name, v in (("n_prompts", n_prompts), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(lambda_, bool) or not isinstance(lambda_, (int, float)) or not 0.0 < lambda_ <= 1.0:
            raise ValueError(f"lambda_ must be in (0, 1], got {lambda_!r}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if kv_pool is not None and not isinstance(kv_pool, KVPool):
            raise ValueError(f"kv_pool must be a KVPool or None, got {type(kv_pool).__name__}")
        if isinstance(resident_kv_bytes, bool) or not isinstance(resident_kv_bytes, int) or resident_kv_bytes < 0:
            raise ValueError(f"resident_kv_bytes must be an int >= 0, got {resident_kv_bytes!r}")
        if not 0.0 <= kv_low <= kv_high <= 1.0:
            raise ValueError(f"need 0 <= kv_low <= kv_high <= 1, got kv_low={kv_low}, kv_high={kv_high}")
        self.loop = loop
        self.engine = loop.engine
        self.n_prompts, self.k = n_prompts, k
        self.lambda_ = float(lambda_)
        self.max_staleness = max_staleness
        self.seed = int(seed)
        self.kv_pool = kv_pool
        self.resident_kv_bytes = resident_kv_bytes
        self.reuse_stale_kv = bool(reuse_stale_kv)
        slots = int(getattr(self.engine, "max_batch_size", 1))
        workload = n_prompts * k
        self.max_concurrency = max_concurrency if max_concurrency is not None else workload
        self.min_concurrency = min_concurrency if min_concurrency is not None else min(slots, self.max_concurrency)
        if not 1 <= self.min_concurrency <= self.max_concurrency:
            raise ValueError(
                f"need 1 <= min_concurrency <= max_concurrency, got {self.min_concurrency} and {self.max_concurrency}"
            )
        self.kv_high, self.kv_low = float(kv_high), float(kv_low)
        self.concurrency = max(self.min_concurrency, min(self.max_concurrency, 2 * slots))
        # engines that cannot hand out KV (``kv_transfer = False``, e.g. `HTTPEngine`): a paused
        # request keeps only its tokens there; resume re-prefills, no resident-KV budget, no export_kv
        self.kv_transfer = bool(getattr(self.engine, "kv_transfer", True))
        self._bytes_per_token = _kv_bytes_per_token(self.engine) if self.kv_transfer else 0
        self._prompts: deque[Task] = deque()
        self._groups: dict[int, list[Trajectory]] = {}  # admitted, not yet dispatched
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # traj id -> engine-held paused KV (LRU)
        self._kv_expected: set[str] = set()  # paused trajectories that held KV when paused
        self._submitted: dict[str, tuple[int, bool]] = {}  # request id -> (given tokens, came with KV)
        self._next_group = 0
        self.iteration = 0
        self.staleness_hist: Counter[int] = Counter()
        self.stats: dict[str, int] = {
            "admitted_groups": 0, "dispatched_groups": 0, "completed": 0, "pauses": 0,
            "kv_resumes": 0, "kv_resident_hits": 0, "kv_pool_hits": 0, "kv_misses": 0, "kv_stale_dropped": 0,
            "kv_writebacks": 0, "kv_turn_hits": 0, "kv_turn_pooled": 0, "admission_blocked": 0, "throttle_down": 0, "throttle_up": 0,
        }

    # ------------------------------------------------------------------ prompts and views
    def add_prompts(self, tasks: Iterable[Task]) -> None:
        """Queue prompts (tasks) for admission, in order."""
        for t in tasks:
            if not isinstance(t, Task):
                raise ValueError(f"prompts must be Task objects, got {type(t).__name__}")
            self._prompts.append(t)

    @property
    def num_pending_prompts(self) -> int:
        """Prompts queued, not yet admitted."""
        return len(self._prompts)

    def trajectories(self) -> list[Trajectory]:
        """Every admitted, not yet dispatched trajectory (paused, running or done), by (group, sample)."""
        return [t for gid in sorted(self._groups) for t in self._groups[gid]]

    def paused(self) -> list[Trajectory]:
        """Paused trajectories in resume order (oldest first)."""
        return [t for t in self.trajectories() if t.status == "paused"]

    def oldest_paused_version(self) -> int | None:
        """Smallest policy version of any sampled token of a paused trajectory."""
        vs = [v for t in self.paused() if (v := t.oldest_version()) is not None]
        return min(vs) if vs else None

    def admission_blocked(self) -> bool:
        """True when staleness control stops new prompts (SPEC §3.2 step 4)."""
        oldest = self.oldest_paused_version()
        return oldest is not None and self.engine.version - oldest > self.max_staleness

    def kv_hit_rate(self) -> float:
        """(resident + pool hits) / resumes of trajectories that held KV when paused."""
        n = self.stats["kv_resumes"]
        return (self.stats["kv_resident_hits"] + self.stats["kv_pool_hits"]) / n if n else 0.0

    # ------------------------------------------------------------------ one iteration
    def run_iteration(
        self, prompts: Sequence[Task] | None = None, *, on_group: Callable[[Group], None] | None = None
    ) -> list[Group]:
        """Run one partial-rollout iteration (module doc); returns the groups completed in it."""
        if prompts is not None:
            self.add_prompts(prompts)
        if self.engine.has_unfinished():
            raise ValueError("run_iteration needs an engine with no queued or running requests")
        self.iteration += 1
        n_total = self.n_prompts * self.k
        target = max(1, math.ceil(self.lambda_ * n_total - 1e-9))
        ready: deque[Trajectory] = deque(self.paused())
        if self.admission_blocked():
            self.stats["admission_blocked"] += 1
        else:
            n_new = min(len(self._prompts), max(0, n_total - len(ready)) // self.k)
            for _ in range(n_new):
                ready.extend(self._admit(self._prompts.popleft()))
        dispatched: list[Group] = []
        live: dict[str, Trajectory] = {}
        completed = 0

        def done(traj: Trajectory) -> None:
            nonlocal completed
            completed += 1
            self.stats["completed"] += 1
            group = self._groups[traj.group_id]
            if all(t.done for t in group):
                g = self._dispatch(traj.group_id)
                dispatched.append(g)
                if on_group is not None:
                    on_group(g)

        while (ready or live) and completed < target:
            self._throttle(len(ready))
            while ready and len(live) < self.concurrency:
                traj = ready.popleft()
                if not self._submit(traj, live):
                    done(traj)
            if not live:
                continue
            for res in self.engine.step():
                traj = live.pop(res.request_id)
                self._submitted.pop(res.request_id, None)
                if self.loop.finish_turn(traj, res):
                    done(traj)
                else:
                    ready.appendleft(traj)  # its next turn goes first
        self._pause_rest(live, ready)
        return dispatched

    def _admit(self, task: Task) -> list[Trajectory]:
        gid = self._next_group
        self._next_group += 1
        group = []
        for j in range(self.k):
            traj = Trajectory(
                traj_id=f"g{gid}/s{j}", group_id=gid, sample_index=j,
                seed=trajectory_seed(self.seed, gid, j), task=task.to_dict(), admitted_version=self.engine.version,
            )
            self.loop.start(traj)
            group.append(traj)
        self._groups[gid] = group
        self.stats["admitted_groups"] += 1
        return group

    def _dispatch(self, gid: int) -> Group:
        trajs = self._groups.pop(gid)
        g = Group(gid, dict(trajs[0].task), trajs, dispatched_version=self.engine.version)
        self.staleness_hist.update(g.staleness())
        self.stats["dispatched_groups"] += 1
        return g

    def _throttle(self, backlog: int) -> None:
        util_fn = getattr(self.engine, "kv_utilization", None)
        util = float(util_fn()) if callable(util_fn) else 0.0
        queued = int(getattr(self.engine, "num_queued", 0))
        if util > self.kv_high and self.concurrency > self.min_concurrency:
            self.concurrency = max(self.min_concurrency, int(self.concurrency * 0.75))
            self.stats["throttle_down"] += 1
        elif util < self.kv_low and backlog > 0 and queued == 0 and self.concurrency < self.max_concurrency:
            self.concurrency = min(self.max_concurrency, self.concurrency + max(1, self.concurrency // 4))
            self.stats["throttle_up"] += 1

    def _submit(self, traj: Trajectory, live: dict[str, Trajectory]) -> bool:
        """Hand the trajectory's current turn to the engine (resident KV, pooled KV or a
        prefill). False when it cannot continue (context full: it is now done)."""
        was_paused = traj.status == "paused"
        req = self.loop.make_request(traj)
        if req is None:
            self._forget_kv(traj.traj_id)
            return False
        tid = traj.traj_id
        traj.status = "running"
        expected = tid in self._kv_expected
        self._kv_expected.discard(tid)
        if was_paused and expected:
            self.stats["kv_resumes"] += 1
        version = self.engine.version
        res = self._resident.pop(tid, None)
        if res is not None:
            assert res.request_id == req.request_id, (res.request_id, req.request_id)
            if self.reuse_stale_kv or res.version == version or not self.kv_transfer:
                self.engine.resume([res.request_id])
                if res.has_kv:
                    self.stats["kv_resident_hits"] += 1
                self._submitted[req.request_id] = (len(req.given_ids), res.has_kv)
                live[req.request_id] = traj
                return True
            self.engine.abort([res.request_id])
            self.stats["kv_stale_dropped"] += 1
            self.stats["kv_misses"] += 1
            self.engine.add_request(req)
            self._submitted[req.request_id] = (len(req.given_ids), False)
            live[req.request_id] = traj
            return True
        kv = None
        if was_paused and expected:
            kv = self.kv_pool.take(tid) if self.kv_pool is not None else None
            if kv is not None and not self.reuse_stale_kv and kv.oldest_version != version:
                kv = None
                self.stats["kv_stale_dropped"] += 1
            self.stats["kv_pool_hits" if kv is not None else "kv_misses"] += 1
        else:  # a new turn: the KV of the trajectory's previous turn, when the engine kept it
            kv = self.loop.turn_kv(traj, req)
            if kv is not None and not self.reuse_stale_kv and kv.oldest_version != version:
                kv = None  # the previous turn's KV predates the weights: re-prefill the whole context
                self.stats["kv_stale_dropped"] += 1
            if kv is not None:
                self.stats["kv_turn_hits"] += 1
        self.engine.add_request(req, kv=kv)
        self._submitted[req.request_id] = (len(req.given_ids), kv is not None)
        live[req.request_id] = traj
        return True

    def _pause_rest(self, live: dict[str, Trajectory], ready: deque[Trajectory]) -> None:
        """Pause what is in the engine (KV stays resident, then write-back) and the backlog."""
        if live:
            for partial in self.engine.pause(list(live)):
                traj = live[partial.request_id]
                given, with_kv = self._submitted.pop(partial.request_id, (0, False))
                self.loop.absorb_partial(traj, partial)
                has_kv = self.kv_transfer and (with_kv or partial.num_tokens > given)
                nbytes = (len(partial.prompt_ids) + partial.num_tokens - 1) * self._bytes_per_token if has_kv else 0
                self._resident[traj.traj_id] = _Resident(partial.request_id, nbytes, self.engine.version, has_kv)
                if has_kv:
                    self._kv_expected.add(traj.traj_id)
                self.stats["pauses"] += 1
        for traj in ready:
            # its next turn was not submitted: the previous turn's KV (already on CPU) goes to the pool
            kv = self.loop.take_turn_kv(traj.traj_id)
            if kv is not None and self.kv_pool is not None and self.kv_pool.put(traj.traj_id, kv):
                self._kv_expected.add(traj.traj_id)
                self.stats["kv_turn_pooled"] += 1
            if traj.status != "paused":
                self.loop.save_env(traj)
                traj.status = "paused"
                traj.pauses += 1
                self.stats["pauses"] += 1
        self._write_back(self.resident_kv_bytes)

    def _write_back(self, budget: int) -> None:
        """Evict the least recently paused engine-resident KV until at most ``budget`` bytes
        remain: written to the pool (the only time the pool is written), or dropped. An engine
        without KV transfer holds no KV: its paused requests stay there until resumed."""
        if not self.kv_transfer:
            return
        while self._resident and sum(r.nbytes for r in self._resident.values()) > budget:
            tid, res = self._resident.popitem(last=False)
            if res.has_kv:
                kv = self.engine.export_kv(res.request_id)
                self.stats["kv_writebacks"] += 1
                if self.kv_pool is not None:
                    self.kv_pool.put(tid, kv)
            else:
                self.engine.abort([res.request_id])
        if budget == 0:  # requests with no KV at all need not stay in the engine either
            for tid in [t for t, r in self._resident.items() if not r.has_kv]:
                self.engine.abort([self._resident.pop(tid).request_id])

    def _forget_kv(self, tid: str) -> None:
        self.loop.drop_turn_kv(tid)
        res = self._resident.pop(tid, None)
        if res is not None:
            self.engine.abort([res.request_id])
        if self.kv_pool is not None:
            self.kv_pool.discard(tid)
        self._kv_expected.discard(tid)

    def offload_kv(self) -> None:
        """Evict every engine-resident paused KV into the pool (e.g. before a co-located
        train step needs the engine's memory)."""
        self._write_back(0)

    def release_engine(self) -> None:
        """Take every paused request out of the engine, so that it can serve other work under any request id
        (the held-out evaluation after the last step reuses the training ids ``g<i>/s<j>#t<k>``). Engine-held
        KV goes to the pool first, as `offload_kv` moves it. An engine without KV transfer (`HTTPEngine`) keeps a
        paused request's tokens only; that request is aborted. Each trajectory keeps its tokens, log-probs and
        versions here, and a later resume sends its whole context again, with the same tokens (`_submit`)."""
        self._write_back(0)
        for tid in list(self._resident):
            self.engine.abort([self._resident.pop(tid).request_id])

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: paused and finished-but-undispatched trajectories (with env
        state), the prompt queue, counters and statistics. KV tensors are not included."""
        return {
            "version": SCHEDULER_STATE_VERSION,
            "config": {"n_prompts": self.n_prompts, "k": self.k, "seed": self.seed},
            "iteration": self.iteration,
            "next_group": self._next_group,
            "concurrency": self.concurrency,
            "prompts": [t.to_dict() for t in self._prompts],
            "groups": {str(gid): [t.to_dict() for t in trajs] for gid, trajs in sorted(self._groups.items())},
            "kv_expected": sorted(self._kv_expected),
            "kv_pool": self.kv_pool.state_dict() if self.kv_pool is not None else None,
            "stats": dict(self.stats),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` into this scheduler (whose engine holds none of its requests)."""
        if not isinstance(state, dict) or state.get("version") != SCHEDULER_STATE_VERSION:
            raise ValueError(f"not a partial-rollout scheduler state of version {SCHEDULER_STATE_VERSION}")
        cfg = state["config"]
        if (cfg["n_prompts"], cfg["k"], cfg["seed"]) != (self.n_prompts, self.k, self.seed):
            raise ValueError(
                f"state was saved with n_prompts={cfg['n_prompts']}, k={cfg['k']}, seed={cfg['seed']}; this scheduler "
                f"has n_prompts={self.n_prompts}, k={self.k}, seed={self.seed}"
            )
        if self._groups or self._resident:
            raise ValueError("load_state_dict needs a fresh scheduler (this one already holds trajectories)")
        self.iteration = int(state["iteration"])
        self._next_group = int(state["next_group"])
        self.concurrency = max(self.min_concurrency, min(self.max_concurrency, int(state["concurrency"])))
        self._prompts = deque(Task.from_dict(t) for t in state["prompts"])
        self._groups = {int(g): [Trajectory.from_dict(t) for t in ts] for g, ts in state["groups"].items()}
        for traj in self.trajectories():
            if traj.status == "running":  # saved mid-iteration: treat as paused
                traj.status = "paused"
        self._kv_expected = set(state["kv_expected"])
        if self.kv_pool is not None and state.get("kv_pool") is not None:
            self.kv_pool.load_state_dict(state["kv_pool"])
        self.stats.update({k: int(v) for k, v in state["stats"].items() if k in self.stats})
        self.staleness_hist = Counter({int(k): int(v) for k, v in state["staleness_hist"].items()})

    def save(self, path: str | Path) -> Path:
        """Write `state_dict` as JSON atomically (`k3post.io.atomic_write`)."""
        return atomic_write(path, json.dumps(self.state_dict(), ensure_ascii=False))

    def load(self, path: str | Path) -> None:
        """Restore a state written by `save`."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"{p}: no scheduler state file")
        self.load_state_dict(json.loads(p.read_text(encoding="utf-8")))
