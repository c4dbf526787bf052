"""bench/partial_rollout.py: the workload is many distinct tasks (no prompt repeated, within or across
repeats, and both modes get the same ones), the task-independent tool calls the policy learns are valid
5-turn episodes whose tool results differ per task, and the headline is the wall-clock ratio over >= 3
repeats.

Shape legend: none (token lists only).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from k3post.envs.episode import run_episode_sync
from k3post.envs.families.common import scripted_policy
from k3post.envs.families.registry import get_family

_BENCH = Path(__file__).parents[1] / "bench" / "partial_rollout.py"
_spec = importlib.util.spec_from_file_location("bench_partial_rollout", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def _prompt(task) -> str:
    return json.dumps(list(task.messages), sort_keys=True)


def test_default_workload_tasks_are_distinct():
    args = bench.parse_args([])
    n_tasks = args.repeats * bench.prompts_per_repeat(args)
    assert n_tasks == 3 * 8 * (10 + 2)
    tasks = bench.make_tasks(n_tasks, seed=args.seed)
    assert len({t.id for t in tasks}) == len({_prompt(t) for t in tasks}) == n_tasks
    # distinct corpora too, not just distinct questions over one corpus
    assert len({json.dumps(t.metadata["docs"], sort_keys=True) for t in tasks}) == n_tasks
    with pytest.raises(ValueError, match="repeats must be >= 3"):
        bench.parse_args(["--repeats", "2"])


def test_fixed_action_episodes_are_valid_and_see_task_specific_results():
    fam = get_family("agents.search")
    tasks = bench.make_tasks(4, seed=0)
    calls, results = set(), []
    for task in tasks:
        ep = run_episode_sync(scripted_policy(bench.fixed_action_turns(task)), fam.make_env(task), task)
        assistant = [m for m in ep.messages if m["role"] == "assistant"]
        tools = [m["content"] for m in ep.messages if m["role"] == "tool"]
        assert len(assistant) == 5 and tools[-1] == "Submitted."
        assert not any(t.startswith(("No results", "Error", "error")) for t in tools), tools
        calls.add(json.dumps([m["tool_calls"][0]["function"] for m in assistant]))
        results.append(tuple(tools[:-1]))
    assert len(calls) == 1  # the policy's calls do not depend on the task ...
    assert len(set(results)) == len(tasks)  # ... what it reads does


def test_repeats_get_disjoint_task_slices_and_a_wall_clock_headline(tiny_agent_policy, one_torch_thread):
    tok = tiny_agent_policy[1]
    args = bench.parse_args(["--repeats", "3", "--iters", "2", "--n", "2", "--k", "2", "--max-turn-tokens", "4",
                             "--slots", "4", "--max-pos", "4096"])
    tasks = bench.make_tasks(args.repeats * bench.prompts_per_repeat(args), seed=0)
    sync_runs, part_runs = bench.run_repeats(args, tiny_agent_policy, tasks)
    per = bench.prompts_per_repeat(args)
    seen: set[str] = set()
    for r, (s, p) in enumerate(zip(sync_runs, part_runs)):
        slice_ids = {t.id for t in tasks[r * per : (r + 1) * per]}
        assert s["groups"] == args.n * args.iters and len(set(s["task_ids"])) == len(s["task_ids"])
        assert set(s["task_ids"]) | set(p["task_ids"]) <= slice_ids  # both modes drew from this repeat's slice
        assert not (set(s["task_ids"]) & seen)  # and no repeat reuses another's tasks
        seen |= set(s["task_ids"]) | set(p["task_ids"])
    sync, part = bench.combine(tok, sync_runs), bench.combine(tok, part_runs)
    assert len(sync["groups_per_s"]) == len(part["groups_per_s"]) == 3
    out = bench.ratio_summary("speedup_vs_sync", part["groups_per_s"], sync["groups_per_s"])
    assert out["speedup_vs_sync_n"] == 3.0 and out["speedup_vs_sync_min"] <= out["speedup_vs_sync_max"]
