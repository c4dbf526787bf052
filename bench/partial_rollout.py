"""Benchmark: partial rollout (λ = 0.7) against synchronous rollout (λ = 1) on a heavy-tailed
agentic workload (issue 6, part 5).

**Workload.** Real ``agents.search`` episodes (a 2-hop question over the task's corpus:
search / open / search / open / submit tool calls against the real environment, rewarded by
its verifier), sampled at temperature 1 (no top-k / top-p, no ``ignore_eos``: every length is
the policy's own stop decision) by a small Qwen3-MoE policy (hidden 64, 2 layers, 4 experts,
``--max-pos`` positions) that first learns them. Its training data is the reference
trajectory of one task whose first think channel is a filler of a drawn length, which the
policy must learn to draw itself:

* **regime choice**: the first filler word selects a length regime ``i`` with probability
  ``pi_i`` (``--regimes word:pi:mean,...``; the words are single tokens);
* **length**: the same word repeats; after each word the policy stops with hazard
  ``h_i = 1 / mean_i`` (a geometric number of words, mean ``mean_i``), capped at
  ``--filler-cap`` words in training; then the 5-turn tool-calling episode follows.

The filler length is thus a mixture of geometric distributions (hyperexponential), the
standard finite approximation of a Pareto tail. Defaults: ``a`` (p 0.45, mean 4 words),
``to`` (0.3, 40), ``think`` (0.25, 1,000), filler cap 4,000 in training, turns capped at
``--max-turn-tokens`` 4,096 in sampling (finish "length", reward 0: the usual response-length
cap of RL), 5,632 positions. Measured on the sampled episodes (printed): output tokens p50
274, p90 1,102, p99 2,807, max 4,096, i.e. p50 : p90 : max = 1 : 4 : 15 (the ~267 output
tokens of the five tool-call turns are the floor); regime frequencies 0.47 / 0.28 / 0.25 with
mean thinking 4 / 37 / 880 tokens. Each regime is an order-1 Markov chain (the next token
depends only on the current filler word), which a tiny model learns from **soft targets**: at
the regime-choice position the loss is the cross-entropy against ``pi`` over the regime
words, at each filler position against ``(1 - h_i, h_i)`` over (next word, ``<|close|>``);
every other trainable token has its usual hard target. The sampled regime frequencies and
mean thinking tokens per regime are printed, to check that the policy reproduces them.

**Protocol.** Both modes use the same policy, prompt stream (the task, one group of K per
prompt), seeds and engine settings (``--slots`` slots, CPU KV pool ``--pool-mb``, every
paused KV evicted to the pool), each with its own engine over the shared model. Per mode:
``--iters`` iterations of N prompts x K samples through `PartialRolloutScheduler`
(synchronous = λ 1: every iteration waits for all N·K); the two modes' iterations are
interleaved (sync 1, partial 1, sync 2, ...) so that load from other processes on the
machine hits both alike. After every iteration the engine's version is bumped with
``update_weights`` (same tensors: a stand-in for the train step, whose time is not counted),
so tokens carry versions and staleness admission (``--max-staleness``) is real.

Throughput = completed groups delivered to training / rollout wall time; ``speedup_vs_sync``
= partial / synchronous groups per second (target >= 2.5). The first iteration of each mode
is pipeline warm-up for partial rollout (its active set starts empty), so the steady-state
ratio without it (``speedup_vs_sync_steady``) is reported too, with the same ratio per CPU
second (process time) and per engine step (``speedup_vs_sync_per_engine_step``: the ratio a
machine whose decode step costs the same at any batch size would see, as a GPU roughly does
for a model whose weights outweigh its KV cache; on this CPU the tiny model's step cost grows
with the rows and, through attention, with each row's context).

Also printed: per iteration (groups, engine steps, seconds, admission blocked: a blocked
iteration only resumes paused trajectories and, having fewer than λ·N·K, drains them), the
engine step cost by decode batch size (mean ms per ``step()`` call, bucketed by the rows
decoded in it; the rest of the rollout time is the scheduler / agent loop / env, printed as
``outside_engine_s``), the per-token staleness histogram at dispatch, the KV-pool hit rate,
success rate and sampled output-length quantiles.

Prints human-readable lines, then one final JSON line with ``speedup_vs_sync``,
``speedup_vs_sync_steady``, ``partial_groups_per_s``, ``sync_groups_per_s``, ...

Usage: OMP_NUM_THREADS=1 python bench/partial_rollout.py [--iters 16] [--n 8] [--k 4] [--regimes ...]
(about 2 minutes on an idle core, ~45 s of it policy training; up to ~6 under heavy load from other processes).

Shape legend: T tokens of one training sequence, V vocabulary, R length regimes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from k3post.commands import default_corpus
from k3post.envs.episode import run_episode_sync
from k3post.envs.families.registry import get_family
from k3post.envs.task import Task
from k3post.envs.tools import openai_tools
from k3post.models import build_tiny_moe
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import GenerationResult, SamplingParams
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.tokenizer import train_tokenizer
from k3post.xtml import XTML

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def parse_regimes(spec: str) -> list[tuple[str, float, float]]:
    """``"a:0.5:4,to:0.3:40"`` -> [(word, probability, mean words)]; probabilities sum to 1."""
    out = []
    for part in spec.split(","):
        word, p, mean = part.split(":")
        if float(mean) < 1.0:
            raise ValueError(f"regime {word!r}: mean must be >= 1 word, got {mean}")
        out.append((word, float(p), float(mean)))
    if abs(sum(p for _, p, _ in out) - 1.0) > 1e-6:
        raise ValueError(f"regime probabilities must sum to 1, got {sum(p for _, p, _ in out)}")
    return out


class TimedEngine(EmbeddedEngine):
    """`EmbeddedEngine` that records (rows decoded, seconds) of every ``step()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_log: list[tuple[int, float]] = []

    def step(self) -> list[GenerationResult]:
        rows = self.num_running
        t0 = time.perf_counter()
        out = super().step()
        self.step_log.append((rows, time.perf_counter() - t0))
        return out


def train_policy(args: argparse.Namespace) -> tuple[Any, Any, XTML, Task]:
    """The policy (module doc): returns (model, tokenizer, xtml, task)."""
    regimes = parse_regimes(args.regimes)
    tok = train_tokenizer(default_corpus(n_per_family=2, n_main=4), vocab_size=1024)
    xtml = XTML(tok)
    first_ids, next_ids = [], []
    for word, _, _ in regimes:
        a, b = (tok(s, add_special_tokens=False)["input_ids"] for s in (word, " " + word))
        if len(a) != 1 or len(b) != 1:
            raise ValueError(f"regime word {word!r} is not a single token ({a}, {b}); pick another")
        first_ids.append(a[0])
        next_ids.append(b[0])
    fam = get_family("agents.search")
    task = fam.generate(1, seed=0)[0]
    env = fam.make_env(task)
    ep = run_episode_sync(fam.reference_policy(task, "low"), env, task)
    tools = openai_tools(env.tool_specs())
    first = next(i for i, m in enumerate(ep.messages) if m["role"] == "assistant")
    base = xtml.render(ep.messages, tools=tools).ids
    rng = random.Random(args.seed)
    model = build_tiny_moe(
        len(tok), seed=args.seed, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id,
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        moe_intermediate_size=64, num_experts=4, intermediate_size=128, max_position_embeddings=args.max_pos,
    )
    if args.policy_cache and os.path.isfile(args.policy_cache):
        model.load_state_dict(torch.load(args.policy_cache))
        print(f"policy loaded from {args.policy_cache}")
        return model.eval(), tok, xtml, task
    pi_R = torch.tensor([p for _, p, _ in regimes])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    n_tokens = 0
    for step in range(args.train_steps):
        i = rng.choices(range(len(regimes)), weights=[p for _, p, _ in regimes])[0]
        word, _, mean = regimes[i]
        h = 1.0 / mean
        n = 1 if h >= 1.0 else 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - h))
        n = min(n, args.filler_cap)
        msgs = [dict(m) for m in ep.messages]
        msgs[first]["reasoning_content"] = " ".join([word] * n)
        r = xtml.render(msgs, tools=tools)
        s = next(j for j, (x, y) in enumerate(zip(base, r.ids)) if x != y)  # first filler token
        assert r.ids[s : s + n + 1] == [first_ids[i]] + [next_ids[i]] * (n - 1) + [xtml.close_id]
        ids_T = torch.tensor(r.ids)
        mask_T = torch.tensor(r.loss_mask)
        logp_TV = F.log_softmax(model(ids_T[None]).logits[0, :-1].float(), dim=-1)  # row t predicts token t+1
        nll_T = -logp_TV.gather(1, ids_T[1:, None])[:, 0]
        # soft targets: the regime choice (row s-1) and the stop decisions (rows s .. s+n-1)
        nll_T[s - 1] = -(pi_R * logp_TV[s - 1, first_ids]).sum()
        rows = torch.arange(s, s + n)
        nll_T[rows] = -((1.0 - h) * logp_TV[rows, next_ids[i]] + h * logp_TV[rows, xtml.close_id])
        loss = nll_T[mask_T[1:]].mean()
        n_tokens += len(r.ids)
        lr = args.lr * min(1.0, (step + 1) / 10) * (0.1 if step >= 0.7 * args.train_steps else 1.0)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    print(f"policy trained: {args.train_steps} steps ({n_tokens} tokens) in {time.perf_counter() - t0:.1f} s, "
          f"last loss {float(loss.detach()):.4f}")
    if args.policy_cache:
        torch.save(model.state_dict(), args.policy_cache)
    return model.eval(), tok, xtml, task


def step_costs(log: list[tuple[int, float]]) -> dict[str, list[float]]:
    """Engine steps bucketed by rows decoded (bucket b: b <= rows < next bucket): [steps, mean ms]."""
    out: dict[str, list[float]] = {}
    for lo, hi in zip(BATCH_BUCKETS, BATCH_BUCKETS[1:] + (10**9,)):
        ts = [t for rows, t in log if lo <= rows < hi]
        if ts:
            out[f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"] = [len(ts), round(1000 * statistics.mean(ts), 2)]
    return out


class ModeRun:
    """One mode (λ) of the bench: its own engine over the shared policy, agent loop, KV pool
    and scheduler; `iteration` runs and times one scheduler iteration, `summary` the totals."""

    def __init__(self, args: argparse.Namespace, policy: tuple[Any, Any, XTML, Task], lambda_: float) -> None:
        model, self.tok, xtml, task = policy
        self.engine = TimedEngine(model, self.tok, max_batch_size=args.slots, seed=args.seed)
        sampling = SamplingParams(temperature=1.0, max_tokens=args.max_turn_tokens)
        self.loop = AgentLoop(self.engine, xtml, get_family(task.family).make_env, sampling=sampling)
        self.sch = PartialRolloutScheduler(
            self.loop, n_prompts=args.n, k=args.k, lambda_=lambda_, max_staleness=args.max_staleness,
            seed=args.seed, kv_pool=KVPool(args.pool_mb << 20), resident_kv_bytes=0,
        )
        self.sch.add_prompts([task] * (args.n * (args.iters + 2)))
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.groups: list[Any] = []
        self.per_iter: list[dict[str, Any]] = []

    def iteration(self) -> None:
        """One scheduler iteration (timed), then the weight sync of the train step (not timed)."""
        blocked = self.sch.stats["admission_blocked"]
        n_steps = len(self.engine.step_log)
        t0, c0 = time.perf_counter(), time.process_time()
        gs = self.sch.run_iteration()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.groups += gs
        self.per_iter.append({
            "groups": len(gs), "steps": len(self.engine.step_log) - n_steps, "wall_s": wall, "cpu_s": cpu,
            "engine_s": sum(t for _, t in self.engine.step_log[n_steps:]),
            "blocked": self.sch.stats["admission_blocked"] > blocked,
        })
        self.engine.update_weights(self.weights)  # same tensors: only the version moves

    def summary(self) -> dict[str, Any]:
        """Throughput (overall and steady: without the first iteration), staleness, KV, step costs."""

        def rate(its: list[dict[str, Any]], key: str) -> float:
            return sum(it["groups"] for it in its) / max(1e-9, sum(it[key] for it in its))

        trajs = [t for g in self.groups for t in g.trajectories]
        per_iter, steady = self.per_iter, self.per_iter[1:]
        out = {
            "groups": len(self.groups),
            "wall_s": sum(it["wall_s"] for it in per_iter),
            "groups_per_s": rate(per_iter, "wall_s"),
            "groups_per_s_steady": rate(steady, "wall_s"),
            "groups_per_cpu_s_steady": rate(steady, "cpu_s"),
            "groups_per_kstep": 1000.0 * rate(per_iter, "steps"),
            "groups_per_kstep_steady": 1000.0 * rate(steady, "steps"),
            "outside_engine_s": sum(it["wall_s"] - it["engine_s"] for it in per_iter),
            "per_iter": [(it["groups"], it["steps"], round(it["wall_s"], 2)) + (("blocked",) if it["blocked"] else ())
                         for it in per_iter],
            "blocked_iters": sum(it["blocked"] for it in per_iter),
            "success": sum(t.reward == 1.0 for t in trajs) / max(1, len(trajs)),
            "finish": dict(Counter(t.finish for t in trajs)),
            "output_tokens": sorted(t.output_tokens for t in trajs),
            "regimes": regime_stats(self.tok, trajs),
            "staleness_hist": dict(sorted(self.sch.staleness_hist.items())),
            "kv_hit_rate": self.sch.kv_hit_rate(),
            "stats": dict(self.sch.stats),
            "engine_steps": self.engine.stats["steps"],
            "step_costs": step_costs(self.engine.step_log),
            "prefill_tokens": self.engine.stats["prefill_tokens"],
            "decode_tokens": self.engine.stats["decode_tokens"],
        }
        self.loop.close()
        return out


def run_modes(args: argparse.Namespace, policy: tuple[Any, Any, XTML, Task]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Synchronous and partial rollout, their iterations interleaved (sync 1, partial 1, sync 2,
    ...) so that load from other processes on the machine hits both alike."""
    sync, part = ModeRun(args, policy, 1.0), ModeRun(args, policy, args.lambda_)
    for _ in range(args.iters):
        sync.iteration()
        part.iteration()
    return sync.summary(), part.summary()


def regime_stats(tok: Any, trajs: list[Any]) -> dict[str, list[float]]:
    """Per first think token (the sampled regime word): [trajectories, mean thinking tokens]."""
    by: dict[str, list[int]] = {}
    for t in trajs:
        by.setdefault(tok.convert_ids_to_tokens(t.token_ids[t.prompt_len]), []).append(t.thinking_tokens)
    return {w: [len(v), round(statistics.mean(v), 1)] for w, v in sorted(by.items(), key=lambda kv: -len(kv[1]))}


def quantiles(xs: list[int]) -> dict[str, int]:
    """p50 / p90 / p99 / max of a sorted list (nearest rank below)."""
    return {q: xs[int(f * (len(xs) - 1))] for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="prompts per iteration (N)")
    p.add_argument("--k", type=int, default=4, help="samples per prompt (K)")
    p.add_argument("--lambda_", type=float, default=0.7)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--slots", type=int, default=32, help="engine slots (max_batch_size)")
    p.add_argument("--pool-mb", type=int, default=256, help="CPU KV pool budget (MiB)")
    p.add_argument("--max-turn-tokens", type=int, default=4096)
    p.add_argument("--max-pos", type=int, default=5632, help="model positions (max_model_len)")
    p.add_argument("--regimes", default="a:0.45:4,to:0.3:40,think:0.25:1000",
                   help="word:probability:mean filler words, comma-separated")
    p.add_argument("--filler-cap", type=int, default=4000, help="longest training filler (words)")
    p.add_argument("--train-steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--policy-cache", default="", help="load the policy from / save it to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if not 0.0 < args.lambda_ < 1.0:
        raise ValueError(f"--lambda_ must be in (0, 1) for the partial mode, got {args.lambda_}")
    if args.iters < 2:
        raise ValueError(f"--iters must be >= 2 (the steady state excludes the first iteration), got {args.iters}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    t_start = time.perf_counter()
    policy = train_policy(args)
    sync, part = run_modes(args, policy)
    lengths = quantiles(sync["output_tokens"])  # every admitted trajectory of a λ = 1 run: the unbiased sample
    for name, r in (("synchronous (λ=1)", sync), (f"partial (λ={args.lambda_})", part)):
        print(f"{name}: {r['groups']} groups in {r['wall_s']:.1f} s = {r['groups_per_s']:.3f} groups/s "
              f"(steady {r['groups_per_s_steady']:.3f}/s, {r['groups_per_cpu_s_steady']:.3f}/CPU s); "
              f"{r['engine_steps']} engine steps = {r['groups_per_kstep']:.2f} groups per 1000 steps "
              f"(steady {r['groups_per_kstep_steady']:.2f}); outside engine {r['outside_engine_s']:.1f} s")
        print(f"  per iteration (groups, steps, s[, blocked]): {r['per_iter']}")
        print(f"  engine step cost by rows decoded {{rows: [steps, mean ms]}}: {r['step_costs']}")
        print(f"  success {r['success']:.2f}, finish {r['finish']}, output tokens {quantiles(r['output_tokens'])}, "
              f"regimes {{first think token: [trajectories, mean thinking tokens]}} {r['regimes']}")
        print(f"  staleness histogram (versions behind at dispatch: tokens) {r['staleness_hist']}")
        print(f"  KV: hit rate {r['kv_hit_rate']:.2f}, scheduler {r['stats']}")
        print(f"  prefill tokens {r['prefill_tokens']}, decode tokens {r['decode_tokens']}")
    speedup = part["groups_per_s"] / sync["groups_per_s"]
    steady = part["groups_per_s_steady"] / sync["groups_per_s_steady"]
    print(f"sampled output tokens (λ=1 run) {lengths}, p50 : p90 : max = 1 : "
          f"{lengths['p90'] / lengths['p50']:.1f} : {lengths['max'] / lengths['p50']:.1f}")
    print(f"speedup_vs_sync: {speedup:.2f}x, steady (first iteration of each mode excluded) {steady:.2f}x "
          f"(target >= 2.5); total bench time {time.perf_counter() - t_start:.0f} s")
    result = {
        "speedup_vs_sync": round(speedup, 3),
        "speedup_vs_sync_steady": round(steady, 3),
        "speedup_vs_sync_steady_cpu": round(part["groups_per_cpu_s_steady"] / sync["groups_per_cpu_s_steady"], 3),
        "speedup_vs_sync_per_engine_step": round(part["groups_per_kstep"] / sync["groups_per_kstep"], 3),
        "speedup_vs_sync_per_engine_step_steady": round(part["groups_per_kstep_steady"] / sync["groups_per_kstep_steady"], 3),
        "partial_groups_per_s": round(part["groups_per_s"], 4),
        "sync_groups_per_s": round(sync["groups_per_s"], 4),
        "partial_groups_per_kstep": round(part["groups_per_kstep"], 3),
        "sync_groups_per_kstep": round(sync["groups_per_kstep"], 3),
        "partial_groups": part["groups"],
        "sync_groups": sync["groups"],
        "partial_blocked_iters": part["blocked_iters"],
        "output_tokens_quantiles": lengths,
        "kv_hit_rate": round(part["kv_hit_rate"], 4),
        "staleness_hist": {str(k): v for k, v in part["staleness_hist"].items()},
        "partial_step_costs": part["step_costs"],
        "sync_step_costs": sync["step_costs"],
        "partial_outside_engine_s": round(part["outside_engine_s"], 2),
        "sync_outside_engine_s": round(sync["outside_engine_s"], 2),
        "partial_success": round(part["success"], 3),
        "sync_success": round(sync["success"], 3),
        "lambda": args.lambda_,
        "n": args.n,
        "k": args.k,
        "iters": args.iters,
        "regimes": args.regimes,
        "threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
