"""Benchmark: scale-out on this machine: RL step time with 1 vs 2 trainer ranks (local processes, and rank 1
as a Ray actor) and 1 vs 2 engine servers, weight-sync time per MB for each backend, and Ray's start-up.

What each number measures:
  * ``step_s_<arm>``: seconds of one `k3post.loop.PolicyLoop.step` (rollout, signal, trainer step, weight
    push; λ = 1, synchronous), median of ``--steps`` steps after one warm-up step, for the arms
      ranks1      one process, embedded engine (today's default)
      ranks2      2 trainer ranks (`k3post.trainer.ranks.on_ranks`, FSDP2 over gloo), rank 1 a local process,
                  embedded engine on rank 0
      ranks2_ray  the same with rank 1 a `TrainerRankActor` on a Ray placement group (``distributed.enabled``)
      servers1    one process, rollout on 1 local engine server (``rl.rollout.engine.kind=http``, ``launch=1``)
      servers2    one process, rollout on 2 local engine servers
    Each arm's run (set-up, spawn, actor or server start excluded from the step time) is repeated
    ``--repeats`` times, interleaved, the order rotated every round (bench/common.py). Ratios (step time of
    the first over the second: below 1 is faster), each with the paired repeats' min-max:
    ``ranks2_vs_ranks1``, ``ranks2_ray_vs_ranks2``, ``servers2_vs_servers1``.
  * ``sync_ms_per_mb_<set>_<backend>``: ms per MB of weights of one sync into an engine, per backend of
    `k3post.distributed.weight_sync` runnable here (gloo torch.distributed, disk, in-process; CUDA IPC needs
    a GPU), measured by bench/weight_sync.py's ``bench_set`` on its "tiny" and "wide" weight sets.
  * ``ray_start_s``: ``ray.init(num_cpus=2)`` + a placement group of 2 bundles ready (`RayCluster.startup_s`);
    ``ray_actor_s``: then one `TrainerRankActor` placed and answering (a worker process that imported
    ``k3post.distributed.ray_cluster``; torch is imported when it starts serving, not counted);
    ``ray_shutdown_s``; ``--repeats`` cycles.

Caveats (read before quoting): a shared 2-core CPU. Two trainer ranks split the same 2 cores that one
process uses, and add an all-gather (weights back to rank 0) and a reduce-scatter per step, so ``ranks2``
measures FSDP's overhead, not its scaling; two engine servers likewise share the cores with the trainer.
The model is the tiny Qwen3-MoE: communication and Python overhead dominate, unlike a GPU run. While the
RL arms run, the Ray cluster of ``ranks2_ray`` is up (its daemons idle beside every arm). Compare runs of one
machine only; the machine state (load average) is printed with the numbers.

Stops by itself: ``--budget-s`` (default 600) bounds the whole run; repeats that would start after it are
skipped (their count is printed).

Usage: nice -n 19 python bench/scaleout.py [--repeats 3] [--steps 3] [--budget-s 600]

Shape legend: none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from k3post.stages.sft_data import default_corpus
from k3post.config.distributed import DistributedConfig, FSDPConfig, RolesConfig
from k3post.config import EngineConfig, PolicyOptimConfig, RLConfig, RolloutConfig
from k3post.trainer.ranks import on_ranks
from k3post.envs.families.streams import train_tasks
from k3post.loop import PolicyLoop
from k3post.models import build_tiny_moe, save_model
from k3post.stages.rl import rl_signal
from k3post.tokenizer import load_tokenizer, train_tokenizer
from k3post.xtml import XTML

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary, summary  # noqa: E402
from rl_step import budget_table  # noqa: E402

FAMILY = "general.arithmetic"


def _timed_steps(model_dir: str, rl: RLConfig, steps: int) -> float:
    """The median seconds of ``steps`` loop steps after one warm-up step (runs on rank 0)."""
    tok = load_tokenizer(model_dir)
    from k3post.models import load_model

    tasks = train_tasks([FAMILY], rl.n_tasks, difficulty=rl.difficulty, seed=rl.seed)
    pl = PolicyLoop(load_model(model_dir), tok, rl, signal=rl_signal(budget_table(tasks, rl.rollout.max_tokens), rl))
    try:
        pl.step(tasks)
        return statistics.median(pl.step(tasks)["step_s"] for _ in range(steps))
    finally:
        pl.close()


CAVEAT = {"ranks2_vs_ranks1": "2 ranks share the 2 cores 1 process uses, plus an all-gather and a reduce-scatter "
                               "a step: FSDP's overhead, not its scaling",
          "ranks2_ray_vs_ranks2": "the same 2 ranks, rank 1 placed by Ray instead of spawned: the launcher's per-step "
                                  "cost (none expected: the step talks gloo either way)",
          "servers2_vs_servers1": "2 servers share the 2 cores with the trainer and each other: HTTP and weight-push "
                                  "overhead, not rollout scaling"}


def rl_arms(model_dir: Path, args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    from k3post.distributed.ray_cluster import RayFollowers

    rl = RLConfig(domain="general", families=[FAMILY], n_tasks=8, progress=False, optim=PolicyOptimConfig(lr=1e-4),
                  rollout=RolloutConfig(n_prompts=2, k=4, lambda_=1.0, max_tokens=32, slots=8))
    http = lambda n: replace(rl, rollout=replace(rl.rollout, engine=EngineConfig(kind="http", launch=n,  # noqa: E731
                                                                                 launch_threads=1)))
    on_ray = lambda: RayFollowers(cluster)  # noqa: E731
    runs = {"ranks1": (1, rl, None), "ranks2": (2, rl, None), "ranks2_ray": (2, rl, on_ray),
            "servers1": (1, http(1), None), "servers2": (1, http(2), None)}
    deadline = time.perf_counter() + args.budget_s * 0.8
    skipped = {"n": 0}

    def arm(ranks: int, cfg: RLConfig, followers: Any):  # noqa: ANN202
        def run() -> float:
            if time.perf_counter() > deadline:
                skipped["n"] += 1
                return float("nan")
            kw = {"followers": followers} if followers is not None else {}
            return on_ranks(FSDPConfig(ranks=ranks), _timed_steps, str(model_dir), cfg, args.steps, **kw)
        return run

    times = interleaved({k: arm(*v) for k, v in runs.items()}, repeats=args.repeats, warmup=0)
    times = {k: [x for x in v if x == x] for k, v in times.items()}  # drop the skipped (nan) repeats
    out: dict[str, Any] = {"skipped_repeats": skipped["n"]}
    for k, v in times.items():
        if v:
            out.update(summary(f"step_s_{k}", v))
    for key in CAVEAT:
        two, one = key.split("_vs_")
        n = min(len(times[two]), len(times[one]))
        if n:
            out.update(ratio_summary(key, times[two][:n], times[one][:n]))
    return out


def weight_sync(args: argparse.Namespace) -> dict[str, float]:
    import weight_sync as ws  # bench/weight_sync.py

    out: dict[str, float] = {}
    for name in ("tiny", "wide"):
        with tempfile.TemporaryDirectory() as tmp:
            got = ws.bench_set(name, argparse.Namespace(repeats=args.repeats, bucket_mb=8.0, receivers=1), Path(tmp))
        out[f"sync_mb_{name}"] = got[f"{name}_mb"]
        for arm in ("gloo", "disk", "in_process"):  # MB/s -> ms per MB (the fastest repeat is the min)
            out[f"sync_ms_per_mb_{name}_{arm}_median"] = 1000.0 / got[f"{name}_{arm}_mb_s_median"]
            out[f"sync_ms_per_mb_{name}_{arm}_min"] = 1000.0 / got[f"{name}_{arm}_mb_s_max"]
            out[f"sync_ms_per_mb_{name}_{arm}_max"] = 1000.0 / got[f"{name}_{arm}_mb_s_min"]
            out[f"sync_ms_per_mb_{name}_{arm}_n"] = got[f"{name}_{arm}_mb_s_n"]
    return out


RAY = DistributedConfig(enabled=True, num_cpus=2, cpus_per_bundle=0.5, roles=RolesConfig(trainers=2, engines=0))


def ray_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeats`` cycles of a local cluster's start-up, a first actor, shutdown (no cluster may be up)."""
    import ray

    from k3post.distributed.ray_cluster import RayCluster, TrainerRankActor

    rows: dict[str, list[float]] = {"ray_start_s": [], "ray_actor_s": [], "ray_shutdown_s": []}
    for _ in range(args.repeats):
        cluster = RayCluster(RAY)
        t0 = time.perf_counter()
        actor = TrainerRankActor.options(**cluster.options("trainers", 1)).remote()
        ray.get(actor.pid.remote())
        rows["ray_actor_s"].append(time.perf_counter() - t0)
        rows["ray_start_s"].append(cluster.startup_s)
        t0 = time.perf_counter()
        cluster.close()
        rows["ray_shutdown_s"].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"ray": ray.__version__}
    for k, v in rows.items():
        out.update(summary(k, v))
    return out


def _spread(result: dict[str, Any], key: str) -> str:
    return (f"{result[key + '_median']:.3f} (min {result[key + '_min']:.3f}, max {result[key + '_max']:.3f}, "
            f"n {result[key + '_n']:.0f})")


def report(result: dict[str, Any]) -> None:
    """The numbers as lines a person reads (the JSON follows)."""
    for name in ("tiny", "wide"):
        if f"sync_mb_{name}" in result:
            print(f"weight sync, {name} set ({result[f'sync_mb_{name}']:.1f} MB), ms per MB: " + "; ".join(
                f"{arm} {_spread(result, f'sync_ms_per_mb_{name}_{arm}')}" for arm in ("gloo", "disk", "in_process")))
    for k in ("ranks1", "ranks2", "ranks2_ray", "servers1", "servers2"):
        if f"step_s_{k}_median" in result:
            print(f"RL step {k}: {_spread(result, f'step_s_{k}')} s")
    for key, caveat in CAVEAT.items():
        if key in result:
            print(f"{key}: {result[key]:.2f} (paired repeats min {result[key + '_min']:.2f}, max "
                  f"{result[key + '_max']:.2f}, n {result[key + '_n']:.0f}); caveat: {caveat}")
    for k in ("ray_start_s", "ray_actor_s", "ray_shutdown_s"):
        if f"{k}_median" in result:
            print(f"{k[:-2]}: {_spread(result, k)} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per arm (>= 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed loop steps per run (after one warm-up step)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="stop starting new runs after this")
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1:
        raise ValueError("need --repeats >= 1 and --steps >= 1")
    t_start = time.perf_counter()
    result: dict[str, Any] = {"repeats": args.repeats, "steps": args.steps, "machine_before": machine_state()}
    result.update(ray_overhead(args))
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(default_corpus(n_per_family=1, n_main=10), vocab_size=400)
        model = build_tiny_moe(len(tok), seed=0, num_hidden_layers=2, pad_token_id=tok.pad_token_id,
                               eos_token_id=XTML(tok).eom_id)
        model_dir = save_model(model, Path(tmp) / "model", tok)
        result.update(weight_sync(args))
        from k3post.distributed.ray_cluster import RayCluster

        with RayCluster(RAY) as cluster:
            result.update(rl_arms(model_dir, args, cluster))
    result["wall_s"] = time.perf_counter() - t_start
    result["machine"] = machine_state()
    report(result)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
