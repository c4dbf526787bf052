"""Long-run soak of the RL loop (issue 20): RL for N steps (default 1,000) of a tiny model, sampling what
would grow if something leaked, and printing each quantity's slope after warm-up.

    python bench/soak.py                         # 1,000 steps; a line per sample, slopes, then one JSON line
    python bench/soak.py --steps 200 --budget-s 600
    python bench/soak.py --tools                 # multi-turn and sandboxed: agents.search, coding.write_function

The run is the real loop (`k3post.loop.PolicyLoop`, the body `train_policy` drives) with partial rollout on:
λ = 0.5 and 3 engine slots for 2 prompts × 2 samples, so trajectories are paused every step and their KV goes
through the engine and the KV pool; a checkpoint every ``save_every`` steps with ``keep_last``; metrics into
metrics.jsonl and TensorBoard, as a run writes them. Two policies:

    single-turn   (default) an untrained tiny model on general.arithmetic (``--families``: others): it calls
                  no tools, lr 1e-3
    --tools       a tiny model first SFT-ed (`train_sft`) on the reference solutions of its few training tasks,
                  so that it makes their tool calls itself: agents.search (5 turns: search, open ..., submit;
                  each turn's prefill reuses the previous turn's KV, the agent loop's turn KV cache) and
                  coding.write_function (write_file and run_tests in the episode's bubblewrap sandbox, then
                  the verifier in a fresh one); RL at temperature 0.3 and lr 1e-6, so the calls stay learned

Every tool call, sandbox, subprocess and temp folder is the real one (sandboxes are only counted, by wrapping
`Sandbox.__init__` / `Sandbox.run`); the sandboxes' folders go to a temp folder of the run's own, so they are
counted exactly on a machine others use too.

Sampled every ``sample_every`` steps:

    rss_mib            VmRSS of this process (/proc/self/status)
    fds                open file descriptors (/proc/self/fd)
    kv_pool_entries    entries / bytes in the CPU KV pool (its budget bounds the bytes)
    kv_pool_bytes
    engine_*           what the engine holds between steps: paused requests, KV kept for finished requests,
                       queued / running requests, and the weight plans its attributes hold (`WeightPlan`, the forward's view of one
                       weight version: the per-version cache)
    sched_*            the scheduler's and agent loop's maps: admitted groups, engine-resident paused KV,
                       requests in flight, environments, per-trajectory turn KV
    live_tensors       torch tensors reachable by the garbage collector
    ckpt_folders       checkpoint folders on disk (must equal keep_last once keep_last saves happened)
    ckpt_state_bytes   the newest checkpoint's trainer_state.pt, and (pickled) its parts: ``ckpt_sched_bytes``
                       the scheduler's state (paused and undispatched trajectories: it moves with them),
                       ``ckpt_loop_bytes`` the rest but the KV pool's tensors (optimizer, RNG, step, cursor,
                       config: constant; the per-step rows are in metrics.jsonl only, `k3post.loop`)
    child_procs        processes descending from this one (sandboxed commands, bwrap), and ``zombies`` among them
    sandbox_dirs       sandbox folders (``k3sbx-*``) in the run's temp folder: the live environments' (2 each)
    sandboxes_made     sandboxes built and commands run in them so far, and ``tool_calls`` the episodes made
    sandbox_runs

Also returned: what the episodes did (`episode_counts`, summed), the descendant processes before the run and
after it (loop closed), the sandbox folders left, and the engine's KV counters (``kv_kept``: turns whose KV was
kept for the next turn; ``kv_reused_tokens``: context tokens not prefilled again).

A slope is the least-squares line through the samples after ``warmup`` steps, per 100 steps.

Shape legend: none.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
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
_TOOL_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  moe_intermediate_size=64, num_experts=4, intermediate_size=128)  # tests/test_agent_loop.py's


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
    attributes and its forward's reach (the current plan, and any container attribute holding plans), not process-wide, so
    engines left alive by others in the same process (a test session) do not count."""
    import torch

    from k3post.rollout.embedded.forward import WeightPlan

    def own_plans(engine: Any) -> int:
        """Plans held by the engine's attributes or by its forward's (`LeanForward` holds the current one)."""
        found: set[int] = set()
        for holder in (engine, getattr(engine, "_lean", None)):
            if holder is None:
                continue
            for value in vars(holder).values():
                items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) \
                    else (value,)
                found.update(id(v) for v in items if isinstance(v, WeightPlan))
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
    from k3post.checkpoint import latest_checkpoint, load_trainer_state

    ckpt = latest_checkpoint(ckpt_root)
    if ckpt is None:
        return {"ckpt_state_bytes": 0.0, "ckpt_sched_bytes": 0.0, "ckpt_loop_bytes": 0.0}
    state = load_trainer_state(ckpt)
    rest = {k: v for k, v in state.items() if k not in ("scheduler", "kv_pool")}
    return {"ckpt_state_bytes": float((ckpt / "trainer_state.pt").stat().st_size),
            "ckpt_sched_bytes": float(len(pickle.dumps(state["scheduler"]))),
            "ckpt_loop_bytes": float(len(pickle.dumps(rest)))}


def _budgets(tasks: list[Any], b0: float = 16.0) -> Any:
    """b0 = ``b0`` thinking tokens for every task (the soak measures resources, not effort control)."""
    from k3post.rewards.effort import BudgetTable, TaskSamples

    table = BudgetTable({"soak": True})
    table.add_samples({t.content_hash(): TaskSamples(t.family, [b0] * 3, [True] * 3) for t in tasks}, q=0.9, min_b0=1.0, floor=0.0)
    return table


def descendants() -> tuple[int, int]:
    """(processes descending from this one, how many of them are zombies), from /proc."""
    children: dict[int, list[int]] = {}
    state: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # gone meanwhile
            continue
        state[int(entry)] = rest[0]
        children.setdefault(int(rest[1]), []).append(int(entry))
    todo, found = list(children.get(os.getpid(), [])), []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return len(found), sum(state.get(p) == "Z" for p in found)


def sandbox_dirs() -> int:
    """Sandbox work and private folders (``k3sbx-*``) in the temp folder."""
    return sum(1 for p in Path(tempfile.gettempdir()).glob("k3sbx-*"))


class SandboxCounter:
    """Counts the sandboxes made and the commands run in them while active (the real `Sandbox` does the work;
    its ``__init__`` and ``run`` are wrapped to count calls)."""

    def __init__(self) -> None:
        self.made = self.runs = 0

    def __enter__(self) -> "SandboxCounter":
        from k3post.envs.sandbox import Sandbox

        self._init, self._run = Sandbox.__init__, Sandbox.run
        counter, init, run = self, self._init, self._run

        def counted_init(sb: Any, *a: Any, **kw: Any) -> None:
            counter.made += 1
            init(sb, *a, **kw)

        def counted_run(sb: Any, *a: Any, **kw: Any) -> Any:
            counter.runs += 1
            return run(sb, *a, **kw)

        Sandbox.__init__, Sandbox.run = counted_init, counted_run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from k3post.envs.sandbox import Sandbox

        Sandbox.__init__, Sandbox.run = self._init, self._run  # type: ignore[method-assign]


def episode_counts(groups: Any, xtml: Any) -> dict[str, float]:
    """What the step's finished episodes did: episodes, assistant turns, tool calls (every sampled turn parsed
    as the agent loop parses it), the calls that run code in a sandbox (``run_tests`` / ``run_python``),
    malformed episodes and passes."""
    out = {"episodes": 0.0, "turns": 0.0, "tool_calls": 0.0, "code_runs": 0.0, "malformed": 0.0, "passed": 0.0}
    for g in groups:
        for t in g.trajectories:
            out["episodes"] += 1
            out["turns"] += t.turns
            out["malformed"] += t.finish == "malformed"
            out["passed"] += (t.reward or 0.0) >= 1.0
            start = None
            for i, m in enumerate([*t.trainable, False]):  # each run of sampled tokens is one assistant turn
                if m and start is None:
                    start = i
                elif not m and start is not None:
                    try:
                        calls = xtml.parse(t.token_ids[start:i], after_prefix=True, partial=True)["tool_calls"]
                    except Exception:  # noqa: BLE001 - a malformed turn calls nothing
                        calls = []
                    out["tool_calls"] += len(calls)
                    out["code_runs"] += sum(c["function"]["name"] in ("run_tests", "run_python") for c in calls)
                    start = None
    return out


def _single_turn(seed: int, families: tuple[str, ...], steps: int, **rl: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The single-turn soak: an untrained tiny model (it calls no tools), lr 1e-3, 24-token turns."""
    from k3post.stages.sft_data import default_corpus
    from k3post.config.effort import EffortConfig
    from k3post.config.rl import RLConfig
    from k3post.envs.families.streams import train_tasks
    from k3post.models import build_tiny_moe
    from k3post.tokenizer import train_tokenizer
    from k3post.xtml import XTML

    tok = train_tokenizer(default_corpus(1, n_main=10), vocab_size=320)
    model = build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id, **_TINY)
    cfg = RLConfig(domain=families[0].split(".")[0], families=list(families), steps=steps, n_tasks=8, seed=seed,
                   effort_control=EffortConfig(tau_max=1.0, max_cap=1.0)).with_settings(
        {"rollout": {"max_tokens": 24}, "optim": {"lr": 1e-3}}).with_settings(rl)
    tasks = train_tasks(cfg.families, cfg.n_tasks, difficulty=cfg.difficulty, seed=seed)
    return tok, model, cfg, tasks, _budgets(tasks)


def _tool_using(seed: int, families: tuple[str, ...], steps: int, work: Path, sft_steps: int, n_tasks: int,
                **rl: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The tool-using soak: a tiny model SFT-ed (`train_sft`, the pipeline's own stage 1) on the reference
    solutions of its few training tasks at effort high, so that it makes their tool calls itself (search /
    open / submit; write_file / run_tests, then the verifier's run in a fresh sandbox); RL samples at
    temperature 0.3 with lr 1e-6 (the calls stay what it learned; the trainer still steps every time)."""
    from k3post.stages.sft_data import default_corpus
    from k3post.config.rl import RLConfig
    from k3post.data import Sample, render_record
    from k3post.envs.episode import run_episode_sync
    from k3post.envs.families.registry import get_family
    from k3post.envs.families.streams import train_tasks
    from k3post.models import build_tiny_moe
    from k3post.rollout.evaluation import make_env
    from k3post.stages.sft import SFTConfig, train_sft
    from k3post.tokenizer import train_tokenizer
    from k3post.xtml import XTML

    tok = train_tokenizer(default_corpus(n_per_family=2, n_main=4), vocab_size=1024)
    xtml = XTML(tok)
    model = build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id, **_TOOL_TINY)
    cfg = RLConfig(domain=families[0].split(".")[0], families=list(families), steps=steps, n_tasks=n_tasks,
                   effort="high", seed=seed).with_settings(
        {"rollout": {"max_tokens": 192, "temperature": 0.3}, "optim": {"lr": 1e-6}}).with_settings(rl)
    tasks = train_tasks(cfg.families, cfg.n_tasks, difficulty=cfg.difficulty, seed=seed)
    samples = []
    for task in tasks:
        ep = run_episode_sync(get_family(task.family).reference_policy(task, cfg.effort), make_env(task), task)
        samples.append(Sample(*render_record(xtml, {"messages": ep.messages, "tools": ep.tools, "effort": cfg.effort}),
                              source=task.id))
    train_sft(model, tok, samples, SFTConfig(steps=sft_steps, lr=1e-2, warmup_steps=10, pack_len=2048,
                                             rows_per_batch=len(samples), save_every=10 ** 6, log_every=10 ** 6,
                                             progress=False), work / "sft", seed=seed, resume=False)
    return tok, model, cfg, tasks, _budgets(tasks, b0=10_000.0)  # no effort override: every pass is reward 1


def run_soak(steps: int, work: str | Path, *, sample_every: int = 10, warmup: int | None = None, save_every: int = 5,
             keep_last: int = 2, kv_pool_mb: int = 4, budget_s: float | None = None, seed: int = 0,
             families: tuple[str, ...] = ("general.arithmetic",), tools: bool = False, sft_steps: int = 200,
             tool_tasks: int = 2, echo: bool = False) -> dict[str, Any]:
    """RL for ``steps`` steps in ``work`` (module doc) on ``families``; stops early after ``budget_s`` seconds.
    ``tools``: the tool-using soak (`_tool_using`: ``tool_tasks`` training tasks per family, ``sft_steps`` of SFT
    on their reference solutions first), else the single-turn one.
    Returns the samples, the slopes per 100 steps after ``warmup`` (default steps // 5), the counts' maxima,
    what the episodes did (`episode_counts`, summed) and the processes / sandbox folders before and after."""
    import torch

    from k3post.loop import PolicyLoop
    from k3post.metrics import MetricsLogger
    from k3post.stages.rl import rl_signal
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
    old_tmp = tempfile.tempdir
    # the sandboxes' folders go to a temp folder of this run's own (counted exactly, nobody else's), in the
    # system's temp folder and traversable: a root run's sandbox drops to another uid, which must reach them
    own_tmp = tempfile.mkdtemp(prefix="k3post-soak-tmp-")
    os.chmod(own_tmp, 0o711)
    tempfile.tempdir = own_tmp
    procs_before = descendants()
    rl = dict(rollout={"n_prompts": 2, "k": 2, "slots": 3, "lambda_": 0.5, "kv_pool_mb": kv_pool_mb},
              save_every=save_every, keep_last=keep_last, progress=False)
    t_setup = time.perf_counter()
    try:
        tok, model, cfg, tasks, budgets = (_tool_using(seed, families, steps, work, sft_steps, tool_tasks, **rl) if tools
                                           else _single_turn(seed, families, steps, **rl))
        setup_s = time.perf_counter() - t_setup
        xtml = XTML(tok)
        metrics = MetricsLogger(work)
        ckpt_root = work / "checkpoints"
        samples: list[dict[str, float]] = []
        paused = 0.0
        did: dict[str, float] = {}
        t0 = time.perf_counter()
        stopped_by_budget = False
        with SandboxCounter() as sandboxes:
            pl = PolicyLoop(model, tok, cfg, signal=rl_signal(budgets, cfg))
            try:
                while pl.step_no < steps:  # `train_policy`'s driver, with a probe between steps
                    rec = pl.step(tasks)
                    paused += rec["paused"]
                    for k, v in episode_counts(pl.last_groups, xtml).items():
                        did[k] = did.get(k, 0.0) + v
                    metrics.log("rl", pl.step_no, rec)
                    if pl.step_no % cfg.save_every == 0 or pl.step_no == steps:
                        pl.save(ckpt_root)
                    if pl.step_no % sample_every == 0 or pl.step_no == steps:
                        kids, zombies = descendants()
                        s = {"step": float(pl.step_no), "time_s": time.perf_counter() - t0, **_probe(pl, ckpt_root),
                             "child_procs": float(kids), "zombies": float(zombies), "sandbox_dirs": float(sandbox_dirs()),
                             "sandboxes_made": float(sandboxes.made), "sandbox_runs": float(sandboxes.runs),
                             "tool_calls": did.get("tool_calls", 0.0)}
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
        seconds = time.perf_counter() - t0
        gc.collect()
        procs_after, dirs_after = descendants(), sandbox_dirs()
    finally:
        tempfile.tempdir = old_tmp
        shutil.rmtree(own_tmp, ignore_errors=True)
    after = [s for s in samples if s["step"] > warmup]
    keys = [k for k in samples[0] if k not in ("step", "time_s")] if samples else []
    slopes = {k: slope_per_100([int(s["step"]) for s in after], [s[k] for s in after]) for k in keys}
    return {
        "steps": pl.step_no, "steps_asked": steps, "stopped_by_budget": stopped_by_budget, "warmup": warmup,
        "setup_s": setup_s, "seconds": seconds, "paused_total": paused, "keep_last": keep_last,
        "families": list(families), "tools": tools, "episodes": did,
        "sandboxes": {"made": sandboxes.made, "runs": sandboxes.runs},
        "engine_stats": {k: pl.engine.stats.get(k, 0) for k in ("kv_kept", "kv_reused_tokens", "prefill_tokens",
                                                               "decode_tokens")},
        "processes": {"before": procs_before, "after": procs_after}, "sandbox_dirs_after": dirs_after,
        "kv_pool_budget_bytes": kv_pool_mb << 20, "kv_pool_stats": dict(pl.rollout.pool.stats),
        "bounds": {"slots": cfg.rollout.slots, "samples_per_iteration": cfg.rollout.n_prompts * cfg.rollout.k,
                   "n_prompts": cfg.rollout.n_prompts},
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
    ap.add_argument("--families", default="",
                    help="comma-separated families (default: general.arithmetic; with --tools agents.search,"
                         "coding.write_function)")
    ap.add_argument("--tools", action="store_true",
                    help="the tool-using soak: SFT on the families' reference solutions first, so the model calls tools")
    ap.add_argument("--sft-steps", type=int, default=200, help="--tools: SFT steps before RL")
    ap.add_argument("--tool-tasks", type=int, default=2, help="--tools: training tasks per family")
    ap.add_argument("--work", default="", help="run folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    families = args.families or ("agents.search,coding.write_function" if args.tools else "general.arithmetic")
    with tempfile.TemporaryDirectory(prefix="k3post-soak-") as tmp:
        out = run_soak(args.steps, args.work or tmp, sample_every=args.sample_every, warmup=args.warmup,
                       save_every=args.save_every, keep_last=args.keep_last, budget_s=args.budget_s,
                       families=tuple(families.split(",")), tools=args.tools, sft_steps=args.sft_steps,
                       tool_tasks=args.tool_tasks, echo=True)
    print(f"steps {out['steps']}/{out['steps_asked']} in {out['seconds']:.0f} s (set-up {out['setup_s']:.0f} s), warm-up "
          f"{out['warmup']} steps, {out['paused_total']:.0f} trajectories paused")
    e = out["episodes"]
    print(f"episodes {e.get('episodes', 0):.0f}: {e.get('turns', 0):.0f} assistant turns, {e.get('tool_calls', 0):.0f} tool "
          f"calls ({e.get('code_runs', 0):.0f} run code), {e.get('malformed', 0):.0f} malformed, {e.get('passed', 0):.0f} "
          f"passed; sandboxes made {out['sandboxes']['made']}, commands run in them {out['sandboxes']['runs']}; "
          f"descendant processes (and zombies) before {out['processes']['before']}, after {out['processes']['after']}; "
          f"sandbox folders left {out['sandbox_dirs_after']}; engine {out['engine_stats']}")
    for k, v in out["slopes_per_100_steps"].items():
        print(f"slope {k:>20}: {v:+.3f} per 100 steps (max after warm-up {out['max_after_warmup'][k]:.1f})")
    print(json.dumps({"machine": machine_state(), **{k: v for k, v in out.items() if k != "samples"}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
