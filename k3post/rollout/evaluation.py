"""Held-out evaluation of a policy on any task family through the rollout engine: whole episodes
(multi-turn, tool calls, the family's verifier), not single completions.

`evaluate_episodes` runs each task once with greedy decoding (or K samples at a temperature) through
the `AgentLoop` over an `EmbeddedEngine` and reports, per family: pass rate (reward ≥
``pass_threshold``), mean reward, mean T(y) (SPEC §3.3: thinking tokens for general tasks, all output
tokens for agentic ones), mean output tokens and how episodes ended (answer / length / malformed ...).
An episode whose infrastructure failed (``Trajectory.infra``: an env worker lost, the sandbox or the browser
unavailable) is no outcome of the policy: it is left out of ``n`` and of every rate and mean, and counted
in ``infra`` (by kind).

Shape legend: none (token lists only).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from k3post.envs.families.registry import get_family, local_env
from k3post.envs.task import Task
from k3post.rollout.agent_loop import AgentLoop, trajectory_seed
from k3post.rollout.engine import SamplingParams
from k3post.rollout.trajectory import Trajectory, counts_output_tokens
from k3post.stats import wilson_interval
from k3post.xtml import OMIT_EFFORT, XTML

__all__ = ["run_episodes", "evaluate_episodes", "summarize_trajectories", "paired_passes", "make_env", "local_env", "env_placement",
           "reference_effort_tokens",
           "reference_turn_tokens"]


_PLACEMENT: list[Callable[[Task], Any]] = []  # env factories installed by `env_placement`, innermost last


def make_env(task: Task) -> Any:
    """A fresh environment for ``task``: in this process (`local_env`), or where `env_placement` put the
    environments (Ray environment workers: `k3post.distributed.env_workers`)."""
    return _PLACEMENT[-1](task) if _PLACEMENT else local_env(task)


@contextmanager
def env_placement(factory: Callable[[Task], Any]) -> Iterator[None]:
    """Within the block, `make_env` builds environments with ``factory`` (task -> environment)."""
    _PLACEMENT.append(factory)
    try:
        yield
    finally:
        _PLACEMENT.remove(factory)


def _reference_rendering(xtml: XTML, task: Task, effort: str, mode: str, *, verify: bool) -> tuple[Any, Any]:
    """(episode, rendering) of the family's scripted reference solution of ``task`` at ``effort``, run through its
    environment here (``verify``: and judged by its verifier) and rendered with ``xtml``."""
    from k3post.envs.episode import run_episode_sync

    ep = run_episode_sync(get_family(task.family).reference_policy(task, effort), local_env(task), task, verify=verify)
    return ep, xtml.render(ep.messages, tools=ep.tools or None, effort=effort, mode=mode)


def _turn_spans(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """[start, end) of every run of the loss mask: the assistant turns of a rendering."""
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def reference_turn_tokens(xtml: XTML, tasks: Sequence[Task], effort: str, *, mode: str = "think") -> int:
    """The longest assistant turn, in tokens, of the families' scripted reference solutions of ``tasks``
    at ``effort`` (each run through its environment). A per-turn generation cap below it truncates the
    reference solution itself, so a policy cannot pass those tasks at that effort."""
    longest = 0
    for task in tasks:
        _, r = _reference_rendering(xtml, task, effort, mode, verify=False)  # scripted: no verdict needed
        longest = max([longest, *(b - a for a, b in _turn_spans(r.loss_mask))])
    return longest


def reference_effort_tokens(xtml: XTML, task: Task, effort: str, *, mode: str = "think") -> int | None:
    """T(y) (SPEC §3.3, `Trajectory.effort_tokens`) of the family's scripted reference solution of ``task`` at
    ``effort``, rendered with ``xtml`` as a policy would sample it: every assistant token across turns where the
    domain counts output tokens (`counts_output_tokens`), else the thinking tokens (each turn up to its first
    ``<|close|>``); None when the reference does not solve the task. A budget below it excludes the family's own
    solution."""
    ep, r = _reference_rendering(xtml, task, effort, mode, verify=True)
    if ep.verdict is None or float(ep.reward or 0.0) < 1.0:
        return None
    spans = _turn_spans(r.loss_mask)
    if counts_output_tokens(task.domain):
        return sum(b - a for a, b in spans)
    return sum(next((k for k in range(a, b) if r.ids[k] == xtml.close_id), b) - a for a, b in spans)


def summarize_trajectories(trajs: Sequence[Trajectory], *, pass_threshold: float = 1.0) -> dict[str, Any]:
    """Pass rate with its 95% Wilson interval, mean reward, mean T(y) and output tokens, finish reasons (and
    why the malformed ones were), every T(y) (for histograms), and per trajectory its task id and whether it
    passed (for paired comparisons on the same tasks, `k3post.stats.paired_change`). Infrastructure failures
    are not in any of these (module doc): ``infra`` counts them by kind."""
    infra = dict(Counter(t.infra for t in trajs if t.infra is not None))
    infra_ids = [str(t.task.get("id", t.traj_id)) for t in trajs if t.infra is not None]
    trajs = [t for t in trajs if t.infra is None]
    if not trajs:
        return {"n": 0, "pass_rate": 0.0, "pass_ci95": [0.0, 1.0], "mean_reward": 0.0, "mean_effort_tokens": 0.0,
                "mean_output_tokens": 0.0, "finish": {}, "malformed": {}, "infra": infra, "effort_tokens": [],
                "task_ids": [], "passed": [], "infra_task_ids": infra_ids}
    rewards = [float(t.reward or 0.0) for t in trajs]
    passed = [r >= pass_threshold for r in rewards]
    return {
        "n": len(trajs),
        "pass_rate": sum(passed) / len(trajs),
        "pass_ci95": list(wilson_interval(sum(passed), len(trajs))),
        "mean_reward": statistics.fmean(rewards),
        "mean_effort_tokens": statistics.fmean(t.effort_tokens() for t in trajs),
        "mean_output_tokens": statistics.fmean(t.output_tokens for t in trajs),
        "finish": dict(Counter(t.finish or "none" for t in trajs)),
        "malformed": dict(Counter(t.malformed for t in trajs if t.malformed is not None)),
        "infra": infra,
        "effort_tokens": [t.effort_tokens() for t in trajs],
        "task_ids": [str(t.task.get("id", t.traj_id)) for t in trajs],
        "passed": passed,
        "infra_task_ids": infra_ids,
    }


def _check_same_episodes(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """ValueError unless the two summaries ran the same tasks the same number of times (infrastructure failures
    included)."""
    every = [Counter(list(s["task_ids"]) + list(s.get("infra_task_ids", ()))) for s in (a, b)]
    if every[0] != every[1]:
        raise ValueError("the two evaluations ran different tasks: no paired comparison")


def task_pass_shares(s: Mapping[str, Any]) -> dict[str, float]:
    """Per task id, the share of its episodes in the summary ``s`` (`summarize_trajectories`) that passed: avg@k when
    each task ran k times."""
    runs: dict[str, list[bool]] = {}
    for tid, p in zip(s["task_ids"], s["passed"]):
        runs.setdefault(tid, []).append(bool(p))
    return {tid: sum(ps) / len(ps) for tid, ps in runs.items()}


def paired_shares(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """`task_pass_shares` of two summaries over the tasks both have, in ``a``'s order (a task whose every episode
    failed its infrastructure in one run is left out); ValueError when the two ran other tasks or other counts of them."""
    _check_same_episodes(a, b)
    sa, sb = task_pass_shares(a), task_pass_shares(b)
    common = [t for t in sa if t in sb]
    return [sa[t] for t in common], [sb[t] for t in common]


def paired_passes(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[list[bool], list[bool]]:
    """``passed`` of two `summarize_trajectories` summaries over the episodes both have, in ``a``'s order
    (matched by task id and its occurrence): an episode whose infrastructure failed in either run is left out
    of the pair (`k3post.stats.paired_change` takes the result). ValueError when the two ran other tasks."""
    _check_same_episodes(a, b)

    def keyed(s: Mapping[str, Any]) -> dict[tuple[str, int], bool]:
        seen: Counter[str] = Counter()
        out = {}
        for tid, p in zip(s["task_ids"], s["passed"]):
            out[(tid, seen[tid])] = bool(p)
            seen[tid] += 1
        return out

    ka, kb = keyed(a), keyed(b)
    common = [k for k in ka if k in kb]
    return [ka[k] for k in common], [kb[k] for k in common]


def run_episodes(
    engine: Any,
    xtml: XTML,
    tasks: Sequence[Task],
    *,
    effort: str | None,
    max_tokens: int,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    mode: str | None = None,
    env_factory: Callable[[Task], Any] = make_env,
    group_ids: Sequence[int] | None = None,
    progress: str | None = None,
) -> list[list[Trajectory]]:
    """Run every task ``samples`` times to the end through one `AgentLoop` (synchronous) and return
    the trajectories, one list per task. Sample j of task i is ``g<g>/s<j>`` with seed
    ``trajectory_seed(seed, g, j)``, g = ``group_ids[i]`` (default i): pass ids derived from the
    tasks themselves to make a task's samples independent of which other tasks run with it.
    ``mode``: the XTML mode (default "think" with an effort, "instruct" without; "think" with
    ``effort=None`` renders the default effort, `k3post.xtml.OMIT_EFFORT` no thinking-effort message).
    ``progress``: a label; with one, a progress bar counts the episodes as they end (None: no bar)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    gids = list(range(len(tasks))) if group_ids is None else [int(g) for g in group_ids]
    if len(gids) != len(tasks):
        raise ValueError(f"group_ids has {len(gids)} ids for {len(tasks)} tasks")
    loop = AgentLoop(engine, xtml, env_factory, sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
                     effort=effort, mode=mode or ("think" if effort not in (None, OMIT_EFFORT) else "instruct"))
    per_task = [
        [Trajectory(traj_id=f"g{g}/s{j}", group_id=g, sample_index=j, seed=trajectory_seed(seed, g, j),
                    task=t.to_dict(), admitted_version=engine.version) for j in range(samples)]
        for g, t in zip(gids, tasks)
    ]
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks) * samples, desc=progress, unit="episode", dynamic_ncols=True, mininterval=1.0)
    try:
        loop.run([t for ts in per_task for t in ts], on_done=None if bar is None else lambda _t: bar.update(1))
    finally:
        loop.close()
        if bar is not None:
            bar.close()
    return per_task


def evaluate_episodes(
    engine: Any,
    xtml: XTML,
    tasks: Sequence[Task],
    *,
    effort: str | None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    pass_threshold: float = 1.0,
    keep_examples: int = 2,
    mode: str | None = None,
    progress: str | None = None,
) -> dict[str, Any]:
    """Run every task ``samples`` times (greedy by default, `run_episodes`) and summarise per family
    and overall.

    Returns ``{"overall": summary, "families": {family: summary}, "examples": [...]}`` where a
    summary is `summarize_trajectories`' dict and an example holds a task id, the decoded
    sampled text of its first ``keep_examples`` trajectories and their reward. ``progress``: a label for a
    progress bar over the episodes (`run_episodes`)."""
    trajs = [t for ts in run_episodes(engine, xtml, tasks, effort=effort, max_tokens=max_tokens, temperature=temperature,
                                      samples=samples, seed=seed, mode=mode, progress=progress) for t in ts]
    by_family: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_family.setdefault(t.task["family"], []).append(t)
    examples = []
    for t in trajs[:keep_examples]:
        sampled = [tok for tok, m in zip(t.token_ids, t.trainable) if m]
        examples.append({"task": t.task.get("id", t.traj_id), "text": xtml.tokenizer.decode(sampled),
                         "reward": t.reward, "effort_tokens": t.effort_tokens()})
    return {
        "overall": summarize_trajectories(trajs, pass_threshold=pass_threshold),
        "families": {f: summarize_trajectories(ts, pass_threshold=pass_threshold) for f, ts in sorted(by_family.items())},
        "examples": examples,
    }
