"""How long the families' scripted reference solutions are at each effort (what SFT imitates), in tokens.

    python bench/reference_effort.py runs/demo/tokenizer [--n 40] [--seed 123]

Per family and effort: the mean number of assistant tokens per episode (every turn, thinking, tool calls
and answer: the loss-mask tokens of the XTML rendering) and the mean thinking tokens, then low / max of
each. SPEC §3.3 counts T(y) as thinking tokens on general tasks and all output tokens on agentic ones; the
low-effort budget is τ_low · b0 = 0.4 · b0, so a family whose references have T(low) / T(max) above 0.4
cannot meet the low budget by imitation. Not a timing benchmark: no ratio against a baseline, the numbers
are exact counts for the given tokenizer and tasks. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3post.constants import EFFORTS  # noqa: E402
from k3post.envs.episode import run_episode_sync  # noqa: E402
from k3post.envs.families.registry import get_family  # noqa: E402
from k3post.rollout.evaluation import make_env  # noqa: E402
from k3post.tokenizer import load_tokenizer  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

FAMILIES = ("general.arithmetic", "agents.search", "agents.assistant", "coding.write_function", "coding.bugfix")


def measure(xtml: XTML, family: str, n: int, seed: int) -> dict[str, dict[str, float]]:
    """Mean assistant and thinking tokens per reference episode of ``n`` tasks, per effort."""
    fam = get_family(family)
    tasks = fam.generate(n, seed=seed)
    out: dict[str, dict[str, float]] = {}
    for effort in EFFORTS:
        total, think = [], []
        for task in tasks:
            ep = run_episode_sync(fam.reference_policy(task, effort), make_env(task), task, verify=False)
            r = xtml.render(ep.messages, tools=ep.tools or None, effort=effort, mode="think")
            total.append(sum(r.loss_mask))
            # the assistant turns' reasoning text, tokenized on its own (within ~1 token per turn of the
            # in-context count)
            think.append(sum(len(xtml.tokenizer.encode(m.get("reasoning_content") or "", add_special_tokens=False))
                             for m in ep.messages if m.get("role") == "assistant"))
        out[effort] = {"assistant_tokens": statistics.fmean(total), "think_tokens": statistics.fmean(think)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizer", help="a tokenizer folder (e.g. runs/demo/tokenizer)")
    p.add_argument("--n", type=int, default=40, help="tasks per family")
    p.add_argument("--seed", type=int, default=123)
    ns = p.parse_args(argv)
    xtml = XTML(load_tokenizer(ns.tokenizer, require_xtml=True))
    result = {}
    for family in FAMILIES:
        m = measure(xtml, family, ns.n, ns.seed)
        ratio = {k: m["low"][k] / m["max"][k] if m["max"][k] else float("nan") for k in m["max"]}
        result[family] = {**m, "low_over_max": ratio}
        print(f"{family:24} assistant max {m['max']['assistant_tokens']:6.1f} high {m['high']['assistant_tokens']:6.1f} "
              f"low {m['low']['assistant_tokens']:6.1f} (low/max {ratio['assistant_tokens']:.2f}); thinking max "
              f"{m['max']['think_tokens']:6.1f} high {m['high']['think_tokens']:6.1f} low {m['low']['think_tokens']:6.1f}")
    print(json.dumps({"n": ns.n, "seed": ns.seed, "tokenizer": ns.tokenizer, "families": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
