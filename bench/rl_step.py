"""Benchmark: one RL step of k3post against TRL's ``GRPOTrainer`` (issue 7).

One step = generation + scoring + one optimizer update, for both:

* k3post: the body of `k3post.rl.train_rl`'s loop, on the same objects ``train_rl`` builds
  (`k3post.rl.PolicyLoop`, the loop `train_rl` runs: `EmbeddedEngine` sharing the model, `AgentLoop`,
  `PartialRolloutScheduler` with λ = 1 so the step is synchronous like TRL's, `KVPool`, AdamW):
  ``run_iteration`` → ``rl_signal`` (verifier
  rewards, effort override, group advantages; zero-variance groups skipped) → `policy_step` →
  ``engine.update_weights({})``.
* TRL: ``GRPOTrainer.train()`` as a user runs it on CPU without vLLM (its ``generate()`` path),
  one optimizer step per generation batch (``steps_per_generation = 1``, ``num_iterations = 1``,
  ``beta = 0``: no reference model and no extra old-log-prob forward; no MoE aux loss, which
  k3post's loss does not have either).

Same work on both sides: the tiny Qwen3-MoE (`build_tiny_moe`, preset "tiny", ~1.05 M
parameters) over a BPE trained on ``default_corpus()`` (vocab 512), deep-copied so both start
from the same weights. Prompts: the same ``general.arithmetic`` tasks (difficulty 1) in the same
order, rendered with XTML at effort ``max``; TRL receives the decoded prompt text, which its
tokenizer call turns back into exactly the same ids (checked). Rewards: the family's environment
and verifier on the XTML-parsed sampled message on both sides (`VerifierReward` for TRL, tested
equal to k3post's agent loop); a completion cut at ``--max-tokens`` gets 0 on both. k3post's
budget table gives every task b0 = ``--max-tokens``, so the effort override (−1 when T > τ·b0)
runs but never fires and both see the same rewards. N = 4 prompts × K = 8 samples = 32
completions of at most 48 new tokens per step, temperature 1 (no top-k / top-p), AdamW (lr
2e-4, betas 0.9 / 0.95, no weight decay, gradient clipping at 1), fp32, one torch thread.

Warm start: a random model gets reward 0 everywhere, and k3post then skips every group (nothing
to learn from) while TRL still trains on all 32. So the model is first SFT-ed (``--sft-steps``)
on the reference ``max`` traces of the benchmark's own prompts (a speed benchmark, not a
learning one): its samples are well-formed XTML of about 46 tokens (the reference traces are
46-48 tokens, so a fair share hit the 48-token cap) and groups have mixed rewards. Some groups
still come out all right or all wrong; k3post trains only the others, TRL all 32 sequences. So
besides the real step, every k3post step also times `policy_step` over all 32 sequences (the
skipped groups with advantage 0) on a scratch copy of the model: ``speedup_vs_trl_equal_work``
uses that update time instead of the real one.

Timing: the two run interleaved in one process. A ``TrainerCallback`` runs one k3post step
(timed on its own) inside TRL's ``on_step_end``; a TRL step is the wall time from the end of
that previous callback to TRL's next ``on_step_end`` (TRL's whole loop: batch fetch,
generation, rewards, loss, backward, clip, AdamW, scheduler, logging). The first ``--warmup``
steps of each are discarded. ``speedup_vs_trl`` = median TRL step / median k3post step
(target >= 1.5). k3post's step is split into generation / scoring / update; TRL's into
generation (``_generate_single_turn``), rewards (``_calculate_rewards``) and the rest of the
step (loss, backward, optimizer, loop), by timers around its own methods. A check run then
trains with `train_rl` itself (same settings and prompts) and reports the median of its
recorded ``step_s``, so the bench's copy of the loop body is known to time what ``train_rl``
does.

Prints human lines, then a final JSON line with ``speedup_vs_trl``, ``speedup_vs_trl_equal_work``,
``k3post_step_s_median``, ``trl_step_s_median``, the tokens each side generated per step, ...

Needs TRL: ``pip install -e '.[bench]'`` (or ``pip install trl``).

Usage: python bench/rl_step.py [--steps 6] [--warmup 1] [--threads 1]

Shape legend: none (token lists only).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from k3post.commands import default_corpus
from k3post.data import Sample
from k3post.envs.episode import run_episode_sync
from k3post.envs.families import get_family
from k3post.envs.task import Task
from k3post.models import build_tiny_moe
from k3post.policy_step import TokenSequence, policy_step
from k3post.rewards.effort import BudgetTable, TaskSamples, task_key
from k3post.rl import PolicyLoop, RLConfig, rl_signal, train_rl, train_tasks
from k3post.rollout.trajectory import Group
from k3post.sft import SFTConfig, train_sft
from k3post.tokenizer import train_tokenizer
from k3post.xtml import XTML, XTMLParseError

FAMILY = "general.arithmetic"


# ---------------------------------------------------------------------- shared setup
def warm_start(model: Any, tok: Any, xtml: XTML, tasks: Sequence[Task], args: argparse.Namespace, out_dir: str) -> float:
    """SFT ``model`` in place on the reference traces of ``tasks`` at ``args.effort``; returns
    the final loss. This is a speed benchmark: the policy only has to answer the benchmark's own
    prompts right part of the time, so that groups have mixed rewards (GRPO's working regime)."""
    samples = []
    for task in tasks:
        fam = get_family(task.family)
        ep = run_episode_sync(fam.reference_policy(task, args.effort), fam.make_env(task), task)
        r = xtml.render(ep.messages, effort=args.effort)
        samples.append(Sample(r.ids, r.loss_mask, task.id))
    cfg = SFTConfig(steps=args.sft_steps, lr=5e-3, warmup_steps=10, pack_len=256, rows_per_batch=8,
                    save_every=10**9, progress=False)
    return train_sft(model, tok, samples, cfg, out_dir, seed=args.seed, resume=False).final_loss


def budget_table(tasks: Sequence[Task], max_tokens: int) -> BudgetTable:
    """b0 = ``max_tokens`` for every task: the override's limit τ·b0 is then never below the cap."""
    table = BudgetTable({"bench": "rl_step", "b0": max_tokens})
    table.add_samples({task_key(t): TaskSamples(t.family, [max_tokens], [True]) for t in tasks}, q=0.9, min_b0=1.0)
    return table


def rl_config(args: argparse.Namespace) -> RLConfig:
    return RLConfig(
        domain="general", effort=args.effort, families=[FAMILY], steps=args.warmup + args.steps,
        n_prompts=args.n, k=args.k, lambda_=1.0, temperature=1.0, max_tokens=args.max_tokens,
        max_model_len=args.max_model_len, slots=args.n * args.k, difficulty=args.difficulty,
        n_tasks=args.n * (args.warmup + args.steps), lr=args.lr, grad_clip=1.0, seed=args.seed, progress=False,
    )


# ---------------------------------------------------------------------- k3post
class K3PostStep:
    """`train_rl`'s own loop (`PolicyLoop` with the RL signal), one step at a time."""

    def __init__(self, model: Any, tok: Any, cfg: RLConfig, budgets: BudgetTable) -> None:
        self.model, self.cfg = model, cfg
        self.signal = rl_signal(budgets, cfg)
        self.pl = PolicyLoop(model, tok, cfg, signal=self.signal)
        self.pad_id, self.lkw = self.pl.pad_id, self.pl.loss_kwargs

    def step(self, tasks: Sequence[Task]) -> dict[str, float]:
        """One RL step on ``tasks`` (N prompts): times of its parts and what it did."""
        rec = self.pl.step(tasks)
        groups = self.pl.last_groups
        seqs, _ = self.signal(groups)  # the same sequences the step trained on (deterministic)
        trajs = [t for g in groups for t in g.trajectories]
        return {
            "step_s": rec["step_s"], "generate_s": rec["rollout_s"], "score_s": rec["score_s"], "update_s": rec["update_s"],
            "update_all_s": self._update_all_s(groups, seqs),
            "completions": float(len(trajs)), "tokens": float(sum(t.output_tokens for t in trajs)),
            "capped": float(sum(t.finish == "length" for t in trajs)), "reward": rec["reward"],
            "trained_seqs": rec["train/num_sequences"], "trained_tokens": rec["train/num_tokens"],
            "zero_variance_groups": rec["zero_variance_groups"],
        }

    def _update_all_s(self, groups: Sequence[Group], seqs: list[TokenSequence]) -> float:
        """Time of `policy_step` over every sampled sequence (the zero-variance groups that
        ``_score`` skips added with advantage 0), on a scratch copy of the model with a fresh
        AdamW: the update with TRL's amount of work, not counted in the step."""
        skipped = [t for g in groups if len({t.reward for t in g.trajectories}) == 1 for t in g.trajectories]
        extra = [TokenSequence(list(t.token_ids), list(t.trainable), list(t.logprobs), [0.0] * len(t.token_ids))
                 for t in skipped]
        scratch = copy.deepcopy(self.model)
        opt = torch.optim.AdamW(scratch.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
        t0 = time.perf_counter()
        policy_step(scratch, opt, seqs + extra, pad_id=self.pad_id, loss_kwargs=self.lkw,
                    micro_batch_tokens=self.cfg.micro_batch_tokens, grad_clip=self.cfg.grad_clip)
        return time.perf_counter() - t0


# ---------------------------------------------------------------------- TRL
class VerifierReward:
    """TRL reward function: the family's environment and verifier on the XTML-parsed sampled
    message, as `AgentLoop.finish_turn` scores a single-turn episode (0 when the completion
    does not end in ``<|end_of_msg|>`` or does not parse)."""

    __name__ = "general_arithmetic_verifier"

    def __init__(self, xtml: XTML) -> None:
        self.xtml = xtml
        self._aio = asyncio.new_event_loop()
        self.seen: list[list[str]] = []  # task ids of each call, in order of first appearance

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                 task: list[str], **_: Any) -> list[float]:
        tasks = [Task.from_dict(json.loads(t)) for t in task]
        self.seen.append(list(dict.fromkeys(t.id for t in tasks)))
        return [self.score(t, ids) for t, ids in zip(tasks, completion_ids)]

    def score(self, task: Task, ids: list[int]) -> float:
        if not ids or ids[-1] != self.xtml.eom_id:
            return 0.0
        parser = self.xtml.stream("think")
        try:
            for t in ids:
                parser.feed(t)
            message = parser.finish()
        except XTMLParseError:
            return 0.0
        message["num_tokens"] = len(ids)
        env = get_family(task.family).make_env(task)
        self._aio.run_until_complete(env.reset(task))
        try:
            result = self._aio.run_until_complete(env.step(message))
        except ValueError:
            return 0.0
        return float(env.verify().reward) if result.done else 0.0


def build_trl(model: Any, tok: Any, prompts: list[str], tasks: Sequence[Task], args: argparse.Namespace,
              out_dir: str, callbacks: list[Any]) -> Any:
    """TRL's ``GRPOTrainer`` (timed parts: `_generate_single_turn`, `_calculate_rewards`,
    `_generate_and_score_completions`; nothing else changed) on the prompts, in order."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        times: dict[str, float] = {}

        def _timed(self, key: str, fn: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.times[key] = time.perf_counter() - t0
            return out

        def _generate_single_turn(self, *a: Any, **kw: Any) -> Any:
            return self._timed("generate_s", super()._generate_single_turn, *a, **kw)

        def _calculate_rewards(self, *a: Any, **kw: Any) -> Any:
            return self._timed("rewards_s", super()._calculate_rewards, *a, **kw)

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            return self._timed("generate_and_score_s", super()._generate_and_score_completions, *a, **kw)

    ds = Dataset.from_dict({"prompt": prompts, "task": [json.dumps(t.to_dict()) for t in tasks]})
    cfg = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=10**6, disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
        per_device_train_batch_size=args.n * args.k, gradient_accumulation_steps=1, num_generations=args.k,
        steps_per_generation=1, num_iterations=1, beta=0.0, max_steps=args.warmup + args.steps,
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        shuffle_dataset=False, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        router_aux_loss_coef=0.0,  # k3post's loss has no MoE load-balancing term: TRL need not pay for one
    )
    return TimedGRPOTrainer(model=model, reward_funcs=VerifierReward(XTML(tok)), args=cfg, train_dataset=ds,
                            processing_class=tok, callbacks=callbacks)


def _trl_callback(k3: K3PostStep, tasks: Sequence[Task], args: argparse.Namespace,
                  trl_rec: list[dict[str, float]], k3_rec: list[dict[str, float]]) -> Any:
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        """Times TRL's step (previous callback exit → this on_step_end), then runs one k3post step."""

        def __init__(self) -> None:
            self.mark = time.perf_counter()
            self.trainer: Any = None

        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            self.mark = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            dt = time.perf_counter() - self.mark
            i = state.global_step - 1
            stats = _trl_step_stats(self.trainer)
            step_tasks = tasks[i * args.n : (i + 1) * args.n]
            if self.trainer.reward_funcs[0].seen[-1] != [t.id for t in step_tasks]:
                raise RuntimeError(f"TRL's step {i} prompts differ from k3post's")
            trl_rec.append({"step_s": dt, "update_s": dt - stats["generate_and_score_s"], **stats})
            k3_rec.append(k3.step(step_tasks))
            t, k = trl_rec[-1], k3_rec[-1]
            print(f"step {i}{' (warm-up)' if i < args.warmup else ''}: TRL {t['step_s']:.3f} s "
                  f"({t['tokens']:.0f} tokens, reward {t['reward']:.2f}) | k3post {k['step_s']:.3f} s "
                  f"(generate {k['generate_s']:.3f}, score {k['score_s']:.3f}, update {k['update_s']:.3f}; "
                  f"{k['tokens']:.0f} tokens, reward {k['reward']:.2f}, trained {k['trained_seqs']:.0f} seqs; "
                  f"update of all {k['completions']:.0f}: {k['update_all_s']:.3f})", flush=True)
            self.mark = time.perf_counter()

    return Interleave()


def _trl_step_stats(trainer: Any) -> dict[str, float]:
    """Tokens, reward and timed parts of TRL's last step (its metric buffers and our timers)."""
    m = trainer._metrics["train"]
    n = trainer.args.per_device_train_batch_size
    gs = trainer.times["generate_and_score_s"]
    return {
        "tokens": m["completions/mean_length"][-1] * n,
        "capped": m["completions/clipped_ratio"][-1] * n,
        "reward": m["reward"][-1],
        "generate_s": trainer.times["generate_s"], "rewards_s": trainer.times["rewards_s"],
        "generate_and_score_s": gs,
    }


# ---------------------------------------------------------------------- main
def _median(rec: list[dict[str, float]], key: str, skip: int) -> float:
    return statistics.median(r[key] for r in rec[skip:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=4, help="prompts per step")
    ap.add_argument("--k", type=int, default=8, help="group size")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--effort", default="max")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--sft-steps", type=int, default=300, help="warm-start SFT steps (0: random weights)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-train-rl-check", action="store_true", help="skip the train_rl check run")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.n < 1 or args.k < 2:
        raise ValueError("--steps must be >= 1, --warmup >= 0, --n >= 1 and --k >= 2")
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="k3post-bench-rl-") as tmp:
        _main(args, tmp)


def _main(args: argparse.Namespace, tmp: str) -> None:
    import trl

    tok = train_tokenizer(default_corpus(), vocab_size=512, out_dir=os.path.join(tmp, "tok"))
    xtml = XTML(tok)
    base = build_tiny_moe(len(tok), seed=args.seed, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"torch {torch.__version__}, trl {trl.__version__}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}; model {n_params / 1e6:.2f} M parameters, vocab {len(tok)}")
    cfg = rl_config(args)
    tasks = train_tasks([FAMILY], cfg.n_tasks, difficulty=args.difficulty, seed=args.seed)
    if args.sft_steps:
        t0 = time.perf_counter()
        loss = warm_start(base, tok, xtml, tasks, args, os.path.join(tmp, "sft"))
        print(f"warm start: {args.sft_steps} SFT steps in {time.perf_counter() - t0:.1f} s, final loss {loss:.3f}")
    prompt_ids = [xtml.render(list(t.messages), effort=args.effort, add_generation_prompt=True).ids for t in tasks]
    prompts = [tok.decode(p) for p in prompt_ids]
    if tok(text=prompts)["input_ids"] != prompt_ids:
        raise RuntimeError("TRL's tokenization of the prompt text differs from the XTML prompt ids")
    budgets = budget_table(tasks, args.max_tokens)
    print(f"{len(tasks)} prompts of {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens; per step "
          f"{args.n} prompts x {args.k} samples, at most {args.max_tokens} new tokens, temperature 1")

    k3 = K3PostStep(copy.deepcopy(base), tok, cfg, budgets)
    trl_rec: list[dict[str, float]] = []
    k3_rec: list[dict[str, float]] = []
    cb = _trl_callback(k3, tasks, args, trl_rec, k3_rec)
    trainer = build_trl(copy.deepcopy(base), tok, prompts, tasks, args, os.path.join(tmp, "trl"), [cb])
    cb.trainer = trainer
    trainer.train()
    k3.loop.close()

    w = args.warmup
    k3_med, trl_med = _median(k3_rec, "step_s", w), _median(trl_rec, "step_s", w)
    speedup = trl_med / k3_med
    print(f"k3post: median step {k3_med:.3f} s (generate {_median(k3_rec, 'generate_s', w):.3f}, score "
          f"{_median(k3_rec, 'score_s', w):.3f}, update {_median(k3_rec, 'update_s', w):.3f}); "
          f"{statistics.fmean(r['tokens'] for r in k3_rec[w:]):.0f} tokens per step")
    print(f"TRL:    median step {trl_med:.3f} s (generate {_median(trl_rec, 'generate_s', w):.3f}, rewards "
          f"{_median(trl_rec, 'rewards_s', w):.3f}, rest of the step {_median(trl_rec, 'update_s', w):.3f}); {statistics.fmean(r['tokens'] for r in trl_rec[w:]):.0f} tokens per step")
    equal = [r["generate_s"] + r["score_s"] + r["update_all_s"] for r in k3_rec[w:]]
    equal_med = statistics.median(equal)
    print(f"k3post with TRL's update work (every sequence trained, zero-variance groups too): median {equal_med:.3f} s "
          f"(update {_median(k3_rec, 'update_all_s', w):.3f}); k3post's real step trained "
          f"{statistics.fmean(r['trained_seqs'] for r in k3_rec[w:]):.1f} of {args.n * args.k} sequences per step")
    print(f"speedup_vs_trl: {speedup:.2f}x (target >= 1.5); with equal update work {trl_med / equal_med:.2f}x")

    check = float("nan")
    if not args.no_train_rl_check:
        res = train_rl(copy.deepcopy(base), tok, cfg, os.path.join(tmp, "rl"), budgets=budget_table(tasks, args.max_tokens),
                       resume=False, evaluate=False)
        check = statistics.median(h["step_s"] for h in res.history[w:])
        print(f"check: train_rl itself, {len(res.history)} steps, median step_s after the warm-up {check:.3f} s")

    result = {
        "speedup_vs_trl": round(speedup, 3),
        "k3post_step_s_median": round(k3_med, 4),
        "trl_step_s_median": round(trl_med, 4),
        "k3post_generate_s_median": round(_median(k3_rec, "generate_s", w), 4),
        "k3post_score_s_median": round(_median(k3_rec, "score_s", w), 4),
        "k3post_update_s_median": round(_median(k3_rec, "update_s", w), 4),
        "speedup_vs_trl_equal_work": round(trl_med / equal_med, 3),
        "k3post_equal_work_step_s_median": round(equal_med, 4),
        "k3post_update_all_s_median": round(_median(k3_rec, "update_all_s", w), 4),
        "trl_generate_s_median": round(_median(trl_rec, "generate_s", w), 4),
        "trl_rewards_s_median": round(_median(trl_rec, "rewards_s", w), 4),
        "trl_update_s_median": round(_median(trl_rec, "update_s", w), 4),
        "k3post_tokens_per_step": round(statistics.fmean(r["tokens"] for r in k3_rec[w:]), 1),
        "trl_tokens_per_step": round(statistics.fmean(r["tokens"] for r in trl_rec[w:]), 1),
        "k3post_capped_per_step": round(statistics.fmean(r["capped"] for r in k3_rec[w:]), 2),
        "trl_capped_per_step": round(statistics.fmean(r["capped"] for r in trl_rec[w:]), 2),
        "k3post_reward_mean": round(statistics.fmean(r["reward"] for r in k3_rec[w:]), 4),
        "trl_reward_mean": round(statistics.fmean(r["reward"] for r in trl_rec[w:]), 4),
        "k3post_trained_seqs_per_step": round(statistics.fmean(r["trained_seqs"] for r in k3_rec[w:]), 2),
        "k3post_train_rl_step_s_median": round(check, 4),
        "completions_per_step": args.n * args.k,
        "group_size": args.k,
        "max_new_tokens": args.max_tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "sft_steps": args.sft_steps,
        "threads": torch.get_num_threads(),
        "trl_version": trl.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
