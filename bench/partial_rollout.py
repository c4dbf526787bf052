"""Benchmark: partial rollout (λ = 0.7) against synchronous rollout (λ = 1) on a heavy-tailed
agentic workload (issue 6, part 5).

Workload: real ``agents.search`` episodes (search / open / submit tool calls against the real
environment, rewarded by its verifier) sampled at temperature 1 by a small Qwen3-MoE policy
that first learns them: AdamW on the reference trajectory of one task whose first think
channel is padded with a filler of random length, so the policy itself decides how long it
"thinks" before its tool calls, then runs the 5-turn tool-calling episode. The filler length
of a training sample is long-tailed: with probability ``--long-frac`` uniform in
[``--long-min``, ``--long-max``] words (the rare long reasoning), else Pareto(x_m=1,
``--alpha``) - 1 words capped at 16 (a pure Pareto tail is not learned well enough by a tiny
model in seconds: its sampled lengths came out nearly light-tailed). The policy's actual
sampled lengths (median / p90 / max output tokens) are printed for both modes. Both modes use
the same policy, prompts (the task, one group of K per prompt), seeds and engine settings.

Per mode: ``--iters`` iterations of N prompts x K samples through `PartialRolloutScheduler`
(synchronous = λ 1: every iteration waits for all N·K). Between iterations the engine's
version is bumped with ``update_weights`` (same tensors: a stand-in for the train step,
whose time is not counted), so tokens carry versions and staleness is real. Throughput =
completed groups delivered to training / rollout wall time. ``speedup_vs_sync`` = partial /
synchronous groups per second (target >= 2.5). Also printed: the per-token staleness
histogram at dispatch, the KV-pool hit rate (paused trajectories resumed with their KV:
engine-resident or prefetched from the CPU pool, over all such resumes), the episode
success rate and lengths.

Prints human-readable lines, then one final JSON line with ``speedup_vs_sync``,
``partial_groups_per_s``, ``sync_groups_per_s``, ``kv_hit_rate``, ``staleness_hist``, ...

Usage: python bench/partial_rollout.py [--iters 6] [--n 8] [--k 4] [--threads 1]

Shape legend: T tokens of one training sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from k3post.commands import default_corpus
from k3post.envs.episode import run_episode_sync
from k3post.envs.families.registry import get_family
from k3post.envs.task import Task
from k3post.envs.tools import openai_tools
from k3post.models import build_tiny_moe
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.engine import SamplingParams
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.tokenizer import train_tokenizer
from k3post.xtml import XTML


def train_policy(args: argparse.Namespace) -> tuple[Any, Any, XTML, Task]:
    """A small Qwen3-MoE that runs the reference agents.search episode of one task after a
    filler "thinking" of heavy-tailed length; returns (model, tokenizer, xtml, task)."""
    tok = train_tokenizer(default_corpus(n_per_family=2, n_main=4), vocab_size=1024)
    xtml = XTML(tok)
    fam = get_family("agents.search")
    task = fam.generate(1, seed=0)[0]
    env = fam.make_env(task)
    ep = run_episode_sync(fam.reference_policy(task, "low"), env, task)
    tools = openai_tools(env.tool_specs())
    first = next(i for i, m in enumerate(ep.messages) if m["role"] == "assistant")
    rng = random.Random(args.seed)
    model = build_tiny_moe(
        len(tok), seed=args.seed, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id,
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        moe_intermediate_size=64, num_experts=4, intermediate_size=128,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for step in range(args.train_steps):
        if rng.random() < args.long_frac:
            filler = rng.randint(args.long_min, args.long_max)
        else:
            filler = min(16, int((1.0 - rng.random()) ** (-1.0 / args.alpha)) - 1)
        msgs = [dict(m) for m in ep.messages]
        msgs[first]["reasoning_content"] = " ".join(["step"] * filler)
        r = xtml.render(msgs, tools=tools)
        ids_1T = torch.tensor(r.ids)[None]
        labels_1T = ids_1T.clone()
        labels_1T[0, ~torch.tensor(r.loss_mask)] = -100
        lr = args.lr * min(1.0, (step + 1) / 10) * (0.1 if step >= 0.7 * args.train_steps else 1.0)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(ids_1T, labels=labels_1T).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    print(f"policy trained: {args.train_steps} steps in {time.perf_counter() - t0:.1f} s, last loss {float(loss.detach()):.4f}")
    return model.eval(), tok, xtml, task


def run_mode(args: argparse.Namespace, policy: tuple[Any, Any, XTML, Task], lambda_: float) -> dict[str, Any]:
    """``--iters`` iterations at ``lambda_``; throughput, staleness, KV statistics."""
    model, tok, xtml, task = policy
    engine = EmbeddedEngine(model, tok, max_batch_size=args.slots, seed=args.seed)
    fam = get_family(task.family)
    loop = AgentLoop(engine, xtml, fam.make_env, sampling=SamplingParams(temperature=1.0, max_tokens=args.max_turn_tokens))
    pool = KVPool(args.pool_mb << 20)
    sch = PartialRolloutScheduler(
        loop, n_prompts=args.n, k=args.k, lambda_=lambda_, max_staleness=args.max_staleness, seed=args.seed,
        kv_pool=pool, resident_kv_bytes=0,
    )
    sch.add_prompts([task] * (args.n * (args.iters + 2)))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    wall = 0.0
    groups = []
    per_iter = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        gs = sch.run_iteration()
        dt = time.perf_counter() - t0
        wall += dt
        groups += gs
        per_iter.append((len(gs), round(dt, 2)))
        engine.update_weights(weights)  # the train step's weight sync (time not counted)
    trajs = [t for g in groups for t in g.trajectories]
    out = {
        "groups": len(groups),
        "wall_s": wall,
        "groups_per_s": len(groups) / wall,
        "per_iter": per_iter,
        "success": sum(t.reward == 1.0 for t in trajs) / max(1, len(trajs)),
        "mean_turns": statistics.mean(t.turns for t in trajs) if trajs else 0.0,
        "output_tokens": sorted(t.output_tokens for t in trajs),
        "staleness_hist": dict(sorted(sch.staleness_hist.items())),
        "kv_hit_rate": sch.kv_hit_rate(),
        "stats": dict(sch.stats),
        "pool": dict(pool.stats),
        "engine_steps": engine.stats["steps"],
        "groups_per_kstep": 1000.0 * len(groups) / max(1, engine.stats["steps"]),
        "prefill_tokens": engine.stats["prefill_tokens"],
        "decode_tokens": engine.stats["decode_tokens"],
    }
    loop.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--n", type=int, default=8, help="prompts per iteration (N)")
    p.add_argument("--k", type=int, default=4, help="samples per prompt (K)")
    p.add_argument("--lambda_", type=float, default=0.7)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--slots", type=int, default=32, help="engine slots (max_batch_size)")
    p.add_argument("--pool-mb", type=int, default=256, help="CPU KV pool budget (MiB)")
    p.add_argument("--max-turn-tokens", type=int, default=1024)
    p.add_argument("--train-steps", type=int, default=700)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of the short thinking filler")
    p.add_argument("--long-frac", type=float, default=0.2, help="fraction of long thinking fillers")
    p.add_argument("--long-min", type=int, default=300)
    p.add_argument("--long-max", type=int, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if not 0.0 < args.lambda_ < 1.0:
        raise ValueError(f"--lambda_ must be in (0, 1) for the partial mode, got {args.lambda_}")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    policy = train_policy(args)
    sync = run_mode(args, policy, 1.0)
    part = run_mode(args, policy, args.lambda_)
    for name, r in (("synchronous (λ=1)", sync), (f"partial (λ={args.lambda_})", part)):
        toks = r["output_tokens"]
        print(f"{name}: {r['groups']} groups in {r['wall_s']:.1f} s = {r['groups_per_s']:.3f} groups/s; "
              f"per iteration (groups, s) {r['per_iter']}")
        if toks:
            print(f"  success {r['success']:.2f}, mean turns {r['mean_turns']:.2f}, output tokens median "
                  f"{statistics.median(toks)}, p90 {toks[int(0.9 * (len(toks) - 1))]}, max {toks[-1]}")
        print(f"  staleness histogram (versions behind at dispatch: tokens) {r['staleness_hist']}")
        print(f"  KV: hit rate {r['kv_hit_rate']:.2f}, scheduler {r['stats']}, pool {r['pool']}")
        print(f"  engine: {r['engine_steps']} steps ({r['groups_per_kstep']:.2f} groups per 1000 steps), "
              f"prefill tokens {r['prefill_tokens']}, decode tokens {r['decode_tokens']}")
    speedup = part["groups_per_s"] / sync["groups_per_s"]
    print(f"speedup_vs_sync: {speedup:.2f}x (target >= 2.5)")
    result = {
        "speedup_vs_sync": round(speedup, 3),
        "partial_groups_per_s": round(part["groups_per_s"], 4),
        "sync_groups_per_s": round(sync["groups_per_s"], 4),
        "partial_groups": part["groups"],
        "sync_groups": sync["groups"],
        "kv_hit_rate": round(part["kv_hit_rate"], 4),
        "staleness_hist": {str(k): v for k, v in part["staleness_hist"].items()},
        "speedup_vs_sync_per_engine_step": round(part["groups_per_kstep"] / sync["groups_per_kstep"], 3),
        "partial_prefill_tokens": part["prefill_tokens"],
        "partial_decode_tokens": part["decode_tokens"],
        "sync_prefill_tokens": sync["prefill_tokens"],
        "sync_decode_tokens": sync["decode_tokens"],
        "partial_success": round(part["success"], 3),
        "sync_success": round(sync["success"], 3),
        "lambda": args.lambda_,
        "n": args.n,
        "k": args.k,
        "iters": args.iters,
        "threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
