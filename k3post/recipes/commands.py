"""Command bodies behind `k3post sft`, `rl`, `experts`, `mopd`, `draft` and `init-model` (the demo has its own module)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from k3post.config import K3Config
from k3post.errors import UserError, attach_run_log
from k3post.metrics import MetricsLogger
from k3post.models import build_tiny_moe, count_parameters, load_model, new_folder, save_model
from k3post.quant.qat import apply_qat
from k3post.recipes.select import select_checkpoint
from k3post.runs import RunSummary, open_run
from k3post.stages.mopd import eval_caps, evaluate_mopd, expert_name, mopd_eval_tasks, train_mopd
from k3post.stages.sft import train_sft
from k3post.stages.sft_data import default_corpus, run_tokenizer, sft_samples, synthesize_sft_data
from k3post.spec.layout import draft_aux_layers, draft_target
from k3post.spec.mtp import MTPHead, load_mtp, save_mtp
from k3post.threads import child_threads, command_plan, exit_with_parent, use_threads
from k3post.workers import worker_pool
from k3post.tokenizer import ensure_xtml_tokens, load_tokenizer, train_tokenizer
from k3post.urls import is_url
from k3post.xtml import XTML

if TYPE_CHECKING:
    from k3post.config.rollout import EngineConfig
    from k3post.config.mopd import MOPDConfig

log = logging.getLogger("k3post.commands")


def init_model(out_dir: str | Path, *, preset: str = "tiny", vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a tokenizer + freshly initialised tiny Qwen3-MoE into one folder plain transformers loads."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        raise UserError(f"{out}: already holds a model; choose an empty folder")
    tok = train_tokenizer(default_corpus(seed=seed), vocab_size=vocab_size, out_dir=out)
    model = build_tiny_moe(
        len(tok), preset, seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end_of_msg|>")
    )
    return save_model(model, out, tok)


def add_xtml_tokens(src: str | Path, out_dir: str | Path, *, seed: int = 0) -> tuple[Path | None, list[str]]:
    """`k3post add-tokens SRC OUT_DIR`: a copy of the model folder ``src`` (or of a tokenizer-only folder) whose
    tokenizer has the XTML tokens (`ensure_xtml_tokens`: the missing ones added as special tokens, ``<|pad|>``
    when it has no pad) and whose embeddings are resized to match, the new rows drawn with ``seed``; the model
    keeps the dtype its config.json names. Written into a temporary folder renamed into place, so a failure
    leaves no half folder. Returns (the folder written, the tokens added); (None, []) when nothing is missing:
    ``src`` serves as it is and nothing is written."""
    import warnings

    src, out = Path(src), Path(out_dir)
    if not src.is_dir() or not any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"{src}: not a model or tokenizer folder (no tokenizer.json / tokenizer_config.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: already exists and is not empty; choose a new folder")
    tokenizer = load_tokenizer(src)
    model = None
    if (src / "config.json").is_file():
        config = json.loads((src / "config.json").read_text())
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        model = load_model(src, dtype if dtype in ("float32", "bfloat16") else "float32")
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # the caller reports what was added
        warnings.simplefilter("ignore", UserWarning)
        added = ensure_xtml_tokens(tokenizer, model)
    if not added:
        return None, []
    with new_folder(out) as tmp:
        if model is not None:
            save_model(model, tmp, tokenizer)
        else:
            tokenizer.save_pretrained(tmp)
    return out, added


@contextmanager
def stage_summary(run: Path, command: str) -> Iterator[RunSummary]:
    """The run folder's ``summary.json`` (`RunSummary`) around a stage command, so `k3post report` shows every
    command's folder: status ``running`` from the start, ``done`` at the end, or ``failed`` / ``interrupted``
    with the error (then re-raised); ``wall_s`` is this command's time."""
    summary = RunSummary(run / "summary.json")
    summary.data.pop("error", None)
    t0 = time.perf_counter()
    summary.update(command=command)
    try:
        yield summary
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        summary.update(status=status, error=f"{type(e).__name__}: {e}", wall_s=round(time.perf_counter() - t0, 1))
        raise
    summary.update(status="done", wall_s=round(time.perf_counter() - t0, 1))


def describe_model(model: torch.nn.Module, tokenizer: Any, source: str | Path) -> str:
    """One line for a report's header: architecture, where it came from, size and vocabulary."""
    arch = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    return f"{arch} from {source}, {count_parameters(model) / 1e6:.2f} M params, vocab {len(tokenizer)}"


def sft_summary(res: Any, stats: Any, n_quantized: int) -> dict[str, Any]:
    """What the report's SFT section shows of one SFT run (`k3post.stages.sft.SFTResult`, the data's load stats)."""
    return {
        "steps": res.steps, "final_loss": res.final_loss, "wall_s": round(res.wall_s, 1),
        "tokens_per_s": res.tokens_per_s, "n_samples": stats.kept, "skipped": stats.skipped,
        "resumed_from": res.resumed_from, "qat": f"on ({n_quantized} expert tensors)" if n_quantized else "off",
    }


def run_sft(cfg: K3Config) -> Path:
    """`k3post sft CONFIG`: train `model.path` (or a fresh `model.preset`) on `sft.train_file`; returns the
    final folder. Without `sft.train_file` the built-in families' data is synthesized first, as in the demo."""
    run = open_run(cfg.run.dir, cfg, "sft")
    with stage_summary(run, "sft") as summary:
        return _sft_in(cfg, run, summary)


def _sft_in(cfg: K3Config, run: Path, summary: RunSummary) -> Path:
    """`run_sft` in its opened run folder."""
    torch.manual_seed(cfg.run.seed)  # first: the XTML token rows ensure_xtml_tokens adds are drawn from this RNG
    if cfg.model.path:
        model = load_model(cfg.model.path, cfg.model.dtype)
        tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
        ensure_xtml_tokens(tokenizer, model)
    else:
        tokenizer = run_tokenizer(cfg, run)
        model = build_tiny_moe(
            len(tokenizer), cfg.model.preset, seed=cfg.run.seed, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|end_of_msg|>"),
        )
    summary.update(model=describe_model(model, tokenizer, cfg.model.path or f"a fresh {cfg.model.preset} Qwen3-MoE"))
    train_file = cfg.sft.train_file or synthesize_sft_data(cfg, run, tokenizer)
    samples, stats = sft_samples(cfg, train_file, tokenizer)
    if stats.skipped:
        print(stats.summary())
    quantized = apply_qat(model, cfg.qat) if cfg.qat.enabled else []
    metrics = MetricsLogger(run)
    res = train_sft(model, tokenizer, samples, cfg.sft, run / "sft", seed=cfg.run.seed, metrics=metrics)
    metrics.close()
    final = save_model(model, run / "sft" / "final", tokenizer)
    if res.mtp is not None:
        save_mtp(res.mtp, final)
    summary.update(sft=sft_summary(res, stats, len(quantized)))
    print(f"SFT done: {res.steps} steps, final loss {res.final_loss:.4f}, {res.wall_s:.0f} s → {final}")
    choice = select_checkpoint(cfg, run / "sft")  # sft.select=validation: final becomes the best kept checkpoint
    if choice is not None:
        summary.update(sft_selection=choice)
    return final


def _start_rl_run(cfg: K3Config, stage: str) -> tuple[Path, Path]:
    """Open the run folder for ``stage`` (`k3post.runs.open_run`: rl.init is checked first); return it and the
    checkpoint RL starts from."""
    run = open_run(cfg.run.dir, cfg, stage)
    return run, Path(cfg.rl.init) if cfg.rl.init else run / "sft" / "final"


def check_judge_slots(cfg: K3Config) -> None:
    """A UserError, before anything runs, when judge slots are asked for a judge that cannot use them."""
    n = cfg.distributed.roles.judges
    if cfg.distributed.enabled and n > 0 and is_url(cfg.rl.judge):
        raise UserError(f"distributed.roles.judges={n}, but rl.judge is a URL ({cfg.rl.judge}): that judge is served "
                        "elsewhere, so nothing would run on the judges bundles; set distributed.roles.judges=0, or "
                        "rl.judge to a model folder (or 'policy') to serve it there")


def _judge_servers(stack: ExitStack, cluster: Any, cfg: K3Config, init: Path, run: Path, judged: bool
                   ) -> "EngineConfig | None":
    """With ``distributed.roles.judges`` = N > 0 and a judged family in the run: the judge model of ``rl.judge``
    served by N frozen engine-server actors on the judges bundles (killed when ``stack`` closes; their state,
    the port a restart binds again, in ``run/judges``); returns their ``http`` `EngineConfig`, the GRM
    scorers' judge engine. None (the judge decodes in the scorer's process) when N is 0 or nothing is judged."""
    import shutil

    from k3post.config.rollout import EngineConfig
    from k3post.distributed.ray_cluster import engine_config
    from k3post.rewards.judge import judge_model_dir

    n = cfg.distributed.roles.judges
    if n == 0:
        return None
    if not judged:
        log.warning("distributed.roles.judges=%d: no family of this run is judged (rl.judge %r), so the judges bundles "
                    "stay empty", n, cfg.rl.judge)
        return None
    model_dir = judge_model_dir(cfg.rl, init)
    shutil.rmtree(run / "judges", ignore_errors=True)  # an earlier attempt's ports
    actors = cluster.engine_servers(model_dir, run / "judges", role="judges", max_batch_size=cfg.rl.rollout.slots,
                                    qat=cfg.qat.enabled, seed=cfg.rl.seed)
    stack.callback(cluster.kill, actors)
    judge = engine_config(actors, EngineConfig(timeout_s=cfg.rl.rollout.engine.timeout_s))
    log.info("GRM judge %s: %d engine server(s) on the judges bundles %s: %s", model_dir, n,
             [b for b, _ in cluster.placement.slots["judges"]], judge.urls)
    return judge


def run_rl(cfg: K3Config) -> Path:
    """`k3post rl CONFIG`: one RL expert (rl.domain at rl.effort) from rl.init; returns its folder."""
    check_judge_slots(cfg)
    run, init = _start_rl_run(cfg, "rl")
    with stage_summary(run, "rl") as summary:
        return _rl_in(cfg, run, init, summary)


def _rl_in(cfg: K3Config, run: Path, init: Path, summary: RunSummary) -> Path:
    """`run_rl` in its opened run folder, from the checkpoint ``init``."""
    from k3post.recipes.experts import domain_budgets, load_policy
    from k3post.envs.families.streams import domain_families
    from k3post.stages.rl import train_rl
    from k3post.rewards.judge import build_group_scorer, judged_families
    from k3post.rollout.factory import build_engine, close_engine

    tokenizer = load_tokenizer(init)
    model = load_policy(init, cfg.qat)
    summary.update(model=describe_model(model, tokenizer, init))
    fams = domain_families(cfg.rl.domain, cfg.rl.families, with_judge=bool(cfg.rl.judge))
    rl = replace(cfg.rl.for_domain(cfg.rl.domain), families=fams)
    engine = build_engine(model, tokenizer, engine=rl.rollout.engine, role="budgets (rl.init model)", max_batch_size=rl.rollout.slots,
                          seed=rl.seed)
    try:
        budgets = domain_budgets(engine, XTML(tokenizer), rl, run / f"budgets.{rl.domain}.json")
    finally:
        close_engine(engine)
    metrics = MetricsLogger(run)
    name = f"{rl.domain}.{rl.effort}"
    roles = cfg.distributed.roles
    with ExitStack() as stack:
        stack.callback(metrics.close)
        cluster = None
        if cfg.distributed.enabled and (roles.engines > 0 or roles.judges > 0):
            from k3post.distributed.ray_cluster import cluster_for, engine_config

            cluster = stack.enter_context(cluster_for(cfg.distributed))
        judge = None if cluster is None else _judge_servers(stack, cluster, cfg, init, run, bool(judged_families(rl, fams)))
        scorer = build_group_scorer(rl, init, tokenizer, fams, qat=cfg.qat.enabled, judge_engine=judge)
        if scorer is not None:
            stack.callback(scorer.close)  # type: ignore[attr-defined]
        if cluster is not None and roles.engines > 0:  # the rollouts on engine-server actors
            import shutil

            # a server's folder (port, weights kept for Ray's restarts) lives as long as this attempt's actors
            shutil.rmtree(run / "engines", ignore_errors=True)
            actors = cluster.engine_servers(init, run / "engines", max_batch_size=rl.rollout.slots,
                                            max_model_len=rl.rollout.max_model_len, qat=cfg.qat.enabled, seed=rl.seed)
            stack.callback(cluster.kill, actors)
            rl = replace(rl, rollout=replace(rl.rollout, engine=engine_config(actors, rl.rollout.engine)))
        res = train_rl(model, tokenizer, rl, run / "rl" / name, budgets=budgets, scorer=scorer, metrics=metrics,
                       stage=f"rl/{name}")
    final = save_model(model, run / "rl" / name / "final", tokenizer)
    ov = res.eval.get("overall", {})
    keep = ("n", "pass_rate", "pass_ci95", "mean_reward", "mean_effort_tokens", "mean_output_tokens", "infra")
    summary.update(rl={**summary.data.get("rl", {}), name: {
        "stage": f"rl/{name}", "domain": rl.domain, "effort": rl.effort, "steps": res.steps, "seconds": round(res.seconds, 1),
        "resumed_from": res.resumed_from, "eval": {k: ov[k] for k in keep if k in ov}}})
    print(f"RL {name}: {res.steps} steps in {res.seconds:.0f} s; held-out pass rate {ov.get('pass_rate', float('nan')):.3f}, "
          f"mean T(y) {ov.get('mean_effort_tokens', float('nan')):.1f} → {final}")
    return final


def run_experts(cfg: K3Config) -> Path:
    """`k3post experts CONFIG`: the nine (domain, effort) experts from rl.init; returns the experts folder."""
    check_judge_slots(cfg)
    run, init = _start_rl_run(cfg, "experts")
    with stage_summary(run, "experts") as summary:
        summary.update(model=f"from {init}")
        return _experts_in(cfg, run, init)


def _experts_in(cfg: K3Config, run: Path, init: Path) -> Path:
    """`run_experts` in its opened run folder, from the checkpoint ``init``."""
    from k3post.recipes.experts import expert_grid, format_expert_grid, train_experts
    from k3post.envs.families.streams import domain_families
    from k3post.rewards.judge import judged_families

    metrics = MetricsLogger(run)
    out = run / "experts"
    if cfg.distributed.enabled:  # every expert a Ray task, the domains in parallel, the judge on its actors
        from k3post.distributed.ray_cluster import cluster_for

        judged = any(judged_families(cfg.rl, domain_families(d, cfg.rl.families, with_judge=True)) for d in cfg.rl.domains)
        with cluster_for(cfg.distributed) as cluster, ExitStack() as stack:
            judge = _judge_servers(stack, cluster, cfg, init, run, judged)
            table = train_experts(init, cfg.rl, out, qat=cfg.qat, cluster=cluster, metrics_dir=run, judge_engine=judge)
    else:
        table = train_experts(init, cfg.rl, out, qat=cfg.qat, metrics=metrics)
    metrics.close()
    # (also in grid.json, written by train_experts) each cell: pass after RL [Wilson 95%], SFT pass, paired
    # verdict (↑ higher, = no significant change, ↓ lower), mean T(y), final budget-violation rate; then each
    # domain's targets
    print(format_expert_grid(expert_grid(table)))
    print(f"experts → {out} (table.json, grid.json)")
    raise_if_failed(table)
    return out


def raise_if_failed(table: dict) -> None:
    """After everything was written: a RuntimeError naming each failed expert (and its step), when any failed."""
    failed = table.get("failed") or {}
    if failed:
        cells = "; ".join(f"{n} ({f['error']}{f', step ' + str(f['step']) if f.get('step') is not None else ''})"
                          for n, f in failed.items())
        raise RuntimeError(f"{len(failed)} of {len(failed) + len(table['experts'])} experts failed: {cells}; the other "
                           "results are written, and running the command again retries from the checkpoints")


def mopd_config_for_run(cfg: K3Config, experts_dir: Path) -> "MOPDConfig":
    """``cfg.mopd`` with every missing teacher taken from ``experts_dir/<domain>.<effort>``."""
    m = cfg.mopd
    experts = dict(m.experts)
    for d in m.domains:
        for e in (e for e, w in m.effort_mix.items() if w > 0):
            name = expert_name(d, e)
            if name not in experts and (experts_dir / name / "config.json").is_file():
                experts[name] = str(experts_dir / name)
    return replace(m, experts=experts)


def reusable_teacher_evals(cfg: K3Config, m: "MOPDConfig", experts_dir: Path, tasks: Mapping[str, Sequence[Any]],
                           caps: Mapping[str, int], efforts: Sequence[str]) -> dict[str, Any]:
    """Expert → its own held-out evaluation (``experts_dir/table.json``) where that is the episodes `evaluate_mopd`
    would run for it as a teacher: the teacher is this run's expert folder, it sees its effort message, the same
    engine kind, fp32 weights (as `load_policy` trained and evaluated them, QAT as ``cfg.qat``), the same per-turn
    cap and the same held-out tasks in the same order. Any difference leaves the expert out (measured again)."""
    path = experts_dir / "table.json"
    if not path.is_file() or not m.teacher_sees_effort or m.teacher_dtype != "float32":
        return {}
    table = json.loads(path.read_text()).get("experts", {})
    out = {}
    for d in tasks:
        for e in efforts:
            x = expert_name(d, e)
            summary = (table.get(x) or {}).get("eval", {}).get("overall")
            rcfg = cfg.rl.for_domain(d, e)
            if (summary is None or Path(m.experts.get(x, "")) != experts_dir / x
                    or rcfg.rollout.engine.kind != m.rl.rollout.engine.kind or rcfg.eval_max_tokens != caps[d]
                    or list(summary.get("task_ids", [])) != [t.id for t in tasks[d]]):
                continue
            out[x] = summary
    return out


def distill(cfg: K3Config, init: Path, run: Path, metrics: MetricsLogger | None = None) -> dict:
    """MOPD from ``init`` (the SFT checkpoint) into ``run/mopd``, then the student-vs-teacher table;
    returns the summary written to ``run/mopd/summary.json``."""
    from k3post.recipes.experts import load_policy
    from k3post.rollout.teachers import TeacherPool
    from k3post.loop import rollout_gap
    from k3post.rollout.factory import build_engine, close_engine

    m = mopd_config_for_run(cfg, run / "experts")
    tokenizer = load_tokenizer(init)
    student = load_policy(init, cfg.qat)
    teachers = dict(max_resident=m.max_resident, dtype=m.teacher_dtype, qat=cfg.qat, batch_tokens=m.teacher_batch_tokens)
    with ExitStack() as stack:
        if cfg.distributed.enabled:  # the teachers as Ray actors on their own bundles
            from k3post.distributed.ray_cluster import RayTeacherPool, cluster_for

            pool: Any = RayTeacherPool(stack.enter_context(cluster_for(cfg.distributed)), m.experts, **teachers)
        else:
            pool = TeacherPool(m.experts, **teachers)  # one pool: the teachers stay resident for the evaluation
        stack.callback(pool.close)
        res = train_mopd(student, tokenizer, m, run / "mopd", metrics=metrics, teacher_qat=cfg.qat, pool=pool)
        save_model(student, run / "mopd" / "final", tokenizer)
        engine = build_engine(student, tokenizer, engine=m.rl.rollout.engine, role="MOPD student (final)",
                              max_batch_size=m.rl.rollout.slots, seed=m.rl.seed)
        tasks, caps, efforts = mopd_eval_tasks(m), eval_caps(m), [e for e, w in m.effort_mix.items() if w > 0]
        # a teacher that is one of this run's experts was evaluated on these very episodes when it was trained
        known = reusable_teacher_evals(cfg, m, run / "experts", tasks, caps, efforts)
        if known:
            log.info("MOPD evaluation: %d of %d teachers' rows are their own held-out evaluations (same tasks, cap, "
                     "effort message and weights); the rest are measured", len(known), len(tasks) * len(efforts))
        # with two threads or more to spend and teachers left to measure: the student's episodes here, those
        # teachers' in a second process, each on its share (as the RL domain workers: one process gains little
        # from a second thread here)
        plan = command_plan(cfg, "mopd", workers={"MOPD evaluation (student, teachers)": 2})
        split = plan.budget >= 2 and len(known) < len(tasks) * len(efforts)
        try:
            with use_threads(plan, "mopd: evaluation", run) if split else nullcontext():
                table = evaluate_mopd(engine, XTML(tokenizer), pool, tasks, max_tokens=caps, efforts=efforts,
                                      teacher_sees_effort=m.teacher_sees_effort, engine=m.rl.rollout.engine,
                                      processes=2 if split else 1, known=known)
        finally:
            close_engine(engine)
        teacher_stats = dict(pool.stats)  # training and evaluation together
    out = {"steps": res.steps, "seconds": res.seconds, "teacher_stats": teacher_stats, "rollout_gap": rollout_gap(res.metrics),
           "opd_reward_curve": res.metrics.series("opd_reward"), "reverse_kl_curve": res.metrics.series("reverse_kl"),
           "table": table, "infra_train": sum(x for x in res.metrics.series("infra_episodes") if x == x)}
    (run / "mopd" / "summary.json").write_text(json.dumps(out, indent=1, default=float))
    return out


def run_mopd(cfg: K3Config) -> Path:
    """`k3post mopd CONFIG`: distil the run's experts (or ``mopd.experts``) into one student from rl.init."""
    run, init = _start_rl_run(cfg, "mopd")
    with stage_summary(run, "mopd") as summary:
        summary.update(model=f"from {init}")
        metrics = MetricsLogger(run)
        out = distill(cfg, init, run, metrics)
        metrics.close()
    print(f"{'domain':8} {'effort':6} {'student pass':>12} {'teacher pass':>12} {'student T':>9} {'teacher T':>9}")
    for r in out["table"]["rows"]:
        print(f"{r['domain']:8} {r['effort']:6} {r['student_pass']:12.3f} {r['teacher_pass']:12.3f} "
              f"{r['student_tokens']:9.1f} {r['teacher_tokens']:9.1f}")
    print(f"targets met: {out['table']['ok']} → {run / 'mopd'}")
    return run / "mopd" / "final"


def train_drafts(cfg: K3Config, run: Path, target_dir: Path, losses: Sequence[str],
                 metrics: MetricsLogger | None = None, *, processes: int = 1) -> dict:
    """EAGLE-3 drafts for the frozen target in ``target_dir`` (QAT as it runs), one per loss in ``losses``, all on
    the same data (the target's own episodes, `k3post.spec.data`; every tenth held out), steps and seed; each is
    trained into ``run/draft/<loss>`` and exported (vLLM / SGLang layout) to ``run/draft/<loss>/final``.
    With ``processes`` > 1 the losses train side by side in that many worker processes (`k3post.workers`; each at
    the thread count of the caller's plan, `k3post.threads.child_threads`), after the data is made once here; a failed one's
    exception is raised here. Returns (and writes to ``run/draft/summary.json``) held-out acceptance by depth at
    temperature 1 and 0 before and after training, and the expected acceptance length at k = 3 and 5 drafted tokens."""
    from k3post.envs.families import default_families
    from k3post.recipes.experts import load_policy
    from k3post.rollout.factory import build_engine, close_engine
    from k3post.spec.data import save_samples, target_generations

    d = cfg.draft
    tokenizer = load_tokenizer(target_dir)
    target = load_policy(target_dir, cfg.qat)
    aux = draft_aux_layers(d, len(target.model.layers))  # an input error before any data is generated
    out = run / "draft"
    data = out / "data.jsonl"
    fams = d.families or [f.name for f in default_families()]
    if not data.is_file():
        engine = build_engine(target, tokenizer, role="draft data (target)", max_batch_size=32, seed=cfg.run.seed)
        try:
            save_samples(target_generations(engine, XTML(tokenizer), fams, n_per_family=d.n_per_family,
                                            efforts=d.efforts, max_tokens=d.max_tokens, temperature=d.temperature,
                                            seed=cfg.run.seed), data)
        finally:
            close_engine(engine)
    inputs = _draft_inputs(cfg, run, target_dir, tokenizer)
    mtp_from = inputs["mtp_from"]
    summary: dict = {"target": _run_relative(target_dir, run), "aux_layers": list(aux),
                     "mtp_init": mtp_from and _run_relative(mtp_from, run),
                     "train_episodes": len(inputs["train"]), "held_out_episodes": len(inputs["held"]), "steps": d.steps,
                     "ttt_steps": d.ttt_steps, "losses": {}}
    if processes > 1 and len(losses) > 1:
        del target
        results = _drafts_in_processes(cfg, run, target_dir, list(losses), processes)
    else:
        results = {loss: _train_one_draft(cfg, run, target, loss, inputs, metrics) for loss in losses}
    for loss in losses:
        summary["fc_fit_positions"], summary["losses"][loss] = results[loss]
        after = summary["losses"][loss]["acceptance_by_depth"]
        print(f"  draft {loss:9}: held-out α by depth (T=1) " + ", ".join(f"{a:.3f}" for a in after["t1"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    return summary


def _draft_inputs(cfg: K3Config, run: Path, target_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """What every draft of a run trains from: the episodes split into train / held out (every tenth), the draft
    vocabulary (``draft.draft_vocab``), the MTP head it starts from and the pad id."""
    from k3post.spec.data import load_samples, token_counts
    from k3post.spec.eagle3 import DraftVocab

    d = cfg.draft
    samples = load_samples(run / "draft" / "data.jsonl")
    held = samples[::10]  # every tenth episode is held out for the acceptance-by-depth table
    train = [s for k, s in enumerate(samples) if k % 10]
    vocab = None
    if d.draft_vocab:
        counts = token_counts(train)
        vocab = DraftVocab.from_counts(torch.tensor([counts.get(i, 0) for i in range(len(tokenizer))]), d.draft_vocab)
    mtp, mtp_from = _draft_mtp(d.mtp, target_dir, run)
    return {"train": train, "held": held, "vocab": vocab, "mtp": mtp, "mtp_from": mtp_from, "pad": tokenizer.pad_token_id}


def _train_one_draft(cfg: K3Config, run: Path, target: Any, loss: str, inputs: dict[str, Any],
                     metrics: MetricsLogger | None) -> tuple[int, dict[str, Any]]:
    """One draft of ``train_drafts``: the fc fit, held-out acceptance before, training, acceptance after, the
    export. Returns the fc fit's positions and the loss's summary entry."""
    from k3post.spec.eagle3 import Eagle3Draft
    from k3post.spec.export import export_eagle3
    from k3post.spec.train import evaluate_alpha, expected_accept_length, fit_fc, train_draft

    d = cfg.draft
    out = run / "draft"
    lc = replace(d, loss=loss)
    aux = draft_aux_layers(d, len(target.model.layers))
    train, held, pad = inputs["train"], inputs["held"], inputs["pad"]
    torch.manual_seed(cfg.run.seed)
    draft = Eagle3Draft.from_target(target, aux, mtp=inputs["mtp"], draft_vocab=inputs["vocab"])
    fc_positions = fit_fc(target, draft, train, lc, pad)  # high id < L: fc ≈ the MTP head's input
    before = evaluate_alpha(target, draft, held, lc, pad)
    res = train_draft(target, draft, train, lc, out / loss, pad_id=pad, seed=cfg.run.seed, metrics=metrics,
                      stage=f"draft_{loss}")
    after = evaluate_alpha(target, draft, held, lc, pad)
    export_eagle3(draft, out / loss / "final", nonstock=d.nonstock_export)
    return fc_positions, {
        "acceptance_by_depth_before": before, "acceptance_by_depth": after,
        "expected_accept_length": {t: {str(k): expected_accept_length(after[t], k) for k in (3, 5) if k <= d.ttt_steps}
                                   for t in after},
        "final_loss": res.history[-1]["loss"] if res.history else None,
    }


def _draft_worker(cfg: K3Config, run: Path, target_dir: Path, loss: str) -> tuple[int, dict[str, Any]]:
    """One loss's draft in a worker process of ``train_drafts`` (the threads of the caller's plan, as the RL domain
    workers, `k3post.recipes.experts._domain_worker`); its log lines and metrics rows go to the run's."""
    from k3post.recipes.experts import load_policy

    exit_with_parent()
    torch.set_num_threads(child_threads())
    attach_run_log(run)
    target = load_policy(target_dir, cfg.qat)
    metrics = MetricsLogger(run)
    try:
        return _train_one_draft(cfg, run, target, loss, _draft_inputs(cfg, run, target_dir, load_tokenizer(target_dir)),
                                metrics)
    finally:
        metrics.close()


def _drafts_in_processes(cfg: K3Config, run: Path, target_dir: Path, losses: list[str],
                         processes: int) -> dict[str, tuple[int, dict[str, Any]]]:
    """``_train_one_draft`` for each loss in worker processes (`k3post.workers`), at most ``processes`` at once; a
    worker's exception is raised here."""
    with worker_pool(min(processes, len(losses)), maxtasksperchild=1) as pool:
        return dict(zip(losses, pool.starmap(_draft_worker, [(cfg, run, target_dir, loss) for loss in losses], chunksize=1)))


def _run_relative(path: str | Path, run: Path) -> str:
    """``path`` relative to the run folder when it lies inside it, else as given."""
    where, root = Path(path).resolve(), run.resolve()
    return str(where.relative_to(root)) if where.is_relative_to(root) else str(path)


def _draft_mtp(setting: str, target_dir: Path, run: Path) -> tuple[MTPHead | None, str | None]:
    """The MTP head a draft starts from (``draft.mtp``) and where it came from: a named folder (an error when it
    has none), else the target's own, else the run's SFT model's (SFT trained it, `sft.mtp_weight`; the target may
    be that model after RL and MOPD), or none (``"none"``, or no head anywhere: the draft starts from the
    target's last layer)."""
    if setting == "none":
        return None, None
    if setting:
        head = load_mtp(setting)
        if head is None:
            raise UserError(f"draft.mtp: {setting} has no MTP head (mtp.safetensors, written by SFT with sft.mtp_weight > 0)")
        return head, setting
    for folder in (target_dir, run / "sft" / "final"):
        head = load_mtp(folder)
        if head is not None:
            return head, str(folder)
    return None, None


def run_draft(cfg: K3Config) -> Path:
    """`k3post draft CONFIG`: an EAGLE-3 draft (``draft.loss``) for the frozen target (`draft_target`), trained on
    the target's own episodes; returns its export folder (the layout vLLM and SGLang load)."""
    run = open_run(cfg.run.dir, cfg, "draft")
    with stage_summary(run, "draft") as summary:
        target = draft_target(cfg, run)
        summary.update(model=f"EAGLE-3 draft for {target}")
        metrics = MetricsLogger(run)
        train_drafts(cfg, run, target, [cfg.draft.loss], metrics)
        metrics.close()
    return run / "draft" / cfg.draft.loss / "final"
