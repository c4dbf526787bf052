"""Benchmark: one RL step of k3post against TRL's ``GRPOTrainer`` on equal work (issues 7 and 14).

**What is compared.** One step = generation + scoring + one optimizer update over N = 4 prompts × K = 8
samples = 32 completions, on three arms, each on its own deep copy of the same warm-started model:

* ``k3post`` (the headline): `k3post.loop.PolicyLoop.step`, the body of ``train_rl``'s loop on the objects
  ``train_rl`` builds (`EmbeddedEngine` sharing the model, `AgentLoop`, `PartialRolloutScheduler` with
  λ = 1 so the step is synchronous like TRL's, `KVPool`, AdamW) with ``RLConfig``'s defaults for the loss:
  ``run_iteration`` → ``rl_signal`` (verifier reward, effort override, A = r − mean of the group, no std
  division) → `policy_step` (the K2.5 loss over every sampled token, zero-variance groups included with
  A = 0: ``skip_zero_variance=False``, the default since commit 8fcb3f5) → ``engine.update_weights({})``.
  It trains all 32 sequences every step, as TRL does (checked every step: the bench fails otherwise).
* ``k3post_skip_zero_variance``: a second `PolicyLoop`, identical but for ``skip_zero_variance=True``
  (DAPO's shortcut: groups whose rewards are all equal are left out of the loss), run for real.
* ``trl``: ``GRPOTrainer.train()`` as a user runs it on CPU without vLLM (its transformers ``generate()``
  path), with every setting that changes compute set to k3post's (below).

``speedup_vs_trl`` = median TRL step / median k3post step: **equal work** (target >= 1.5).
``speedup_vs_trl_skip_zero_variance`` = median TRL step / median step of the skipping loop (less work
than TRL on steps that have zero-variance groups; a second number, not the headline).

**Same inputs.** The tiny Qwen3-MoE (`build_tiny_moe`, preset "tiny", ~1.05 M parameters, fp32, no
dropout) over a BPE trained on ``default_corpus()`` (vocab 512). Prompts: the same ``general.arithmetic``
tasks (difficulty 1) in the same order on every arm (step i of every arm gets prompts 4i..4i+3; checked),
rendered with XTML at effort ``max``; TRL receives the decoded prompt text, which its tokenizer call turns
back into exactly the same ids (checked). Rewards: the family's environment and verifier on the
XTML-parsed sampled message on both sides (`VerifierReward` for TRL, tested equal to k3post's agent loop);
a completion cut at ``--max-tokens`` gets 0 on both and is trained on both. k3post's budget table gives
every task b0 = ``--max-tokens``, so the effort override (−1 when T > τ·b0) runs but never fires.

**TRL settings** (`trl_config`; the full ``GRPOConfig`` is in the JSON under ``trl_config``):

* compute graph: ``gradient_checkpointing=False`` (and its new name ``activation_checkpointing=False``
  where transformers has it; TRL's default is True, which recomputes the forward in the backward; k3post
  does not checkpoint; checked on the built trainer's layers); ``bf16=False``, ``fp16=False`` (TRL
  defaults bf16 to True when fp16 is off), so accelerate's mixed precision is "no" (checked) and its
  ``autocast()`` a no-op: fp32 throughout, as k3post; ``torch_compile=False``, ``use_liger_kernel=False``,
  ``cast_lm_head_to_fp32=False`` (already fp32); ``disable_dropout=True`` (the model's dropout is 0 anyway).
* one optimizer step per generation batch: ``per_device_train_batch_size = generation batch = N·K``,
  ``gradient_accumulation_steps=1``, ``steps_per_generation=1``, ``num_iterations=1``: TRL then computes
  no old-log-prob forward (π_old = the detached current log-probs), like k3post, which uses the engine's
  behaviour log-probs; ``beta=0.0``: no reference model, no KL forward (k3post has none).
* loss aggregation: ``loss_type="dapo"`` (also TRL's default): Σ over every completion token of the
  micro-batch / the number of completion tokens in the generation batch (÷ processes, × accumulation
  steps ÷ steps_per_generation); with one process and one micro-batch per optimizer step that is the
  token mean over all sampled tokens of the step, which is k3post's aggregation
  (`policy_step` passes ``token_normalizer`` = the step's sampled-token count to `policy_loss`). "grpo" and
  "sapo" average per sequence first, "dr_grpo" divides by B·max_completion_length, "bnpo" by the local
  micro-batch's tokens (the same number here, but not in general). ``importance_sampling_level="token"``
  (k3post: ``sequence_ratio=False``); ``top_entropy_quantile=1.0``, ``entropy_coef=0.0``,
  ``off_policy_mask_threshold=None``, ``mask_truncated_completions=False`` (k3post trains cut completions).
  The per-token objective differs in form and not in cost: TRL clips the ratio at ε = 0.2 (its default),
  k3post masks tokens with |ℓ| > log 2 and adds τ·ℓ² (τ = 0.01); one step per generation makes TRL's ratio
  exactly 1 and k3post's exp(log π − engine log-prob) 1 up to the train/engine log-prob gap, so both reduce
  to the token mean of A·∇log π (elementwise work on [B, T] either way).
* advantages: ``scale_rewards="none"`` (A = r − group mean, no std division: k3post's
  ``normalize_std=False``); one reward function, weight 1.
* sampling: ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off), ``min_p=None``,
  ``repetition_penalty=1.0``, ``max_completion_length = --max-tokens`` (k3post: ``max_tokens``), stop at
  ``<|end_of_msg|>`` (the model's eos on both sides); ``use_vllm=False``,
  ``use_transformers_continuous_batching=False`` (the default generate path).
* optimizer: ``optim="adamw_torch"`` (torch.optim.AdamW, as k3post), ``learning_rate = --lr``,
  ``adam_beta1=0.9``, ``adam_beta2=0.95``, ``adam_epsilon=1e-8``, ``weight_decay=0.0``,
  ``max_grad_norm=1.0`` (k3post's ``grad_clip``), ``lr_scheduler_type="constant"``, no warm-up (k3post's
  loop has no schedule); ``router_aux_loss_coef=0.0`` (k3post's loss has no MoE load-balancing term).
* nothing else per step: ``logging_strategy="no"``, ``save_strategy="no"``, ``eval_strategy="no"``,
  ``report_to="none"``, ``log_completions=False``, ``disable_tqdm=True``, ``logging_nan_inf_filter=False``,
  ``dataloader_num_workers=0``, ``shuffle_dataset=False``; TRL still fills its per-step metric buffers
  (its own cost, which the bench reads for tokens and rewards).

**Timing.** `common.interleaved`: ``--warmup`` untimed rounds, then ``--steps`` (>= 3) rounds in which each
arm runs one step, the order rotated every round, one process, ``--threads`` torch threads (1). TRL's loop
runs in a helper thread that a callback parks at every ``on_step_end``; a TRL step is the wall time from
the release of the thread to the next ``on_step_end`` (TRL's whole loop: batch fetch, generation, rewards,
loss, backward, clip, AdamW, scheduler, callbacks), while the other arms wait (only one thread runs at a
time). A k3post step is ``PolicyLoop.step``'s own ``step_s``. Ratios are ratios of medians with the min
and max of the paired per-round ratios (`common.ratio_summary`).

**Profile** (JSON ``profile``, medians in seconds): k3post = generate / score / update, the update split
into the model forward (hooks on the model in training mode), AdamW (hooks on the optimizer) and the
rest (log-softmax, entropy, loss, backward, clip, version bump); TRL = generate (``_generate_single_turn``)
/ rewards (``_calculate_rewards``) / the rest of ``_generate_and_score_completions`` (tokenize, decode,
advantages, metrics) / ``compute_loss`` (forward, TRL's fused log-prob head, loss) / backward
(``training_step`` minus those) / AdamW (optimizer hooks) / the rest of the loop; and the tokens k3post's
update runs its forward and backward over (prompt + completion of all 32 sequences) against the sampled
tokens that carry a loss. A check run then trains with `train_rl` itself (same settings and prompts) and
reports the median of its recorded ``step_s``, so the bench's `PolicyLoop` is known to time what
``train_rl`` does.

**Warm start.** A random model gets reward 0 everywhere, so the model is first SFT-ed (``--sft-steps``,
300) on the reference ``max`` traces of the bench's own prompts (a speed benchmark, not a learning one): its
samples are well-formed XTML of ~46-48 tokens (a fair share hit the 48-token cap and score 0), and it has
nearly memorised the traces (SFT loss ~0), so many groups come out all right or all wrong: the zero-variance
groups per step are printed and in the JSON (``k3post_zero_variance_groups_per_step``). They are why the
skipping arm is so much cheaper, and why equal work is the headline.

**Excluded and caveats.** Model loading, the tokenizer, the warm-start SFT, trainer construction, the
warm-up round. Each arm trains its own copy, so after the first step the policies and the sampled lengths
may differ a little (tokens per step are reported per arm).
A 1 M-parameter model on one CPU thread: per-op overhead weighs far more than at scale, and TRL runs
without vLLM; the ratio says how the two implementations compare here, not on a GPU cluster. The machine
may be shared: the JSON records its load (``machine``) and the spread of the paired ratios.

Prints human lines, then a final JSON line: ``speedup_vs_trl`` (+ ``_min``/``_max``/``_n``),
``speedup_vs_trl_skip_zero_variance``, ``target_met``, per-arm step summaries, ``profile``, tokens,
rewards, trained sequences, ``machine``, ``trl_config``, ``caveats``.

Needs TRL: ``pip install -e '.[bench]'`` (or ``pip install trl``).

Usage: python bench/rl_step.py [--steps 6] [--warmup 1] [--threads 1]

Shape legend: none (token lists only).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary, summary  # noqa: E402

from k3post.stages.sft_data import default_corpus  # noqa: E402
from k3post.data import Sample  # noqa: E402
from k3post.envs.episode import run_episode_sync  # noqa: E402
from k3post.envs.families import get_family  # noqa: E402
from k3post.envs.task import Task  # noqa: E402
from k3post.models import build_tiny_moe  # noqa: E402
from k3post.rewards.effort import BudgetTable, TaskSamples, task_key  # noqa: E402
from k3post.loop import PolicyLoop  # noqa: E402
from k3post.config import LossConfig, PolicyOptimConfig, RLConfig, RolloutConfig
from k3post.envs.families.streams import train_tasks
from k3post.stages.rl import rl_signal, train_rl  # noqa: E402
from k3post.stages.sft import SFTConfig, train_sft  # noqa: E402
from k3post.tokenizer import train_tokenizer  # noqa: E402
from k3post.xtml import XTML, XTMLParseError  # noqa: E402

FAMILY = "general.arithmetic"
TARGET = 1.5  # speedup_vs_trl on equal work
CAVEATS = [
    "equal work: every arm trains all N*K sampled sequences per step (k3post: zero-variance groups with A = 0)",
    "tiny model (~1.05 M parameters), fp32, CPU, one torch thread: per-op overhead weighs more than at scale",
    "TRL generates with transformers generate() (no vLLM, no continuous batching); k3post with its embedded engine",
    "each arm trains its own copy: after step 1 the sampled lengths differ a little (tokens per step per arm)",
    "loss forms differ (TRL: PPO clip eps 0.2; k3post: K2.5 band log 2 + tau*l^2), not their cost; on-policy both "
    "reduce to the token mean of A * grad log pi",
    "the machine may be shared with other processes: see machine.loadavg and the min-max of the paired ratios",
]


# ---------------------------------------------------------------------- shared setup
def warm_start(model: Any, tok: Any, xtml: XTML, tasks: Sequence[Task], args: argparse.Namespace, out_dir: str) -> float:
    """SFT ``model`` in place on the reference traces of ``tasks`` at ``args.effort``; returns
    the final loss. This is a speed benchmark: the policy only has to sample well-formed answers to the
    benchmark's own prompts, right part of the time (module doc: many groups still come out all right or
    all wrong)."""
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
    table.add_samples({task_key(t): TaskSamples(t.family, [max_tokens], [True]) for t in tasks}, q=0.9, min_b0=1.0, floor=0.0)
    return table


def rounds(args: argparse.Namespace) -> int:
    """Steps every arm runs: the warm-up rounds and the timed ones."""
    return args.warmup + args.steps


def rl_config(args: argparse.Namespace, *, skip_zero_variance: bool = False) -> RLConfig:
    """k3post's settings: `RLConfig`'s defaults (K2.5 loss, token mean, no std division) but for the
    bench's sizes, λ = 1 (synchronous, like TRL) and ``skip_zero_variance``."""
    return RLConfig(
        domain="general", effort=args.effort, families=[FAMILY], steps=rounds(args), difficulty=args.difficulty,
        n_tasks=args.n * rounds(args), seed=args.seed, progress=False,
        rollout=RolloutConfig(n_prompts=args.n, k=args.k, lambda_=1.0, temperature=1.0, max_tokens=args.max_tokens,
                              max_model_len=args.max_model_len, slots=args.n * args.k),
        optim=PolicyOptimConfig(lr=args.lr, weight_decay=0.0, grad_clip=1.0),
        loss=LossConfig(skip_zero_variance=skip_zero_variance),
    )


# ---------------------------------------------------------------------- k3post
class _PartTimer:
    """Seconds spent between pairs of hook calls (``start`` / ``stop``), summed until ``take``."""

    def __init__(self) -> None:
        self.total, self._t0 = 0.0, 0.0

    def start(self, *_: Any, **__: Any) -> None:
        self._t0 = time.perf_counter()

    def stop(self, *_: Any, **__: Any) -> None:
        self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        out, self.total = self.total, 0.0
        return out


class K3PostArm:
    """One `PolicyLoop` (`train_rl`'s loop) stepping through the bench's prompts, N per step."""

    def __init__(self, name: str, model: Any, tok: Any, cfg: RLConfig, budgets: BudgetTable, tasks: Sequence[Task]) -> None:
        self.name, self.cfg, self.tasks = name, cfg, list(tasks)
        self.pl = PolicyLoop(model, tok, cfg, signal=rl_signal(budgets, cfg))
        self.rec: list[dict[str, float]] = []
        self.fwd, self.opt = _PartTimer(), _PartTimer()
        # timers only: the trainer's model forwards (the engine runs its own kernels, in eval mode) and AdamW
        model.register_forward_pre_hook(lambda m, *_: self.fwd.start() if m.training else None)
        model.register_forward_hook(lambda m, *_: self.fwd.stop() if m.training else None)
        self.pl.trainer.optimizer.register_step_pre_hook(self.opt.start)
        self.pl.trainer.optimizer.register_step_post_hook(self.opt.stop)

    def step(self) -> float:
        """One `PolicyLoop.step`; records its parts and returns its ``step_s``."""
        i, n = len(self.rec), self.cfg.rollout.n_prompts
        want = {t.id for t in self.tasks[i * n : (i + 1) * n]}
        rec = self.pl.step(self.tasks)
        got = {g.task["id"] for g in self.pl.last_groups}
        if got != want:
            raise RuntimeError(f"{self.name} step {i}: trained on prompts {sorted(got)}, expected {sorted(want)}")
        trajs = [t for g in self.pl.last_groups for t in g.trajectories]
        r = {
            "step_s": rec["step_s"], "generate_s": rec["rollout_s"], "score_s": rec["score_s"], "update_s": rec["update_s"],
            "forward_s": self.fwd.take(), "optimizer_s": self.opt.take(),
            "completions": float(len(trajs)), "tokens": float(sum(t.output_tokens for t in trajs)),
            "capped": float(sum(t.finish == "length" for t in trajs)), "reward": rec["reward"],
            "groups": rec["groups"], "trained_groups": rec["trained_groups"],
            "zero_variance_groups": rec["zero_variance_groups"],
            "trained_seqs": rec.get("train/num_sequences", 0.0), "trained_tokens": rec.get("train/num_tokens", 0.0),
            # positions the training forward ran (padding included; a group's shared prompt counts once) and
            # prompt + completion of every trained sequence (what a forward without prompt sharing runs)
            "forward_tokens": rec.get("train/forward_tokens", 0.0),
            "sequence_tokens": float(sum(len(t.token_ids) for t in trajs)) if not self.cfg.loss.skip_zero_variance else 0.0,
        }
        r["update_rest_s"] = r["update_s"] - r["forward_s"] - r["optimizer_s"]
        if not self.cfg.loss.skip_zero_variance and (r["trained_groups"] != r["groups"] or r["trained_seqs"] != r["completions"]):
            raise RuntimeError(f"{self.name} step {i}: trained {r['trained_seqs']:.0f} of {r['completions']:.0f} sequences "
                               "(equal work needs every group trained)")
        self.rec.append(r)
        print(f"  {self.name} step {i}: {r['step_s']:.3f} s (generate {r['generate_s']:.3f}, score {r['score_s']:.3f}, "
              f"update {r['update_s']:.3f}); {r['tokens']:.0f} tokens, reward {r['reward']:.2f}, trained "
              f"{r['trained_groups']:.0f}/{r['groups']:.0f} groups ({r['zero_variance_groups']:.0f} zero-variance)", flush=True)
        return r["step_s"]

    def close(self) -> None:
        self.pl.close()


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


def trl_config(args: argparse.Namespace, out_dir: str) -> Any:
    """TRL's ``GRPOConfig`` with every setting that changes compute set to k3post's (module doc)."""
    from trl import GRPOConfig

    # transformers >= 5.x names it activation_checkpointing (gradient_checkpointing, TRL's True, is its alias)
    new_name = {"activation_checkpointing": False} if "activation_checkpointing" in {
        f.name for f in dataclasses.fields(GRPOConfig)} else {}
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, seed=args.seed,
        # compute graph and precision: no recomputation, fp32 (no bf16 / fp16, so no autocast), no compile
        gradient_checkpointing=False, **new_name, bf16=False, fp16=False, torch_compile=False, use_liger_kernel=False,
        cast_lm_head_to_fp32=False, disable_dropout=True,
        # one optimizer step per generation batch, no old-log-prob or reference forward
        per_device_train_batch_size=args.n * args.k, gradient_accumulation_steps=1, num_generations=args.k,
        steps_per_generation=1, num_iterations=1, beta=0.0, max_steps=rounds(args),
        # loss: token mean over every sampled token of the step; advantages without std division
        loss_type="dapo", importance_sampling_level="token", scale_rewards="none", mask_truncated_completions=False,
        top_entropy_quantile=1.0, entropy_coef=0.0, off_policy_mask_threshold=None, router_aux_loss_coef=0.0,
        # sampling
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, use_vllm=False, use_transformers_continuous_batching=False, pad_to_multiple_of=None,
        # optimizer
        optim="adamw_torch", learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        # data, logging, saving: nothing beyond the step
        shuffle_dataset=False, dataloader_num_workers=0, dataloader_pin_memory=False,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", log_completions=False,
        disable_tqdm=True, logging_nan_inf_filter=False,
    )


def checkpointing(model: Any) -> bool:
    """Whether any module of ``model`` recomputes its forward in the backward (HF's flag on each layer)."""
    return any(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())


def trl_config_dict(cfg: Any) -> dict[str, Any]:
    """The full config as JSON-able values (``to_dict``, anything else as its string)."""
    return json.loads(json.dumps(cfg.to_dict(), default=str))


def build_trl(model: Any, tok: Any, prompts: list[str], tasks: Sequence[Task], args: argparse.Namespace,
              out_dir: str, callbacks: list[Any]) -> Any:
    """TRL's ``GRPOTrainer`` on the prompts, in order, with timers around its own methods
    (`_generate_single_turn`, `_calculate_rewards`, `_generate_and_score_completions`, ``compute_loss``,
    ``training_step``); nothing else changed."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _timed(self, key: str, fn: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t0
            return out

        def _generate_single_turn(self, *a: Any, **kw: Any) -> Any:
            return self._timed("generate_s", super()._generate_single_turn, *a, **kw)

        def _calculate_rewards(self, *a: Any, **kw: Any) -> Any:
            return self._timed("rewards_s", super()._calculate_rewards, *a, **kw)

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            return self._timed("generate_and_score_s", super()._generate_and_score_completions, *a, **kw)

        def compute_loss(self, *a: Any, **kw: Any) -> Any:
            return self._timed("compute_loss_s", super().compute_loss, *a, **kw)

        def training_step(self, *a: Any, **kw: Any) -> Any:
            return self._timed("training_step_s", super().training_step, *a, **kw)

    ds = Dataset.from_dict({"prompt": prompts, "task": [json.dumps(t.to_dict()) for t in tasks]})
    trainer = TimedGRPOTrainer(model=model, reward_funcs=VerifierReward(XTML(tok)), args=trl_config(args, out_dir),
                               train_dataset=ds, processing_class=tok, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its end-of-train dict on stdout is not the bench's JSON line
    trainer.times = {}
    return trainer


class TRLArm:
    """TRL's ``trainer.train()`` in a helper thread, one optimizer step per `step` call: a callback parks
    the thread at every ``on_step_end`` until the next call, so only one thread runs at a time."""

    def __init__(self, tok: Any, model: Any, prompts: list[str], tasks: Sequence[Task], args: argparse.Namespace,
                 out_dir: str) -> None:
        from transformers import TrainerCallback

        self.args, self.tasks = args, list(tasks)
        self.rec: list[dict[str, float]] = []
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._t0, self._dt = 0.0, 0.0
        self._error: BaseException | None = None
        self._finished, self._stopping = False, False
        self.opt = _PartTimer()
        self.threads = 0
        arm = self

        class Park(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, a: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
                inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's AdamW
                inner.register_step_pre_hook(arm.opt.start)
                inner.register_step_post_hook(arm.opt.stop)

            def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
                arm._dt = time.perf_counter() - arm._t0
                arm._done.release()
                arm._go.acquire()
                if arm._stopping:  # close() before max_steps (an error elsewhere): end train() here
                    control.should_training_stop = True
                arm._t0 = time.perf_counter()

        self.trainer = build_trl(model, tok, prompts, tasks, args, os.path.join(out_dir, "trl"), [Park()])
        self._thread = threading.Thread(target=self._run, name="trl-train", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(self.args.threads)  # the intra-op setting, explicitly in this thread too
        self.threads = torch.get_num_threads()
        self._go.acquire()
        self._t0 = time.perf_counter()
        try:
            self.trainer.train()
        except BaseException as e:  # handed to the main thread by step()
            self._error = e
        finally:
            self._finished = True
            self._done.release()

    def step(self) -> float:
        """Release TRL for one optimizer step; wait for its ``on_step_end``; return its wall time."""
        if self._finished:
            raise RuntimeError("TRL's training loop has ended (max_steps reached)")
        i = len(self.rec)
        self.trainer.times.clear()
        self.opt.take()
        self._go.release()
        self._done.acquire()
        if self._error is not None or self._finished:
            raise RuntimeError(f"TRL step {i} failed") from self._error
        want = [t.id for t in self.tasks[i * self.args.n : (i + 1) * self.args.n]]
        if self.trainer.reward_funcs[0].seen[-1] != want:
            raise RuntimeError(f"TRL's step {i} prompts differ from k3post's")
        r = _trl_step_stats(self.trainer, self._dt, self.opt.take())
        self.rec.append(r)
        print(f"  trl step {i}: {r['step_s']:.3f} s (generate {r['generate_s']:.3f}, rewards {r['rewards_s']:.3f}, "
              f"loss forward {r['compute_loss_s']:.3f}, backward {r['backward_s']:.3f}, optimizer {r['optimizer_s']:.3f}); "
              f"{r['tokens']:.0f} tokens, reward {r['reward']:.2f}", flush=True)
        return r["step_s"]

    def close(self) -> None:
        """Let ``train()`` finish (after ``max_steps``, or now when closed early)."""
        self._stopping = True
        self._go.release()
        self._thread.join(timeout=120)


def _trl_step_stats(trainer: Any, step_s: float, optimizer_s: float) -> dict[str, float]:
    """Tokens, reward and timed parts of TRL's last step (its metric buffers and our timers)."""
    m = trainer._metrics["train"]
    n = trainer.args.per_device_train_batch_size
    t = trainer.times
    gs, ts = t["generate_and_score_s"], t["training_step_s"]
    return {
        "step_s": step_s,
        "tokens": m["completions/mean_length"][-1] * n,
        "capped": m["completions/clipped_ratio"][-1] * n,
        "reward": m["reward"][-1],
        "generate_s": t["generate_s"], "rewards_s": t["rewards_s"],
        "generate_and_score_s": gs, "score_other_s": gs - t["generate_s"] - t["rewards_s"],
        "compute_loss_s": t["compute_loss_s"], "backward_s": ts - gs - t["compute_loss_s"],
        "optimizer_s": optimizer_s, "loop_rest_s": step_s - ts - optimizer_s,
        "update_s": step_s - gs,  # everything but generation and scoring: TRL's side of k3post's update_s
    }


# ---------------------------------------------------------------------- main
def _med(rec: list[dict[str, float]], key: str, skip: int) -> float:
    return statistics.median(r[key] for r in rec[skip:])


def _mean(rec: list[dict[str, float]], key: str, skip: int) -> float:
    return statistics.fmean(r[key] for r in rec[skip:])


def _round(d: dict[str, float], nd: int = 4) -> dict[str, float]:
    return {k: round(v, nd) for k, v in d.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps (repeats) per arm after the warm-up, >= 3")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per arm")
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
    args = ap.parse_args(argv)
    if args.steps < 3 or args.warmup < 0 or args.n < 1 or args.k < 2 or args.threads < 1:
        raise ValueError("--steps must be >= 3, --warmup >= 0, --n >= 1, --k >= 2 and --threads >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="k3post-bench-rl-") as tmp:
        _main(args, tmp)


def _main(args: argparse.Namespace, tmp: str) -> None:
    import trl

    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    tok = train_tokenizer(default_corpus(), vocab_size=512, out_dir=os.path.join(tmp, "tok"))
    xtml = XTML(tok)
    base = build_tiny_moe(len(tok), seed=args.seed, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"torch {torch.__version__}, trl {trl.__version__}, threads {torch.get_num_threads()}, "
          f"load average {load_start}; model {n_params / 1e6:.2f} M parameters, vocab {len(tok)}")
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

    k3 = K3PostArm("k3post", copy.deepcopy(base), tok, cfg, budgets, tasks)
    k3s = K3PostArm("k3post_skip_zero_variance", copy.deepcopy(base), tok, rl_config(args, skip_zero_variance=True),
                    budgets, tasks)
    tr = TRLArm(tok, copy.deepcopy(base), prompts, tasks, args, tmp)
    if tr.trainer.accelerator.mixed_precision != "no" or checkpointing(tr.trainer.model):
        raise RuntimeError("TRL runs with mixed precision or gradient checkpointing")
    try:
        times = interleaved({"trl": tr.step, "k3post": k3.step, "k3post_skip_zero_variance": k3s.step},
                            repeats=args.steps, warmup=args.warmup)
    finally:
        tr.close()
        k3.close()
        k3s.close()
    machine = machine_state()
    if tr.threads != args.threads:
        raise RuntimeError(f"TRL's thread ran {tr.threads} torch threads, not {args.threads}")

    w = args.warmup
    head = ratio_summary("speedup_vs_trl", times["trl"], times["k3post"])
    skip = ratio_summary("speedup_vs_trl_skip_zero_variance", times["trl"], times["k3post_skip_zero_variance"])
    steps = {**summary("k3post_step_s", times["k3post"]),
             **summary("k3post_skip_zero_variance_step_s", times["k3post_skip_zero_variance"]),
             **summary("trl_step_s", times["trl"])}
    profile = {
        "k3post": _round({k: _med(k3.rec, k, w) for k in ("step_s", "generate_s", "score_s", "update_s", "forward_s",
                                                          "optimizer_s", "update_rest_s")}),
        "k3post_skip_zero_variance": _round({k: _med(k3s.rec, k, w) for k in ("step_s", "generate_s", "score_s", "update_s",
                                                                             "forward_s", "optimizer_s", "update_rest_s")}),
        "trl": _round({k: _med(tr.rec, k, w) for k in ("step_s", "generate_s", "rewards_s", "score_other_s", "update_s",
                                                       "compute_loss_s", "backward_s", "optimizer_s", "loop_rest_s")}),
    }
    gen_ratio = profile["trl"]["generate_s"] / profile["k3post"]["generate_s"]
    upd_ratio = profile["trl"]["update_s"] / profile["k3post"]["update_s"]
    for arm, prof in profile.items():
        print(f"{arm}: " + ", ".join(f"{k} {v:.3f}" for k, v in prof.items()))
    met = head["speedup_vs_trl"] >= TARGET
    print(f"speedup_vs_trl (equal work): {head['speedup_vs_trl']:.2f}x (paired min {head['speedup_vs_trl_min']:.2f}, "
          f"max {head['speedup_vs_trl_max']:.2f}, {args.steps} repeats), target >= {TARGET}: "
          f"{'met' if met else 'NOT MET'}; skipping zero-variance groups {skip['speedup_vs_trl_skip_zero_variance']:.2f}x; "
          f"generation {gen_ratio:.2f}x, update (everything after scoring) {upd_ratio:.2f}x")
    for c in CAVEATS:
        print(f"  caveat: {c}")

    check = float("nan")
    if not args.no_train_rl_check:
        res = train_rl(copy.deepcopy(base), tok, cfg, os.path.join(tmp, "rl"), budgets=budget_table(tasks, args.max_tokens),
                       resume=False, evaluate=False)
        check = statistics.median(res.metrics.series("step_s")[w:])
        print(f"check: train_rl itself, {res.steps} steps, median step_s after the warm-up {check:.3f} s "
              f"(the bench's k3post arm: {steps['k3post_step_s_median']:.3f} s)")

    result: dict[str, Any] = {
        **_round(head, 3), **_round(skip, 3),
        "target": TARGET, "target_met": met,
        **_round(steps),
        "generation_speedup_vs_trl": round(gen_ratio, 3), "update_speedup_vs_trl": round(upd_ratio, 3),
        "profile": profile,
        "k3post_tokens_per_step": round(_mean(k3.rec, "tokens", w), 1),
        "k3post_skip_zero_variance_tokens_per_step": round(_mean(k3s.rec, "tokens", w), 1),
        "trl_tokens_per_step": round(_mean(tr.rec, "tokens", w), 1),
        "k3post_capped_per_step": round(_mean(k3.rec, "capped", w), 2),
        "trl_capped_per_step": round(_mean(tr.rec, "capped", w), 2),
        "k3post_reward_mean": round(_mean(k3.rec, "reward", w), 4),
        "k3post_skip_zero_variance_reward_mean": round(_mean(k3s.rec, "reward", w), 4),
        "trl_reward_mean": round(_mean(tr.rec, "reward", w), 4),
        "k3post_trained_seqs_per_step": round(_mean(k3.rec, "trained_seqs", w), 2),
        "k3post_skip_zero_variance_trained_seqs_per_step": round(_mean(k3s.rec, "trained_seqs", w), 2),
        "k3post_zero_variance_groups_per_step": round(_mean(k3.rec, "zero_variance_groups", w), 2),
        "k3post_update_sampled_tokens_per_step": round(_mean(k3.rec, "trained_tokens", w), 1),
        "k3post_update_forward_tokens_per_step": round(_mean(k3.rec, "forward_tokens", w), 1),
        "k3post_update_sequence_tokens_per_step": round(_mean(k3.rec, "sequence_tokens", w), 1),
        "k3post_train_rl_step_s_median": round(check, 4),
        "completions_per_step": args.n * args.k, "group_size": args.k, "max_new_tokens": args.max_tokens,
        "steps": args.steps, "warmup": args.warmup, "sft_steps": args.sft_steps, "threads": args.threads,
        "trl_version": trl.__version__,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "loadavg_at_start": load_start,
        "machine": machine,
        "caveats": CAVEATS,
        "trl_config": trl_config_dict(tr.trainer.args),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
