"""`k3post experts`: the nine RL experts, general / agents / coding × max → high → low (SPEC §3.3).

For each domain:

    b0(x)   = estimate_budgets(SFT model, the domain's training tasks, effort max)   once, cached
    max     = train_rl(SFT checkpoint,  effort max,  τ_max with the cap)
    high    = train_rl(max expert,      effort high, τ_high)
    low     = train_rl(high expert,     effort low,  τ_low)

Each expert is saved as a Hugging Face folder ``experts/<domain>.<effort>/`` (safetensors + tokenizer),
its run (checkpoints, exact resume) under ``experts/<domain>.<effort>.run/``; a finished expert is
not retrained when the command runs again. The SFT model is evaluated once per domain at every
effort (the "before" row). ``experts/table.json`` holds, per expert: held-out pass rate and mean
T(y) before (SFT at that effort) and after, the budget-violation rate and the token ratio of the
last steps, the reward curve.

A stage that raises does not take the other domains down: its cell goes to ``table["failed"]`` (the
expert, the step, the error, its traceback, also written to ``<expert>.run/error.log``), the later
efforts of its domain are marked as blocked by it, and the other domains go on. `train_experts` logs
every failure with its traceback; running the command again resumes from the checkpoints and retries.

Shape legend: none.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import statistics
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from k3post.config.rollout import EngineConfig
from k3post.constants import DOMAINS, EFFORTS
from k3post.errors import StepFailed, attach_run_log
from k3post.io import atomic_write
from k3post.metrics import MetricsLogger
from k3post.models import load_model
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rewards.effort import BudgetTable, Curriculum, budget_summary, estimate_budgets, floor_applies
from k3post.config.rl import RLConfig
from k3post.envs.families.streams import domain_families, eval_tasks, train_tasks
from k3post.loop import rollout_gap
from k3post.stages.rl import train_rl, sampled_eval
from k3post.rewards.judge import GroupScorer, build_group_scorer, judged_families
from k3post.rollout.factory import build_engine, close_engine
from k3post.rollout.evaluation import evaluate_episodes, paired_passes, paired_shares, reference_effort_tokens
from k3post.stats import paired_change, paired_mean_change
from k3post.threads import child_threads, exit_with_parent, pid_alive
from k3post.workers import worker_pool
from k3post.tokenizer import load_tokenizer
from k3post.xtml import XTML

log = logging.getLogger("k3post.experts")  # the name users filter on, kept when the module moved to recipes/

__all__ = ["train_experts", "train_domain_experts", "domain_budgets", "expert_dir", "load_policy", "GridTargets",
           "expert_grid", "format_expert_grid"]


def expert_dir(root: str | Path, name: str) -> Path:
    """Folder of expert ``name`` ("<domain>.<effort>") under ``root``."""
    return Path(root) / name


def load_policy(path: str | Path, qat: QATConfig | None) -> torch.nn.Module:
    """A checkpoint as a trainable policy, with MX QAT applied when ``qat`` is enabled."""
    model = load_model(path)
    if qat is not None and qat.enabled:
        apply_qat(model, qat)
    return model


def domain_budgets(engine: Any, xtml: XTML, cfg: RLConfig, path: str | Path) -> BudgetTable:
    """b0 of every training task of ``cfg`` (its domain and families) from the cold-start model
    behind ``engine``, at max effort and the domain's rollout temperature, with the floors of
    `EffortConfig.reference_floor` at the efforts they bound (`floor_applies`), cached in ``path`` (`estimate_budgets`)."""
    ec = cfg.effort_control
    floored = [e for e in EFFORTS if floor_applies(e, ec)]  # computed once here, where the floor bounds a limit
    return estimate_budgets(
        engine, train_tasks(cfg.families, cfg.n_tasks, difficulty=cfg.difficulty, seed=cfg.seed), xtml=xtml,
        samples_per_task=ec.b0_samples, seed=cfg.seed, max_tokens=cfg.rollout.max_tokens, q=ec.b0_quantile,
        min_b0=ec.min_b0, temperature=cfg.rollout.temperature, path=path, progress=cfg.progress,
        floor=(lambda t, e: reference_effort_tokens(xtml, t, e)) if floored else None, floor_efforts=floored,
    )


def _tail(rows: list[dict[str, float]], key: str) -> float:
    """The mean of ``key`` over ``rows`` (a run's last steps), NaN values left out."""
    vals = [h[key] for h in rows if key in h and h[key] == h[key]]
    return statistics.fmean(vals) if vals else float("nan")


_Job = tuple[str, str, RLConfig, str, "QATConfig | None", "str | None", "EngineConfig | None"]
"""One domain's expert job: (domain, sft_dir, cfg, out_dir, qat, metrics_dir, judge_engine)."""


def _enter_worker(metrics_dir: str | None, threads: int | None = None) -> None:
    """A pool worker's start: exit with the parent, ``threads`` torch threads (None: the parent's plan for the
    workers, `k3post.threads.child_threads`; 1 without one), its log appended to the run's k3post.log."""
    exit_with_parent()
    torch.set_num_threads(threads or child_threads())
    if metrics_dir:  # the worker's warnings and engine launches go to the run's k3post.log too (appended)
        attach_run_log(metrics_dir)


def _domain_worker(args: _Job, until: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """One domain's experts (up to ``until``) in this process at ``threads`` torch threads (`_enter_worker`)."""
    domain, sft_dir, cfg, out_dir, qat, metrics_dir, judge_engine = args
    _enter_worker(metrics_dir, threads)
    metrics = MetricsLogger(metrics_dir) if metrics_dir else None
    try:
        return train_domain_experts(domain, sft_dir, cfg, out_dir, qat=qat, metrics=metrics, until=until,
                                    judge_engine=judge_engine)
    finally:
        if metrics is not None:
            metrics.close()


def _expert_job(args: _Job, effort: str, prev: dict[str, Any] | None) -> dict[str, Any]:
    """One (domain, effort) expert as a job of its own (`train_experts` on a cluster): its domain's table
    after this effort. ``prev``, the table after the domain's previous effort, holding a failure: this
    expert starts from a failed one, so it is marked blocked, not trained."""
    domain = args[0]
    name = f"{domain}.{effort}"
    if prev is not None and prev["failed"]:
        blocker = next((n for n, f in prev["failed"].items() if "blocked_by" not in f), next(iter(prev["failed"])))
        prev["failed"].setdefault(name, {"domain": domain, "effort": effort, "step": None,
                                         "error": f"not trained: it starts from {blocker}, which failed",
                                         "blocked_by": blocker})
        _write_json(Path(args[3]) / f"table.{domain}.json", prev)
        return prev
    return _domain_worker(args, until=effort, threads=1)  # one thread, as every actor on the cluster


def train_experts(
    sft_dir: str | Path,
    cfg: RLConfig,
    out_dir: str | Path,
    *,
    qat: QATConfig | None = None,
    metrics: MetricsLogger | None = None,
    scorer: GroupScorer | None = None,
    processes: int = 1,
    metrics_dir: str | Path | None = None,
    cluster: Any = None,
    judge_engine: EngineConfig | None = None,
) -> dict[str, Any]:
    """Every (domain, effort) expert of ``cfg.domains`` × ``cfg.effort_control.curriculum``; returns
    the merged table (also written to ``table.json``; its domain × effort view with the targets checked,
    `expert_grid`, to ``grid.json``).

    The domains' chains are independent, so with ``processes`` > 1 they train in that many worker
    processes (`k3post.workers`; each with the threads of the plan in force, `k3post.threads.child_threads`, one without; metrics to ``metrics_dir`` through their own loggers, the
    JSONL file is shared under a file lock). A judge given as a live ``scorer`` object forces one
    process; ``cfg.judge`` is built inside each worker instead.

    With a ``cluster`` (`k3post.distributed.ray_cluster.RayCluster`) every expert is a Ray task of its own
    (`_expert_job`): the domains' chains run in parallel on the trainer slots, each chain max → high → low
    (a task starts when the previous effort's returned), metrics as with ``processes``.

    ``judge_engine``: the ``http`` `EngineConfig` of the servers holding the judge model (the judge actors of
    ``distributed.roles.judges``): every domain's GRM judge decodes there (`build_group_scorer`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    domains = list(cfg.domains)
    for d in domains:  # a "before" row that failed in an earlier run is retried
        _before_paths(out, d)[1].unlink(missing_ok=True)
    if cluster is not None:
        if scorer is not None:
            raise ValueError("train_experts on a cluster builds each judge from cfg.judge: pass no live scorer")
        jobs = [(d, str(sft_dir), cfg, str(out), qat, str(metrics_dir) if metrics_dir else None, judge_engine)
                for d in domains]
        chains = [[(job, e) for e in cfg.effort_control.curriculum] for job in jobs]
        tables = dict(zip(domains, cluster.run_chains(_expert_job, chains)))
    elif processes > 1 and len(domains) > 1 and scorer is None:
        jobs = [  # scorers (judges) are built inside each worker from cfg.judge
            (d, str(sft_dir), cfg, str(out), qat, str(metrics_dir) if metrics_dir else None, judge_engine) for d in domains]
        with worker_pool(min(processes, len(domains)), maxtasksperchild=1) as pool:
            pending = [pool.apply_async(_domain_worker, (job,)) for job in jobs]
            # then each domain's "before" row as a job of its own: a worker whose domain finished early computes
            # it while that domain's worker trains (`before_row`: whoever reaches a row first computes it)
            extra = [pool.apply_async(_before_job, (job,)) for job in jobs]
            tables = dict(zip(domains, (r.get() for r in pending)))
            for r in extra:
                r.get()
    else:
        tables = {d: train_domain_experts(d, sft_dir, cfg, out, qat=qat, metrics=metrics, scorer=scorer,
                                          judge_engine=judge_engine) for d in domains}
    merged: dict[str, Any] = {"experts": {}, "before": {}, "budgets": {}, "failed": {}, "judge_gate": {}}
    for d in domains:
        for key in merged:
            merged[key].update(tables[d].get(key, {}))
    _write_json(out / "table.json", merged)
    _write_json(out / "grid.json", expert_grid(merged))
    for name, f in merged["failed"].items():
        if "traceback" in f:
            log.error("expert %s failed%s: %s (traceback also in %s)\n%s", name,
                      f" in step {f['step']}" if f.get("step") is not None else "", f["error"], f["log"], f["traceback"])
        else:
            log.error("expert %s not trained: %s", name, f["error"])
    return merged


def _failure(stage: Any, err: BaseException, run_dir: Path) -> dict[str, Any]:
    """The ``table["failed"]`` record of a stage that raised; its traceback goes to ``run_dir/error.log``."""
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "error.log"
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} expert {stage.expert}\n{tb}")
    cause = err.__cause__ if isinstance(err, StepFailed) and err.__cause__ is not None else err
    return {"domain": stage.domain, "effort": stage.effort, "step": err.step if isinstance(err, StepFailed) else None,
            "error": f"{type(cause).__name__}: {cause}", "traceback": tb, "log": str(path)}


def train_domain_experts(
    domain: str,
    sft_dir: str | Path,
    cfg: RLConfig,
    out_dir: str | Path,
    *,
    qat: QATConfig | None = None,
    metrics: MetricsLogger | None = None,
    scorer: GroupScorer | None = None,
    until: str | None = None,
    judge_engine: EngineConfig | None = None,
) -> dict[str, Any]:
    """Train the effort experts of one domain, ``cfg.effort_control.curriculum`` in order, from the
    SFT checkpoint ``sft_dir`` (module doc); returns and writes ``table.<domain>.json``. ``until``: stop
    after that effort's expert (the later ones are left for another call; finished ones are kept).
    Without a live ``scorer``, the domain's GRM judge is built from ``cfg.judge`` (on the servers of
    ``judge_engine`` when given, `build_group_scorer`) and closed at the end."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(sft_dir)
    xtml = XTML(tok)
    table: dict[str, Any] = {"experts": {}, "before": {}, "budgets": {}, "failed": {}}
    table_path = out / f"table.{domain}.json"
    if table_path.is_file():
        table.update(json.loads(table_path.read_text()))
    table["failed"] = {}  # failures of an earlier run are retried
    efforts = list(cfg.effort_control.curriculum)
    stages = list(Curriculum([domain], cfg.effort_control))
    own_scorer = scorer is None
    try:
        if scorer is None:
            scorer = build_group_scorer(cfg, sft_dir, tok, domain_families(domain, cfg.families, with_judge=True),
                                        qat=bool(qat is not None and qat.enabled), judge_engine=judge_engine)
        fams = domain_families(domain, cfg.families, with_judge=scorer is not None)
        if getattr(scorer, "gate", None) is not None:
            table.setdefault("judge_gate", {})[domain] = scorer.gate  # type: ignore[union-attr]
    except Exception as e:  # noqa: BLE001 - the domain's judge could not be built: every cell of it failed
        for stage in stages:
            table["failed"][stage.expert] = _failure(stage, e, out / f"{stage.expert}.run")
        _write_json(table_path, table)
        return table
    blocked_by: str | None = None
    todo = stages if until is None else stages[: efforts.index(until) + 1]
    try:
        for stage in todo:
            dest = expert_dir(out, stage.expert)
            if stage.expert in table["experts"] and (dest / "config.json").is_file():
                log.info("expert %s already trained: %s", stage.expert, dest)
                continue
            if blocked_by is not None:  # it starts from the expert that failed
                table["failed"][stage.expert] = {"domain": stage.domain, "effort": stage.effort, "step": None,
                                                 "error": f"not trained: it starts from {blocked_by}, which failed",
                                                 "blocked_by": blocked_by}
                continue
            try:
                _train_stage(stage, table, sft_dir, cfg, out, tok, xtml, fams, qat, metrics, scorer)
            except Exception as e:  # noqa: BLE001 - one failed cell must not take the other domains down
                table["failed"][stage.expert] = _failure(stage, e, out / f"{stage.expert}.run")
                blocked_by = stage.expert
            _write_json(table_path, table)
    finally:
        if own_scorer and scorer is not None:
            scorer.close()  # type: ignore[attr-defined]
    _write_json(table_path, table)
    return table


def _train_stage(stage: Any, table: dict[str, Any], sft_dir: str | Path, cfg: RLConfig, out: Path, tok: Any, xtml: XTML,
                 fams: list[str], qat: QATConfig | None, metrics: MetricsLogger | None,
                 scorer: GroupScorer | None) -> None:
    """One expert of the curriculum into ``table``: b0 first, once per domain; the SFT model's "before" row, once per
    domain, when the first expert has trained (`before_row`: read, computed here, or awaited from the pool's job)."""
    t0 = time.perf_counter()
    rcfg = replace(cfg.for_domain(stage.domain, stage.effort), families=fams)
    dest = expert_dir(out, stage.expert)
    budget_path = out / f"budgets.{stage.domain}.json"
    if not budget_path.is_file():  # once per domain, from the cold-start (SFT) model: b0 at max effort
        sft_model = load_policy(sft_dir, qat)
        engine = build_engine(sft_model, tok, engine=rcfg.rollout.engine, role=f"{stage.domain} budgets (SFT model)",
                              max_batch_size=rcfg.rollout.slots, seed=rcfg.seed)
        try:
            t_b = time.perf_counter()
            budgets = domain_budgets(engine, xtml, rcfg, budget_path)
            table["budgets"][stage.domain] = {**budget_summary(budgets, stage.domain, rcfg.effort_control),
                                              "seconds": time.perf_counter() - t_b,
                                              "sources": dict(_count(e.source for e in budgets.entries.values()))}
        finally:
            close_engine(engine)
        del sft_model, engine
    else:
        budgets = BudgetTable.load(budget_path)
    src = sft_dir if stage.init_from == "sft" else expert_dir(out, stage.init_from)
    model = load_policy(src, qat)
    run_dir = out / f"{stage.expert}.run"
    res = train_rl(model, tok, rcfg, run_dir, budgets=budgets, scorer=scorer, metrics=metrics,
                   stage=f"rl/{stage.expert}")
    tmp = out / f".{stage.expert}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    if stage.domain not in table["before"]:  # the SFT model's row: here, or from the pool's job for it
        table["before"][stage.domain] = before_row(stage.domain, sft_dir, cfg, out, qat=qat, families=fams)
    before = table["before"][stage.domain][stage.effort]
    after = res.eval["overall"]
    last = res.metrics.tail(3)
    try:  # the paired test needs the same held-out tasks (an infrastructure failure in either run is left out)
        pair = paired_passes(before["overall"], after)
    except ValueError as e:
        raise RuntimeError(f"{stage.expert}: the SFT and expert evaluations ran different tasks") from e
    table["experts"][stage.expert] = {
        "domain": stage.domain, "effort": stage.effort, "init_from": stage.init_from, "steps": res.steps,
        "families": fams, "scale": stage.scale, "n": after["n"],
        "pass_rate": after["pass_rate"], "pass_ci95": after["pass_ci95"], "mean_effort_tokens": after["mean_effort_tokens"],
        "sft_pass_rate": before["overall"]["pass_rate"], "sft_pass_ci95": before["overall"]["pass_ci95"],
        "sft_mean_effort_tokens": before["overall"]["mean_effort_tokens"],
        "change": paired_change(*pair),
        "sampled": _sampled_change(before.get("sampled"), res.eval.get("sampled"), rcfg),
        "eval": res.eval,
        "final_violation_rate": _tail(last, "budget_violation_rate"),
        "rollout_gap": rollout_gap(res.metrics),
        "final_effort_ratio": _tail(last, "effort_ratio"),
        "infra": {"train": sum(x for x in res.metrics.series("infra_episodes") if x == x),
                  "eval": sum(after.get("infra", {}).values())},  # episodes whose infrastructure failed (masked)
        "mixed_groups": _mixed_share(res.metrics),
        "reward_curve": res.metrics.series("reward"),
        "effort_tokens_curve": res.metrics.series("effort_tokens"),
        "seconds": time.perf_counter() - t0,
    }
    ch = table["experts"][stage.expert]["change"]
    log.info("expert %s: pass %.3f (SFT %.3f; %s, p = %.3g), T %.1f", stage.expert, after["pass_rate"],
             before["overall"]["pass_rate"], ch["verdict"], ch["p_value"], after["mean_effort_tokens"])


def _mixed_share(rows: Any) -> float | None:
    """The share of the RL run's finished groups that held a pass and a fail (reward variance, the groups that
    carry a policy gradient): 1 − Σ zero_variance_groups / Σ groups over its steps; None without groups."""
    groups = sum(g for g in rows.series("groups") if g == g)
    flat = sum(z for z in rows.series("zero_variance_groups") if z == z)
    return 1.0 - flat / groups if groups > 0 else None


def _before_paths(out: Path, domain: str) -> tuple[Path, Path, Path]:
    """The "before" row's result file, its error file and its claim file for ``domain`` under ``out``."""
    return out / f"before.{domain}.json", out / f".before.{domain}.error", out / f".before.{domain}.claim"


def _claim(path: Path) -> bool:
    """Take the claim file ``path`` (it holds this process's pid): True when this process now owns the work. A
    claim whose process is gone (a killed run) is taken over."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _claim_alive(path):
                return False
            path.unlink(missing_ok=True)  # its owner died: take it over
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(str(os.getpid()))
        return True
    return False


def _claim_alive(path: Path) -> bool:
    try:
        pid = int(path.read_text() or "0")
    except (OSError, ValueError):
        return True  # being written: its owner is alive
    return pid <= 0 or pid_alive(pid)


def _compute_before(domain: str, sft_dir: str | Path, cfg: RLConfig, qat: QATConfig | None,
                    families: list[str]) -> dict[str, Any]:
    """The SFT model at every effort of the curriculum on the domain's held-out tasks: greedy, and avg@k at each
    effort whose expert samples it (with that expert's k, temperature and seeds: the pairs of its paired test)."""
    efforts = list(cfg.effort_control.curriculum)
    rcfg = replace(cfg.for_domain(domain, efforts[0]), families=families)
    tok = load_tokenizer(sft_dir)
    xtml = XTML(tok)
    sft_model = load_policy(sft_dir, qat)
    engine = build_engine(sft_model, tok, engine=rcfg.rollout.engine, role=f"{domain} 'before' row (SFT model)",
                          max_batch_size=rcfg.rollout.slots, seed=rcfg.seed)
    try:
        held_out = eval_tasks(families, rcfg.eval_n, difficulty=rcfg.difficulty)
        row = {e: evaluate_episodes(engine, xtml, held_out, effort=e, max_tokens=rcfg.eval_max_tokens) for e in efforts}
        for e in efforts:
            ecfg = cfg.for_domain(domain, e)
            if ecfg.eval_samples:
                row[e]["sampled"] = sampled_eval(engine, xtml, held_out, ecfg, e)["overall"]
        return row
    finally:
        close_engine(engine)


def before_row(domain: str, sft_dir: str | Path, cfg: RLConfig, out_dir: str | Path, *, qat: QATConfig | None,
               families: list[str], wait_s: float = 0.5) -> dict[str, Any]:
    """The domain's "before" row (`_compute_before`), once per ``out_dir``: read from ``before.<domain>.json``
    when there; else computed here when this process takes its claim; else another process (`_before_job`, a job
    of `train_experts`' pool) is computing it: wait for its file (its error re-raised here; a claimant that died
    is taken over). So a domain's row is computed by whichever process reaches it first, and nobody waits on a
    job that has not started."""
    out = Path(out_dir)
    done, error, claim = _before_paths(out, domain)
    while True:
        if done.is_file():
            return json.loads(done.read_text())
        if _claim(claim):
            error.unlink(missing_ok=True)
            try:
                row = _compute_before(domain, sft_dir, cfg, qat, families)
            except BaseException:
                atomic_write(error, traceback.format_exc())
                raise
            _write_json(done, row)
            return row
        if error.is_file():  # its claimant (alive) failed
            raise RuntimeError(f"the 'before' row of {domain} failed in another process:\n{error.read_text()}")
        time.sleep(wait_s)


def _before_job(args: _Job) -> None:
    """`before_row` of one domain as a job of `train_experts`' pool: it starts when a worker is free (a domain
    whose experts finished early) and computes the row unless the domain's own worker got there first."""
    domain, sft_dir, cfg, out_dir, qat, metrics_dir, _ = args
    _enter_worker(metrics_dir)
    every = domain_families(domain, cfg.families, with_judge=True)  # the worker's families: judged ones when it
    try:                                                               # has a judge (`build_group_scorer`)
        before_row(domain, sft_dir, cfg, out_dir, qat=qat,
                   families=domain_families(domain, cfg.families, with_judge=bool(judged_families(cfg, every))))
    except Exception:  # noqa: BLE001 - recorded in the error file; the domain's worker raises it in its cell
        log.exception("the 'before' row of %s failed", domain)


def _sampled_change(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, cfg: RLConfig) -> dict[str, Any] | None:
    """avg@k of the SFT model and of the expert on the same held-out tasks and seeds, and the paired change of the
    per-task pass shares (`k3post.stats.paired_mean_change`); None without ``rl.eval_samples``."""
    if before is None or after is None:
        return None
    b, a = paired_shares(before, after["overall"])
    return {"k": cfg.eval_samples, "temperature": cfg.rollout.temperature, "sft": before["pass_rate"],
            "rl": after["overall"]["pass_rate"], "change": paired_mean_change(b, a)}


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _write_json(path: Path, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=1, default=float))


# --------------------------------------------------------------------------- the 3 x 3 table and its targets


@dataclass(frozen=True)
class GridTargets:
    """What the nine experts should show per domain (the nine-experts recipe's table): SFT pass at max at
    least ``sft_pass_min`` on at least ``min_n`` held-out tasks; RL at max higher than SFT (paired verdict
    "higher"); T(low) < T(high) < T(max) and T(low) <= ``low_ratio_max`` · T(max); every expert's final
    budget-violation rate at most ``violation_max``."""

    sft_pass_min: float = 0.25
    min_n: int = 100
    low_ratio_max: float = 0.4
    violation_max: float = 0.03


def expert_grid(table: Mapping[str, Any], targets: GridTargets = GridTargets()) -> dict[str, Any]:
    """The domain × effort table of `train_experts`' result (``table["experts"]``) with each domain's checks
    against ``targets``: ``{"domains": {d: {"cells": {effort: cell}, "checks": {name: True | False | None}}},
    "ok": all checks True}``. A check whose experts are missing (not trained, failed) is None and not ok."""
    experts = table.get("experts", {})
    domains: dict[str, Any] = {}
    order = {d: i for i, d in enumerate(DOMAINS)}
    for e in sorted(experts.values(), key=lambda e: (order.get(e["domain"], len(order)), e["domain"])):
        domains.setdefault(e["domain"], {"cells": {}, "checks": {}})["cells"][e["effort"]] = e
    for d, entry in domains.items():
        cells = entry["cells"]
        mx = cells.get("max")
        t = {e: c["mean_effort_tokens"] for e, c in cells.items()}
        checks: dict[str, bool | None] = {
            "sft_pass_at_max": None if mx is None else bool(mx["sft_pass_rate"] >= targets.sft_pass_min and mx["n"] >= targets.min_n),
            "rl_beats_sft_at_max": None if mx is None else mx["change"]["verdict"] == "higher",
            **({"rl_beats_sft_at_max_sampled": mx["sampled"]["change"]["verdict"] == "higher"}
               if mx is not None and mx.get("sampled") else {}),
            "effort_order": (bool(t["low"] < t["high"] < t["max"]) if {"low", "high", "max"} <= set(t) else None),
            "low_vs_max_tokens": (bool(t["low"] <= targets.low_ratio_max * t["max"]) if {"low", "max"} <= set(t) else None),
            "violations": (bool(all(c["final_violation_rate"] <= targets.violation_max for c in cells.values()))
                           if len(cells) == len(EFFORTS) else None),
        }
        entry["checks"] = checks
    ok = bool(domains) and all(v is True for entry in domains.values() for v in entry["checks"].values())
    return {"domains": domains, "ok": ok, "targets": dataclasses.asdict(targets)}


def format_expert_grid(grid: Mapping[str, Any]) -> str:
    """`expert_grid` as text: a row per domain, a column per effort (pass after RL with its Wilson interval,
    the SFT pass, the paired verdict, T(y), violations), with ``rl.eval_samples`` a row of avg@k (expert, SFT,
    paired verdict and p), then the domain's checks (ok / MISS / n/a)."""
    mark = {True: "ok", False: "MISS", None: "n/a"}
    short = {"higher": "↑", "lower": "↓", "no significant change": "="}
    lines = [f"{'domain':8} " + " ".join(f"{e:^40}" for e in EFFORTS)]
    for d, entry in grid["domains"].items():
        cols = []
        for e in EFFORTS:
            c = entry["cells"].get(e)
            if c is None:
                cols.append(f"{'(not trained)':^40}")
                continue
            lo, hi = c["pass_ci95"]
            cols.append(f"{c['pass_rate']:.3f} [{lo:.2f},{hi:.2f}] SFT {c['sft_pass_rate']:.3f} "
                        f"{short.get(c['change']['verdict'], '?')} T {c['mean_effort_tokens']:5.1f} v {c['final_violation_rate']:.2f}")
        lines.append(f"{d:8} " + " ".join(f"{x:40}" for x in cols))
        sampled = {e: c["sampled"] for e, c in entry["cells"].items() if c.get("sampled")}
        if sampled:
            k = next(iter(sampled.values()))["k"]
            lines.append(f"{'avg@' + str(k):8} " + " ".join(
                f"{'':^40}" if e not in sampled else
                f"{sampled[e]['rl']:.3f} SFT {sampled[e]['sft']:.3f} {short.get(sampled[e]['change']['verdict'], '?')} "
                f"p {sampled[e]['change']['p_value']:.2g}".ljust(40) for e in EFFORTS))
        lines.append(" " * 9 + "  ".join(f"{k} {mark[v]}" for k, v in entry["checks"].items()))
    lines.append(f"targets: {grid['targets']}; all met: {grid['ok']}")
    return "\n".join(lines)
