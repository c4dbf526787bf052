"""How long the families' scripted reference solutions are at each effort (what SFT imitates), in tokens.

    python bench/reference_effort.py runs/demo/tokenizer [--n 40] [--seed 123] [--families F ...]

Per family and effort, over ``n`` tasks of the family (every default family unless ``--families`` names
others), the mean of:

* ``assistant_tokens``: every assistant token of the episode (each turn's thinking, tool calls and
  answer: the loss-mask tokens of the XTML rendering);
* ``floor_tokens``: the same episode rendered with every turn's thinking emptied, the no-thinking floor
  (the tool calls and answers an episode needs at any effort);
* ``think_tokens``: their difference, the thinking tokens in context;
* ``T``: SPEC §3.3's count, thinking tokens on the general domain and every output token on the agentic
  ones (agents, coding);

and, at ``max``, the longest assistant turn (against the per-turn ``rl.rollout.max_tokens``) and the longest context
(against ``sft.max_len`` and ``rl.rollout.max_model_len``).

Per domain (the tasks of its families pooled, ``n`` each): the mean T per effort, T(low) / T(max), and the
per-task violations: tasks whose T is not strictly increasing low < high < max (a low as long as its high
or max counts). The low-effort budget is τ_low · b0 = 0.4 · b0 with b0 measured at max, so a domain whose
references have T(low) / T(max) above 0.4 cannot meet the low budget by imitation. Not a timing
benchmark: the numbers are exact counts for the given tokenizer and tasks (the references are a pure
function of the seed). The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3post.constants import EFFORTS  # noqa: E402
from k3post.envs.episode import run_episode_sync  # noqa: E402
from k3post.envs.families.registry import default_families, get_family  # noqa: E402
from k3post.rollout.evaluation import make_env  # noqa: E402
from k3post.tokenizer import load_tokenizer  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

FIELDS = ("assistant_tokens", "floor_tokens", "think_tokens", "T")


def reference_episodes(family: str, n: int, seed: int) -> dict[str, list[Any]]:
    """Per effort, the reference episodes of the ``n`` tasks of ``generate(n, seed=seed)``, in order."""
    fam = get_family(family)
    tasks = fam.generate(n, seed=seed)
    return {e: [run_episode_sync(fam.reference_policy(t, e), make_env(t), t, verify=False) for t in tasks] for e in EFFORTS}


def episode_counts(xtml: XTML, ep: Any, effort: str, domain: str) -> dict[str, int]:
    """`FIELDS` of one episode, plus ``turn_max`` (its longest assistant turn) and ``context`` (its whole rendering)."""
    tools = ep.tools or None
    r = xtml.render(ep.messages, tools=tools, effort=effort, mode="think")
    total = sum(r.loss_mask)
    bare = [{**m, "reasoning_content": ""} if m.get("role") == "assistant" else m for m in ep.messages]
    floor = sum(xtml.render(bare, tools=tools, effort=effort, mode="think").loss_mask)
    per_turn = Counter(i for i, lm in zip(r.message_index, r.loss_mask) if lm)
    return {"assistant_tokens": total, "floor_tokens": floor, "think_tokens": total - floor,
            "T": total - floor if domain == "general" else total, "turn_max": max(per_turn.values(), default=0),
            "context": len(r.ids)}


def task_counts(xtml: XTML, family: str, n: int, seed: int) -> dict[str, list[dict[str, int]]]:
    """Per effort, `episode_counts` of each of the ``n`` tasks' reference episodes."""
    domain = get_family(family).domain
    return {e: [episode_counts(xtml, ep, e, domain) for ep in eps] for e, eps in reference_episodes(family, n, seed).items()}


def _means(rows_by_effort: dict[str, list[dict[str, int]]]) -> dict[str, dict[str, float]]:
    return {e: {k: statistics.fmean(r[k] for r in rows) for k in FIELDS} for e, rows in rows_by_effort.items()}


def measure(xtml: XTML, family: str, n: int, seed: int) -> dict[str, dict[str, float]]:
    """Mean `FIELDS` per reference episode of ``n`` tasks, per effort."""
    return _means(task_counts(xtml, family, n, seed))


def violations(rows_by_effort: dict[str, list[dict[str, int]]]) -> int:
    """Tasks whose T is not strictly increasing low < high < max."""
    return sum(not (lo["T"] < hi["T"] < mx["T"])
               for lo, hi, mx in zip(rows_by_effort["low"], rows_by_effort["high"], rows_by_effort["max"]))


def domain_summary(per_family: dict[str, dict[str, list[dict[str, int]]]]) -> dict[str, Any]:
    """The pooled tasks of one domain's families: n, mean T per effort, T(low) / T(max), violations."""
    pooled = {e: [r for rows in per_family.values() for r in rows[e]] for e in EFFORTS}
    t = {e: statistics.fmean(r["T"] for r in pooled[e]) for e in EFFORTS}
    v = violations(pooled)
    n = len(pooled["max"])
    return {"n": n, "T": t, "low_over_max": t["low"] / t["max"] if t["max"] else float("nan"),
            "violations": v, "violation_rate": v / n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizer", help="a tokenizer folder (e.g. runs/demo/tokenizer)")
    p.add_argument("--n", type=int, default=40, help="tasks per family")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--families", nargs="*", help="family names (default: every default family)")
    ns = p.parse_args(argv)
    xtml = XTML(load_tokenizer(ns.tokenizer, require_xtml=True))
    names = ns.families or [f.name for f in default_families()]
    per_domain: dict[str, dict[str, dict[str, list[dict[str, int]]]]] = {}
    result: dict[str, Any] = {}
    for family in names:
        rows = task_counts(xtml, family, ns.n, ns.seed)
        per_domain.setdefault(get_family(family).domain, {})[family] = rows
        m = _means(rows)
        ratio = m["low"]["T"] / m["max"]["T"] if m["max"]["T"] else float("nan")
        result[family] = {**m, "low_over_max": ratio, "violations": violations(rows),
                          "max_turn_max": max(r["turn_max"] for r in rows["max"]),
                          "max_context": max(r["context"] for r in rows["max"])}
        print(f"{family:24} T max {m['max']['T']:6.1f} high {m['high']['T']:6.1f} low {m['low']['T']:6.1f} "
              f"(low/max {ratio:.2f}); thinking max {m['max']['think_tokens']:6.1f} high {m['high']['think_tokens']:6.1f} "
              f"low {m['low']['think_tokens']:6.1f}; floor max {m['max']['floor_tokens']:6.1f} "
              f"low {m['low']['floor_tokens']:6.1f}; violations {result[family]['violations']}/{ns.n}; at max the longest turn "
              f"{result[family]['max_turn_max']}, the longest context {result[family]['max_context']}")
    domains = {d: domain_summary(fams) for d, fams in per_domain.items()}
    for d, s in domains.items():
        print(f"domain {d:8} n {s['n']:4d}  T max {s['T']['max']:6.1f} high {s['T']['high']:6.1f} low {s['T']['low']:6.1f} "
              f"(low/max {s['low_over_max']:.2f}); violations {s['violations']}/{s['n']}")
    print(json.dumps({"n": ns.n, "seed": ns.seed, "tokenizer": ns.tokenizer, "families": result, "domains": domains}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
