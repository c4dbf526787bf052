"""Stage 3 MOPD (SPEC §4): one student distilled on-policy from the 9 experts π^(d,e), one readable loop.

    for step in 1..steps:
        groups = scheduler.run_iteration()                 partial rollout, unchanged (§3.2); each prompt of
                                                           domain d is rendered at an effort e drawn per task
                                                           from the configured mixture (`effort_sampler`)
        for each trajectory y of a task of domain d at effort e:
            ctx   = the conversation WITHOUT the thinking-effort message + y's tokens    (`teacher_context`)
            t_i   = log π^(d,e)(y_i | ctx_<i)                one prefill of the teacher, no sampling
            s_i   = the behaviour log-prob the engine recorded for y_i
            r_i   = clip(t_i − s_i, −R_max, R_max) (+ w_orm · (r(y) − mean_group r))      (`opd_reward`)
        loss = policy_loss with r_i as the per-token advantage  (K2.5 mask + quadratic regulariser, §3.1)
        optimizer step; engine.update_weights(); metrics; checkpoint (exact resume)

Everything but the signal is `k3post.loop.train_policy`, the RL loop itself (STYLE.md 4: "on-policy
distillation is RL with a per-token advantage from the teacher").

Decisions:

* **Student log-probs are the behaviour log-probs** (π_old, recorded by the rollout engine), not a fresh
  forward of the current π_θ as SPEC §4's r_t writes. This saves a second student forward per step; under
  partial rollout a token may be a few versions old, but `policy_loss`'s K2.5 band masks the gradient of
  every token with |log π_θ − log π_old| > log 2, so the reward of a token that still trains is within
  log 2 of SPEC's. With λ = 1 and one optimizer step per batch the two are identical. The engine records
  the untempered log π_old, so the reward compares model distributions at any sampling temperature (the
  mean of −r is the reverse-KL estimate only at temperature 1).
* **The teacher does not see the effort** (SPEC §4): its context is the task's prompt re-rendered with
  ``effort=OMIT_EFFORT`` (no thinking-effort message) in the same think mode, followed by the trajectory's
  tokens after the student's prompt,
  unchanged (sampled tokens and tool results). XTML encodes every message on its own, so the two contexts
  differ only by the thinking-effort message; the teacher log-prob of student position i is at i + offset,
  offset = teacher prompt length − student prompt length (< 0). ``teacher_sees_effort=True`` keeps the
  message (for effort-conditioned teachers, e.g. experts trained by `k3post.stages.rl` with the message in their
  prompts, or a previous student).
* **Teachers** (`k3post.rollout.teachers.TeacherPool`): a local checkpoint folder, loaded on demand into CPU
  memory and scored by an engine built over it (at most ``max_resident`` at once, least recently used evicted),
  or an OpenAI-compatible server that returns prompt
  log-probs from ``/v1/completions`` with ``echo=True, logprobs=0, max_tokens=0`` (the vLLM convention;
  `k3post serve EXPERT_DIR` offers it too).
* **Effort per prompt** is a pure function of the task's content hash and the run seed, so a resumed run
  renders every prompt exactly as the uninterrupted one.

Shape legend: B trajectories, T sampled-token positions (right-padded), V vocabulary.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from k3post.algos.advantages import group_advantages_from_groups
from k3post.algos.opd import opd_reward
from k3post.config.mopd import MOPDConfig, effort_weights
from k3post.config.rollout import EngineConfig
from k3post.envs.families.streams import domain_families, eval_tasks, train_tasks
from k3post.envs.task import Task
from k3post.metrics import MetricsLogger
from k3post.policy_step import TokenSequence
from k3post.quant.qat import QATConfig
from k3post.loop import Signal, StageLog, train_policy
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.factory import build_engine, close_engine
from k3post.rollout.engine import request_seed, token_uniform
from k3post.rollout.evaluation import evaluate_episodes, make_env, paired_passes
from k3post.rollout.teachers import TeacherPool
from k3post.rollout.trajectory import Group, Trajectory
from k3post.stats import paired_change, paired_ratio
from k3post.threads import child_threads, exit_with_parent
from k3post.workers import worker_pool
from k3post.urls import is_url
from k3post.xtml import EFFORTS, OMIT_EFFORT, XTML

log = logging.getLogger("k3post.mopd")  # the name users filter on, kept when the module moved to stages/

__all__ = ["MOPDResult", "expert_name", "effort_sampler", "initial_messages",
           "teacher_context", "opd_signal", "mopd_families", "mopd_eval_tasks", "train_mopd", "mopd_checks", "evaluate_mopd", "eval_caps"]


@dataclass
class MOPDResult:
    """What one MOPD run returns: the final step, its per-step rows (read back from the metrics file), the
    teacher pool's counters."""

    steps: int
    metrics: StageLog
    teacher_stats: dict[str, int]
    resumed_from: int | None
    seconds: float


def expert_name(domain: str, effort: str) -> str:
    """The name of expert π^(d,e): ``"domain.effort"``."""
    return f"{domain}.{effort}"


def effort_sampler(mix: Mapping[str, float], seed: int) -> Callable[[Task], str]:
    """Task → effort drawn from ``mix``, a pure function of the task (exact resume):

        u = token_uniform(request_seed(seed, task.content_hash()), 0)         in [0, 1)
        e = the first effort, in the order low, high, max, with  Σ_{e' ≤ e} w_e' / Σ w  > u
    """
    weights = effort_weights(mix)
    total = sum(w for _, w in weights)
    bounds, acc = [], 0.0
    for e, w in weights:
        if w > 0:
            acc += w / total
            bounds.append((acc, e))

    def effort(task: Task) -> str:
        u = token_uniform(request_seed(seed, task.content_hash()), 0)
        return next((e for c, e in bounds if c > u), bounds[-1][1])
    return effort


# --------------------------------------------------------------------------- teachers


# --------------------------------------------------------------------------- the teacher's context


def initial_messages(task: Task) -> list[dict[str, Any]]:
    """The task's prompt messages, as `AgentLoop.start` gets them: ``reset`` of a fresh environment."""
    env = make_env(task)
    try:
        return asyncio.run(env.reset(task))
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def teacher_context(
    xtml: XTML,
    traj: Trajectory,
    messages: Sequence[Mapping[str, Any]],
    *,
    effort: str | None,
    teacher_effort: str | None = None,
    mode: str = "think",
) -> tuple[list[int], int]:
    """(teacher ids, offset): ``messages`` with ``traj.tools`` rendered at ``teacher_effort`` (None: no
    thinking-effort message, `OMIT_EFFORT`) in ``mode`` with the generation prefix, then ``traj``'s tokens after its prompt,
    unchanged. Student position i ≥ prompt_len is teacher position i + offset.

    ValueError unless rendering ``messages`` at the student's ``effort`` reproduces the trajectory's prompt
    exactly (as `AgentLoop.start` rendered it), so the alignment is checked, never assumed."""
    def render(e: str | None) -> list[int]:
        return xtml.render(messages, tools=traj.tools or None, effort=e, mode=mode, add_generation_prompt=True).ids

    prompt = traj.token_ids[: traj.prompt_len]
    if render(effort) != prompt:
        raise ValueError(f"trajectory {traj.traj_id!r}: its prompt is not the task's messages rendered at effort "
                         f"{effort!r} in {mode!r} mode; cannot align the teacher's context")
    teacher = prompt if teacher_effort == effort else render(OMIT_EFFORT if teacher_effort is None else teacher_effort)
    return teacher + traj.token_ids[traj.prompt_len :], len(teacher) - traj.prompt_len


# --------------------------------------------------------------------------- the signal


def opd_signal(pool: TeacherPool, cfg: MOPDConfig, xtml: XTML) -> Signal:
    """The MOPD signal (module doc): per-token ``opd_reward`` of every trajectory against its expert
    ``expert_name(task.domain, effort)``, the effort being the one the student was prompted with.

    Step metrics: ``opd_reward`` (mean per-token reward, outcome term included), ``opd_clip_frac``,
    ``reverse_kl`` (mean behaviour − teacher log-prob, the k1 estimate of KL(π_student ‖ π_teacher)),
    ``opd_tokens``, the outcome ``reward`` / ``pass_rate``, ``effort_tokens`` (mean T(y)) overall and per
    effort, and ``expert/NAME`` (trajectories scored by each expert). A trajectory whose infrastructure
    failed (``Trajectory.infra``: its context ends in an artefact of the failure) is left out of the loss, of
    the outcome term's group baseline and of these metrics (`k3post.loop` counts it)."""
    effort_fn = effort_sampler(cfg.effort_mix, cfg.rl.seed)
    if cfg.r_max <= 0:
        raise ValueError(f"r_max must be > 0, got {cfg.r_max}")

    def signal(groups: Sequence[Group]) -> tuple[list[TokenSequence], dict[str, float]]:
        trajs: list[Trajectory] = []
        efforts: list[str] = []
        ctx: list[tuple[list[int], list[int]]] = []
        by_expert: dict[str, list[int]] = {}
        for g in groups:
            task = Task.from_dict(g.task)
            effort = effort_fn(task)
            expert = expert_name(task.domain, effort)
            messages = initial_messages(task)
            for t in g.trajectories:
                if t.infra is not None:
                    continue
                ids, off = teacher_context(xtml, t, messages, effort=effort,
                                           teacher_effort=effort if cfg.teacher_sees_effort else None)
                by_expert.setdefault(expert, []).append(len(trajs))
                ctx.append((ids, [i + off for i, m in enumerate(t.trainable) if m]))
                trajs.append(t)
                efforts.append(effort)
        teacher_lp: list[list[float]] = [[] for _ in trajs]
        idx = {e: [i for i in rows if ctx[i][1]] for e, rows in by_expert.items()}
        scores = pool.score_all({e: ([ctx[i][0] for i in ix], [ctx[i][1] for i in ix]) for e, ix in idx.items()})
        for expert, ix in idx.items():
            for i, lp in zip(ix, scores[expert]):
                teacher_lp[i] = lp
        B, T = len(trajs), max((len(lp) for lp in teacher_lp), default=0)
        teacher_BT = torch.zeros(B, T)
        student_BT = torch.zeros(B, T)
        mask_BT = torch.zeros(B, T, dtype=torch.bool)
        for b, (t, lp) in enumerate(zip(trajs, teacher_lp)):
            n = len(lp)
            teacher_BT[b, :n] = torch.tensor(lp)
            student_BT[b, :n] = torch.tensor([x for x, m in zip(t.logprobs, t.trainable) if m])
            mask_BT[b, :n] = True
        outcome_B = None
        if cfg.w_orm != 0:
            adv = group_advantages_from_groups([g.rewards for g in groups], valid=[g.valid for g in groups]).advantages
            outcome_B = torch.tensor([a for g, a_g in zip(groups, adv) for a, v in zip(a_g, g.valid) if v],
                                     dtype=torch.float32)
        reward_BT, m = opd_reward(teacher_BT, student_BT, mask_BT, r_max=cfg.r_max,
                                  outcome_advantages_B=outcome_B, w_orm=cfg.w_orm)
        seqs = []
        for t, r_T in zip(trajs, reward_BT.tolist()):
            it = iter(r_T)
            seqs.append(TokenSequence(list(t.token_ids), list(t.trainable), list(t.logprobs),
                                      [next(it) if mk else 0.0 for mk in t.trainable], list(t.versions),
                                      list(t.kv_versions), t.routes_tensor()))
        rewards = [float(t.reward or 0.0) for t in trajs]
        rows = {"opd_reward": m["mean_reward"], "opd_clip_frac": m["clip_frac"], "reverse_kl": m["reverse_kl"],
                "opd_tokens": m["num_tokens"],
                "reward": statistics.fmean(rewards) if rewards else float("nan"),
                "pass_rate": statistics.fmean(r >= 1.0 for r in rewards) if rewards else float("nan"),
                "effort_tokens": statistics.fmean(t.effort_tokens() for t in trajs) if trajs else float("nan")}
        for e in EFFORTS:
            toks = [t.effort_tokens() for t, te in zip(trajs, efforts) if te == e]
            if toks:
                rows[f"effort_tokens/{e}"] = statistics.fmean(toks)
        for name in pool.names:
            rows[f"expert/{name}"] = float(len(by_expert.get(name, ())))
        return seqs, rows
    return signal


# --------------------------------------------------------------------------- the run


def mopd_families(cfg: MOPDConfig) -> dict[str, list[str]]:
    """Domain → the families its prompts come from (``cfg.families[d]``, else those of ``cfg.rl.families`` in
    d, else every verifiable family of d).
    ValueError when ``families`` names a domain that is not in ``domains``."""
    extra = sorted(set(cfg.families) - set(cfg.domains))
    if extra:
        raise ValueError(f"mopd.families names domains {extra} that are not in mopd.domains {cfg.domains}")
    return {d: domain_families(d, cfg.families.get(d) or cfg.rl.families) for d in cfg.domains}


def mopd_eval_tasks(cfg: MOPDConfig) -> dict[str, list[Task]]:
    """Domain → ``eval_n`` held-out tasks per family of it (``rl.domain_overrides`` apply; the input of
    `evaluate_mopd`)."""
    return {d: eval_tasks(fams, cfg.rl.for_domain(d).eval_n, difficulty=cfg.rl.difficulty)
            for d, fams in mopd_families(cfg).items()}


def eval_caps(cfg: MOPDConfig) -> dict[str, int]:
    """Domain → the per-turn cap of its held-out episodes (``rl.eval_max_tokens`` after ``rl.domain_overrides``)."""
    return {d: cfg.rl.for_domain(d).eval_max_tokens for d in cfg.domains}


def _check_experts(cfg: MOPDConfig) -> None:
    efforts = [e for e in EFFORTS if cfg.effort_mix.get(e, 0.0) > 0]
    missing = [expert_name(d, e) for d in cfg.domains for e in efforts if expert_name(d, e) not in cfg.experts]
    if missing:
        raise ValueError(f"mopd.experts lacks a teacher for {missing} (domains {cfg.domains} x efforts {efforts})")


def train_mopd(
    student: torch.nn.Module,
    tokenizer: Any,
    cfg: MOPDConfig,
    out_dir: str | Path,
    *,
    metrics: MetricsLogger | None = None,
    resume: bool = True,
    stop_after: int | None = None,
    teacher_qat: QATConfig | None = None,
    pool: TeacherPool | None = None,
) -> MOPDResult:
    """Distil the experts into ``student`` (in place; start it from the SFT checkpoint) with the loop of the
    module doc over prompts of every domain, interleaved by family (``cfg.domain_weights``: a domain's families give
    that many prompts a round). ``teacher_qat`` applies the experts'
    QAT to the local teachers. ``pool``: a caller's `TeacherPool` (left open, e.g. for `evaluate_mopd`
    with the teachers still resident); by default one is built from ``cfg`` and closed at the end.
    ``stop_after`` ends this call after that many steps (tests kill and resume).
    One generation cap serves the mixed prompts: the largest ``max_tokens`` of the domains (after
    ``rl.domain_overrides``)."""
    t_start = time.perf_counter()
    _check_experts(cfg)
    by_domain = mopd_families(cfg)
    fams = [f for fs in by_domain.values() for f in fs]
    weights = [cfg.domain_weights.get(d, 1) for d, fs in by_domain.items() for _ in fs]
    # interleaved by family, each giving its domain's weight in prompts a round
    tasks = train_tasks(fams, cfg.rl.n_tasks, difficulty=cfg.rl.difficulty, seed=cfg.rl.seed, weights=weights)
    own = pool is None
    if pool is None:
        pool = TeacherPool(cfg.experts, max_resident=cfg.max_resident, dtype=cfg.teacher_dtype, qat=teacher_qat,
                           batch_tokens=cfg.teacher_batch_tokens)
    # one rollout for every domain's prompts: its turns get the longest of the domains' max_tokens
    max_tokens = max(cfg.rl.for_domain(d).rollout.max_tokens for d in cfg.domains)
    try:
        step, rows, resumed_from, pl = train_policy(
            student, tokenizer, replace(cfg.rl, rollout=replace(cfg.rl.rollout, max_tokens=max_tokens)), out_dir,
            tasks=tasks, signal=opd_signal(pool, cfg, XTML(tokenizer)),
            effort_fn=effort_sampler(cfg.effort_mix, cfg.rl.seed), metrics=metrics, stage="mopd", resume=resume,
            stop_after=stop_after,
        )
        pl.close()
    finally:
        if own:
            pool.close()
    return MOPDResult(step, rows, dict(pool.stats), resumed_from, time.perf_counter() - t_start)


# --------------------------------------------------------------------------- evaluation


def mopd_checks(
    rows: Sequence[Mapping[str, Any]], *, pass_ratio_min: float = 0.95, token_tolerance: float = 0.2,
    teacher_pass_min: float = 0.2,
) -> dict[str, Any]:
    """The MOPD targets on a table of (domain, effort) rows holding student_pass, teacher_pass,
    student_tokens, teacher_tokens (mean T(y)):

        pass_ok   = student_pass ≥ pass_ratio_min · teacher_pass           (pass_ratio = s / t, nan if t = 0);
                    None (not applicable) where teacher_pass < teacher_pass_min: a teacher that passes almost
                    nothing gives a ratio of noise. A row with the paired table ("student_vs_teacher") also
                    gets pass_ratio_ci95, the matched-pairs interval of s / t (`k3post.stats.paired_ratio`).
        tokens_ok = |student_tokens − teacher_tokens| ≤ token_tolerance · teacher_tokens   (token_ratio = s / t)
        order_ok  = per domain, the student's mean T(y) strictly increases low < high < max over its efforts

    A row with ``teacher_endpoint`` (its teacher is an endpoint, which scores but is not sampled here: teacher
    numbers NaN) gets pass_ok and tokens_ok None (not applicable).

    Returns {"rows": rows with the ratios and checks, "order": {domain: {"tokens": {effort: T}, "ok"}},
    "ok": every check, "teacher_pass_min": the threshold used}."""
    out_rows: list[dict[str, Any]] = []
    order: dict[str, dict[str, Any]] = {}
    for r in rows:
        s_p, t_p, s_t, t_t = (float(r[k]) for k in ("student_pass", "teacher_pass", "student_tokens", "teacher_tokens"))
        sampled = not r.get("teacher_endpoint")  # an endpoint teacher is not sampled: nothing to compare with
        row = {**r, "pass_ratio": s_p / t_p if t_p > 0 else float("nan"),
               "token_ratio": s_t / t_t if t_t > 0 else float("nan"),
               "pass_ok": s_p >= pass_ratio_min * t_p if sampled and t_p >= teacher_pass_min else None,
               "tokens_ok": abs(s_t - t_t) <= token_tolerance * t_t if sampled else None}
        if r.get("student_vs_teacher"):
            row["pass_ratio_ci95"] = paired_ratio(r["student_vs_teacher"])["ci95"]
        out_rows.append(row)
        order.setdefault(r["domain"], {"tokens": {}})["tokens"][r["effort"]] = s_t
    for d, o in order.items():
        seq = [o["tokens"][e] for e in EFFORTS if e in o["tokens"]]
        o["ok"] = all(a < b for a, b in zip(seq, seq[1:]))
    ok = all(r["pass_ok"] is not False and r["tokens_ok"] is not False for r in out_rows) and all(
        o["ok"] for o in order.values())
    return {"rows": out_rows, "order": order, "ok": ok, "teacher_pass_min": teacher_pass_min}


def _episodes(engine: Any, xtml: XTML, tasks: Sequence[Task], effort: str | None, max_tokens: int) -> dict[str, Any]:
    """Greedy think-mode episodes of ``tasks`` at ``effort`` (None: no thinking-effort message), summarised."""
    return evaluate_episodes(engine, xtml, tasks, effort=OMIT_EFFORT if effort is None else effort,
                             max_tokens=max_tokens, mode="think")["overall"]


def evaluate_mopd(
    student: EmbeddedEngine,
    xtml: XTML,
    pool: TeacherPool,
    tasks: Mapping[str, Sequence[Task]],
    *,
    efforts: Sequence[str] = EFFORTS,
    max_tokens: int | Mapping[str, int] = 128,
    teacher_sees_effort: bool = False,
    pass_ratio_min: float = 0.95,
    token_tolerance: float = 0.2,
    teacher_pass_min: float = 0.2,
    engine: EngineConfig | None = None,
    processes: int = 1,
    known: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The student vs each teacher on held-out ``tasks`` (domain → tasks, e.g. `mopd_eval_tasks`): greedy episodes of the student at each effort and of expert (d, e) as it scores in
    MOPD (no effort message unless ``teacher_sees_effort``); pass rate with its Wilson interval, the paired
    change teacher → student on the same tasks (`k3post.stats.paired_change`) and mean T(y) per (domain, effort),
    then `mopd_checks`. An endpoint teacher (a URL: it scores log-probs, it is not sampled here) gets the
    student's numbers only: its row has ``teacher_endpoint`` and NaN teacher numbers.
    ``max_tokens``: the per-turn cap, one for all or domain → cap (e.g. `eval_caps`). ``engine``: the teachers'
    engine (default: embedded; over ``http`` each teacher runs on launched servers of its own).
    ``processes`` = 2 (embedded engines only): the local teachers' episodes run in a worker process (`k3post.workers`;
    the threads of the caller's plan, `k3post.threads.child_threads`; each teacher loaded there from its folder as the pool loads
    it) while this one runs the student's: the same episodes, so the same table.
    ``known``: expert → the summary of its greedy episodes on exactly these tasks at its effort and cap, measured
    before (the experts' own held-out evaluation, `reusable_teacher_evals`): used as the teacher's numbers instead
    of running them again (ValueError when its tasks are not the domain's); its row says ``teacher_source``."""
    cells = [(d, e, expert_name(d, e), max_tokens if isinstance(max_tokens, int) else max_tokens[d])
             for d in tasks for e in efforts]
    known = dict(known or {})
    for d, _, x, _ in cells:
        if x in known and list(known[x]["task_ids"]) != [t.id for t in tasks[d]]:
            raise ValueError(f"known teacher evaluation of {x} ran other tasks than the {len(tasks[d])} held-out "
                             f"tasks of {d}: measure it here instead")
    local = [(d, e, x, cap) for d, e, x, cap in cells if not is_url(pool.experts.get(x, "")) and x not in known]
    workers = job = None
    teachers: dict[str, Any] = {}
    if processes > 1 and local and (engine is None or engine.kind == "embedded"):
        workers = worker_pool(1)
        job = workers.apply_async(_teacher_episodes, ((
            local, {d: list(tasks[d]) for d, _, _, _ in local}, {x: pool.experts[x] for _, _, x, _ in local}, pool.dtype,
            pool.qat, xtml.tokenizer, teacher_sees_effort, student.max_batch_size, student.max_model_len),))
    try:
        students = {x: _episodes(student, xtml, tasks[d], e, cap) for d, e, x, cap in cells}
        if job is not None:
            teachers, stats = job.get()
            for k, v in stats.items():  # the worker's teacher loads count in the pool's
                pool.stats[k] = pool.stats.get(k, 0) + v
        elif local:
            teachers = _teacher_cells(pool, xtml, local, tasks, teacher_sees_effort, student.max_batch_size,
                                      student.max_model_len, engine)
    finally:
        if workers is not None:
            workers.terminate()
            workers.join()
    teachers.update(known)
    rows = []
    for d, e, x, _ in cells:
        s = students[x]
        row = {"domain": d, "effort": e, "expert": x, "n": s["n"], "student_pass": s["pass_rate"],
               "student_ci95": s["pass_ci95"], "student_tokens": s["mean_effort_tokens"]}
        if x not in teachers:  # an endpoint: it scores log-probs, it is not sampled here
            row.update(teacher_endpoint=pool.experts.get(x, ""), teacher_pass=float("nan"), teacher_ci95=None,
                       teacher_tokens=float("nan"))
        else:
            t = teachers[x]
            row.update(teacher_pass=t["pass_rate"], teacher_ci95=t["pass_ci95"], teacher_tokens=t["mean_effort_tokens"],
                       student_vs_teacher=paired_change(*paired_passes(t, s)),  # same tasks (infra left out)
                       teacher_source="expert evaluation" if x in known else "measured here")
        rows.append(row)
    return mopd_checks(rows, pass_ratio_min=pass_ratio_min, token_tolerance=token_tolerance, teacher_pass_min=teacher_pass_min)


def _teacher_cells(pool: TeacherPool, xtml: XTML, cells: Sequence[tuple[str, str, str, int]],
                   tasks: Mapping[str, Sequence[Task]], teacher_sees_effort: bool, max_batch_size: int,
                   max_model_len: int, engine: EngineConfig | None = None) -> dict[str, dict[str, Any]]:
    """Expert → the summary of its greedy episodes on its domain's tasks, for each (domain, effort, expert, cap)
    cell, each teacher on an engine of its own (`evaluate_mopd`'s teacher half, here or in its worker)."""
    out = {}
    for d, e, x, cap in cells:
        teacher = build_engine(pool.model(x), xtml.tokenizer, engine=engine, role=f"MOPD teacher {x}",
                               max_batch_size=max_batch_size, max_model_len=max_model_len)
        try:
            out[x] = _episodes(teacher, xtml, tasks[d], e if teacher_sees_effort else None, cap)
        finally:
            close_engine(teacher)
    return out


def _teacher_episodes(args: tuple[Any, ...]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """`evaluate_mopd`'s teacher half in a worker process: (`_teacher_cells` on a pool of its own, that pool's
    stats)."""
    exit_with_parent()
    torch.set_num_threads(child_threads())
    cells, tasks, experts, dtype, qat, tokenizer, teacher_sees_effort, max_batch_size, max_model_len = args
    pool = TeacherPool(experts, max_resident=1, dtype=dtype, qat=qat)
    return _teacher_cells(pool, XTML(tokenizer), cells, tasks, teacher_sees_effort, max_batch_size, max_model_len), pool.stats
