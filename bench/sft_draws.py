"""Held-out pass of SFT models as the experts' "before" rows measure it, with why the coding episodes fail.

    python bench/sft_draws.py runs/a/sft/final runs/b/sft/final ... [--config configs/demo.yaml] [--effort max]
        [--coding-max-tokens 640] [--domains coding,agents,general] [--split test|validation] [--json out.json]

For each model folder: greedy pass at ``--effort`` on the recipe's held-out tasks of each domain (coding and agents:
``rl.eval_n`` of the domain's RL families; general: ``data.n_eval`` of them, the SFT evaluation's size), each turn capped at
the domain's ``eval_max_tokens``, the mean effort tokens T, and the coding episodes by outcome: pass, a wrong answer,
cut at the turn cap (``length``), malformed, or another end (`summarize_trajectories`: rates carry n and a 95% Wilson
interval; infrastructure failures are counted apart, under ``infra``). Models are run
with the config's QAT, one thread, as the demo's experts evaluate them. ``--coding-max-tokens`` raises the coding
turn cap (does an episode cut at the cap finish, given room?). ``--split validation`` scores as many tasks of another
held-out seed (`k3post.envs.families.streams.VALIDATION_SEED`): choose between checkpoints there, report the test.

What a "draw" is: the same SFT recipe with another data order (``run.seed``), thread count or device. The demo's
SFT draws spread widely in coding and agents (docs/decisions.md, issue 31 §draws18); compare recipes over several
draws, never one. Not a timing benchmark. The final line is JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from k3post.config import load_config  # noqa: E402
from k3post.recipes.select import domain_pass  # noqa: E402

DOMAINS = ("coding", "agents", "general")


def outcome(traj: object) -> str:
    """pass | answer (ended with a wrong answer) | length (cut at the turn cap) | malformed | the trajectory's end."""
    if (traj.reward or 0) >= 1:
        return "pass"
    if traj.malformed:
        return "malformed"
    return traj.finish or "unknown"


def evaluate_model(path: str, cfg: object, effort: str, coding_max_tokens: int = 0, domains: tuple[str, ...] = DOMAINS,
                   split: str = "test") -> dict:
    """Per domain: pass rate, n, Wilson interval, mean effort tokens and the episodes' outcomes
    (`k3post.recipes.select.domain_pass`, which ``sft.select: validation`` scores checkpoints with)."""
    got = domain_pass(path, cfg, effort, domains, split=split,
                      max_tokens={"coding": coding_max_tokens} if coding_max_tokens else None)
    out = {}
    for dom, s in got.items():  # infrastructure failures are counted apart, as in every evaluation
        out[dom] = {"pass": s["pass_rate"], "n": s["n"], "ci95": s["pass_ci95"], "turn_cap": s["turn_cap"],
                    "mean_effort_tokens": s["mean_effort_tokens"], "infra": s["infra"],
                    "outcomes": dict(collections.Counter(outcome(t) for t in s["trajectories"] if t.infra is None))}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="SFT model folders (sft/final, a checkpoint)")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--effort", default="max", choices=["max", "high", "low"])
    p.add_argument("--coding-max-tokens", type=int, default=0, help="coding turn cap (0: the config's eval_max_tokens)")
    p.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated, of coding, agents, general")
    p.add_argument("--split", default="test", choices=["test", "validation"],
                   help="the held-out tests, or as many tasks of the validation seed (to choose a checkpoint)")
    p.add_argument("--json", default="", help="also write the JSON to this file")
    args = p.parse_args(argv)
    domains = tuple(d for d in args.domains.split(",") if d)
    if not domains or set(domains) - set(DOMAINS):
        p.error(f"--domains: some of {','.join(DOMAINS)}, got {args.domains!r}")
    for m in args.models:
        if not (Path(m) / "config.json").is_file():
            p.error(f"{m}: no model folder (config.json missing)")
    torch.set_num_threads(1)
    cfg = load_config(args.config, [])
    rows = {}
    print(f"{'model':48} " + " ".join(f"{d:>22}" for d in domains) + f"  outcomes of {domains[0]}")
    for m in args.models:
        r = rows[m] = evaluate_model(m, cfg, args.effort, args.coding_max_tokens, domains, args.split)
        cells = " ".join(f"{r[d]['pass']:.3f} [{r[d]['ci95'][0]:.2f},{r[d]['ci95'][1]:.2f}] T{r[d]['mean_effort_tokens']:>4.0f}"
                         for d in domains)
        print(f"{m[-48:]:48} {cells}  {r[domains[0]]['outcomes']}", flush=True)
    res = {"effort": args.effort, "config": args.config, "split": args.split, "models": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
