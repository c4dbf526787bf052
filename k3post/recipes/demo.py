"""`k3post demo`: the whole pipeline on a tiny MoE on CPU, into one run folder.

    runs/<name>/
      config.yaml            resolved config
      data/                  sft_train.jsonl (+ per-source raw / rejected / funnel files, review queue, judge.jsonl:
                             the scripted GRM judge episodes of data.judge_tasks), eval_tasks.jsonl
      pretrain/              stage 0 (`demo.base`, `stage0`): checkpoints and final model when this run built the base
      tokenizer/             byte-level BPE with the XTML tokens (the base's, when the run starts from one)
      model_init/            the initial weights: the base's, else a freshly built tiny Qwen3-MoE (safetensors)
      sft/checkpoints/       step-N/ checkpoints + latest (exact resume)
      sft/final/             the SFT policy (QAT)
      sft_noqat/             the same SFT run without QAT, for comparison
      metrics.jsonl, tensorboard/
      summary.json, report.html

A killed demo resumes where it stopped when run again with the same name and settings (changed settings are
refused, `k3post.runs`); a finished run folder is never overwritten (a new `-N` suffix is used instead;
`run.restart=true`, or `run.overwrite=true`, moves the old run to `<name>.restart-N` and starts afresh).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from k3post.checkpoint import load_weights_into
from k3post.errors import UserError
from k3post.config import K3Config
from k3post.config.sft import SFTConfig
from k3post.io import write_jsonl
from k3post.recipes.evaluate import evaluate_family
from k3post.recipes.experts import train_experts
from k3post.recipes.select import select_checkpoint
from k3post.metrics import MetricsLogger
from k3post.models import PRESETS, build_tiny_moe, count_parameters, load_model, save_model
from k3post.stages.pretrain import base_key, base_record, build_base, cache_root, cached_base, copy_probe, copy_warning
from k3post.quant.qat import apply_qat
from k3post.rewards.judging import evaluate_recipe_judge, judge_eval_enabled
from k3post.recipes.report import write_report
from k3post.stages.sft import train_sft
from k3post.stages.sft_data import run_tokenizer, sft_samples, synthesize_sft_data
from k3post.threads import active_plan, child_threads, command_plan, exit_with_parent, use_threads
from k3post.workers import worker_context, worker_process
from k3post.spec.mtp import save_mtp
from k3post.recipes.commands import distill, raise_if_failed, sft_summary, train_drafts
from k3post.runs import RunSummary, open_run
from k3post.envs.families import get_family
from k3post.envs.task import canonical_json
from k3post.stats import format_rate, paired_change, wilson_interval
from k3post.tokenizer import load_tokenizer
from k3post.xtml import XTML

log = logging.getLogger("k3post.demo")


def _run_dir(cfg: K3Config) -> Path:
    base = cfg.run.dir
    if cfg.run.overwrite or cfg.run.restart:  # open_run moves the old run aside (never deletes it)
        return base
    d, k = base, 0
    while (d / "summary.json").exists() and json.loads((d / "summary.json").read_text()).get("status") == "done":
        k += 1
        d = base.with_name(f"{base.name}-{k}")
    return d


def demo_sft(cfg: K3Config) -> SFTConfig:
    """The demo's SFT settings: ``sft.*`` with the MTP head of ``demo.mtp_weight`` / ``demo.mtp_start_fraction`` /
    ``demo.mtp_lr_scale`` (both SFT runs, so the QAT comparison stays like with like); an ``sft.mtp_weight`` set by
    the user wins (with the ``sft.*`` head settings)."""
    if cfg.sft.mtp_weight > 0:
        return cfg.sft
    return replace(cfg.sft, mtp_weight=cfg.demo.mtp_weight, mtp_start_fraction=cfg.demo.mtp_start_fraction,
                   mtp_lr_scale=cfg.demo.mtp_lr_scale)


def _baseline_worker(cfg: K3Config, run: Path, init_dir: Path, train_file: Path, out: Any) -> None:
    """Child process: the same SFT run as the parent's, from the same initial weights, without QAT."""
    try:
        exit_with_parent()
        torch.set_num_threads(child_threads())  # the parent's plan for the pair (`run_demo`)
        tokenizer = load_tokenizer(init_dir)
        model = load_model(init_dir)
        samples, stats = sft_samples(cfg, train_file, tokenizer)
        sft_cfg = replace(demo_sft(cfg), progress=False)
        metrics = MetricsLogger(run)
        res = train_sft(model, tokenizer, samples, sft_cfg, run / "sft_noqat", seed=cfg.run.seed, metrics=metrics, stage="sft_noqat")
        metrics.close()
        save_model(model, run / "sft_noqat" / "final", tokenizer)
        out.put(("ok", sft_summary(res, stats, 0)))
    except BaseException as e:  # reported by the parent, with the child's message
        out.put(("error", f"{type(e).__name__}: {e}"))


def _start_baseline(cfg: K3Config, run: Path, init_dir: Path, train_file: Path) -> tuple[Any, Any]:
    out = worker_context().Queue()
    proc = worker_process(_baseline_worker, (cfg, run, init_dir, train_file, out), daemon=True)
    proc.start()
    return proc, out


def _join_baseline(proc: Any, out: Any) -> dict[str, Any]:
    status, payload = out.get()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"the no-QAT comparison run failed: {payload}")
    return payload


def _no_base(summary: RunSummary, mode: str, reason: str) -> None:
    log.warning("stage 0: no pretrained base: %s", reason)
    print(f"stage 0: no pretrained base: {reason}")
    summary.update(pretrain={"mode": mode, "used": False, "reason": reason})


def _check_base_model(base: Path, cfg: K3Config) -> None:
    """A `UserError` when the base's shapes are not those ``model.preset`` builds."""
    from transformers import AutoConfig

    have = AutoConfig.from_pretrained(base, local_files_only=True)
    want = {**PRESETS.get(cfg.model.preset, {}), "max_position_embeddings": cfg.model.max_position_embeddings}
    bad = [f"{k} {getattr(have, k, None)} (model.preset={cfg.model.preset}: {v})" for k, v in want.items()
           if getattr(have, k, None) != v]
    if bad:
        raise UserError(f"demo.base: the pretrained base {base} does not match the run's model: {'; '.join(bad)}. "
                        f"Set model.preset to the base's, rebuild it (`k3post pretrain`), or set demo.base=none")


def stage0(cfg: K3Config, run: Path, summary: RunSummary, metrics: MetricsLogger) -> Path | None:
    """Stage 0 of the demo (``demo.base``): the pretrained base the run starts from, or None; recorded in
    ``summary["pretrain"]`` (key, folder, steps, corpus tokens, built here or cached, copy probe; or why the
    run has none). ``build`` trains it (`k3post.stages.pretrain.build_base`, resuming ``run/pretrain`` checkpoints)
    when neither the cache nor this run holds it; ``cached`` only looks; ``none`` never uses one. A resumed
    run keeps the decision it made when it started."""
    prev = summary.data.get("pretrain")
    if prev is not None and not prev.get("used"):
        print(f"stage 0: no pretrained base ({prev.get('reason')}; decided when this run started)")
        return None
    if prev is not None and ((run / "model_init" / "config.json").is_file() or (Path(prev["path"]) / "config.json").is_file()):
        print(f"stage 0: pretrained base {prev['key']} (chosen when this run started): {prev['path']}")
        return Path(prev["path"])
    mode = cfg.demo.base
    if mode == "none":
        _no_base(summary, mode, "demo.base=none: the run starts from random weights")
        return None
    if cfg.model.path:
        _no_base(summary, mode, f"model.path is set: the run starts from {cfg.model.path}")
        return None
    key = base_key(cfg)
    base, built, build_s = cached_base(cfg), False, None
    own = run / "pretrain" / "final"  # built by this run before (pretrain.cache=false, or the cache emptied since)
    if base is None and (own / "base_key.json").is_file() and json.loads((own / "base_key.json").read_text()).get("key") == key:
        base, built = own, True
    if base is None:
        if mode == "cached":
            where = f"in {cache_root(cfg) / 'bases'}" if cfg.pretrain.cache else "(pretrain.cache=false)"
            _no_base(summary, mode, f"demo.base=cached and no base with key {key} {where}: the run starts from random "
                                    f"weights; build it with `k3post pretrain CONFIG` or run with demo.base=build")
            return None
        print(f"stage 0: building the pretrained base (key {key}; cached for later runs)")
        t0 = time.perf_counter()
        base, built = build_base(cfg, run, metrics), True
        build_s = round(time.perf_counter() - t0, 1)
    _check_base_model(base, cfg)
    record = base_record(base, cfg)
    warning = copy_warning(record.get("probe") or {})
    summary.update(pretrain={"mode": mode, "used": True, "built": built, "build_s": build_s, **record, "warning": warning})
    print(f"stage 0: pretrained base {key} ({'built in this run' if built else 'cached'}): {base}")
    if warning:
        log.warning("stage 0: %s", warning)
        print(f"WARNING: stage 0: {warning}")
    return base


#: The SFT pass rate at max (held-out, RL's own eval tasks) inside which a domain can show RL at work: below it
#: few of RL's sampled groups hold a success to learn from, above it little is left to gain (issue 31).
SHOW_WINDOW = (0.2, 0.7)


def domains_to_show(experts: dict[str, Any], k_of: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Per domain with a max-effort expert: its held-out n, SFT pass at max with the Wilson 95% interval,
    whether that pass is inside `SHOW_WINDOW`, the room RL has (the share of tasks SFT fails, and the share of
    RL's groups of ``k_of[domain]`` samples expected to hold both a pass and a fail, the groups with a learning
    signal: 1 - p^k - (1 - p)^k if every task passed with the greedy rate p; concave in p, so an upper bound for
    tasks of uneven difficulty; ``mixed_measured``: the share the expert's training groups actually held, which the
    prompt selection ``rl.train_pass_min`` raises), what RL did (the paired verdict) and a one-line verdict: "RL > SFT
    shown" when a paired test (greedy, or avg@k) found RL higher, else where the SFT pass sits against the window
    (with the measured share when the expert recorded it)."""
    lo_w, hi_w = SHOW_WINDOW
    out = []
    for name, e in experts.items():
        domain, effort = name.rsplit(".", 1)
        if effort != "max":
            continue
        p, n = e["sft_pass_rate"], e["n"]
        k = (k_of or {}).get(domain)
        mixed = None if k is None else 1 - p ** k - (1 - p) ** k
        smp = e.get("sampled")  # avg@k at the rollout temperature, paired per task (rl.eval_samples)
        shown = [what for what, v in (("greedy", e.get("change", {}).get("verdict")),
                                      (f"avg@{smp['k']}" if smp else "", smp["change"]["verdict"] if smp else None))
                 if v == "higher"]
        if shown:  # the paired test resolved a gain: that is what the run shows, whatever the window says
            verdict = (f"RL > SFT shown ({' and '.join(shown)}, paired p < 0.05); SFT passes {p:.0%}"
                       + ("" if lo_w <= p <= hi_w else f", outside {lo_w:.0%}–{hi_w:.0%}"))
        elif p < lo_w:
            measured = e.get("mixed_groups")
            verdict = (f"too hard: SFT passes {p:.0%} < {lo_w:.0%}, few RL groups hold a success" if measured is None else
                       f"too hard: SFT passes {p:.0%} < {lo_w:.0%}; {measured:.0%} of RL's training groups held a pass and a fail")
        elif p > hi_w:
            verdict = f"too easy: SFT passes {p:.0%} > {hi_w:.0%}, little left for RL to gain"
        else:
            verdict = f"can show RL: SFT passes {p:.0%}, inside {lo_w:.0%}–{hi_w:.0%}"
        out.append({"domain": domain, "n": n, "sft_pass": p, "sft_ci95": list(wilson_interval(round(p * n), n)),
                    "inside": bool(lo_w <= p <= hi_w), "room": 1 - p, "k": k, "mixed_groups": mixed,
                    "mixed_measured": e.get("mixed_groups"),
                    "rl_verdict": e.get("change", {}).get("verdict"), "rl_pass": e.get("pass_rate"), "verdict": verdict,
                    "rl_sampled": None if not smp else {"k": smp["k"], "sft": smp["sft"], "rl": smp["rl"],
                                                        "delta": smp["change"]["delta"], "p_value": smp["change"]["p_value"],
                                                        "verdict": smp["change"]["verdict"]}})
    return out


def run_demo(cfg: K3Config) -> Path:
    """Run every stage the project has so far; return the run folder. Under the thread plan of `k3post demo`
    (`k3post.threads`; the CLI's, else its own), and, while processes run side by side (the SFT runs with and
    without QAT, the RL domains), under the plan of those processes."""
    if active_plan() is None:
        with use_threads(command_plan(cfg, "demo"), "k3post demo"):
            return _run_demo(cfg)
    return _run_demo(cfg)


def _run_demo(cfg: K3Config) -> Path:
    t_start = time.perf_counter()
    run = open_run(_run_dir(cfg), cfg, "demo")
    summary = RunSummary(run / "summary.json")
    timings: dict[str, float] = dict(summary.data.get("timings", {}))
    metrics = MetricsLogger(run)
    print(f"k3post demo → {run}")

    def phase(name: str, t0: float) -> None:
        timings[name] = round(time.perf_counter() - t0, 1)
        summary.update(timings=timings)

    # 0. Stage 0: the pretrained base (k3post.stages.pretrain), built once and cached by content hash (demo.base)
    t0 = time.perf_counter()
    base = stage0(cfg, run, summary, metrics)
    if summary.data["pretrain"].get("build_s") is not None and "pretrain" not in timings:
        phase("pretrain", t0)  # stage 0's time, apart from the post-training's

    # 1. tokenizer (the base's; else a BPE on XTML renderings of every family's reference trajectories) and the tiny MoE
    t0 = time.perf_counter()
    d = cfg.data
    eval_family = get_family(d.eval_family)
    if base is not None and not cfg.tokenizer.path and not (run / "tokenizer" / "tokenizer.json").exists():
        load_tokenizer(base).save_pretrained(run / "tokenizer")
    tokenizer = run_tokenizer(cfg, run)
    xtml = XTML(tokenizer)
    stop_id, pad_id = xtml.eom_id, xtml.pad_id
    init_dir = run / "model_init"
    if cfg.model.path:
        model = load_model(cfg.model.path, cfg.model.dtype)
    elif (init_dir / "config.json").exists():
        model = load_model(init_dir)
    elif base is not None:  # SFT (and the no-QAT comparison, from model_init) starts from the base's weights
        model = load_model(base, cfg.model.dtype)
        save_model(model, init_dir, tokenizer)
    else:
        model = build_tiny_moe(
            len(tokenizer), cfg.model.preset, seed=cfg.run.seed, pad_token_id=pad_id, eos_token_id=stop_id,
            max_position_embeddings=cfg.model.max_position_embeddings,
        )
        save_model(model, init_dir, tokenizer)
    summary.update(model=f"Qwen3-MoE {cfg.model.preset}, {count_parameters(model) / 1e6:.2f} M params, vocab {len(tokenizer)}")
    phase("tokenizer+model", t0)

    # 2. SFT data from the synthesis pipeline: reference teachers over every built-in family x effort,
    #    multi-stage verification (structure, outcome, quality, judge); held-out eval tasks disjoint from it
    t0 = time.perf_counter()
    train_file = Path(cfg.sft.train_file) if cfg.sft.train_file else synthesize_sft_data(cfg, run, tokenizer, summary.update)
    seen = {canonical_json(list(t.messages)) for t in eval_family.generate(d.n_train, seed=cfg.run.seed, difficulty=d.difficulty)}
    pool = eval_family.generate(2 * d.n_eval + 50, seed=cfg.run.seed + 1000, difficulty=d.difficulty)
    eval_tasks = [t for t in pool if canonical_json(list(t.messages)) not in seen][: d.n_eval]
    write_jsonl(run / "data" / "eval_tasks.jsonl", [t.to_dict() for t in eval_tasks])
    phase("data", t0)

    # 3. held-out pass rate of the untrained model
    t0 = time.perf_counter()
    evals: dict[str, Any] = dict(summary.data.get("eval", {}))
    def eval_all(tag: str) -> None:
        evals[tag] = {
            e: evaluate_family(model, xtml, eval_family, eval_tasks, effort=e, cfg=cfg.eval)
            for e in cfg.eval.efforts
        }
        summary.update(eval=evals)
        for e, r in evals[tag].items():
            print(f"  {tag:>10} @ {e:<4}: pass {format_rate(r['pass_rate'], r['n'])}  think tokens {r['mean_think_tokens']:.1f}")

    if "base" not in evals:
        eval_all("base")
    phase("eval base", t0)

    # 4. Stage 1 SFT with QAT from the first step (and, for comparison, the same run without QAT)
    samples, stats = sft_samples(cfg, train_file, tokenizer)

    compare = cfg.qat.enabled and cfg.demo.compare_no_qat
    t0 = time.perf_counter()
    baseline_proc = None
    # the no-QAT run trains at the same time in a child process, the threads shared (34% less wall time than in turn)
    pair = {"SFT (QAT)": 1, "SFT (no QAT)": 1}
    with use_threads(command_plan(cfg, "demo", workers=pair), "demo: SFT", run) if compare else nullcontext():
        if compare:
            baseline_proc = _start_baseline(cfg, run, init_dir, train_file)
        quantized = apply_qat(model, cfg.qat) if cfg.qat.enabled else []
        res = train_sft(model, tokenizer, samples, demo_sft(cfg), run / "sft", seed=cfg.run.seed, metrics=metrics, stage="sft")
        save_model(model, run / "sft" / "final", tokenizer)
        if res.mtp is not None:  # the draft stage starts from it (draft.mtp)
            save_mtp(res.mtp, run / "sft" / "final")
        summary.update(sft=sft_summary(res, stats, len(quantized)))
        choice = select_checkpoint(cfg, run / "sft")  # sft.select=validation: the best kept checkpoint
        if choice is not None:
            summary.update(sft_selection=choice)
            if choice["chosen"] != choice["last"]:  # what the SFT evaluation below measures is the chosen model
                load_weights_into(model, run / "sft" / "final")
        if baseline_proc is not None:
            summary.update(sft_noqat=_join_baseline(*baseline_proc))
    phase("sft", t0)

    # 5. held-out pass rate after SFT
    t0 = time.perf_counter()
    eval_all("sft")
    pre = summary.data.get("pretrain") or {}
    if pre.get("used") and "sft_copy" not in summary.data:  # does the SFT model still read as its base did?
        base_probe = pre.get("probe") or {}
        dists = sorted(int(d) for d in base_probe) or [20, 100, 300]
        after = copy_probe(model, tokenizer, dists)
        summary.update(sft_copy=after)
        print("  copy probe after SFT (exact, base → SFT): " + ", ".join(
            f"{d} back {base_probe.get(str(d), {}).get('exact', float('nan')):.2f} → {after[str(d)]['exact']:.2f}" for d in dists))
    phase("eval sft", t0)

    if judge_eval_enabled(cfg) and "judge" not in summary.data:  # the SFT model as the GRM judge (issue 31)
        t0 = time.perf_counter()
        jr = evaluate_recipe_judge(cfg, run / "sft" / "final", metrics)
        summary.update(judge=jr)
        print(f"  judge (SFT model): valid {format_rate(jr['valid']['rate'], jr['n'])}, "
              f"agrees with the reference {format_rate(jr['agreement']['rate'], jr['n'])}")
        phase("eval judge", t0)

    if compare:
        baseline = load_model(run / "sft_noqat" / "final")
        t0 = time.perf_counter()
        evals["sft_noqat"] = {
            "max": evaluate_family(baseline, xtml, eval_family, eval_tasks, effort="max", cfg=cfg.eval)
        }
        qat_vs_noqat = paired_change(evals["sft_noqat"]["max"]["passed"], evals["sft"]["max"]["passed"])
        summary.update(eval=evals, qat_vs_noqat=qat_vs_noqat)
        print(f"  sft_noqat @ max : pass {format_rate(evals['sft_noqat']['max']['pass_rate'], evals['sft_noqat']['max']['n'])}; "
              f"QAT - no QAT {qat_vs_noqat['delta']:+.3f} (McNemar p = {qat_vs_noqat['p_value']:.3g}: {qat_vs_noqat['verdict']})")
        phase("eval sft_noqat", t0)

    # 6. Stage 2 RL: the nine experts, domain x (max -> high -> low), the domains in parallel processes
    t0 = time.perf_counter()
    table: dict[str, Any] = {"experts": {}, "failed": {}}
    if cfg.rl.steps > 0 and cfg.rl.domains:
        domains = {"RL domain workers": len(cfg.rl.domains)}
        with use_threads(command_plan(cfg, "demo", workers=domains), "demo: RL experts", run):
            table = train_experts(run / "sft" / "final", cfg.rl, run / "experts", qat=cfg.qat, metrics=metrics,
                                  processes=len(cfg.rl.domains), metrics_dir=run)
        summary.update(experts={k: {kk: v for kk, v in e.items() if kk != "eval"} for k, e in table["experts"].items()},
                       experts_failed={k: {kk: v for kk, v in f.items() if kk != "traceback"} for k, f in table["failed"].items()})
        for name, e in table["experts"].items():
            print(f"  expert {name:14}: pass {e['sft_pass_rate']:.3f} → {e['pass_rate']:.3f} (n={e['n']}, {e['change']['verdict']}, "
                  f"p = {e['change']['p_value']:.3g})   T(y) {e['sft_mean_effort_tokens']:.1f} → {e['mean_effort_tokens']:.1f}")
            if e.get("sampled"):  # avg@k at the rollout temperature: the expected reward RL optimises, paired per task
                smp, ch = e["sampled"], e["sampled"]["change"]
                print(f"  {'':21} avg@{smp['k']} (T {smp['temperature']:g}) {smp['sft']:.3f} → {smp['rl']:.3f} "
                      f"(Δ {ch['delta']:+.3f} [{ch['ci95'][0]:+.3f}, {ch['ci95'][1]:+.3f}], {ch['verdict']}, p = {ch['p_value']:.3g})")
        for name, f in table["failed"].items():
            print(f"  expert {name:14}: FAILED{f' in step ' + str(f['step']) if f.get('step') is not None else ''}: "
                  f"{f['error']}{'  (traceback: ' + f['log'] + ')' if f.get('log') else ''}")
        phase("rl experts", t0)

    # 7. Stage 3 MOPD: the nine experts distilled into one student (from the SFT checkpoint); a domain with a
    #    failed expert is left out (its teachers are missing)
    t0 = time.perf_counter()
    failed_domains = {f["domain"] for f in table["failed"].values()}
    mopd_domains = [dom for dom in cfg.mopd.domains if dom not in failed_domains]
    if cfg.mopd.rl.steps > 0 and (run / "experts" / "table.json").is_file() and mopd_domains:
        mcfg = replace(cfg, mopd=replace(cfg.mopd, domains=mopd_domains,
                                         families={k: v for k, v in cfg.mopd.families.items() if k in mopd_domains}))
        out = distill(mcfg, run / "sft" / "final", run, metrics)
        if failed_domains:
            out["left_out_domains"] = sorted(failed_domains)
        summary.update(mopd=out)
        for r in out["table"]["rows"]:
            print(f"  MOPD {r['domain']:8} @ {r['effort']:<4}: student {r['student_pass']:.3f} vs teacher {r['teacher_pass']:.3f}, "
                  f"T(y) {r['student_tokens']:.1f} vs {r['teacher_tokens']:.1f}")
        phase("mopd", t0)

    # 8. Deployment: EAGLE-3 drafts for the final model (the MOPD student, else the SFT model), trained on its own
    #    episodes, one per loss (LK_α, the K3 loss, against the KL baseline) on the same data, steps and seed
    t0 = time.perf_counter()
    if cfg.demo.drafts and cfg.draft.steps > 0:
        target_dir = run / "mopd" / "final" if (run / "mopd" / "final" / "config.json").is_file() else run / "sft" / "final"
        n = len(cfg.demo.drafts)  # side by side, one process each: with idle OpenMP workers asleep, one process
        # gains little from a second thread on this model (docs/decisions.md, issue 31 §demo)
        with use_threads(command_plan(cfg, "demo", workers={"drafts": n}), "demo: drafts", run) if n > 1 else nullcontext():
            summary.update(draft=train_drafts(cfg, run, target_dir, cfg.demo.drafts, metrics, processes=n))
        phase("draft", t0)

    k_of = {dom: cfg.rl.for_domain(dom, "max").rollout.k for dom in cfg.rl.domains}
    summary.update(domains=domains_to_show(table["experts"], k_of))
    for row in summary.data["domains"]:
        print(f"  domain {row['domain']:8}: n {row['n']}, {row['verdict']}")
    metrics.close()
    status = "failed" if table["failed"] else "done"  # a failed run resumes (and retries) when run again
    summary.update(status=status, wall_s=round(time.perf_counter() - t_start + summary.data.get("wall_s_before_resume", 0), 1))
    summary.update(post_training_wall_s=round(summary.data["wall_s"] - timings.get("pretrain", 0), 1))
    report = write_report(run)
    print(f"report: {report}")
    raise_if_failed(table)
    return run
