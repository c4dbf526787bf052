"""The one training loop of stages 2 and 3 (RL and MOPD differ only in their `Signal`):

    for step in 1..steps:
        groups  = rollout.run_iteration()          partial rollout (SPEC §3.2), repeated until a group
                                                   has all K samples
        seqs, m = signal(groups)                   RL: reward → effort override → advantage (k3post.stages.rl);
                                                   MOPD: teacher − student log-ratio (k3post.stages.mopd)
        train_step(seqs)                           the trainer's step with the policy loss's gradient
                                                   function (`train_policy_step`, SPEC §3.1)
        rollout.push_weights(trainer)              policy version + 1
        online_draft.step(groups)                  rl.draft only: the rollout's EAGLE-3 draft trains against the
                                                   updated policy (k3post.spec.online)
        metrics; checkpoint                        weights, optimizer, rollout state (and the draft): exact resume

`PolicyLoop` holds the two seams (`k3post.rollout.factory.Rollout`, `k3post.trainer.Trainer`) and is
the body; `train_policy` drives it with checkpoints, metrics and a progress bar. Where the rollout runs
(in this process or on engine servers) and where the trainer runs (CPU or CUDA) are settings of those
seams, not of this loop.

Exact resume: a checkpoint holds the weights, the optimizer, the rollout state (paused and finished but
undispatched trajectories with their env / sandbox state, the prompt queue, the KV pool's tensors) and the
engine version; sampling is counter-based, so a resumed run reproduces the uninterrupted one (tested by
killing a run).

Infrastructure failures (`k3post.errors.InfrastructureError`): an episode whose env worker, sandbox or
browser failed ends with finish "infra" (`k3post.rollout.agent_loop`), a group the GRM judge could not score
is marked "judge" by the RL signal; neither is the policy's outcome, so neither becomes a reward. A group
with at least ``infra_min_valid`` valid samples (capped at K) trains with the failed ones masked out (the
signals' group statistics run over the valid samples, the failed ones are not in the loss); one with fewer
is run again as a fresh group of the same prompt (``infra_retries`` times per prompt), then dropped. Every
step logs ``infra_episodes``, ``infra/<kind>``, ``infra_rate`` (over every episode the step finished,
retried and dropped groups included), ``infra_retried_groups`` and ``infra_dropped_groups``; a step whose
``infra_rate`` exceeds ``infra_max_rate`` raises `InfrastructureError`: the infrastructure is broken, and
training on what is left would train on a biased sample.

Per-step rows: each step's metrics go to the run's metrics.jsonl (made durable before each checkpoint) and
nowhere else: the loop keeps no per-step history in memory or in checkpoints, so a long run's memory and
checkpoints do not grow with its steps (issue 20). A consumer of the whole series reads it back from the
file (`StageLog`: curves, `rollout_gap`, the last steps' values).

Shape legend: none here (the math lives in k3post/algos and k3post/policy_step.py).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from k3post.checkpoint import latest_checkpoint, resuming
from k3post.config.draft import DraftConfig
from k3post.envs.task import Task
from k3post.errors import InfrastructureError, StepFailed
from k3post.metrics import MetricsLogger, iter_metrics
from k3post.policy_step import TokenSequence, train_policy_step
from k3post.rollout.factory import Rollout, RolloutConfig
from k3post.rollout.trajectory import Group, infra_metrics, outcome_metrics
from k3post.routing_replay import check_replayable
from k3post.spec.data import DraftSample
from k3post.spec.export import export_eagle3
from k3post.spec.online import OnlineDraft
from k3post.config.loss import LossConfig
from k3post.config.optim import PolicyOptimConfig
from k3post.trainer import build_trainer

log = logging.getLogger(__name__)

__all__ = ["Signal", "LoopConfig", "PolicyLoop", "StageLog", "train_policy", "rollout_gap"]

# a step runs at most this many partial-rollout iterations to complete a group (each completes >= λ·N·K samples)
_MAX_EMPTY_ITERATIONS = 64

Signal = Callable[[Sequence[Group]], tuple[list[TokenSequence], dict[str, float]]]
"""Dispatched groups → training sequences (per-token advantages) and step metrics: the only part
of the loop that differs between RL (`k3post.stages.rl.rl_signal`) and MOPD (`k3post.stages.mopd.opd_signal`)."""


class LoopConfig(Protocol):
    """What the loop reads from a stage's config (`k3post.config.rl.RLConfig` is one)."""

    steps: int
    effort: str
    seed: int
    rollout: RolloutConfig
    optim: PolicyOptimConfig
    loss: LossConfig
    save_every: int
    keep_last: int
    progress: bool
    micro_batch_tokens: int
    device: str
    infra_min_valid: int
    infra_retries: int
    infra_max_rate: float
    draft: str
    draft_steps: int
    draft_lr: float

    def rollout_config(self) -> RolloutConfig: ...

    def lr_at(self, step: int) -> float: ...


class PolicyLoop:
    """The loop's objects (a `Rollout` and a `Trainer` over one model) and its body: `step` is one
    iteration of the module doc, `save` / `load` a checkpoint with exact resume. `train_policy` drives
    it; benchmarks time `step` on their own prompts."""

    online_draft: OnlineDraft | None = None  # rl.draft: the rollout's draft, trained after every step

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: LoopConfig,
        *,
        signal: Signal,
        effort_fn: Callable[[Task], str | None] | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.signal = cfg, tokenizer, signal
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_id, self.loss_kwargs = pad_id, cfg.loss.policy_loss_kwargs()  # what `train_policy_step` is handed every step
        if cfg.rollout.routing_replay == "rollout-routes":  # fail before training when the routers cannot be replayed
            check_replayable(model)
        self.trainer = build_trainer(model, cfg.optim, device=cfg.device, pad_id=pad_id, grad_clip=cfg.optim.grad_clip)
        self.model = model  # trained in place (a sharded trainer copies its weights back after every step)
        self.rollout = Rollout(self.model, tokenizer, cfg.rollout_config(), effort=cfg.effort, seed=cfg.seed,
                               effort_fn=effort_fn)
        if cfg.draft:
            self.online_draft = OnlineDraft(self.rollout.engine.speculative.drafter, self.model,
                                            DraftConfig(lr=cfg.draft_lr, progress=False), steps=cfg.draft_steps,
                                            pad_id=pad_id, seed=cfg.seed)
        self.step_no, self.cursor = 0, 0
        self.last_groups: list[Group] = []  # the groups the last step trained on
        self.infra_retries: dict[str, int] = {}  # task id -> re-runs of its group after infrastructure failures

    def train_step(self, seqs: Sequence[TokenSequence], *, version: int, lr: float) -> dict[str, float]:
        """The trainer's step with the policy loss's gradient function (`k3post.policy_step.train_policy_step`)."""
        return train_policy_step(self.trainer, seqs, pad_id=self.pad_id, loss_kwargs=self.loss_kwargs,
                                 micro_batch_tokens=self.cfg.micro_batch_tokens, version=version, lr=lr,
                                 routing_replay=self.cfg.rollout.routing_replay == "rollout-routes",
                                 exact=self.cfg.rollout.exact)

    @property
    def engine(self) -> Any:
        return self.rollout.engine

    @property
    def loop(self) -> Any:
        """The rollout's agent loop."""
        return self.rollout.loop

    def step(self, tasks: Sequence[Task]) -> dict[str, float]:
        """One step: top the prompt queue up to N from the stream cycling over ``tasks``, run
        partial-rollout iterations until at least one group has completed (with few prompts and λ < 1
        an iteration can end before any group has all K samples; the weights do not change in between),
        the signal, one trainer step, the weight push. Returns the step's metrics, with the time of each
        part (the caller logs them: nothing per step is kept here)."""
        t0 = time.perf_counter()
        before = self.rollout.counters()
        groups: list[Group] = []
        finished: list[Group] = []  # every group the step's iterations completed (retried and dropped ones too)
        retried = dropped = iterations = 0
        while not groups:  # an iteration that completes no whole group leaves nothing to train on: run another
            if iterations == _MAX_EMPTY_ITERATIONS:
                raise RuntimeError(f"{iterations} partial-rollout iterations completed no group of {self.cfg.rollout.k} samples "
                                   f"(n_prompts={self.cfg.rollout.n_prompts}, lambda_={self.cfg.rollout.lambda_})")
            while self.rollout.num_pending_prompts < self.cfg.rollout.n_prompts:
                self.rollout.add_prompts([tasks[self.cursor % len(tasks)]])
                self.cursor += 1
            got = self.rollout.run_iteration()
            iterations += 1
            finished += got
            for g in got:
                fate = self._infra_triage(g)
                retried += fate == "retry"
                dropped += fate == "drop"
                if fate == "train":
                    groups.append(g)
            self._check_infra(finished)
        t1 = time.perf_counter()
        seqs, sig = self.signal(groups)  # the RL signal marks the groups its judge could not score ("judge")
        self._check_infra(finished)
        t2 = time.perf_counter()
        lr = self.cfg.lr_at(self.step_no)
        train_m = self.train_step(seqs, version=self.rollout.version, lr=lr)
        version = self.rollout.push_weights(self.trainer.named_weights)
        t3 = time.perf_counter()
        draft_m: dict[str, float] = {}
        if self.online_draft is not None:  # the draft follows the policy it now drafts for
            draft_m = self.online_draft.step([DraftSample(list(t.token_ids), list(t.trainable))
                                              for g in groups for t in g.trajectories if t.infra is None])
        t4 = time.perf_counter()
        counters = {k: v - before[k] for k, v in self.rollout.counters().items()}
        if counters.get("spec_drafted"):  # speculative rollout: the share of drafted tokens the policy accepted
            counters["spec_acceptance_rate"] = counters["spec_accepted"] / counters["spec_drafted"]
        self.step_no += 1
        stale = [x for g in groups for x in g.staleness()]
        rec = {**sig, **{f"train/{k}": v for k, v in train_m.items()},
               "lr": lr, "version": float(version), "groups": float(len(groups)), "iterations": float(iterations),
               "rollout_s": t1 - t0, "score_s": t2 - t1, "update_s": t3 - t2, "step_s": t4 - t0,
               **({"draft_s": t4 - t3} if self.online_draft is not None else {}),
               **{f"draft/{k}": v for k, v in draft_m.items()},
               "kv_hit_rate": self.rollout.kv_hit_rate(), "paused": float(len(self.rollout.paused())),
               **counters,
               "mean_staleness": statistics.fmean(stale) if stale else 0.0,
               **outcome_metrics([t for g in groups for t in g.trajectories]),
               **infra_metrics([t for g in finished for t in g.trajectories]),
               "infra_retried_groups": float(retried), "infra_dropped_groups": float(dropped)}
        self.last_groups = groups
        return rec

    def _infra_triage(self, group: Group) -> str:
        """What to do with a finished group (module doc): "train" (its valid samples; the failed ones are
        masked by the signal), "retry" (the prompt is queued again) or "drop"."""
        valid = sum(group.valid)
        key = str(group.task.get("id", group.group_id))
        if valid == len(group.trajectories) or valid >= min(self.cfg.infra_min_valid, len(group.trajectories)):
            self.infra_retries.pop(key, None)
            return "train"
        kinds = sorted({t.infra for t in group.trajectories if t.infra is not None})
        n = self.infra_retries.get(key, 0)
        if n < self.cfg.infra_retries:
            self.infra_retries[key] = n + 1
            self.rollout.add_prompts([Task.from_dict(group.task)])
            log.warning("group %d (task %s): %d of %d samples failed for infrastructure reasons (%s); running the "
                        "prompt again (retry %d of %d)", group.group_id, key, len(group.trajectories) - valid,
                        len(group.trajectories), ", ".join(kinds), n + 1, self.cfg.infra_retries)
            return "retry"
        self.infra_retries.pop(key, None)
        log.warning("group %d (task %s): %d of %d samples failed for infrastructure reasons (%s) after %d retries; "
                    "the group is dropped", group.group_id, key, len(group.trajectories) - valid,
                    len(group.trajectories), ", ".join(kinds), n)
        return "drop"

    def _check_infra(self, finished: Sequence[Group]) -> None:
        """Raise `InfrastructureError` when more than ``infra_max_rate`` of the episodes of ``finished``
        failed for infrastructure reasons."""
        m = infra_metrics([t for g in finished for t in g.trajectories])
        if m["infra_rate"] > self.cfg.infra_max_rate:
            kinds = ", ".join(f"{k[6:]} {int(v)}" for k, v in m.items() if k.startswith("infra/"))
            n = sum(len(g.trajectories) for g in finished)
            raise InfrastructureError(
                f"{int(m['infra_episodes'])} of {n} episodes of step {self.step_no + 1} failed for infrastructure "
                f"reasons ({kinds}): above rl.infra_max_rate = {self.cfg.infra_max_rate:g}; the infrastructure is "
                "broken, not the policy (see the run log for each failure)")

    def save(self, ckpt_root: Path) -> Path:
        """Checkpoint: weights, optimizer, rollout state (paused trajectories, KV pool tensors, version)."""
        rollout = self.rollout.state_dict()
        return self.trainer.save_checkpoint(ckpt_root, self.step_no, tokenizer=self.tokenizer, state={
            "scheduler": rollout["scheduler"], "kv_pool": rollout["kv_pool"], "engine_version": rollout["engine_version"],
            "cursor": self.cursor, "config": asdict(self.cfg),  # type: ignore[call-overload]
            "infra_retries": dict(self.infra_retries),
            **({"online_draft": self.online_draft.state_dict()} if self.online_draft is not None else {}),
        }, keep_last=self.cfg.keep_last)

    def load(self, ckpt: Path) -> list[dict[str, float]] | None:
        """Restore a checkpoint written by `save` (into a loop built with the same config; any trainer rank
        count). Returns the per-step rows a checkpoint of an older k3post carried (its ``history``: steps 1..
        its step), which the loop no longer keeps; None for a current checkpoint."""
        with resuming(ckpt):
            state = self.trainer.load_checkpoint(ckpt)
        self.rollout.refresh_weights()
        self.rollout.load_state_dict(state)
        self.step_no, self.cursor = int(state["step"]), int(state["cursor"])
        self.infra_retries = {str(k): int(v) for k, v in dict(state.get("infra_retries") or {}).items()}
        if self.online_draft is not None:
            if "online_draft" not in state:
                raise ValueError(f"{ckpt}: rl.draft is set but the checkpoint was written without an online draft; "
                                 "resume with the run's own settings or start a new run")
            self.online_draft.load_state_dict(state["online_draft"])
        legacy = state.get("history")
        return None if legacy is None else list(legacy)

    def close(self) -> None:
        self.rollout.close()


def train_policy(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: LoopConfig,
    out_dir: str | Path,
    *,
    tasks: Sequence[Task],
    signal: Signal,
    effort_fn: Callable[[Task], str | None] | None = None,
    metrics: MetricsLogger | None = None,
    stage: str = "rl",
    resume: bool = True,
    stop_after: int | None = None,
) -> tuple[int, StageLog, int | None, PolicyLoop]:
    """The loop of the module doc over a prompt stream cycling through ``tasks``, trained with
    ``signal``; each prompt is rendered at ``effort_fn(task)`` (default: the config's effort). Each step's
    row goes to ``metrics`` under ``stage`` (default: ``out_dir/metrics.jsonl``, without TensorBoard); a run
    that starts from step 0 first drops the stage's rows there, a resumed one those after its checkpoint.
    Returns (final step, the stage's rows as a `StageLog`, the step resumed from, the loop); the caller
    evaluates with ``loop.engine`` / ``loop.loop`` and closes it. ``stop_after`` ends this call after that
    many steps (tests kill and resume)."""
    if not tasks:
        raise ValueError("train_policy needs at least one training task")
    ckpt_root = Path(out_dir) / "checkpoints"
    own_metrics = metrics is None
    sink = MetricsLogger(out_dir, tensorboard=False) if metrics is None else metrics
    pl = PolicyLoop(model, tokenizer, cfg, signal=signal, effort_fn=effort_fn)
    try:
        resumed_from = None
        ckpt = latest_checkpoint(ckpt_root, keep_last=cfg.keep_last) if resume else None
        if ckpt is not None:
            legacy = pl.load(ckpt)
            resumed_from = pl.step_no
            sink.truncate(stage, pl.step_no)
            _check_rows(sink, stage, pl.step_no, legacy)
            log.info("resumed %s from %s (step %d)", stage, ckpt, pl.step_no)
        else:  # a run killed before its first checkpoint (or one started over) may have logged rows
            sink.truncate(stage, 0)
        bar = tqdm(total=cfg.steps, initial=pl.step_no, desc=stage, disable=not cfg.progress, dynamic_ncols=True,
                   mininterval=1.0)
        end = cfg.steps if stop_after is None else min(cfg.steps, pl.step_no + stop_after)
        while pl.step_no < end:
            try:
                rec = pl.step(tasks)
            except Exception as e:  # name the stage and the step; the cause is chained
                raise StepFailed(stage, pl.step_no + 1, e) from e
            sink.log(stage, pl.step_no, rec)
            bar.update(1)
            bar.set_postfix({k: f"{rec[k]:.2f}" for k in ("reward", "effort_tokens", "opd_reward") if k in rec})
            if pl.step_no % cfg.save_every == 0 or pl.step_no == cfg.steps:
                sink.sync()  # the rows up to the checkpoint's step are as durable as the checkpoint
                pl.save(ckpt_root)
        bar.close()
        # the caller evaluates on this engine; a server (no KV transfer) still holds the last step's paused
        # requests, and evaluation ids are the training ids
        pl.rollout.release_engine()
        if pl.online_draft is not None and pl.step_no == cfg.steps:  # the draft that followed the policy, servable
            log.info("%s: the online draft -> %s", stage,
                     export_eagle3(pl.online_draft.draft, Path(out_dir) / "draft", nonstock=True))
    except BaseException:
        pl.close()
        raise
    finally:
        if own_metrics:
            sink.close()
    return pl.step_no, StageLog(sink.path, stage, pl.step_no), resumed_from, pl


def _check_rows(metrics: MetricsLogger, stage: str, step: int, legacy: Sequence[Mapping[str, float]] | None) -> None:
    """After a resume at ``step``: the stage's rows of steps 1..step should all be in ``metrics``. Missing
    ones are put back from ``legacy`` (the history a checkpoint of an older k3post carried) when it has
    them, else named in a warning (the curves and summaries then leave those steps out)."""
    have = {int(r["step"]) for r in iter_metrics(metrics.path, stage)}
    missing = sorted(set(range(1, step + 1)) - have)
    if not missing:
        return
    if legacy is not None and len(legacy) >= step:
        metrics.replace_stage(stage, [(i + 1, row) for i, row in enumerate(legacy[:step])])
        log.info("%s: put the rows of steps 1..%d back into %s from the checkpoint's history (an older "
                 "k3post kept them there)", stage, step, metrics.path)
        return
    log.warning("%s: %s has no rows for %d of steps 1..%d (%s): the run's curves and summaries leave those "
                "steps out", stage, metrics.path, len(missing), step, _ranges(missing))


def _ranges(steps: Sequence[int]) -> str:
    """"1-3, 7" for [1, 2, 3, 7]."""
    out: list[str] = []
    for s in steps:
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


_ROW_KEYS = ("stage", "step", "time")  # what `MetricsLogger.log` adds to a step's values


class StageLog:
    """The per-step rows of one stage of a run: the rows of ``stage`` with steps 1..``steps`` in the
    metrics file at ``path``, read back when asked, one row at a time. Each row is the values the loop's
    step returned (`PolicyLoop.step`), without the logger's stage / step / time. Nothing is cached: a long
    run's series is never held whole unless a caller asks for it (`rows`)."""

    def __init__(self, path: str | Path, stage: str, steps: int) -> None:
        self.path, self.stage, self.steps = Path(path), stage, steps

    def items(self) -> Iterator[tuple[int, dict[str, float]]]:
        """(step, row) in file order (the step order of one run)."""
        for r in iter_metrics(self.path, self.stage):
            step = int(r.get("step", 0))
            if 1 <= step <= self.steps:
                yield step, {k: v for k, v in r.items() if k not in _ROW_KEYS}

    def __iter__(self) -> Iterator[dict[str, float]]:
        return (row for _, row in self.items())

    def rows(self) -> list[dict[str, float]]:
        return list(self)

    def series(self, key: str) -> list[float]:
        """``key`` of every step 1..steps, NaN where a step's row lacks it or has no row."""
        out, nxt = [], 1
        for step, row in self.items():
            out += [math.nan] * (step - nxt)
            out.append(row.get(key, math.nan))
            nxt = step + 1
        return out + [math.nan] * (self.steps + 1 - nxt)

    def tail(self, n: int) -> list[dict[str, float]]:
        """The last ``n`` rows."""
        return list(deque(self, maxlen=n))


def rollout_gap(history: Iterable[Mapping[str, float]], prefix: str = "train/") -> dict[str, float]:
    """The train–rollout log-prob gap over a run's steps (`policy_step`'s ``rollout_gap_*``): the token-weighted
    mean and the max of |log π_trainer − log π_engine| over the sampled tokens each step trained with the
    weights that sampled them over KV of those weights (``mean``, ``max``, ``tokens``: the engine mismatch); the
    same over the tokens those weights sampled over KV of older ones (``stale_kv_mean``, ``stale_kv_max``,
    ``stale_kv_tokens``: a paused trajectory resumed on its kept KV, ``rl.rollout.resume_kv=reuse``); and over the
    tokens older weights sampled (``moved_mean``, ``moved_tokens``: how far the policy moved since). With routes
    recorded (``rl.rollout.routing_replay`` measure / rollout-routes) also ``routing_mismatch_frac`` over
    ``routing_positions``: the share of recorded context positions the trainer's own top-k routed differently from
    the engine in some MoE layer. ``history``: the steps' rows (a `StageLog`), read once."""
    parts = {"": "rollout_gap", "stale_kv_": "rollout_gap_stale_kv", "moved_": "policy_moved_gap"}  # moved: no max
    n = dict.fromkeys(parts, 0.0)
    total = dict.fromkeys(parts, 0.0)
    top: dict[str, float] = {}  # a row without a max counts 0 (gaps are >= 0); none while no row was read
    known = mismatched = 0.0
    for h in history:
        k = h.get(f"{prefix}routing_known_tokens", 0.0)
        if k:
            known += k
            mismatched += h[f"{prefix}routing_mismatch_frac"] * k
        for out, key in parts.items():
            tokens = h.get(f"{prefix}{key}_tokens", 0.0)
            n[out] += tokens
            if tokens > 0:
                total[out] += h[f"{prefix}{key}_mean"] * tokens
            top[out] = max(top.get(out, 0.0), h.get(f"{prefix}{key}_max", 0.0))
    res: dict[str, float] = {}
    for out in parts:
        res[f"{out}tokens"] = n[out]
        if out and not n[out]:  # no such token: no mean or max (NaN would make equal runs compare unequal)
            continue
        res[f"{out}mean"] = total[out] / n[out] if n[out] else float("nan")
        if out != "moved_":
            res[f"{out}max"] = top.get(out, float("nan"))
    if known:
        res.update(routing_positions=known, routing_mismatch_frac=mismatched / known)
    return res
