"""Benchmark: scale-out on this machine: RL step time with 1 vs 2 trainer ranks and 1 vs 2 engine servers,
weight-sync time per MB for each backend, and Ray's start-up overhead (when ray is importable).

What each number measures:
  * ``step_s_<arm>``: seconds of one `k3post.loop.PolicyLoop.step` (rollout, signal, trainer step, weight
    push; λ = 1, synchronous), median of ``--steps`` steps after one warm-up step, for the arms
      ranks1      one process, embedded engine (today's default)
      ranks2      2 trainer ranks (`k3post.distributed.ranks.on_ranks`, FSDP2 over gloo), embedded engine on rank 0
      servers1    one process, rollout on 1 local engine server (``rl.engine.kind=http``, ``launch=1``)
      servers2    one process, rollout on 2 local engine servers
    Each arm's run (set-up, spawn or server start excluded from the step time) is repeated ``--repeats``
    times, interleaved (bench/common.py). Ratios: ``ranks2_vs_ranks1`` and ``servers2_vs_servers1`` (step
    time of 2 over 1: below 1 is faster).
  * ``sync_ms_per_mb_<backend>``: ms per MB of weights of one sync into an engine, per backend of
    `k3post.distributed.weight_sync` runnable here (gloo torch.distributed, disk, in-process; CUDA IPC needs
    a GPU), measured by bench/weight_sync.py's ``bench_set`` on the tiny weight set.
  * ``ray_init_s`` / ``ray_shutdown_s``: a local ``ray.init(num_cpus=2)`` and its shutdown.

Caveats (read before quoting): a shared 2-core CPU. Two trainer ranks split the same 2 cores that one
process uses, and add an all-gather (weights back to rank 0) and a reduce-scatter per step, so ``ranks2``
measures FSDP's overhead, not its scaling; two engine servers likewise share the cores with the trainer.
The model is the tiny Qwen3-MoE: communication and Python overhead dominate, unlike a GPU run. Compare
runs of one machine only; the machine state (load average) is printed with the numbers.

Stops by itself: ``--budget-s`` (default 480) bounds the whole run; repeats that would start after it are
skipped (their count is printed).

Usage: python bench/scaleout.py [--repeats 2] [--steps 3] [--budget-s 480]

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

from k3post.commands import default_corpus
from k3post.config.distributed import FSDPConfig
from k3post.config.rl import RLConfig
from k3post.config.rollout import EngineConfig
from k3post.distributed.ranks import on_ranks
from k3post.envs.families.streams import train_tasks
from k3post.loop import PolicyLoop
from k3post.models import build_tiny_moe, save_model
from k3post.rl import rl_signal
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
    pl = PolicyLoop(load_model(model_dir), tok, rl, signal=rl_signal(budget_table(tasks, rl.max_tokens), rl))
    try:
        pl.step(tasks)
        return statistics.median(pl.step(tasks)["step_s"] for _ in range(steps))
    finally:
        pl.close()


def rl_arms(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    rl = RLConfig(domain="general", families=[FAMILY], n_prompts=2, k=4, n_tasks=8, lambda_=1.0, max_tokens=32,
                  slots=8, progress=False, lr=1e-4)
    http = lambda n: replace(rl, engine=EngineConfig(kind="http", launch=n, launch_threads=1))  # noqa: E731
    runs = {"ranks1": (1, rl), "ranks2": (2, rl), "servers1": (1, http(1)), "servers2": (1, http(2))}
    deadline = time.perf_counter() + args.budget_s * 0.75
    skipped = {"n": 0}

    def arm(ranks: int, cfg: RLConfig):  # noqa: ANN202
        def run() -> float:
            if time.perf_counter() > deadline:
                skipped["n"] += 1
                return float("nan")
            return on_ranks(FSDPConfig(ranks=ranks), _timed_steps, str(model_dir), cfg, args.steps)
        return run

    times = interleaved({k: arm(*v) for k, v in runs.items()}, repeats=args.repeats, warmup=0)
    times = {k: [x for x in v if x == x] for k, v in times.items()}  # drop the skipped (nan) repeats
    out: dict[str, Any] = {"skipped_repeats": skipped["n"]}
    for k, v in times.items():
        if v:
            out.update(summary(f"step_s_{k}", v))
    for two, one in (("ranks2", "ranks1"), ("servers2", "servers1")):
        n = min(len(times[two]), len(times[one]))
        if n:
            out.update(ratio_summary(f"{two}_vs_{one}", times[two][:n], times[one][:n]))
    return out


def weight_sync(args: argparse.Namespace) -> dict[str, float]:
    import weight_sync as ws  # bench/weight_sync.py

    with tempfile.TemporaryDirectory() as tmp:
        got = ws.bench_set("tiny", argparse.Namespace(repeats=args.repeats + 1, bucket_mb=8.0, receivers=1), Path(tmp))
    out = {"sync_mb": got["tiny_mb"]}
    for arm in ("gloo", "disk", "in_process"):
        out[f"sync_ms_per_mb_{arm}"] = 1000.0 / got[f"tiny_{arm}_mb_s_median"]
    return out


def ray_overhead() -> dict[str, Any]:
    try:
        import ray
    except ImportError:
        return {"ray": "not importable here"}
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    t1 = time.perf_counter()
    ray.shutdown()
    return {"ray": ray.__version__, "ray_init_s": t1 - t0, "ray_shutdown_s": time.perf_counter() - t1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per arm (>= 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed loop steps per run (after one warm-up step)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new runs after this")
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1:
        raise ValueError("need --repeats >= 1 and --steps >= 1")
    t_start = time.perf_counter()
    result: dict[str, Any] = {"repeats": args.repeats, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(default_corpus(n_per_family=1, n_main=10), vocab_size=400)
        model = build_tiny_moe(len(tok), seed=0, num_hidden_layers=2, pad_token_id=tok.pad_token_id,
                               eos_token_id=XTML(tok).eom_id)
        model_dir = save_model(model, Path(tmp) / "model", tok)
        result.update(weight_sync(args))
        print("weight sync (ms per MB): " + ", ".join(f"{k[15:]} {v:.1f}" for k, v in result.items()
                                                      if k.startswith("sync_ms_per_mb_")), flush=True)
        result.update(rl_arms(model_dir, args))
    for k in ("ranks1", "ranks2", "servers1", "servers2"):
        if f"step_s_{k}_median" in result:
            print(f"RL step {k}: {result[f'step_s_{k}_median']:.2f} s (median of {result[f'step_s_{k}_n']:.0f} runs)")
    result.update(ray_overhead())
    result["caveats"] = ("shared 2-core CPU: 2 trainer ranks or 2 engine servers split the cores one process uses, "
                         "so the ratios measure overhead (all-gather, reduce-scatter, HTTP, weight pushes), not scaling; "
                         "tiny model: communication and Python dominate")
    result["wall_s"] = time.perf_counter() - t_start
    result["machine"] = machine_state()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
