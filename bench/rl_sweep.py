"""One point of an RL sweep: one of the demo's max experts (general.max unless ``--domain`` names another)
trained from an existing SFT checkpoint with some ``rl.*`` settings changed, measured the way the demo reports
it, plus what says whether the policy moved.

    python bench/rl_sweep.py RUN POINT [--domain general|agents|coding] [key=value ...]

RUN: a demo run folder holding ``sft/final`` (e.g. one run with ``rl.steps=0``); the config is the demo's,
``configs/demo.yaml``, with the overrides on top (``rl.optim.lr=3e-4 rl.rollout.temperature=1.2 ...``). The expert is trained
exactly as `k3post demo` trains it (`train_domain_experts`, one torch thread, the demo's QAT), into
``RUN/sweep/POINT/``. b0 and the SFT "before" row are computed once per run (``RUN/sweep/_before``) and reused
by every point (they depend on neither the optimiser nor the sampling settings; ``RUN/sweep/_before.DOMAIN``
for a domain other than general). Points that change what b0 or the "before" row measure (``n_tasks``,
``eval_n``, ``eval_samples``, ``difficulty``, ``families``) must use a run folder of their own, or a POINT named
``_fresh*`` (which computes them itself and does not share them).

Writes ``RUN/sweep/POINT/point.json`` and prints it as the final JSON line, after one readable line: held-out
pass at max before → after (n, the paired McNemar p; with ``eval_samples`` the avg@k row is in the JSON), the training pass rate over the first and the second
half of the steps, the policy entropy over the first and the last quarter, the share of zero-variance groups,
and the parameter change mean |θ_RL − θ_SFT| / mean |θ_SFT| (the whole model; the MX expert values too).

Shape legend: none.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.fmean(xs) if xs else float("nan")


def param_change(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, float]:
    """mean |θ_b − θ_a| and mean |θ_a| over every parameter both models have, and their ratio; the same
    ratio over the QAT expert weights alone, and the share of their entries whose MX-quantized value (what
    the forward uses) changed (only when QAT is applied to both models)."""
    from k3post.quant.qat import quantized_expert_weights

    pb = dict(b.named_parameters())
    qa, qb = quantized_expert_weights(a), quantized_expert_weights(b)
    diff = total = ediff = etotal = 0.0
    n = changed = nq = 0
    for name, p in a.named_parameters():
        d = float((pb[name].detach() - p.detach()).abs().sum())
        t = float(p.detach().abs().sum())
        diff, total, n = diff + d, total + t, n + p.numel()
        if name in qa:
            ediff, etotal = ediff + d, etotal + t
            changed += int((qa[name] != qb[name]).sum())
            nq += p.numel()
    return {"mean_abs_delta": diff / n, "mean_abs": total / n, "relative": diff / total,
            "experts_relative": ediff / etotal if etotal else float("nan"),
            "quantized_changed_share": changed / nq if nq else float("nan")}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    run, point, overrides = Path(argv[0]), argv[1], argv[2:]
    domain = "general"
    if "--domain" in overrides:
        i = overrides.index("--domain")
        if i + 1 == len(overrides):
            print("--domain needs a value: general, agents or coding", file=sys.stderr)
            return 2
        domain = overrides[i + 1]
        overrides = overrides[:i] + overrides[i + 2:]
    from k3post.config import load_config
    from k3post.recipes.experts import load_policy, train_domain_experts
    from k3post.metrics import iter_metrics

    torch.set_num_threads(1)
    cfg = load_config(Path(__file__).parents[1] / "configs" / "demo.yaml", ["rl.progress=false", *overrides])
    sft = run / "sft" / "final"
    before_dir = run / "sweep" / ("_before" if domain == "general" else f"_before.{domain}")
    share = not point.startswith("_fresh")
    out = run / "sweep" / point
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rcfg = cfg.rl
    t0 = time.perf_counter()
    table_name, budgets_name = f"table.{domain}.json", f"budgets.{domain}.json"
    if share and (before_dir / table_name).is_file():  # b0 and the "before" row: computed once
        shutil.copy(before_dir / budgets_name, out)
        table = json.loads((before_dir / table_name).read_text())
        (out / table_name).write_text(json.dumps({"before": table["before"], "budgets": table["budgets"]}))
    table = train_domain_experts(domain, sft, rcfg, out, qat=cfg.qat, until="max")
    if share and not (before_dir / table_name).is_file():
        before_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / budgets_name, before_dir)
        (before_dir / table_name).write_text(json.dumps({"before": table["before"], "budgets": table["budgets"]}))
    if table["failed"]:
        print(json.dumps(table["failed"], indent=1, default=str))
        return 1
    name = f"{domain}.max"
    e = table["experts"][name]
    rows = [r for r in iter_metrics(out / f"{name}.run" / "metrics.jsonl", f"rl/{name}")]
    steps = len(rows)
    half, q = steps // 2, max(1, steps // 4)
    col = lambda key: [float(r.get(key, float("nan"))) for r in rows]  # noqa: E731
    zero, groups = sum(col("zero_variance_groups")), sum(col("groups"))
    ent = col("train/entropy")
    moved = param_change(load_policy(sft, cfg.qat), load_policy(out / name, cfg.qat))
    ch = e["change"]
    res = {
        "point": point, "domain": domain, "overrides": overrides, "seed": rcfg.seed, "steps": steps,
        "n": e["n"], "sft_pass": e["sft_pass_rate"], "rl_pass": e["pass_rate"], "delta": ch["delta"],
        "ci95": ch["ci95"], "b": ch["b"], "c": ch["c"], "p": ch["p_value"], "verdict": ch["verdict"],
        "train_pass_first_half": _mean(col("pass_rate")[:half]), "train_pass_second_half": _mean(col("pass_rate")[half:]),
        "entropy_first_quarter": _mean(ent[:q]), "entropy_last_quarter": _mean(ent[-q:]),
        "zero_variance_share": zero / groups if groups else float("nan"), "groups": groups,
        "mean_abs_log_ratio": _mean(col("train/mean_abs_log_ratio")), "grad_norm": _mean(col("train/grad_norm")),
        "masked_frac": _mean(col("train/masked_frac")), "effort_tokens_first": _mean(col("effort_tokens")[:half]),
        "effort_tokens_second": _mean(col("effort_tokens")[half:]),
        "violation_rate": _mean(col("budget_violation_rate")), "param_change": moved,
        "sft_tokens": e["sft_mean_effort_tokens"], "rl_tokens": e["mean_effort_tokens"],
        "seconds": round(time.perf_counter() - t0, 1), "expert_seconds": round(e["seconds"], 1),
    }
    if e.get("sampled"):
        res["sampled"] = e["sampled"]
    (out / "point.json").write_text(json.dumps(res, indent=1))
    shutil.rmtree(out / f"{name}.run" / "checkpoints", ignore_errors=True)
    print(f"{point:>14} seed {rcfg.seed}: max {res['sft_pass']:.3f} → {res['rl_pass']:.3f} (n {res['n']}, b {ch['b']} c {ch['c']}, "
          f"p {ch['p_value']:.3g}) train pass {res['train_pass_first_half']:.3f} → {res['train_pass_second_half']:.3f} "
          f"entropy {res['entropy_first_quarter']:.3f} → {res['entropy_last_quarter']:.3f} zero-var {res['zero_variance_share']:.2f} "
          f"|Δθ|/|θ| {moved['relative']:.2e} (experts {moved['experts_relative']:.2e}, MX values changed "
          f"{moved['quantized_changed_share']:.3f}) {res['seconds']:.0f} s", flush=True)
    print(json.dumps(res), flush=True)  # the final JSON line every bench prints
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
