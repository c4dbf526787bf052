"""The run report: one self-contained ``report.html`` (plots embedded as PNG) from a run folder.

Everything is read back from disk (``summary.json``, ``metrics.jsonl``, ``config.yaml``), so
``k3post report RUN_DIR`` rebuilds the page of any run, finished or not. Each pipeline stage
contributes a section; stages a run has not reached are simply absent.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from k3post.io import atomic_write
from k3post.metrics import read_metrics


def _plot_png(series: dict[str, tuple[list[float], list[float]]], *, title: str, xlabel: str, ylabel: str, logy: bool = False) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.4)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _png_b64(fig)


def _png_b64(fig: Any) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _hist_png(series: dict[str, list[float]], *, title: str, xlabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=110)
    hi = max((max(v) for v in series.values() if v), default=1.0)
    bins = [hi * i / 30 for i in range(31)] if hi > 0 else 10
    for label, vals in series.items():
        ax.hist(vals, bins=bins, alpha=0.5, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("episodes")
    ax.legend()
    return _png_b64(fig)


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0} th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:12px;white-space:pre-wrap}
.muted{color:#777}
"""


def _induction_line(ind: dict[str, Any] | None) -> str:
    """Stage 0's phase 1 in words (`k3post.stages.pretrain._formed`)."""
    if not ind:
        return "no stopping rule recorded"
    verdict = "reached the target" if ind.get("reached") else "stopped at its cap"
    return (f"held-out induction accuracy {ind['induction_acc']:.3f} after {ind['steps']} steps ({verdict} "
            f"{ind['target']})")


def _pretrain_section(run: Path, summary: dict[str, Any]) -> str:
    """Stage 0: the base the run started from (``summary["pretrain"]``, the demo's; or why it has none), the
    loss curve when the run trained it, and the copy probe."""
    path = run / "metrics.jsonl"
    rows = read_metrics(path, "pretrain") if path.is_file() else []
    pre = summary.get("pretrain")
    if not rows and not pre:
        return ""
    parts = ["<h2>Stage 0: pretrained base</h2>"]
    if pre is not None and not pre.get("used"):
        parts.append(f"<p><b>This run has no pretrained base</b> (demo.base={html.escape(str(pre.get('mode')))}): "
                     f"{html.escape(str(pre.get('reason')))}.</p>")
    elif pre is not None:
        how = (f"built in this run ({pre['build_s']:.0f} s, apart from the post-training's time)" if pre.get("build_s") is not None
               else "built in this run" if pre.get("built") else "cached (built by an earlier run; nothing trained here)")
        parts.append(_table(["base", ""], [["key", pre.get("key")], ["folder", pre.get("path")], ["how", how],
                                            ["steps", pre.get("steps")], ["corpus tokens", pre.get("corpus_tokens") or "not recorded"],
                                            ["tokens per step", pre.get("tokens_per_step") or "not recorded"],
                                            ["induction phase", _induction_line(pre.get("induction"))]]))
        if pre.get("warning"):
            parts.append(f"<p><b>Warning: {html.escape(str(pre['warning']))}.</b></p>")
    ind = read_metrics(path, "pretrain/induction") if path.is_file() else []
    if rows:
        shift = ind[-1]["step"] if ind else 0  # the corpus phase's steps come after the induction phase's
        series = {"induction rows": ([r["step"] for r in ind], [r["loss"] for r in ind])} if ind else {}
        series["corpus"] = ([r["step"] + shift for r in rows], [r["loss"] for r in rows])
        parts.append(_img(_plot_png(series, title="pretraining loss (CE, token mean)", xlabel="step", ylabel="loss",
                                    logy=True), "pretraining loss"))
    table = []
    probe = read_metrics(path, "pretrain/probe") if path.is_file() else []
    if pre is not None and pre.get("probe"):
        table = [[int(d), r["exact"], r["token_acc"], r["n"]] for d, r in pre["probe"].items()]
    elif probe:
        last = probe[-1]
        dists = sorted(int(k.rsplit("_", 1)[1]) for k in last if k.startswith("copy_exact_"))
        table = [[d, last[f"copy_exact_{d}"], last[f"copy_token_acc_{d}"], ""] for d in dists]
    after = summary.get("sft_copy") or {}
    if table and after:  # the same probe on the SFT model: what SFT kept of the base's reading
        table = [row + [after.get(str(row[0]), {}).get("exact", ""), after.get(str(row[0]), {}).get("token_acc", "")]
                 for row in table]
    if table:
        parts.append("<p>Copy probe: held-out 2–3-token names restated d tokens after their introduction (teacher-forced)"
                     + ("; the last two columns are the SFT model's (under QAT when the run uses it)." if after else ".") + "</p>")
        parts.append(_table(["tokens back", "names exact", "name tokens", "n"] + (["after SFT: exact", "after SFT: tokens"] if after else []),
                            sorted(table)))
    return "\n".join(parts)


def _domains_section(run: Path, summary: dict[str, Any]) -> str:
    """Which domains the run can show RL on (``summary["domains"]``, `k3post.recipes.demo.domains_to_show`)."""
    rows = summary.get("domains")
    if rows is None:
        return ""
    if not rows:
        return "<h2>Domains the run can show</h2><p>No max-effort RL expert in this run: nothing to judge.</p>"
    body = [[r["domain"], r["n"], _rate(r["sft_pass"], r["sft_ci95"]), "yes" if r["inside"] else "no", r["room"],
             "" if r["mixed_groups"] is None else f"{r['mixed_groups']:.2f} (k {r['k']})",
             "" if r.get("mixed_measured") is None else f"{r['mixed_measured']:.2f}",
             "" if r["rl_pass"] is None else f"greedy {r['sft_pass']:.3f} → {r['rl_pass']:.3f} ({r['rl_verdict']})"
             + ("" if not r.get("rl_sampled") else
                f"; avg@{r['rl_sampled']['k']} {r['rl_sampled']['sft']:.3f} → {r['rl_sampled']['rl']:.3f} "
                f"(Δ {r['rl_sampled']['delta']:+.3f}, p {r['rl_sampled']['p_value']:.2g}: {r['rl_sampled']['verdict']})"),
             r["verdict"]] for r in rows]
    return ("<h2>Domains the run can show</h2><p class=muted>From the SFT pass rate at max on RL's held-out tasks: "
            "RL shows where SFT passes 20–70 % (below, few sampled groups hold a success; above, little is left to gain).</p>"
            + _table(["domain", "n", "SFT pass at max [95%]", "inside 0.2–0.7", "room (SFT fails)",
                      "groups with a pass and a fail (expected at the SFT pass)", "measured in RL's training groups",
                      "RL at max (paired verdict)", "verdict"], body))


def _sft_section(run: Path, summary: dict[str, Any]) -> str:
    runs = [tag for tag in ("sft", "sft_noqat") if summary.get(tag)]
    if not runs:
        return ""
    parts = ["<h2>Stage 1: SFT</h2>"]
    series = {}
    for tag in runs:
        rows = read_metrics(run / "metrics.jsonl", tag)
        if rows:
            label = "QAT (MXFP4/MXFP8)" if tag == "sft" else "no QAT"
            series[label] = ([r["step"] for r in rows], [r["loss"] for r in rows])
    if series:
        parts.append(_img(_plot_png(series, title="SFT loss (masked CE, token mean)", xlabel="step", ylabel="loss", logy=True), "SFT loss curve"))
    keys = [
        ("steps", "steps"), ("final loss", "final_loss"), ("wall time (s)", "wall_s"),
        ("tokens/s (packed, incl. padding)", "tokens_per_s"), ("training samples", "n_samples"),
        ("QAT", "qat"), ("resumed from step", "resumed_from"),
    ]
    parts.append(_table([""] + runs, [[label] + [summary[t].get(k, "") for t in runs] for label, k in keys]))
    sel = summary.get("sft_selection")
    if sel:  # sft.select=validation (k3post.recipes.select)
        doms = list(sel["rows"][0]["domains"]) if sel["rows"] else []
        parts.append(f"<p>The SFT model is the kept checkpoint with the highest mean validation pass at {html.escape(sel['effort'])} "
                     f"({sel['n_per_domain']} validation tasks per domain, greedy): <b>{html.escape(sel['chosen'])}</b>; "
                     f"the last one is {html.escape(sel['last'])}"
                     + (" (sft/last)." if sel["chosen"] != sel["last"] else ".") + "</p>")
        parts.append(_table(["checkpoint"] + doms + ["mean", "chosen"],
                            [[r["checkpoint"]] + [_rate(r["domains"][d]["pass"], r["domains"][d]["ci95"]) for d in doms]
                             + [r["mean_pass"], "✓" if r["checkpoint"] == sel["chosen"] else ""] for r in sel["rows"]]))
    return "\n".join(parts)


def _judge_section(run: Path, summary: dict[str, Any]) -> str:
    """The SFT model as the GRM judge on held-out reference pairs (`k3post.rewards.judging.evaluate_judge`), and
    RL's judge gate per domain (`k3post.rewards.judging.gate_judge`, in the experts' table)."""
    j = summary.get("judge")
    gates = (_stage_file(run, summary, "experts") or {}).get("judge_gate") or {}
    if not j:
        return _gate_part(gates)
    taught = (summary.get("synth") or {}).get("judge")
    parts = ["<h2>GRM judge: the SFT model judging held-out pairs</h2>",
             f"<p class=muted>{j['pairs']} held-out pairs whose better answer is known (the reference teacher's "
             "answer against a degraded one), each judged in both orders, one attempt each, "
             f"{html.escape(j.get('sampling', ''))}. Valid: the 4-step protocol completed with consistent totals; "
             "agrees: valid and the reference's total higher (an invalid judgement or a tie does not agree). "
             + (f"SFT data: {taught['records']} scripted judge episodes of {taught['pairs']} pairs." if taught else
                "The SFT data held no judge episodes.") + "</p>"]
    rows = [["all", j["n"], _rate(j["valid"]["rate"], j["valid"]["ci95"]), _rate(j["agreement"]["rate"], j["agreement"]["ci95"]),
             _rate(j["agreement_valid"]["rate"], j["agreement_valid"]["ci95"]) if j["agreement_valid"]["n"] else "–", j["ties"], j["picks_a"]]]
    for fam, r in j.get("by_family", {}).items():
        rows.append([fam, r["n"], _rate(r["valid"]["rate"], r["valid"]["ci95"]), _rate(r["agreement"]["rate"], r["agreement"]["ci95"]),
                     "", "", ""])
    parts.append(_table(["pairs of", "judgements", "valid [95%]", "agrees [95%]", "agrees among valid", "ties", "prefers A"], rows))
    if j.get("invalid_reasons"):
        parts.append("<p>Invalid judgements by reason: " + html.escape(", ".join(f"{k} {v}" for k, v in sorted(j["invalid_reasons"].items()))) + "</p>")
    parts.append(_gate_part(gates))
    return "\n".join(p for p in parts if p)


def _gate_part(gates: dict[str, Any]) -> str:
    """RL's judge gate per domain (``rl.judge_min_agreement``): what it measured and what rewarded the judged families."""
    if not gates:
        return ""
    rows = [[d, ", ".join(g["families"]), g["n"], _rate(g["valid"]["rate"], g["valid"]["ci95"]),
             _rate(g["agreement"]["rate"], g["agreement"]["ci95"]), f"{g['min_agreement']:g}",
             "the judge" if g["passed"] else "their own verifier (rl.judge_fallback: format_gate)"]
            for d, g in sorted(gates.items())]
    return ("<h3>RL's judge gate</h3><p class=muted>Before a domain's experts train, the judge judges held-out reference "
            "pairs as RL samples it; below rl.judge_min_agreement the judged families are rewarded by their own verifier "
            "(an explicit opt-in, rl.judge_fallback: format_gate) or the domain fails (the default).</p>"
            + _table(["domain", "pairs of", "judgements", "valid [95%]", "agrees [95%]", "threshold", "judged families rewarded by"], rows))


def _gap_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """The train–rollout log-prob gap of RL / MOPD runs (`k3post.loop.rollout_gap`)."""
    rows = [(name, g) for name, g in rows if g and g.get("tokens")]
    if not rows:
        return ""

    def stale(g: dict[str, float]) -> list[Any]:
        n = int(g.get("stale_kv_tokens", 0))
        return [n, f"{g['stale_kv_mean']:.2e}" if n else "–", f"{g['stale_kv_max']:.2e}" if n else "–"]

    return ("<p>Train–rollout log-prob gap with QAT: |log π (trainer's forward) − log π (the rollout engine's, "
            "recorded when it sampled)| over the tokens each step trained with the weights that sampled them, "
            "over KV cache of those weights (SPEC §5: kernel noise only; a QAT path missing on either side gives a "
            "mean above 5e-3), and apart over the tokens they sampled over KV kept from older weights (a paused "
            "trajectory resumed on its kept KV, <code>rl.rollout.resume_kv=reuse</code>: the policy's own change, not the "
            "engine's). Routed differently: the share of context positions the trainer's own top-k sends to other "
            "experts than the engine did in some MoE layer (recorded with <code>rl.rollout.routing_replay</code> measure or "
            "rollout-routes; the latter trains on the engine's routes). With <code>rl.rollout.exact</code> the engine and "
            "the trainer's log-prob values run one batch-invariant forward: the mean and max are exactly 0 (a step "
            "with any gap there stops the run).</p>"
            + _table(["run", "mean |Δ log p|", "max |Δ log p|", "tokens", "tokens over older KV", "their mean",
                      "their max", "routed differently"],
                     [[name, f"{g['mean']:.2e}", f"{g['max']:.2e}", int(g["tokens"]), *stale(g),
                       f"{g['routing_mismatch_frac']:.4f} of {int(g['routing_positions'])}"
                       if g.get("routing_positions") else "–"] for name, g in rows]))


def _rate(p: float, ci: Sequence[float] | None) -> str:
    """A pass rate with its 95% Wilson interval."""
    return f"{p:.3f}" if not ci else f"{p:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


_YES_NO = {True: "yes", False: "no"}


def _ratio(r: float, ci: Sequence[float] | None) -> str:
    return f"{r:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _change(c: dict[str, Any]) -> str:
    """A paired comparison (`k3post.stats.paired_change`): the change, its interval, McNemar's p, the verdict."""
    return (f"{c['before']:.3f} → {c['after']:.3f}, Δ {c['delta']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}], "
            f"McNemar p = {c['p_value']:.3g}: <b>{html.escape(c['verdict'])}</b>")


def _eval_section(summary: dict[str, Any]) -> str:
    ev = summary.get("eval")
    if not ev:
        return ""
    fam = next((r.get("family") for by in ev.values() for r in by.values() if r.get("family")), None)
    n = next((r["n"] for by in ev.values() for r in by.values()), 0)
    parts = [f"<h2>Held-out pass rate{f' ({html.escape(fam)}, {n} tasks, greedy)' if fam else ''}</h2>"]
    header = ["model", "effort", "pass rate [95% interval]", "mean think tokens", "mean output tokens", "malformed", "n"]
    rows = []
    for model_name, by_effort in ev.items():
        for effort, r in by_effort.items():
            rows.append([model_name, effort, _rate(r["pass_rate"], r.get("pass_ci95")), r["mean_think_tokens"],
                         r["mean_output_tokens"], r["malformed"], r["n"]])
    parts.append(_table(header, rows))
    cmp = summary.get("qat_vs_noqat")
    if cmp:
        parts.append(f"<p>SFT with QAT vs without, max effort, the same {cmp['n']} tasks: {_change(cmp)}.</p>")
    for model_name, by_effort in ev.items():
        for effort, r in by_effort.items():
            for ex in r.get("examples", [])[:1]:
                parts.append(f"<p class=muted>{html.escape(model_name)} @ {html.escape(str(effort))}, {html.escape(ex['task'])}, reward {ex['reward']}</p><pre>{html.escape(ex['completion'])}</pre>")
    return "\n".join(parts)


def _synth_section(run: Path, summary: dict[str, Any]) -> str:
    synth = summary.get("synth")
    if not synth:
        return ""
    f = synth["funnel"]
    parts = ["<h2>Stage 1 data: Synthesis funnel</h2>",
             "<p class=muted>Reference teachers over every built-in family and effort; each sample passes "
             "structure → outcome → quality → judge. Uncertain samples wait in the review queue "
             "(<code>k3post review list</code>) and are not trained on until accepted.</p>"]
    parts.append(_funnel_table(f))
    parts.append(_table(["family", "training samples"], sorted(synth["samples_by_family"].items())))
    return "\n".join(parts)


def _funnel_table(f: dict[str, Any]) -> str:
    """A `k3post.synth.verify.Funnel.to_dict` as a table: per stage in / kept / rejected / uncertain / reasons."""
    rows = []
    for st in f["stages"]:
        reasons = "; ".join(f"{k}: {v}" for k, v in {**st["reject_reasons"], **st["uncertain_reasons"]}.items())
        rows.append([st["name"], st["seen"], st["kept"], st["rejected"], st["uncertain"], reasons])
    rows.append(["final", f["total"], f["kept"], f["rejected"], f["uncertain"], ""])
    return _table(["stage", "in", "kept", "rejected", "uncertain", "reasons"], rows)


def _kg_section(run: Path, summary: dict[str, Any]) -> str:
    """KG-guided task synthesis (``k3post synth-tasks`` wrote ``kg_funnel.json`` into the run folder)."""
    path = run / "kg_funnel.json"
    if not path.is_file():
        return ""
    kg = json.loads(path.read_text())
    d = kg["dag"]
    return "\n".join([
        "<h2>KG-guided task synthesis</h2>",
        f"<p>Concept DAG: {d['nodes']} nodes ({d['atomic']} atomic, {d['seeds']} seeds), {d['edges']} edges, depth "
        f"{d['max_depth']}; of {d['proposed']} proposed sub-concepts {d['merged']} merged into existing nodes, "
        f"{d['ungrounded']} not grounded in the corpus, {d['not_finer']} not finer than their parent.</p>",
        _funnel_table(kg["funnel"]),
        _table(["task type", "kept"], sorted(kg["kept_by_type"].items())),
    ])


_STAGE_FILES = {"experts": "experts/table.json", "mopd": "mopd/summary.json", "draft": "draft/summary.json"}


def _stage_file(run: Path, summary: dict[str, Any], stage: str) -> Any:
    """A stage's own result file (the experts' table.json, MOPD's summary.json), else its copy in summary.json."""
    path = run / _STAGE_FILES[stage]
    return json.loads(path.read_text()) if path.is_file() else summary.get(stage)


def _rl_section(run: Path, summary: dict[str, Any]) -> str:
    """Stage 2: the 3×3 expert table, targets, reward curves and T(y) histograms per effort."""
    table = _stage_file(run, summary, "experts")
    if not table or not (table.get("experts") or table.get("failed")):
        return ""
    ex, failed = table.get("experts", {}), table.get("failed", {})
    domains = list(dict.fromkeys(e["domain"] for e in [*ex.values(), *failed.values()]))
    efforts = list(dict.fromkeys(e["effort"] for e in [*ex.values(), *failed.values()]))
    parts = ["<h2>Stage 2: RL experts (domain × effort)</h2>",
             "<p class=muted>Each domain trains max → high → low, each from the previous expert (SPEC §3.3), with the "
             "K2.5 loss under partial rollout; b0 per task from the SFT model. Held-out pass rate and mean T(y) "
             "(thinking tokens for general, all output tokens for agents / coding), greedy, SFT → expert.</p>"]
    rows = []
    for d in domains:
        for e in efforts:
            r = ex.get(f"{d}.{e}")
            f = failed.get(f"{d}.{e}")
            if f is not None:
                where = f" in step {f['step']}" if f.get("step") is not None else ""
                tb = f"; traceback in {f['log']}" if f.get("log") else ""
                rows.append([d, e, f"FAILED{where}: {f['error']}{tb}", "", "", "", "", "", "", ""])
            if r is None:
                continue
            ch = r.get("change")
            rows.append([d, e, f"{_rate(r['sft_pass_rate'], r.get('sft_pass_ci95'))} → {_rate(r['pass_rate'], r.get('pass_ci95'))}",
                         f"{ch['delta']:+.3f} [{ch['ci95'][0]:+.3f}, {ch['ci95'][1]:+.3f}], p = {ch['p_value']:.3g}: {ch['verdict']}"
                         if ch else "", r.get("n", ""),
                         f"{r['sft_mean_effort_tokens']:.1f} → {r['mean_effort_tokens']:.1f}",
                         r["final_violation_rate"], r["steps"], _infra(r.get("infra")), r["seconds"]])
    parts.append(_table(["domain", "effort", "pass rate [95%] (SFT → RL)", "paired change (McNemar)", "n",
                         "mean T(y) (SFT → RL)", "budget violations (last steps)", "steps",
                         "infra failures (train / eval)", "seconds"], rows))
    checks = []
    for d in domains:
        if not any(f"{d}.{e}" in ex for e in efforts):
            continue
        m, lo = ex.get(f"{d}.max"), ex.get(f"{d}.low")
        raised = [e for e in efforts if f"{d}.{e}" in ex and ex[f"{d}.{e}"].get("change", {}).get("verdict") == "higher"]
        ratio = lo["mean_effort_tokens"] / m["mean_effort_tokens"] if m and lo and m["mean_effort_tokens"] > 0 else float("nan")
        viol = max(ex[f"{d}.{e}"]["final_violation_rate"] for e in efforts if f"{d}.{e}" in ex)
        checks.append([d, f"{len(raised)}/{len(efforts)} ({', '.join(raised) or 'none'})", ratio,
                       "yes" if ratio <= 0.4 else "no", viol, "yes" if viol <= 0.03 else "no"])
    parts.append("<p>Targets: RL raises held-out pass rate over SFT (counted only where the paired McNemar test on the "
                 "same tasks gives p &lt; 0.05); <code>low</code> uses ≤ 40% of <code>max</code>'s "
                 "tokens; budget violations ≤ 3% at the end of each effort's training.</p>")
    parts.append(_table(["domain", "efforts where RL > SFT (p < 0.05)", "T(low) / T(max)", "≤ 0.4", "max violation rate", "≤ 3%"], checks))
    budgets = {d: b for d, b in (table.get("budgets") or {}).items() if isinstance(b, dict) and b.get("efforts")}
    if budgets:
        parts.append("<p>Budgets (SPEC §3.3): b0 per task from the SFT model at max effort; the limit of effort e is "
                     "τ_e · b0, never below T of the task's own reference solution at e when "
                     "<code>rl.effort_control.reference_floor</code> is on (ours: a limit under the reference leaves "
                     "no correct answer inside the budget; docs/decisions.md issue 31 §floor). Median limit per "
                     "effort, and the tasks whose limit the floor raised.</p>")
        parts.append(_table(["domain", "tasks", "median b0", *[f"{e}: median limit (raised by the floor)" for e in efforts]],
                            [[d, b["tasks"], b["median_b0"],
                              *[f"{b['efforts'][e]['median_limit']:.0f} ({b['efforts'][e]['raised_by_floor']}/{b['tasks']})"
                                if e in b["efforts"] else "" for e in efforts]] for d, b in budgets.items()]))
    below = below_start_notes(ex)
    if below:
        parts.append("<p><b>Experts significantly below their SFT start</b> (paired McNemar p &lt; 0.05):</p><ul>"
                     + "".join(f"<li>{html.escape(n)}</li>" for n in below) + "</ul>")
    parts.append(_gap_table([(name, e.get("rollout_gap", {})) for name, e in ex.items()]))
    for d in domains:
        series = {e: (list(range(1, len(ex[f"{d}.{e}"]["reward_curve"]) + 1)), ex[f"{d}.{e}"]["reward_curve"])
                  for e in efforts if f"{d}.{e}" in ex}
        if not series:
            continue
        parts.append(_img(_plot_png(series, title=f"{d}: mean reward per RL step (before the effort override)",
                                    xlabel="step", ylabel="reward"), f"{d} reward curves"))
        t_series = {e: (list(range(1, len(ex[f"{d}.{e}"].get("effort_tokens_curve", [])) + 1)), ex[f"{d}.{e}"]["effort_tokens_curve"])
                    for e in efforts if ex.get(f"{d}.{e}", {}).get("effort_tokens_curve")}
        if t_series:
            parts.append(_img(_plot_png(t_series, title=f"{d}: mean T(y) of the sampled episodes per RL step",
                                        xlabel="step", ylabel="T(y) tokens"), f"{d} T(y) curves"))
        hist = {e: ex[f"{d}.{e}"]["eval"]["overall"].get("effort_tokens", []) for e in efforts if f"{d}.{e}" in ex}
        if any(hist.values()):
            parts.append(_img(_hist_png(hist, title=f"{d}: T(y) of held-out episodes per effort expert", xlabel="T(y) tokens"),
                              f"{d} T(y) histograms"))
    return "\n".join(parts)


def below_start_notes(experts: dict[str, dict[str, Any]]) -> list[str]:
    """One sentence per expert whose held-out pass is significantly below the SFT model's at its effort (paired
    verdict "lower"), saying what the expert's table shows about why: where it trained from (the effort curriculum
    starts high from max's expert and low from high's, not from the SFT model) and whether its T(y) fell (consistent
    with the effort budget trading accuracy for tokens) or not (then the loss is not the budget's)."""
    notes = []
    for name, e in experts.items():
        ch = e.get("change") or {}
        if ch.get("verdict") != "lower":
            continue
        text = f"{name}: {e['sft_pass_rate']:.3f} → {e['pass_rate']:.3f} (n {e.get('n', '?')}, p {ch['p_value']:.2g})."
        start = e.get("init_from", "sft")
        if start != "sft":
            parent = experts.get(start)
            text += (f" It trained from {start}'s expert (the effort curriculum), not from the SFT model"
                     + (f"; {start} itself passes {parent['pass_rate']:.3f} at {parent['effort']} against the SFT model's "
                        f"{parent['sft_pass_rate']:.3f}" if parent else "") + ".")
        t0, t1 = e["sft_mean_effort_tokens"], e["mean_effort_tokens"]
        if t1 < t0:
            text += (f" Its mean T(y) fell {t0:.1f} → {t1:.1f} tokens under the {e['effort']} budget (scale "
                     f"{e.get('scale', '?')} of b0), consistent with the effort budget trading accuracy for tokens.")
        else:
            text += f" Its mean T(y) did not fall ({t0:.1f} → {t1:.1f}): the loss is not the effort budget's."
        notes.append(text)
    return notes


def _rl_run_section(run: Path, summary: dict[str, Any]) -> str:
    """`k3post rl`: each expert it trained in this folder (summary.json ``rl``), its held-out pass rate and the
    reward and T(y) curves of its steps from metrics.jsonl."""
    runs = summary.get("rl") or {}
    if not runs:
        return ""
    parts = ["<h2>Stage 2: RL (k3post rl)</h2>"]
    rows = []
    for name, r in runs.items():
        ev = r.get("eval") or {}
        rate = _rate(ev["pass_rate"], ev.get("pass_ci95")) if "pass_rate" in ev else "not evaluated"
        rows.append([name, r["steps"], r.get("resumed_from") or "", rate, ev.get("n", ""),
                     ev.get("mean_effort_tokens", ""), r["seconds"]])
    parts.append(_table(["expert", "steps", "resumed from step", "held-out pass rate [95%]", "n", "mean T(y)", "seconds"], rows))
    path = run / "metrics.jsonl"
    for key, title, ylabel in (("reward", "mean reward per RL step (before the effort override)", "reward"),
                               ("effort_tokens", "mean T(y) of the sampled episodes per RL step", "T(y) tokens")):
        series = {}
        for name, r in runs.items():
            pts = [(m["step"], m[key]) for m in (read_metrics(path, r["stage"]) if path.is_file() else []) if key in m]
            if pts:
                series[name] = ([x for x, _ in pts], [y for _, y in pts])
        if series:
            parts.append(_img(_plot_png(series, title=title, xlabel="step", ylabel=ylabel), f"RL {key} curves"))
    return "\n".join(parts)


def _infra(counts: dict[str, Any] | None) -> str:
    """"train / eval" episodes whose infrastructure failed (masked out, never a reward); "" for older runs."""
    return "" if not counts else f"{int(counts.get('train', 0))} / {int(counts.get('eval', 0))}"


def _mopd_section(run: Path, summary: dict[str, Any]) -> str:
    """Stage 3: student vs teacher per (domain, effort), the targets, the per-token OPD reward curve."""
    m = _stage_file(run, summary, "mopd")
    if not m:
        return ""
    t = m["table"]
    parts = ["<h2>Stage 3: MOPD (nine experts → one student)</h2>",
             "<p class=muted>The student (from the SFT checkpoint, prompted with the effort message) is trained on "
             "r_t = clip(log π_teacher − log π_student, ±R_max) of its own tokens, teacher = expert (domain, effort) "
             "scoring the conversation without the effort message (SPEC §4). Held-out, greedy.</p>"]
    if m.get("left_out_domains"):
        parts.append(f"<p><b>Left out</b> (an expert of theirs failed): {html.escape(', '.join(m['left_out_domains']))}</p>")
    rows = [[r["domain"], r["effort"], r.get("n", ""), _rate(r["student_pass"], r.get("student_ci95")),
             _rate(r["teacher_pass"], r.get("teacher_ci95")), _ratio(r["pass_ratio"], r.get("pass_ratio_ci95")),
             _YES_NO.get(r["pass_ok"], "n/a (endpoint teacher: not sampled)" if r.get("teacher_endpoint")
                         else f"n/a (teacher < {t.get('teacher_pass_min', 0.2):g})"),
             (f"{r['student_vs_teacher']['delta']:+.3f}, p = {r['student_vs_teacher']['p_value']:.3g}: "
              f"{r['student_vs_teacher']['verdict']}") if r.get("student_vs_teacher") else "",
             r["student_tokens"], r["teacher_tokens"], r["token_ratio"], _YES_NO.get(r["tokens_ok"], "n/a")] for r in t["rows"]]
    parts.append(_table(["domain", "effort", "n", "student pass [95%]", "teacher pass [95%]", "ratio [95%]", "≥ 0.95",
                         "student − teacher (paired)", "student T(y)", "teacher T(y)", "ratio", "±20%"], rows))
    parts.append(_table(["domain", "student mean T(y) by effort", "low < high < max"],
                        [[d, ", ".join(f"{e} {v:.1f}" for e, v in o["tokens"].items()), "yes" if o["ok"] else "no"]
                         for d, o in t["order"].items()]))
    parts.append(_gap_table([("MOPD student", m.get("rollout_gap", {}))]))
    curve = m.get("opd_reward_curve") or []
    if curve:
        xs = list(range(1, len(curve) + 1))
        parts.append(_img(_plot_png({"mean per-token OPD reward": (xs, curve),
                                     "reverse KL (student − teacher log-prob)": (xs, m.get("reverse_kl_curve") or [])},
                                    title="MOPD per-token signal", xlabel="step", ylabel="nats / token"), "MOPD reward curve"))
    infra = f"; {int(m['infra_train'])} episodes masked out for infrastructure failures" if m.get("infra_train") else ""
    parts.append(f"<p class=muted>{m['steps']} steps in {m['seconds']:.0f} s{infra}; teacher pool {html.escape(json.dumps(m.get('teacher_stats', {})))}</p>")
    return "\n".join(parts)


def _grid_section(run: Path, summary: dict[str, Any]) -> str:
    """The nine experts at a glance: SFT → RL expert → MOPD student per (domain, effort), the per-domain targets
    (`k3post.recipes.experts.expert_grid`) and, in words, which domains this run can and cannot show at its scale."""
    from k3post.recipes.experts import expert_grid

    table = _stage_file(run, summary, "experts")
    if not table or not table.get("experts"):
        return ""
    mopd = _stage_file(run, summary, "mopd")
    student = {(r["domain"], r["effort"]): r for r in (mopd or {}).get("table", {}).get("rows", [])}
    grid = expert_grid(table)
    efforts = ["max", "high", "low"]
    rows = []
    for d, entry in grid["domains"].items():
        row: list[Any] = [d]
        for e in efforts:
            c = entry["cells"].get(e)
            if c is None:
                row.append("(not trained)")
                continue
            m = student.get((d, e))
            mopd_txt = f" → {m['student_pass']:.2f} (teacher {m['teacher_pass']:.2f} on the same {m['n']})" if m else ""
            mopd_t = f" → {m['student_tokens']:.0f}" if m else ""
            smp = c.get("sampled")
            smp_txt = (f"; avg@{smp['k']} at T {smp['temperature']:g}: {smp['sft']:.3f} → {smp['rl']:.3f} "
                       f"(Δ {smp['change']['delta']:+.3f} [{smp['change']['ci95'][0]:+.3f}, {smp['change']['ci95'][1]:+.3f}], "
                       f"p {smp['change']['p_value']:.2g})") if smp else ""
            row.append(f"{c['sft_pass_rate']:.2f} → {c['pass_rate']:.2f}{mopd_txt} (n {c['n']}, greedy){smp_txt}; "
                       f"T {c['sft_mean_effort_tokens']:.0f} → {c['mean_effort_tokens']:.0f}{mopd_t}")
        rows.append(row)
    names = {"sft_pass_at_max": "SFT pass at max ≥ 0.25 (n ≥ 100)", "rl_beats_sft_at_max": "RL > SFT at max (greedy, paired p < 0.05)",
             "rl_beats_sft_at_max_sampled": "RL > SFT at max (avg@k sampled, paired p < 0.05)",
             "effort_order": "T(low) < T(high) < T(max)", "low_vs_max_tokens": "T(low) ≤ 0.4·T(max)",
             "violations": "budget violations ≤ 3%"}
    mark = {True: "met", False: "MISSED", None: "n/a"}
    checks = [[d] + [mark[entry["checks"].get(k)] for k in names] for d, entry in grid["domains"].items()]
    can, cannot = [], []
    for d, entry in grid["domains"].items():
        mx = entry["cells"].get("max")
        if mx is None:
            continue
        if entry["checks"]["sft_pass_at_max"]:
            can.append(d)
        else:
            cannot.append(f"{d} (SFT passes {mx['sft_pass_rate']:.2f} of {mx['n']} held-out tasks at max: too few "
                          "successes for RL to learn from or for a paired test to detect a gain)")
    scale = [f"<p><b>What this run can show at its scale.</b> Domains whose SFT model passes enough held-out tasks "
             f"at max for RL and MOPD to be measured: {html.escape(', '.join(can) or 'none')}.</p>"]
    if cannot:
        scale.append("<p>Cannot show: " + html.escape("; ".join(cannot)) + ". What each domain reaches with more data "
                     "(<code>configs/full.yaml</code>) and why agents stay at 0 on a CPU: docs/decisions.md, "
                     "\"The full recipe\".</p>")
    return "\n".join(["<h2>The nine experts: SFT → RL → MOPD</h2>",
                      "<p class=muted>Each cell: held-out pass rate SFT → RL expert → MOPD student, and mean T(y) the same "
                      "way (greedy). The student runs on MOPD's own held-out tasks (verifiable families only, its eval_n), "
                      "so its number is compared with its teacher's on those same tasks, in brackets.</p>",
                      _table(["domain", *efforts], rows), _table(["domain", *names.values()], checks), *scale])


def _draft_section(run: Path, summary: dict[str, Any]) -> str:
    """Deployment: the EAGLE-3 drafts, LK vs KL: held-out acceptance by depth at T = 1 and T = 0, the expected
    acceptance length, and the loss curves."""
    d = _stage_file(run, summary, "draft")
    if not d or not d.get("losses"):
        return ""
    losses = d["losses"]
    depth = len(next(iter(losses.values()))["acceptance_by_depth"]["t1"])
    parts = ["<h2>Deployment: EAGLE-3 drafts (LK vs KL)</h2>",
             f"<p class=muted>Drafts for {html.escape(str(d['target']))} (a path inside the run folder, or as given), fused "
             f"target layers {d['aux_layers']} (k3post ids), {('from the MTP head in ' + html.escape(str(d['mtp_init']))) if d.get('mtp_init') else 'started from its last layer (no MTP head)'}; "
             f"trained {d['steps']} steps on {d['train_episodes']} of the target's own episodes with a {d['ttt_steps']}-step "
             f"training-time test; acceptance measured teacher-forced on {d['held_out_episodes']} held-out episodes: "
             "T = 1 is Σ min(p, q), T = 0 is argmax agreement. Expected acceptance length = tokens per target forward "
             "when drafting k tokens, 1 + α₀ + α₀α₁ + … (from these α, not a decoding run; "
             "<code>bench/draft.py</code> measures it in the engine).</p>"]
    rows = []
    for loss, r in losses.items():
        for t in ("t1", "t0"):
            acc = r["acceptance_by_depth"][t]
            before = r["acceptance_by_depth_before"][t]
            rows.append([loss, t.replace("t", "T = "), *[f"{b:.3f} → {a:.3f}" for b, a in zip(before, acc)],
                         *[f"{r['expected_accept_length'][t][str(k)]:.3f}" for k in (3, 5) if k <= depth]])
    parts.append(_table(["loss", "temperature", *[f"depth {i} α (before → after)" for i in range(depth)],
                         *[f"accept length k={k}" for k in (3, 5) if k <= depth]], rows))
    series = {}
    for loss in losses:
        hist = read_metrics(run / "metrics.jsonl", f"draft_{loss}") if (run / "metrics.jsonl").exists() else []
        if hist:
            series[f"{loss} loss"] = ([r["step"] for r in hist], [r["loss"] for r in hist])
    if series:
        parts.append(_img(_plot_png(series, title="draft training loss", xlabel="step", ylabel="weighted loss"),
                          "draft loss curves"))
    return "\n".join(parts)


SECTIONS = [_pretrain_section, _synth_section, _kg_section, _sft_section, _judge_section, _grid_section, _rl_section,
            _rl_run_section, _domains_section, _mopd_section, _draft_section]


def _threads_table(run: Path) -> str:
    """The thread plans the run's commands ran under (`k3post.threads`, ``threads.json``): the numbers depend on
    the thread count."""
    path = run / "threads.json"
    if not path.is_file():
        return ""
    try:
        plans = json.loads(path.read_text())
    except ValueError:
        return "<p class=muted>threads.json is unreadable</p>"
    rows = [[p["name"], ", ".join(f"{n} {k}" for k, n in p["workers"].items()), p["torch_threads"],
             p["requested"] or "0 (auto)", f"{p['cores']['usable']} of {p['cores']['cpu_count']}", p["reason"]]
            for p in plans]
    return "<h2>Threads</h2>" + _table(["command / phase", "processes", "torch threads each", "run.threads",
                                        "usable cores", "why"], rows)


def write_report(run_dir: str | Path) -> Path:
    """Render ``report.html`` for a run folder and return its path."""
    run = Path(run_dir)
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    cfg_text = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else ""
    head = [
        f"<h1>k3post run: {html.escape(run.name)}</h1>",
        f"<p class=muted>status: {html.escape(summary.get('status', 'unknown'))}; "
        f"total wall time {summary.get('wall_s', 0):.0f} s; model {html.escape(str(summary.get('model', '?')))}</p>",
    ]
    if summary.get("error"):
        head.append(f"<p>error: {html.escape(str(summary['error']))}</p>")
    from k3post.errors import UserError
    from k3post.status import status_text

    try:  # what `k3post status` prints: steps, ETA, last metrics, checkpoints
        head.append(f"<pre>{html.escape(status_text(run))}</pre>")
    except UserError:  # a folder of synth-tasks' files only: no run to describe
        pass
    if summary.get("timings"):
        head.append(_table(["phase", "seconds"], [[k, v] for k, v in summary["timings"].items()]))
    head.append(_threads_table(run))
    body = [_eval_section(summary)] + [s(run, summary) for s in SECTIONS]
    cfg_html = f"<h2>Config</h2><pre>{html.escape(cfg_text)}</pre>" if cfg_text else ""
    page = f"<!doctype html><html><head><meta charset=utf-8><title>k3post {html.escape(run.name)}</title><style>{CSS}</style></head><body>{''.join(head)}{''.join(body)}{cfg_html}</body></html>"
    return atomic_write(run / "report.html", page)
