"""Teacher-forced turn accuracy of a policy on multi-turn families: where does an agentic episode break?

    python bench/agent_turns.py runs/full/sft/final [--families agents.search,agents.assistant] [--n 40] [--effort max]

For each held-out task the family's reference episode is replayed; before every assistant turn the policy
continues the reference history greedily (one turn, at most --max-tokens tokens) and the turn is scored:
    call ok  : the same tool calls as the reference (names and arguments, in order); a final answer turn:
               the same answer text (whitespace-normalised)
    name ok  : the same tool names only (the argument values are where copying from tool results happens)
Episode success needs every turn right, so with per-turn accuracy p over m turns a policy passes about p^m
of the episodes; the table gives p per turn position. A turn is generated up to --max-tokens tokens; the
default, 0, gives each turn its reference's length plus --slack, rounded up to 64 (a cap below the reference's own length
fails turns that are right: at --effort max a search turn is ~230 tokens). Turns that hit their cap are
counted ("capped"). A turn whose reference history alone fills the model's context (``max_position_embeddings``;
late turns of long episodes) cannot be generated: it is left out of the rates and counted ("no_room").
Not a timing benchmark. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from k3post.envs.episode import run_episode_sync  # noqa: E402
from k3post.envs.families.registry import get_family  # noqa: E402
from k3post.envs.families.streams import eval_tasks  # noqa: E402
from k3post.recipes.evaluate import complete  # noqa: E402
from k3post.recipes.experts import load_policy  # noqa: E402
from k3post.quant.qat import QATConfig  # noqa: E402
from k3post.rollout.evaluation import make_env  # noqa: E402
from k3post.tokenizer import load_tokenizer  # noqa: E402
from k3post.xtml import XTML  # noqa: E402


def _calls(msg: dict) -> list[tuple[str, dict]]:
    out = []
    for c in msg.get("tool_calls") or []:
        args = c["function"]["arguments"]
        try:  # a model may write arguments that are not JSON: kept as text (never equal to a reference's dict)
            parsed = json.loads(args) if isinstance(args, str) else dict(args)
        except (ValueError, TypeError):
            parsed = {"<unparsed>": str(args)}
        out.append((c["function"]["name"], parsed))
    return out


def _norm(text: str | None) -> str:
    return " ".join((text or "").split())


def turn_accuracy(model: torch.nn.Module, xtml: XTML, family: str, n: int, effort: str, max_tokens: int,
                  slack: int = 64, max_len: int | None = None) -> list[dict]:
    """Per task, per assistant turn of the reference: whether the policy's greedy turn matches it, and whether
    it hit its cap (``max_tokens``; 0: the reference turn's own length + ``slack``). A turn whose history holds
    ``max_len`` tokens or more (default: the model's ``max_position_embeddings``) is a row with ``no_room``."""
    fam = get_family(family)
    tasks = eval_tasks([family], n, difficulty=1)
    room = max_len if max_len is not None else int(model.config.get_text_config(decoder=True).max_position_embeddings)
    prompts, refs, caps = [], [], []
    no_room: list[tuple[str, int]] = []
    for task in tasks:
        ep = run_episode_sync(fam.reference_policy(task, effort), make_env(task), task, verify=False)
        msgs = list(ep.messages)
        for i, m in enumerate(msgs):
            if m.get("role") != "assistant":
                continue
            r = xtml.render(msgs[:i], tools=ep.tools or None, effort=effort, mode="think", add_generation_prompt=True)
            turn = sum(1 for x in msgs[:i] if x.get("role") == "assistant")
            if len(r.ids) >= room:  # the history alone fills the context: nothing can be generated
                no_room.append((task.id, turn))
                continue
            prompts.append(r.ids)
            ref_len = len(xtml.render(msgs[:i + 1], tools=ep.tools or None, effort=effort, mode="think").ids) - len(r.ids)
            caps.append(max_tokens or -(-(ref_len + slack) // 64) * 64)  # in steps of 64: few batched calls
            refs.append((task.id, turn, m))
    outs: list[list[int]] = [[] for _ in prompts]
    for cap in sorted(set(caps)):  # one batched call per cap
        idx = [j for j, c in enumerate(caps) if c == cap]
        for j, ids in zip(idx, complete(model, [prompts[j] for j in idx], max_new_tokens=cap, stop_id=xtml.eom_id, batch_size=32)):
            outs[j] = ids
    rows = []
    for (tid, k, ref), ids, cap in zip(refs, outs, caps):
        try:
            got = xtml.parse(ids, after_prefix=True)
        except ValueError:
            got = {}
        ref_calls, got_calls = _calls(ref), _calls(got) if got else []
        if ref_calls:
            ok = got_calls == ref_calls
        else:
            ok = bool(got) and not got_calls and _norm(got.get("content")) == _norm(ref.get("content"))
        rows.append({"task": tid, "turn": k, "call_ok": ok, "capped": len(ids) >= cap and (not ids or ids[-1] != xtml.eom_id),
                     "name_ok": [c[0] for c in got_calls] == [c[0] for c in ref_calls]})
    rows += [{"task": tid, "turn": k, "no_room": True} for tid, k in no_room]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a policy folder (e.g. runs/full/sft/final)")
    p.add_argument("--families", default="agents.search,agents.assistant")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--effort", default="max")
    p.add_argument("--max-tokens", type=int, default=0, help="per-turn cap; 0: the reference turn's length + --slack, rounded up to 64")
    p.add_argument("--slack", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--qat", action="store_true", help="apply MX QAT (the default QATConfig) as the recipe's engines run a "
                   "QAT-trained model; without it the weights run unquantized (the numbers before this flag existed)")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    xtml = XTML(load_tokenizer(ns.model, require_xtml=True))
    model = load_policy(ns.model, QATConfig(enabled=True) if ns.qat else None)
    result = {}
    for family in ns.families.split(","):
        rows = turn_accuracy(model, xtml, family, ns.n, ns.effort, ns.max_tokens, ns.slack)
        no_room = sum(1 for r in rows if r.get("no_room"))
        unfinished = {r["task"] for r in rows if r.get("no_room")}  # not every turn could be tried: never "all right"
        rows = [r for r in rows if not r.get("no_room")]
        by_turn: dict[int, list[dict]] = {}
        for r in rows:
            by_turn.setdefault(r["turn"], []).append(r)
        tasks = {r["task"] for r in rows}
        all_ok = sum(all(r["call_ok"] for r in rows if r["task"] == t) for t in tasks - unfinished)
        per_turn = {k: {"n": len(v), "call_ok": sum(r["call_ok"] for r in v) / len(v), "name_ok": sum(r["name_ok"] for r in v) / len(v),
                        "capped": sum(r["capped"] for r in v)}
                    for k, v in sorted(by_turn.items())}
        result[family] = {"per_turn": per_turn, "turns_all_ok": all_ok, "tasks": len(tasks),
                          "call_ok": sum(r["call_ok"] for r in rows) / len(rows), "capped": sum(r["capped"] for r in rows),
                          "no_room": no_room}
        print(f"{family}: every turn right on {all_ok}/{len(tasks)} tasks ({result[family]['capped']} of {len(rows)} turns hit their cap, "
              f"{no_room} left out: no room in the context); "
              "per turn (call ok / tool names ok): " +
              ", ".join(f"{k}: {v['call_ok']:.2f}/{v['name_ok']:.2f}" for k, v in per_turn.items()))
    print(json.dumps({"model": ns.model, "qat": ns.qat, "effort": ns.effort, "n": ns.n, "max_tokens": ns.max_tokens, "slack": ns.slack, "families": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
