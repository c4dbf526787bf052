"""Benchmark: partial rollout (λ = 0.7) against synchronous rollout (λ = 1) on a heavy-tailed
agentic workload of many distinct tasks (issue 6, part 5; issue 14: like with like).

**Workload.** Real ``agents.search`` episodes over ``--repeats`` x N x (``--iters`` + 2) DISTINCT tasks
(``make_tasks``: each task its own generated corpus and question; no task is repeated, so no two
groups share context beyond the system prompt and tool list, and the engine's prefix sharing and KV
reuse get no help from repeated prompts). Every episode is search / open / search / open / submit
tool calls against the real environment of its task, sampled at temperature 1 (no top-k / top-p, no
``ignore_eos``: every length is the policy's own stop decision) by a small Qwen3-MoE policy (hidden
64, 2 layers, 4 experts, ``--max-pos`` positions) that first learns them. Its training data is, per
step, one task's episode whose first think channel is a filler of a drawn length, which the policy
must learn to draw itself:

* **regime choice**: the first filler word selects a length regime ``i`` with probability
  ``pi_i`` (``--regimes word:pi:mean,...``; the words are single tokens);
* **length**: the same word repeats; after each word the policy stops with hazard
  ``h_i = 1 / mean_i`` (a geometric number of words, mean ``mean_i``), capped at
  ``--filler-cap`` words in training; then the 5-turn tool-calling episode follows.

The episode's tool calls are task-independent (``fixed_action_turns``: search "university" / open
d01 / search "city" / open d02 / submit "unknown"), while the question and every tool result are the
task's own. A 64-wide 2-layer policy cannot learn to copy entity names across hundreds of tasks:
trained on their reference trajectories (real names), it misspelt the names, got "No results." and
broke the XTML format right after (checked on 8 episodes after 600 and after 1,500 training steps:
all 8 ended "malformed", nearly all after one turn), which is not an agentic workload.
So rewards are 0 by design (``*_success``); the bench measures rollout throughput, not the policy.

The filler length is a mixture of geometric distributions (hyperexponential), the standard finite
approximation of a Pareto tail. Defaults: ``a`` (p 0.45, mean 4 words), ``to`` (0.3, 40), ``think``
(0.25, 1,000), filler cap 4,000 in training, turns capped at ``--max-turn-tokens`` 4,096 in sampling
(finish "length", the usual response-length cap of RL), 5,632 positions. Measured on the sampled
episodes of the synchronous runs (printed every run; default settings): output tokens p50 269, p90
1,200, p99 3,132, max 4,096, i.e. p50 : p90 : max = 1 : 4.5 : 15 (the ~267 output tokens of the five
tool-call turns are the floor); ~10% of episodes end "malformed" (the policy's own format slips).
Each regime is an order-1 Markov chain, which a tiny model learns from **soft targets**: at the
regime-choice position the loss is the cross-entropy against ``pi`` over the regime words, at each
filler position against ``(1 - h_i, h_i)`` over (next word, ``<|close|>``); every other trainable
token has its usual hard target. The sampled regime frequencies and mean thinking tokens per regime
are printed, to check that the policy reproduces them.

**Protocol.** ``--repeats`` (>= 3) independent repeats. In repeat r both modes get the same slice of
distinct tasks (one group of K per task, in the same order), the same policy, seeds and engine
settings (``--slots`` slots, CPU KV pool ``--pool-mb``, every paused KV evicted to the pool), each a
fresh engine over the shared model and a fresh scheduler; ``--iters`` iterations of N prompts x K
samples through `PartialRolloutScheduler` (synchronous = λ 1: every iteration waits for all N·K), the
two modes' iterations interleaved (sync 1, partial 1, sync 2, ...; partial first in odd repeats) so
that load from other processes hits both alike. After every iteration the engine's version is
bumped with ``update_weights`` (same tensors: a stand-in for the train step, whose time is not
counted), so tokens carry versions and staleness admission (``--max-staleness``) is real.

**What each ratio measures** (``bench/common.py`` ``ratio_summary``: ratio of the medians over
repeats, ``_min`` / ``_max`` over the paired repeats, ``_n``):

* ``speedup_vs_sync`` (THE HEADLINE, wall clock) = partial / synchronous completed groups delivered
  to training per second of rollout wall time, all iterations of a repeat. Excluded: policy
  training, task generation, engine construction and the weight-sync stand-in between iterations.
  Caveat: each repeat starts partial rollout's pipeline empty (its first iteration is a warm-up) and
  ends with its in-flight trajectories uncounted, so over a short repeat this understates what a long
  RL run would see. Target >= 2.5.
* ``speedup_vs_sync_steady`` (secondary, wall clock): the same without the first iteration of each
  mode; in-flight work at the start and at the end of the window then roughly cancels, so it is the
  long-run estimate, with the caveat that the stock of paused trajectories is not held equal.
* ``speedup_vs_sync_steady_cpu`` (diagnostic): the steady ratio per CPU second of this process, which
  on a shared machine is less affected by other processes.
* ``projected_speedup_vs_sync_const_step_cost`` (a PROJECTION, not a measurement): partial /
  synchronous groups per engine step, i.e. the wall-clock ratio only if wall time = engine steps x a
  constant step cost (``projected_speedup_assumption`` in the JSON): a decode step costing the same at
  any batch size and context, as a GPU roughly does for a model whose weights outweigh its KV cache,
  and nothing outside the engine costing time. On this CPU the step cost grows with the rows and,
  through attention, with each row's context (printed: step cost by rows decoded), so the projection
  is not what this machine delivers.

Also printed: per repeat and iteration (groups, engine steps, seconds, admission blocked: a blocked
iteration only resumes paused trajectories and, having fewer than λ·N·K, drains them), the engine step
cost by decode batch size (mean ms per ``step()`` call, bucketed by the rows decoded in it; the rest of
the rollout time is the scheduler / agent loop / env, printed as ``outside_engine_s``), the per-token
staleness histogram at dispatch, the KV-pool hit rate, finish reasons and sampled output-length
quantiles. ``machine`` (``machine_state()``) records the load average and CPU at the end of the run.

Prints human-readable lines, then one final JSON line: the ratios first (headline ``speedup_vs_sync``),
then ``partial_groups_per_s_*``, ``sync_groups_per_s_*``, counts, distributions, ``wall_s``, ``machine``.

**The cost model** (`k3post.rollout.cost_model`, issue 32). The scheduler makes no wall-clock decision, so a
run's time is the sum of its engine steps' costs plus the agent loop between them. Every timed step's
`StepWork` (rows decoded, their total context, prefill tokens) is recorded. ``--fit-curve FILE`` fits
``a + b·rows + c·context + d·[prefill] + e·prefill tokens`` (ms) to the synchronous runs' steps, writes it
(with the outside-engine cost per finished turn) and predicts both modes with it: the partial runs are out
of sample. ``--curve FILE`` predicts with another curve (e.g. ``bench/step_cost.py``'s kernel-level one).
Printed: predicted vs measured engine and wall seconds per mode, and by kind of step.

**The simulator** (``--simulate COST_CURVE --book FILE``, every number labelled SIMULATED). ``--save-book
FILE`` keeps every turn a real run sampled (after the timed iterations each mode drains its stream, untimed,
so every trajectory of every task is recorded). ``--simulate`` then runs the real scheduler, agent loop and
environments over `ReplayEngine`s (`k3post.rollout.replay`: the engine protocol over recorded tokens, each
step priced by the curve) for every (λ, staleness) of ``--sim-lambdas`` x ``--sim-staleness``, and with
``--sim-fixed-scale`` the same setting under the curve's fixed step cost scaled; prints the speed-up of each
and the best. With the weights unchanged, sampling is a function of (seed, context), so the replay of the
recorded setting reproduces the real run's step trace exactly (tests/test_replay.py).

Usage: OMP_NUM_THREADS=1 python bench/partial_rollout.py [--repeats 3] [--iters 10] [--n 8] [--k 4] [--regimes ...]
    [--device cuda] [--fit-curve fit.json] [--curve curve.json] [--save-book book.json.gz] [--policy-cache p.pt]
    python bench/partial_rollout.py --simulate fit.json --book book.json.gz [--sim-fixed-scale 1,4,16]
(measured: 3.5 minutes with the defaults on a quiet 2-core machine: 50 s of policy training, then ~50 s per
repeat; ``--policy-cache FILE`` skips the training on later runs; a simulation takes ~12 s per grid point).

Shape legend: T tokens of one training sequence, V vocabulary, R length regimes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_state, ratio_summary, summary  # noqa: E402

from k3post.stages.sft_data import default_corpus  # noqa: E402
from k3post.envs.episode import run_episode_sync  # noqa: E402
from k3post.envs.families.common import scripted_policy  # noqa: E402
from k3post.envs.families.registry import get_family  # noqa: E402
from k3post.envs.task import Task  # noqa: E402
from k3post.envs.tools import openai_tools  # noqa: E402
from k3post.models import build_tiny_moe  # noqa: E402
from k3post.rollout.agent_loop import AgentLoop  # noqa: E402
from k3post.rollout.embedded import EmbeddedEngine  # noqa: E402
from k3post.rollout.engine import GenerationResult, SamplingParams  # noqa: E402
from k3post.rollout.cost_model import CostCurve, fit_linear, predict_engine_s, step_work_summary  # noqa: E402
from k3post.rollout.kv_pool import KVPool  # noqa: E402
from k3post.rollout.replay import RecordingMixin, ReplayBook, ReplayEngine, load_books, save_books  # noqa: E402
from k3post.rollout.scheduler import PartialRolloutScheduler  # noqa: E402
from k3post.tokenizer import train_tokenizer  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
SEARCH_WORDS = ("university", "city", "company")
PROJECTION_ASSUMPTION = (
    "wall time = engine steps x one constant step cost (a decode step costs the same at any batch size and "
    "context, and nothing outside the engine costs time); not true on this CPU, where it grows with rows and context"
)


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


class TimedEngine(RecordingMixin, EmbeddedEngine):
    """`EmbeddedEngine` that records (rows decoded, seconds) of every ``step()``, its `StepWork`
    (``work_log``), the finished turns (``turns``) and their tokens (``book``, for ``--simulate``).
    On CUDA the clock stops after a ``torch.cuda.synchronize()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_log: list[tuple[int, float]] = []
        self.turns = 0
        self._cuda = self.device.type == "cuda"

    def step(self) -> list[GenerationResult]:
        rows = self.num_running
        t0 = time.perf_counter()
        out = super().step()
        if self._cuda:
            torch.cuda.synchronize()
        if self.tracing:  # not while draining after the timed iterations: then only the book records
            self.step_log.append((rows, time.perf_counter() - t0))
            self.turns += sum(r.finish_reason in ("stop", "length") for r in out)
        return out


def make_tasks(count: int, seed: int) -> list[Task]:
    """``count`` distinct ``agents.search`` tasks (each its own generated corpus and question); raises if two
    render the same prompt (the workload must not repeat a task)."""
    tasks = get_family("agents.search").generate(count, seed=seed)
    prompts = {json.dumps(list(t.messages), sort_keys=True) for t in tasks}
    if len(tasks) != count or len(prompts) != count:
        raise ValueError(f"asked for {count} distinct tasks, got {len(tasks)} with {len(prompts)} distinct prompts")
    return tasks


def fixed_action_turns(task: Task) -> list[dict[str, Any]]:
    """The reference turns of ``task`` (``agents.search`` at effort "low": search / open per hop, then
    submit) with every tool argument replaced by a task-independent one: search ``SEARCH_WORDS[i]`` (words
    every generated corpus matches), open ``d01``, ``d02``, ..., submit ``unknown``. A tiny policy cannot
    learn to copy entity names across hundreds of tasks (module doc); these calls it can learn, and the
    tool results they get still differ per task."""
    turns = get_family("agents.search").reference_turns(task, "low")
    out, n_search, n_open = [], 0, 0
    for turn in turns:
        turn = json.loads(json.dumps(turn))
        for call in turn.get("tool_calls") or []:
            fn = call["function"]
            if fn["name"] == "search":
                fn["arguments"] = json.dumps({"query": SEARCH_WORDS[n_search % len(SEARCH_WORDS)]})
                n_search += 1
            elif fn["name"] == "open":
                n_open += 1
                fn["arguments"] = json.dumps({"doc_id": f"d{n_open:02d}"})
            else:
                fn["arguments"] = json.dumps({"answer": "unknown"})
        out.append(turn)
    return out


def make_tokenizer() -> tuple[Any, XTML]:
    """The policy's BPE tokenizer (trained on the built-in corpus; deterministic) and its XTML."""
    tok = train_tokenizer(default_corpus(n_per_family=2, n_main=4), vocab_size=1024)
    return tok, XTML(tok)


def train_policy(args: argparse.Namespace, tasks: list[Task]) -> tuple[Any, Any, XTML]:
    """The policy (module doc), trained on the reference trajectories of ``tasks`` (one drawn task per
    step, each with a freshly drawn filler): returns (model, tokenizer, xtml)."""
    regimes = parse_regimes(args.regimes)
    tok, xtml = make_tokenizer()
    first_ids, next_ids = [], []
    for word, _, _ in regimes:
        a, b = (tok(s, add_special_tokens=False)["input_ids"] for s in (word, " " + word))
        if len(a) != 1 or len(b) != 1:
            raise ValueError(f"regime word {word!r} is not a single token ({a}, {b}); pick another")
        first_ids.append(a[0])
        next_ids.append(b[0])
    model = build_tiny_moe(
        len(tok), seed=args.seed, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id,
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        moe_intermediate_size=64, num_experts=4, intermediate_size=128, max_position_embeddings=args.max_pos,
    )
    if args.policy_cache and os.path.isfile(args.policy_cache):
        model.load_state_dict(torch.load(args.policy_cache))
        print(f"policy loaded from {args.policy_cache}")
        return model.eval(), tok, xtml
    fam = get_family("agents.search")
    refs = []  # (messages, tools, index of the first assistant message, rendered ids without filler)
    for task in tasks:
        env = fam.make_env(task)
        ep = run_episode_sync(scripted_policy(fixed_action_turns(task)), env, task)
        tools = openai_tools(env.tool_specs())
        first = next(i for i, m in enumerate(ep.messages) if m["role"] == "assistant")
        refs.append((ep.messages, tools, first, xtml.render(ep.messages, tools=tools).ids))
    rng = random.Random(args.seed)
    pi_R = torch.tensor([p for _, p, _ in regimes])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    n_tokens = 0
    for step in range(args.train_steps):
        messages, tools, first, base = refs[rng.randrange(len(refs))]
        i = rng.choices(range(len(regimes)), weights=[p for _, p, _ in regimes])[0]
        word, _, mean = regimes[i]
        h = 1.0 / mean
        n = 1 if h >= 1.0 else 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - h))
        n = min(n, args.filler_cap)
        msgs = [dict(m) for m in messages]
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
    print(f"policy trained on {len(tasks)} distinct tasks: {args.train_steps} steps ({n_tokens} tokens) in "
          f"{time.perf_counter() - t0:.1f} s, last loss {float(loss.detach()):.4f}")
    if args.policy_cache:
        torch.save(model.state_dict(), args.policy_cache)
    return model.eval(), tok, xtml


def step_costs(log: list[tuple[int, float]]) -> dict[str, list[float]]:
    """Engine steps bucketed by rows decoded (bucket b: b <= rows < next bucket): [steps, mean ms]."""
    out: dict[str, list[float]] = {}
    for lo, hi in zip(BATCH_BUCKETS, BATCH_BUCKETS[1:] + (10**9,)):
        ts = [t for rows, t in log if lo <= rows < hi]
        if ts:
            out[f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"] = [len(ts), round(1000 * statistics.mean(ts), 2)]
    return out


class ModeRun:
    """One mode (λ) in one repeat: its own engine over the shared policy, agent loop, KV pool and
    scheduler, fed ``tasks`` (one group of K per task, in order); `iteration` runs and times one
    scheduler iteration, `summary` the repeat's totals."""

    def __init__(self, args: argparse.Namespace, policy: tuple[Any, Any, XTML], lambda_: float, tasks: list[Task],
                 engine: Any = None, max_staleness: int | None = None) -> None:
        model, self.tok, xtml = policy
        self.engine = engine if engine is not None else TimedEngine(model, self.tok, max_batch_size=args.slots,
                                                                    seed=args.seed)
        sampling = SamplingParams(temperature=1.0, max_tokens=args.max_turn_tokens)
        self.loop = AgentLoop(self.engine, xtml, get_family("agents.search").make_env, sampling=sampling)
        self.sch = PartialRolloutScheduler(
            self.loop, n_prompts=args.n, k=args.k, lambda_=lambda_,
            max_staleness=args.max_staleness if max_staleness is None else max_staleness,
            seed=args.seed, kv_pool=KVPool(args.pool_mb << 20), resident_kv_bytes=0,
        )
        self.sch.add_prompts(tasks)
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()} if model is not None else {}
        self.groups: list[Any] = []
        self.per_iter: list[dict[str, Any]] = []
        self.simulated = isinstance(self.engine, ReplayEngine)

    def iteration(self) -> None:
        """One scheduler iteration (timed), then the weight sync of the train step (not timed)."""
        blocked = self.sch.stats["admission_blocked"]
        n_work = len(self.engine.work_log)
        if self.simulated:  # the modelled engine's clock; outside the engine: the curve's cost per turn
            t0, turns0 = self.engine.clock_s, self.engine.stats["turns"]
            gs = self.sch.run_iteration()
            turns = self.engine.stats["turns"] - turns0
            engine_s = self.engine.clock_s - t0
            wall = cpu = engine_s + turns * self.engine.curve.outside_ms_per_turn / 1000.0
        else:
            n_steps, turns0 = len(self.engine.step_log), self.engine.turns
            t0, c0 = time.perf_counter(), time.process_time()
            gs = self.sch.run_iteration()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            turns = self.engine.turns - turns0
            engine_s = sum(t for _, t in self.engine.step_log[n_steps:])
        self.groups += gs
        work = self.engine.work_log[n_work:]
        self.per_iter.append({
            "groups": len(gs), "steps": len(work), "wall_s": wall, "cpu_s": cpu, "engine_s": engine_s,
            "turns": turns, "work": work, "blocked": self.sch.stats["admission_blocked"] > blocked,
        })
        self.engine.update_weights(self.weights)  # same tensors: only the version moves

    def drain(self) -> None:
        """Untimed, after the timed iterations: run every prompt of the stream and every paused
        trajectory to its end, so the replay book holds every turn any scheduling of this stream needs."""
        self.engine.tracing = False
        while self.sch.num_pending_prompts or self.sch.paused():
            self.sch.run_iteration()

    def summary(self) -> dict[str, Any]:
        """This repeat's rates (all iterations; steady: without the first) and raw records to combine."""

        def rate(its: list[dict[str, Any]], key: str) -> float:
            return sum(it["groups"] for it in its) / max(1e-9, sum(it[key] for it in its))

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
            "engine_s": sum(it["engine_s"] for it in per_iter),
            "turns": sum(it["turns"] for it in per_iter),
            "work": [w for it in per_iter for w in it["work"]],
            "engine_s_steady": sum(it["engine_s"] for it in steady),
            "wall_s_steady": sum(it["wall_s"] for it in steady),
            "groups_steady": sum(it["groups"] for it in steady),
            "turns_steady": sum(it["turns"] for it in steady),
            "work_steady": [w for it in steady for w in it["work"]],
            "per_iter": [(it["groups"], it["steps"], round(it["wall_s"], 2)) + (("blocked",) if it["blocked"] else ())
                         for it in per_iter],
            "blocked_iters": sum(it["blocked"] for it in per_iter),
            "trajs": [t for g in self.groups for t in g.trajectories],
            "task_ids": [g.task["id"] for g in self.groups],
            "staleness_hist": Counter(self.sch.staleness_hist),
            "stats": Counter(self.sch.stats),
            "engine_steps": self.engine.stats["steps"],
            "step_log": list(getattr(self.engine, "step_log", [])),
            "prefill_tokens": self.engine.stats["prefill_tokens"],
            "decode_tokens": self.engine.stats["decode_tokens"],
        }
        if not self.simulated and self.engine.tracing:
            self.drain()
        out["book"] = getattr(self.engine, "book", None)
        self.loop.close()
        return out


def run_repeats(
    args: argparse.Namespace, policy: tuple[Any, Any, XTML], tasks: list[Task], *,
    replay: list[ReplayBook] | None = None, curve: CostCurve | None = None, lambda_: float | None = None,
    max_staleness: int | None = None, quiet: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``args.repeats`` repeats; in repeat r both modes get the same slice of distinct tasks (a fresh engine
    and scheduler each) and run their iterations interleaved (sync 1, partial 1, sync 2, ...; partial
    first in odd repeats) so that load from other processes hits both alike. With ``replay`` (one book
    per repeat) and ``curve``, each mode runs on a `ReplayEngine` instead: simulated."""
    per = prompts_per_repeat(args)
    lam = args.lambda_ if lambda_ is None else lambda_
    sync_runs, part_runs = [], []
    for r in range(args.repeats):
        stream = tasks[r * per : (r + 1) * per]
        engines: list[Any] = [None, None]
        if replay is not None:
            engines = [ReplayEngine(replay[r], curve, max_batch_size=args.slots, max_model_len=args.max_pos,
                                    seed=args.seed) for _ in range(2)]
        sync = ModeRun(args, policy, 1.0, stream, engines[0], max_staleness)
        part = ModeRun(args, policy, lam, stream, engines[1], max_staleness)
        order = (sync, part) if r % 2 == 0 else (part, sync)
        for _ in range(args.iters):
            for mode in order:
                mode.iteration()
        sync_runs.append(sync.summary())
        part_runs.append(part.summary())
        if not quiet:
            print(f"repeat {r}: sync {sync_runs[-1]['groups_per_s']:.3f} groups/s, partial "
                  f"{part_runs[-1]['groups_per_s']:.3f} groups/s, ratio "
                  f"{part_runs[-1]['groups_per_s'] / sync_runs[-1]['groups_per_s']:.2f} "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
    return sync_runs, part_runs


def prompts_per_repeat(args: argparse.Namespace) -> int:
    """Distinct tasks queued per repeat (both modes get the same ones): N per iteration plus 2 iterations'
    worth of slack for partial rollout's admission ahead."""
    return args.n * (args.iters + 2)


def combine(tok: Any, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's repeats together: per-repeat rate lists, pooled counts and distributions."""
    trajs = [t for r in runs for t in r["trajs"]]
    stats: Counter[str] = sum((r["stats"] for r in runs), Counter())
    resumes = stats["kv_resumes"]
    out: dict[str, Any] = {k: [r[k] for r in runs] for k in (
        "groups_per_s", "groups_per_s_steady", "groups_per_cpu_s_steady", "groups_per_kstep", "groups_per_kstep_steady")}
    out.update(
        groups=sum(r["groups"] for r in runs),
        wall_s=sum(r["wall_s"] for r in runs),
        outside_engine_s=sum(r["outside_engine_s"] for r in runs),
        per_iter=[r["per_iter"] for r in runs],
        distinct_tasks=len({i for r in runs for i in r["task_ids"]}),
        blocked_iters=sum(r["blocked_iters"] for r in runs),
        success=sum(t.reward == 1.0 for t in trajs) / max(1, len(trajs)),
        finish=dict(Counter(t.finish for t in trajs)),
        output_tokens=sorted(t.output_tokens for t in trajs),
        regimes=regime_stats(tok, trajs),
        staleness_hist=dict(sorted(sum((r["staleness_hist"] for r in runs), Counter()).items())),
        kv_hit_rate=(stats["kv_resident_hits"] + stats["kv_pool_hits"]) / resumes if resumes else 0.0,
        stats=dict(stats),
        engine_steps=sum(r["engine_steps"] for r in runs),
        step_costs=step_costs([x for r in runs for x in r["step_log"]]),
        prefill_tokens=sum(r["prefill_tokens"] for r in runs),
        decode_tokens=sum(r["decode_tokens"] for r in runs),
    )
    return out


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
    p.add_argument("--repeats", type=int, default=3, help="independent repeats (fresh engines, new tasks), >= 3")
    p.add_argument("--iters", type=int, default=10, help="iterations per mode per repeat")
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
    p.add_argument("--device", default="cpu", help="where the policy runs in rollout (cpu, cuda); trained on CPU")
    p.add_argument("--curve", default="", help="a cost curve (bench/step_cost.py) to predict this run's times with")
    p.add_argument("--fit-curve", default="", help="fit a linear cost curve to the synchronous runs' steps, write it "
                   "here and predict both modes with it")
    p.add_argument("--save-book", default="", help="write the sampled turns here (gzipped JSON) for --simulate")
    p.add_argument("--simulate", default="", metavar="COST_CURVE",
                   help="SIMULATE: replay --book's turns through the real scheduler, steps priced by this curve")
    p.add_argument("--book", default="", help="the --save-book file of a real run (for --simulate)")
    p.add_argument("--sim-lambdas", default="0.5,0.6,0.7,0.8,0.9")
    p.add_argument("--sim-staleness", default="1,2,4,8")
    p.add_argument("--sim-fixed-scale", default="",
                   help="--simulate: also price --lambda_ / --max-staleness with the curve's fixed step cost x each "
                        "of these factors (e.g. 1,4,16,64): how the gain grows with the share of fixed cost")
    p.add_argument("--outside-ms-per-turn", type=float, default=None,
                   help="--simulate: agent loop / env cost per finished turn (default: the curve's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.simulate and not args.book:
        raise ValueError("--simulate needs --book (the --save-book file of a real run)")
    for flag in ("curve", "simulate", "book"):  # checked before the run, not after it
        if getattr(args, flag) and not os.path.isfile(getattr(args, flag)):
            raise ValueError(f"--{flag.replace('_', '-')}: no such file {getattr(args, flag)!r}")
    if not 0.0 < args.lambda_ < 1.0:
        raise ValueError(f"--lambda_ must be in (0, 1) for the partial mode, got {args.lambda_}")
    if args.repeats < 3:
        raise ValueError(f"--repeats must be >= 3, got {args.repeats}")
    if args.iters < 2:
        raise ValueError(f"--iters must be >= 2 (the steady state excludes the first iteration), got {args.iters}")
    return args


BOOK_ARGS = ("seed", "n", "k", "iters", "repeats", "max_turn_tokens", "max_pos", "regimes", "filler_cap",
             "train_steps", "lr")


def residuals(runs: list[dict[str, Any]], curve: CostCurve) -> dict[str, list[float]]:
    """Measured vs predicted engine seconds by kind of step (decode only by rows, prefill only, decode +
    prefill): {kind: [steps, measured s, predicted s]}, to see where the model misses."""
    out: dict[str, list[float]] = {}
    for r in runs:
        for w, (_, t) in zip(r["work"], r["step_log"]):
            if w.rows and w.prefill:
                kind = "decode+prefill"
            elif w.prefill:
                kind = "prefill"
            else:
                kind = next(f"decode {lo}-{hi - 1}" for lo, hi in zip(BATCH_BUCKETS, BATCH_BUCKETS[1:] + (10**9,))
                            if lo <= w.rows < hi)
            row = out.setdefault(kind, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += t
            row[2] += curve.price(w) / 1000.0
    return {k: [v[0], round(v[1], 2), round(v[2], 2)] for k, v in sorted(out.items())}


def predict(sync_runs: list[dict[str, Any]], part_runs: list[dict[str, Any]], curve: CostCurve) -> dict[str, Any]:
    """The cost model against this run: engine seconds predicted from each mode's step trace by ``curve``
    vs measured, and the wall time with the outside-engine cost per turn of the synchronous runs."""
    turns = sum(r["turns"] for r in sync_runs)
    outside_ms = 1000.0 * sum(r["outside_engine_s"] for r in sync_runs) / max(1, turns)
    out: dict[str, Any] = {"outside_ms_per_turn_from_sync": round(outside_ms, 3), "curve_source": curve.source}
    rates = {}
    for mode, runs in (("sync", sync_runs), ("partial", part_runs)):
        pred_engine = [predict_engine_s(r["work"], curve) for r in runs]
        meas_engine = [r["engine_s"] for r in runs]
        pred_wall = [e + r["turns"] * outside_ms / 1000.0 for e, r in zip(pred_engine, runs)]
        meas_wall = [r["wall_s"] for r in runs]
        out[f"{mode}_engine_s_measured"] = round(sum(meas_engine), 2)
        out[f"{mode}_engine_s_predicted"] = round(sum(pred_engine), 2)
        out[f"{mode}_engine_error"] = round(sum(pred_engine) / sum(meas_engine) - 1.0, 4)
        out[f"{mode}_wall_s_measured"] = round(sum(meas_wall), 2)
        out[f"{mode}_wall_s_predicted"] = round(sum(pred_wall), 2)
        out[f"{mode}_wall_error"] = round(sum(pred_wall) / sum(meas_wall) - 1.0, 4)
        out[f"{mode}_work"] = {k: round(v, 1) for k, v in step_work_summary([w for r in runs for w in r["work"]]).items()}
        out[f"{mode}_by_kind"] = residuals(runs, curve)
        rates[mode] = [r["groups"] / w for r, w in zip(runs, pred_wall)]
    out.update(ratio_summary("predicted_speedup_vs_sync", rates["partial"], rates["sync"]))
    return out


def simulate(args: argparse.Namespace) -> None:
    """``--simulate``: the real scheduler, agent loop and environments over `ReplayEngine`s (the --book's
    turns, steps priced by the curve), sync vs partial for every (λ, staleness) of the grid. SIMULATED."""
    curve = CostCurve.load(args.simulate)
    books, meta = load_books(args.book)
    for k in BOOK_ARGS:
        if k in meta and meta[k] != getattr(args, k):
            print(f"--simulate: {k} = {meta[k]!r} as recorded in {args.book} (not {getattr(args, k)!r})")
            setattr(args, k, meta[k])
    if len(books) < args.repeats:
        raise ValueError(f"{args.book}: {len(books)} books for {args.repeats} repeats")
    if args.outside_ms_per_turn is not None:
        curve.outside_ms_per_turn = float(args.outside_ms_per_turn)
    tok, xtml = make_tokenizer()
    tasks = make_tasks(args.repeats * prompts_per_repeat(args), seed=args.seed)
    print(f"SIMULATED with the cost curve {args.simulate}: {curve.source}")
    print(f"  outside the engine {curve.outside_ms_per_turn:.2f} ms per finished turn; {args.slots} slots; "
          f"recorded by: {meta.get('recorded_on', '?')}")
    grid = []
    t0 = time.perf_counter()
    for lam in (float(x) for x in args.sim_lambdas.split(",")):
        for st in (int(x) for x in args.sim_staleness.split(",")):
            sync_runs, part_runs = run_repeats(args, (None, tok, xtml), tasks, replay=books, curve=curve, lambda_=lam,
                                               max_staleness=st, quiet=True)
            sync, part = combine(tok, sync_runs), combine(tok, part_runs)
            row = {"lambda": lam, "max_staleness": st}
            row.update(ratio_summary("sim_speedup_vs_sync", part["groups_per_s"], sync["groups_per_s"]))
            row.update(ratio_summary("sim_speedup_vs_sync_steady", part["groups_per_s_steady"], sync["groups_per_s_steady"]))
            row["sim_blocked_iters"] = part["blocked_iters"]
            row["sim_mean_rows_partial"] = round(step_work_summary([w for r in part_runs for w in r["work"]])["mean_rows"], 1)
            row["sim_mean_rows_sync"] = round(step_work_summary([w for r in sync_runs for w in r["work"]])["mean_rows"], 1)
            grid.append(row)
            print(f"SIMULATED λ {lam:.2f} staleness {st}: speedup {row['sim_speedup_vs_sync']:.2f}x "
                  f"({row['sim_speedup_vs_sync_min']:.2f}-{row['sim_speedup_vs_sync_max']:.2f}), steady "
                  f"{row['sim_speedup_vs_sync_steady']:.2f}x; rows per step sync {row['sim_mean_rows_sync']}, partial "
                  f"{row['sim_mean_rows_partial']}; blocked iterations {row['sim_blocked_iters']}", flush=True)
    scales = []
    for m in (float(x) for x in args.sim_fixed_scale.split(",") if x):
        c = curve.with_fixed_cost(m * float(curve.step_ms or 0.0), f"fixed step cost x {m:g}")
        sync_runs, part_runs = run_repeats(args, (None, tok, xtml), tasks, replay=books, curve=c, quiet=True)
        sync, part = combine(tok, sync_runs), combine(tok, part_runs)
        row = {"fixed_scale": m, "step_ms": round(float(c.step_ms or 0.0), 4)}
        row.update(ratio_summary("sim_speedup_vs_sync", part["groups_per_s"], sync["groups_per_s"]))
        engine_s = sum(r["engine_s"] for r in sync_runs)
        row["sync_fixed_share"] = round(sum(len(r["work"]) for r in sync_runs) * float(c.step_ms or 0.0) / 1000.0
                                        / max(1e-9, sum(r["wall_s"] for r in sync_runs)), 3)
        row["sync_engine_share"] = round(engine_s / max(1e-9, sum(r["wall_s"] for r in sync_runs)), 3)
        scales.append(row)
        print(f"SIMULATED fixed step cost x {m:g} ({row['step_ms']} ms; {100 * row['sync_fixed_share']:.0f} % of the "
              f"synchronous rollout time): λ {args.lambda_} staleness {args.max_staleness}: speedup "
              f"{row['sim_speedup_vs_sync']:.2f}x ({row['sim_speedup_vs_sync_min']:.2f}-{row['sim_speedup_vs_sync_max']:.2f})",
              flush=True)
    best = max(grid, key=lambda r: r["sim_speedup_vs_sync"])
    print(f"SIMULATED best: λ {best['lambda']} staleness {best['max_staleness']}: {best['sim_speedup_vs_sync']:.2f}x "
          f"({time.perf_counter() - t0:.0f} s of simulation)")
    print(json.dumps({"simulated": True, "curve": args.simulate, "curve_source": curve.source,
                      "outside_ms_per_turn": curve.outside_ms_per_turn, "slots": args.slots,
                      "best_lambda": best["lambda"], "best_max_staleness": best["max_staleness"],
                      "best_sim_speedup_vs_sync": best["sim_speedup_vs_sync"], "grid": grid, "fixed_scale": scales}))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    if args.simulate:
        simulate(args)
        return
    t_start = time.perf_counter()
    tasks = make_tasks(args.repeats * prompts_per_repeat(args), seed=args.seed)
    model, tok, xtml = train_policy(args, tasks)
    policy = (model.to(args.device), tok, xtml)
    sync_runs, part_runs = run_repeats(args, policy, tasks)
    if args.save_book:
        books, conflicts = [], 0
        for s_run, p_run in zip(sync_runs, part_runs):
            book = ReplayBook()
            conflicts += book.merge(s_run["book"]) + book.merge(p_run["book"])
            books.append(book)
        print(f"turns sampled differently by the two modes (batch-dependent rounding): {conflicts}")
        meta = {k: getattr(args, k) for k in BOOK_ARGS}
        meta["recorded_on"] = f"{args.device} {machine_state()['cpu']}"
        save_books(args.save_book, books, meta)
        print(f"replay book: {sum(len(b) for b in books)} turns in {args.save_book}")
    tok = policy[1]
    sync, part = combine(tok, sync_runs), combine(tok, part_runs)
    lengths = quantiles(sync["output_tokens"])  # every admitted trajectory of a λ = 1 run: the unbiased sample
    for name, r in (("synchronous (λ=1)", sync), (f"partial (λ={args.lambda_})", part)):
        gps = ", ".join(f"{x:.3f}" for x in r["groups_per_s"])
        print(f"{name}: {r['groups']} groups from {r['distinct_tasks']} distinct tasks in {r['wall_s']:.1f} s; "
              f"groups/s per repeat [{gps}]; {r['engine_steps']} engine steps; outside engine {r['outside_engine_s']:.1f} s")
        print(f"  per iteration per repeat (groups, steps, s[, blocked]): {r['per_iter']}")
        print(f"  engine step cost by rows decoded {{rows: [steps, mean ms]}}: {r['step_costs']}")
        print(f"  success {r['success']:.2f}, finish {r['finish']}, output tokens {quantiles(r['output_tokens'])}, "
              f"regimes {{first think token: [trajectories, mean thinking tokens]}} {r['regimes']}")
        print(f"  staleness histogram (versions behind at dispatch: tokens) {r['staleness_hist']}")
        print(f"  KV: hit rate {r['kv_hit_rate']:.2f}, scheduler {r['stats']}")
        print(f"  prefill tokens {r['prefill_tokens']}, decode tokens {r['decode_tokens']}")
    print(f"sampled output tokens (λ=1 runs) {lengths}, p50 : p90 : max = 1 : "
          f"{lengths['p90'] / lengths['p50']:.1f} : {lengths['max'] / lengths['p50']:.1f}")

    result: dict[str, Any] = {}
    result.update(ratio_summary("speedup_vs_sync", part["groups_per_s"], sync["groups_per_s"]))
    result.update(ratio_summary("speedup_vs_sync_steady", part["groups_per_s_steady"], sync["groups_per_s_steady"]))
    result.update(ratio_summary("speedup_vs_sync_steady_cpu", part["groups_per_cpu_s_steady"], sync["groups_per_cpu_s_steady"]))
    result.update(ratio_summary("projected_speedup_vs_sync_const_step_cost", part["groups_per_kstep"], sync["groups_per_kstep"]))
    result["projected_speedup_assumption"] = PROJECTION_ASSUMPTION
    curves: list[tuple[str, CostCurve]] = []
    if args.fit_curve:
        steps = [(w, t) for r in sync_runs for w, (_, t) in zip(r["work"], r["step_log"])]
        where = torch.cuda.get_device_name() if args.device.startswith("cuda") else machine_state()["cpu"]
        fitted = fit_linear([w for w, _ in steps], [t for _, t in steps], source=(
            f"bench/partial_rollout.py --fit-curve: linear fit to the {len(steps)} timed engine steps of the synchronous "
            f"runs on {where} ({args.device}, {torch.get_num_threads()} thread(s), torch {torch.__version__}), the "
            f"bench's policy, {time.strftime('%Y-%m-%d')}"))
        turns = sum(r["turns"] for r in sync_runs)
        fitted.outside_ms_per_turn = 1000.0 * sum(r["outside_engine_s"] for r in sync_runs) / max(1, turns)
        fitted.save(args.fit_curve)
        lin = fitted.meta["linear"]
        print(f"fitted cost (ms) = {lin['a_ms']:.4f} + {lin['b_ms_per_row']:.4f}·rows + {lin['c_ms_per_context']:.3g}·context "
              f"+ {lin['d_ms_prefill_step']:.4f}·[prefill] + {lin['e_ms_per_prefill_token']:.5f}·prefill tokens "
              f"(R² per step {lin['r2']:.2f}); outside the engine {fitted.outside_ms_per_turn:.3f} ms a turn -> {args.fit_curve}")
        curves.append(("fitted on the synchronous runs (partial: out of sample)", fitted))
    if args.curve:
        curves.append((args.curve, CostCurve.load(args.curve)))
    result["cost_model"] = {}
    for name, curve in curves:
        pred = predict(sync_runs, part_runs, curve)
        print(f"cost model, {name}: engine s sync {pred['sync_engine_s_predicted']} predicted / "
              f"{pred['sync_engine_s_measured']} measured ({100 * pred['sync_engine_error']:+.1f} %), partial "
              f"{pred['partial_engine_s_predicted']} / {pred['partial_engine_s_measured']} "
              f"({100 * pred['partial_engine_error']:+.1f} %); wall s sync {pred['sync_wall_s_predicted']} / "
              f"{pred['sync_wall_s_measured']} ({100 * pred['sync_wall_error']:+.1f} %), partial "
              f"{pred['partial_wall_s_predicted']} / {pred['partial_wall_s_measured']} "
              f"({100 * pred['partial_wall_error']:+.1f} %); predicted speedup {pred['predicted_speedup_vs_sync']:.2f}x")
        print(f"  work per mode: sync {pred['sync_work']}, partial {pred['partial_work']}")
        print(f"  by kind of step {{kind: [steps, measured s, predicted s]}}: sync {pred['sync_by_kind']}; partial "
              f"{pred['partial_by_kind']}")
        result["cost_model"][name] = pred
    for mode, r in (("partial", part), ("sync", sync)):
        result.update(summary(f"{mode}_groups_per_s", r["groups_per_s"]))
    for name, key in (("headline", "speedup_vs_sync"), ("secondary", "speedup_vs_sync_steady"),
                      ("diagnostic", "speedup_vs_sync_steady_cpu"), ("PROJECTION", "projected_speedup_vs_sync_const_step_cost")):
        print(f"{key} ({name}): {result[key]:.2f}x, paired min-max {result[key + '_min']:.2f}-{result[key + '_max']:.2f} "
              f"over {args.repeats} repeats")
    print(f"  the projection assumes {PROJECTION_ASSUMPTION}")
    print(f"target speedup_vs_sync >= 2.5: {'met' if result['speedup_vs_sync'] >= 2.5 else 'NOT met'}; "
          f"total bench time {time.perf_counter() - t_start:.0f} s")
    result.update({
        "partial_groups": part["groups"],
        "sync_groups": sync["groups"],
        "distinct_tasks": len(tasks),
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
        "repeats": args.repeats,
        "regimes": args.regimes,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "machine": machine_state(),
    })
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
