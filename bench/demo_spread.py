"""The spread of the demo's headline numbers over several runs (seeds, CPU kernels): what the README states.

    for s in 0 1 2; do k3post demo run.name=seed$s run.seed=$s rl.seed=$s mopd.rl.seed=$s; done
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 k3post demo run.name=seed0_avx2 ...
    python bench/demo_spread.py runs/seed*

Per headline number: each run's value with n and its 95% Wilson interval, and over the runs the min, the
median and the max of the values plus the lowest Wilson lower bound and the highest upper bound (the range
a user's run should land in). Paired changes (QAT vs no QAT, SFT → RL expert, teacher → student) give each
run's verdict (exact McNemar on the same held-out tasks) and how many runs reached each verdict.
The final line is JSON (``--json`` writes it to a file as well).

Caveats: a handful of runs is a handful of draws; the min–max over 3 seeds is not a confidence interval
of the spread itself. Runs that did not finish (``status`` != done) are listed and left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3post.stats import wilson_interval  # noqa: E402

# (key, label, path to a {"pass_rate", "n"}-like record in summary.json); rates carry n and an interval
_RATES: list[tuple[str, str, Callable[[dict], tuple[float, int] | None]]] = []
# (key, label, path to a paired_change record)
_PAIRED: list[tuple[str, str, Callable[[dict], dict | None]]] = []
# (key, label, path to a plain number)
_VALUES: list[tuple[str, str, Callable[[dict], float | None]]] = []


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _eval_rate(stage: str, effort: str) -> Callable[[dict], tuple[float, int] | None]:
    def f(s: dict) -> tuple[float, int] | None:
        r = _get(s, "eval", stage, effort)
        return None if r is None else (float(r["pass_rate"]), int(r["n"]))
    return f


def _expert_rate(expert: str, key: str) -> Callable[[dict], tuple[float, int] | None]:
    def f(s: dict) -> tuple[float, int] | None:
        e = _get(s, "experts", expert)
        if e is None or key not in e:
            return None
        n = _get(e, "change", "n")
        return float(e[key]), int(n) if n is not None else 0
    return f


def _mopd(domain: str, effort: str, key: str) -> Callable[[dict], Any]:
    def f(s: dict) -> Any:
        for r in _get(s, "mopd", "table", "rows") or []:
            if (r.get("domain"), r.get("effort")) == (domain, effort):
                if key in ("student_pass", "teacher_pass"):
                    return float(r[key]), int(r["n"])
                return r.get(key)
        return None
    return f


for eff in ("max", "high", "low"):
    _RATES.append((f"base.{eff}", f"base model, general.arithmetic @ {eff}", _eval_rate("base", eff)))
for eff in ("max", "high", "low"):
    _RATES.append((f"sft.{eff}", f"SFT with MXFP4 QAT @ {eff}", _eval_rate("sft", eff)))
_RATES.append(("sft_noqat.max", "SFT without QAT @ max", _eval_rate("sft_noqat", "max")))
_PAIRED.append(("qat_vs_noqat", "QAT − no QAT @ max (same tasks)", lambda s: s.get("qat_vs_noqat")))
for exp in ("general.max", "general.high", "general.low", "coding.max", "agents.max"):
    _RATES.append((f"expert.{exp}.sft", f"expert {exp}: SFT before RL", _expert_rate(exp, "sft_pass_rate")))
    _RATES.append((f"expert.{exp}", f"expert {exp}: after RL", _expert_rate(exp, "pass_rate")))
    _PAIRED.append((f"expert.{exp}.change", f"RL change {exp} (same tasks)", lambda s, e=exp: _get(s, "experts", e, "change")))
for exp in ("general.max", "general.high", "general.low"):
    _VALUES.append((f"expert.{exp}.effort_tokens", f"expert {exp}: mean T(y)",
                    lambda s, e=exp: _get(s, "experts", e, "mean_effort_tokens")))
for exp in ("general.max", "general.high", "general.low", "coding.max", "agents.max"):
    _VALUES.append((f"expert.{exp}.rollout_gap_mean", f"expert {exp}: train–rollout |Δ log p| mean",
                    lambda s, e=exp: _get(s, "experts", e, "rollout_gap", "mean")))
    _VALUES.append((f"expert.{exp}.rollout_gap_max", f"expert {exp}: train–rollout |Δ log p| max",
                    lambda s, e=exp: _get(s, "experts", e, "rollout_gap", "max")))
for eff in ("max", "high", "low"):
    _RATES.append((f"mopd.general.{eff}.student", f"MOPD student general @ {eff}", _mopd("general", eff, "student_pass")))
    _RATES.append((f"mopd.general.{eff}.teacher", f"MOPD teacher general @ {eff}", _mopd("general", eff, "teacher_pass")))
    _PAIRED.append((f"mopd.general.{eff}.change", f"teacher → student general @ {eff}", _mopd("general", eff, "student_vs_teacher")))
_VALUES.append(("wall_s", "demo wall time (s)", lambda s: s.get("wall_s")))


def spread(runs: Sequence[tuple[str, dict]]) -> dict[str, Any]:
    """The spread record of the module doc over (name, summary) pairs."""
    out: dict[str, Any] = {"runs": [n for n, _ in runs], "rates": {}, "paired": {}, "values": {}}
    for key, label, f in _RATES:
        rows = []
        for name, s in runs:
            got = f(s)
            if got is None or got[1] <= 0:
                continue
            p, n = got
            lo, hi = wilson_interval(round(p * n), n)
            rows.append({"run": name, "rate": p, "n": n, "ci95": [round(lo, 4), round(hi, 4)]})
        if rows:
            vals = [r["rate"] for r in rows]
            out["rates"][key] = {"label": label, "per_run": rows, "min": min(vals), "median": statistics.median(vals),
                                 "max": max(vals), "lowest_ci95_lo": min(r["ci95"][0] for r in rows),
                                 "highest_ci95_hi": max(r["ci95"][1] for r in rows)}
    for key, label, f in _PAIRED:
        rows = [{"run": name, **{k: ch[k] for k in ("n", "delta", "ci95", "p_value", "verdict")}}
                for name, s in runs if isinstance(ch := f(s), dict) and ch.get("n")]
        if rows:
            verdicts: dict[str, int] = {}
            for r in rows:
                verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
            out["paired"][key] = {"label": label, "per_run": rows, "verdicts": verdicts,
                                  "delta_min": min(r["delta"] for r in rows), "delta_max": max(r["delta"] for r in rows)}
    for key, label, f in _VALUES:
        vals = [(name, float(v)) for name, s in runs if isinstance(v := f(s), (int, float))]
        if vals:
            xs = [v for _, v in vals]
            out["values"][key] = {"label": label, "per_run": dict(vals), "min": min(xs), "median": statistics.median(xs),
                                  "max": max(xs)}
    return out


def _print(sp: dict[str, Any]) -> None:
    print(f"runs: {', '.join(sp['runs'])}")
    for rec in sp["rates"].values():
        n = sorted({r["n"] for r in rec["per_run"]})
        print(f"{rec['label']}: {rec['min']:.3f}–{rec['max']:.3f} (median {rec['median']:.3f}, n={'/'.join(map(str, n))}, "
              f"Wilson 95% over the runs {rec['lowest_ci95_lo']:.3f}–{rec['highest_ci95_hi']:.3f})")
    for rec in sp["paired"].values():
        v = ", ".join(f"{k} ×{c}" for k, c in sorted(rec["verdicts"].items()))
        print(f"{rec['label']}: Δ {rec['delta_min']:+.3f}…{rec['delta_max']:+.3f}; verdicts {v}")
    for rec in sp["values"].values():
        print(f"{rec['label']}: {rec['min']:.4g}–{rec['max']:.4g} (median {rec['median']:.4g})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with summary.json)")
    ap.add_argument("--json", default="", help="also write the spread record here")
    args = ap.parse_args(argv)
    runs = []
    for d in map(Path, args.runs):
        p = d / "summary.json"
        if not p.is_file():
            print(f"skipped {d}: no summary.json", file=sys.stderr)
            continue
        s = json.loads(p.read_text(encoding="utf-8"))
        if s.get("status") != "done":
            print(f"skipped {d}: status {s.get('status')!r}", file=sys.stderr)
            continue
        runs.append((d.name, s))
    if not runs:
        print("no finished runs", file=sys.stderr)
        return 2
    sp = spread(runs)
    _print(sp)
    line = json.dumps(sp)
    if args.json:
        Path(args.json).write_text(line + "\n", encoding="utf-8")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
