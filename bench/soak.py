"""Long-run soak of the RL loop (issue 20): RL for N steps (default 1,000) of a tiny model, sampling what
would grow if something leaked, and printing each quantity's slope after warm-up.

    python bench/soak.py                         # 1,000 steps; a line per sample, slopes, then one JSON line
    python bench/soak.py --steps 200 --budget-s 600

The run is the real loop (`k3post.loop.PolicyLoop`, the body `train_policy` drives) on general.arithmetic
(``--families``: others of one domain) with
partial rollout on: λ = 0.5 and 3 engine slots for 2 prompts × 2 samples, so trajectories are paused every step
and their KV goes through the engine and the KV pool; a checkpoint every ``save_every`` steps with
``keep_last``; metrics into metrics.jsonl and TensorBoard, as a run writes them.

Sampled every ``sample_every`` steps:

    rss_mib            VmRSS of this process (/proc/self/status)
    fds                open file descriptors (/proc/self/fd)
    kv_pool_entries    entries / bytes in the CPU KV pool (its budget bounds the bytes)
    kv_pool_bytes
    engine_*           what the engine holds between steps: paused requests, KV kept for finished requests,
                       queued / running requests, and the weight plans its attributes hold (`_Weights`, the forward's view of one
                       weight version: the per-version cache)
    sched_*            the scheduler's and agent loop's maps: admitted groups, engine-resident paused KV,
                       requests in flight, environments, per-trajectory turn KV
    live_tensors       torch tensors reachable by the garbage collector
    ckpt_folders       checkpoint folders on disk (must equal keep_last once keep_last saves happened)
    ckpt_state_bytes   the newest checkpoint's trainer_state.pt, and (pickled) its parts: ``ckpt_sched_bytes``
                       the scheduler's state (paused and undispatched trajectories: it moves with them),
                       ``ckpt_loop_bytes`` the rest but the KV pool's tensors (optimizer, RNG, step, cursor,
                       config: constant; the per-step rows are in metrics.jsonl only, `k3post.loop`)

A slope is the least-squares line through the samples after ``warmup`` steps, per 100 steps.

Shape legend: none.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_state  # noqa: E402

__all__ = ["run_soak", "slope_per_100", "rss_mib", "open_fds"]

_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=64)


def rss_mib() -> float:
    """This process's resident set (VmRSS), MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    """Open file descriptors of this process (the listing's own fd included, the same in every sample)."""
    return len(os.listdir("/proc/self/fd"))


def slope_per_100(steps: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over steps, times 100 (change per 100 steps); 0.0 with fewer than 2 points."""
    n = len(steps)
    if n < 2:
        return 0.0
    mx, my = sum(steps) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(steps, ys)) / sxx if sxx else 0.0


def _probe(pl: Any, ckpt_root: Path) -> dict[str, float]:
    """What the loop's objects hold now (module doc). Weight plans are counted as the ones the engine's own
    attributes reach (its current plan, and any container attribute holding plans), not process-wide, so
    engines left alive by others in the same process (a test session) do not count."""
    import torch

    from k3post.rollout.embedded import _Weights

    def own_plans(engine: Any) -> int:
        found: set[int] = set()
        for value in vars(engine).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) \
                else (value,)
            found.update(id(v) for v in items if isinstance(v, _Weights))
        return len(found)

    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module proxies warns
        warnings.simplefilter("ignore")
        objs = gc.get_objects()
        live_tensors = sum(1 for o in objs if isinstance(o, torch.Tensor))
        del objs
    eng, sched, loop, pool = pl.rollout.engine, pl.rollout.scheduler, pl.rollout.loop, pl.rollout.pool
    folders = [p for p in ckpt_root.iterdir() if p.is_dir()] if ckpt_root.is_dir() else []
    return {
        "rss_mib": rss_mib(), "fds": float(open_fds()),
        "kv_pool_entries": float(len(pool)), "kv_pool_bytes": float(pool.nbytes),
        "engine_paused": float(eng.num_paused), "engine_kept_kv": float(eng.num_kept_kv),
        "engine_queued": float(eng.num_queued), "engine_running": float(eng.num_running),
        "engine_weight_plans": float(own_plans(eng)),
        "sched_groups": float(len(sched._groups)), "sched_resident": float(len(sched._resident)),
        "sched_submitted": float(len(sched._submitted)), "sched_kv_expected": float(len(sched._kv_expected)),
        "loop_envs": float(len(loop._envs)), "loop_turn_kv": float(len(loop._turn_kv)),
        "live_tensors": float(live_tensors),
        "ckpt_folders": float(len(folders)),
        **_state_bytes(ckpt_root),
    }


def _state_bytes(ckpt_root: Path) -> dict[str, float]:
    """Sizes of the newest checkpoint's trainer state (module doc; zeros before the first checkpoint)."""
    import torch

    from k3post.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(ckpt_root)
    if ckpt is None:
        return {"ckpt_state_bytes": 0.0, "ckpt_sched_bytes": 0.0, "ckpt_loop_bytes": 0.0}
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    rest = {k: v for k, v in state.items() if k not in ("scheduler", "kv_pool")}
    return {"ckpt_state_bytes": float((ckpt / "trainer_state.pt").stat().st_size),
            "ckpt_sched_bytes": float(len(pickle.dumps(state["scheduler"]))),
            "ckpt_loop_bytes": float(len(pickle.dumps(rest)))}


def _budgets(tasks: list[Any]) -> Any:
    """b0 = 16 thinking tokens for every task (the soak measures resources, not effort control)."""
    from k3post.rewards.effort import BudgetTable, TaskSamples

    table = BudgetTable({"soak": True})
    table.add_samples({t.content_hash(): TaskSamples(t.family, [16] * 3, [True] * 3) for t in tasks}, q=0.9, min_b0=1.0)
    return table


def run_soak(steps: int, work: str | Path, *, sample_every: int = 10, warmup: int | None = None, save_every: int = 5,
             keep_last: int = 2, kv_pool_mb: int = 4, budget_s: float | None = None, seed: int = 0,
             families: tuple[str, ...] = ("general.arithmetic",), echo: bool = False) -> dict[str, Any]:
    """RL for ``steps`` steps in ``work`` (module doc) on ``families`` (one domain's); stops early after
    ``budget_s`` seconds. Returns the samples, the slopes per 100 steps after ``warmup`` (default
    steps // 5) and the counts' maxima."""
    import torch

    from k3post.config.effort import EffortConfig
    from k3post.config.rl import RLConfig
    from k3post.commands import default_corpus
    from k3post.envs.families.streams import train_tasks
    from k3post.loop import PolicyLoop
    from k3post.metrics import MetricsLogger
    from k3post.models import build_tiny_moe
    from k3post.rl import rl_signal
    from k3post.tokenizer import train_tokenizer
    from k3post.xtml import XTML

    if steps < 1 or sample_every < 1:
        raise ValueError(f"steps and sample_every must be >= 1, got {steps}, {sample_every}")
    warmup = steps // 5 if warmup is None else warmup
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = train_tokenizer(default_corpus(1, n_main=10), vocab_size=320)
    model = build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id, **_TINY)
    cfg = RLConfig(domain=families[0].split(".")[0], families=list(families), steps=steps, n_prompts=2, k=2, slots=3, n_tasks=8,
                   max_tokens=24, lambda_=0.5, kv_pool_mb=kv_pool_mb, save_every=save_every, keep_last=keep_last,
                   progress=False, lr=1e-3, seed=seed, effort_control=EffortConfig(tau_max=1.0, max_cap=1.0))
    tasks = train_tasks(cfg.families, cfg.n_tasks, difficulty=cfg.difficulty, seed=seed)
    metrics = MetricsLogger(work)
    ckpt_root = work / "checkpoints"
    pl = PolicyLoop(model, tok, cfg, signal=rl_signal(_budgets(tasks), cfg))
    samples: list[dict[str, float]] = []
    paused = 0.0
    t0 = time.perf_counter()
    stopped_by_budget = False
    try:
        while pl.step_no < steps:  # `train_policy`'s driver, with a probe between steps
            rec = pl.step(tasks)
            paused += rec["paused"]
            metrics.log("rl", pl.step_no, rec)
            if pl.step_no % cfg.save_every == 0 or pl.step_no == steps:
                pl.save(ckpt_root)
            if pl.step_no % sample_every == 0 or pl.step_no == steps:
                s = {"step": float(pl.step_no), "time_s": time.perf_counter() - t0, **_probe(pl, ckpt_root)}
                samples.append(s)
                if echo:
                    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) and not v.is_integer() else f"{k}={int(v)}"
                                   for k, v in s.items()), flush=True)
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                stopped_by_budget = pl.step_no < steps
                break
    finally:
        pl.close()
        metrics.close()
    after = [s for s in samples if s["step"] > warmup]
    keys = [k for k in samples[0] if k not in ("step", "time_s")] if samples else []
    slopes = {k: slope_per_100([int(s["step"]) for s in after], [s[k] for s in after]) for k in keys}
    return {
        "steps": pl.step_no, "steps_asked": steps, "stopped_by_budget": stopped_by_budget, "warmup": warmup,
        "seconds": time.perf_counter() - t0, "paused_total": paused, "keep_last": keep_last,
        "kv_pool_budget_bytes": kv_pool_mb << 20, "kv_pool_stats": dict(pl.rollout.pool.stats),
        "bounds": {"slots": cfg.slots, "samples_per_iteration": cfg.n_prompts * cfg.k, "n_prompts": cfg.n_prompts},
        "slopes_per_100_steps": slopes,
        "max_after_warmup": {k: max(s[k] for s in after) for k in keys} if after else {},
        "first_after_warmup": after[0] if after else {}, "last": samples[-1] if samples else {},
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=None, help="steps before the slopes are fitted (default steps // 5)")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=1800.0, help="stop after this many seconds (report the steps reached)")
    ap.add_argument("--families", default="general.arithmetic",
                    help="comma-separated families of one domain (e.g. coding.write_function: sandboxed runs)")
    ap.add_argument("--work", default="", help="run folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="k3post-soak-") as tmp:
        out = run_soak(args.steps, args.work or tmp, sample_every=args.sample_every, warmup=args.warmup,
                       save_every=args.save_every, keep_last=args.keep_last, budget_s=args.budget_s,
                       families=tuple(args.families.split(",")), echo=True)
    print(f"steps {out['steps']}/{out['steps_asked']} in {out['seconds']:.0f} s, warm-up {out['warmup']} steps, "
          f"{out['paused_total']:.0f} trajectories paused")
    for k, v in out["slopes_per_100_steps"].items():
        print(f"slope {k:>20}: {v:+.3f} per 100 steps (max after warm-up {out['max_after_warmup'][k]:.1f})")
    print(json.dumps({"machine": machine_state(), **{k: v for k, v in out.items() if k != "samples"}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
