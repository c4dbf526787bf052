"""The ``k3post tasks`` sub-command: list the built-in task families, print a sample task.

    k3post tasks list [--domain D]
    k3post tasks sample FAMILY [--seed N] [--effort low|high|max] [--difficulty D]
    k3post tasks check FAMILY [--n N] [--seed N] [--difficulty D]

``list`` prints the families grouped by domain with their descriptions (non-verifiable ones are
marked ``[GRM]``). ``sample`` draws one task of FAMILY (``generate(1, seed=N, difficulty=D)``),
runs the family's reference solver at the effort level and prints the task as the model sees it
(XTML text with the tool declaration, the thinking-effort option and the generation prefix),
then the whole reference trajectory in XTML and the verifier's verdict. An unknown family is a
ValueError naming the closest known one. ``check`` is a family author's gate (docs/extending.md): tasks are a
pure function of the seed, the reference solver scores 1 at every effort, every wrong or hacky policy the family
declares scores 0, and the reference's output tokens do not grow as the effort falls; a failure exits 1 with a
line per failing (task, policy).

Wire it in with ``add_tasks_parser(subparsers)``; each leaf sets ``fn`` (``ns.fn(ns) -> int``).
"""

from __future__ import annotations

import argparse

from k3post.constants import DOMAINS, EFFORTS
from k3post.errors import UserError

__all__ = ["add_tasks_parser", "check_family", "cmd_tasks_check", "cmd_tasks_list", "cmd_tasks_sample", "list_text",
           "sample_text"]


def list_text(domain: str | None = None) -> str:
    """The registered families grouped by domain, one ``name  description`` line each."""
    from k3post.envs.families.registry import families, plugin_families

    plugins = plugin_families()
    if domain is not None and domain not in DOMAINS:
        raise UserError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    lines: list[str] = []
    for d in DOMAINS if domain is None else (domain,):
        fams = families(d)
        lines.append(f"{d} ({len(fams)} families)")
        width = max((len(f.name) for f in fams), default=0)
        for f in fams:
            tag = ("" if f.verifiable else " [GRM]") + (f" [plugin {plugins[f.name]}, opt-in]" if f.name in plugins else "")
            lines.append(f"  {f.name:<{width}}  {f.description}{tag}")
        if not fams:
            lines.append("  (none)")
    return "\n".join(lines)


def sample_text(family: str, *, seed: int = 0, effort: str = "max", difficulty: int = 1) -> str:
    """One task of ``family`` and its reference trajectory at ``effort``, rendered as XTML text."""
    from k3post.envs.episode import run_episode_sync
    from k3post.envs.families.registry import get_family
    from k3post.xtml import render_text

    if effort not in EFFORTS:
        raise UserError(f"unknown effort {effort!r}; expected one of {EFFORTS}")
    try:  # an unknown family, a difficulty it does not have: the user's input (exit 2)
        fam = get_family(family)
        task = fam.generate(1, seed=seed, difficulty=difficulty)[0]
    except ValueError as e:
        raise UserError(str(e)) from None
    ep = run_episode_sync(fam.reference_policy(task, effort), fam.make_env(task), task)
    n_prompt = next((i for i, m in enumerate(ep.messages) if m.get("role") == "assistant"), len(ep.messages))
    tools = ep.tools or None
    prompt = render_text(ep.messages[:n_prompt], tools=tools, effort=effort, add_generation_prompt=True)
    trajectory = render_text(ep.messages, tools=tools, effort=effort)
    verdict = ep.verdict
    reward = "n/a" if verdict is None else f"{verdict.reward:g}"
    kind = "verifiable" if fam.verifiable else "non-verifiable: format gate only, quality judged by the GRM"
    return "\n".join(
        [
            f"# {fam.name}  task {task.id}  seed={seed} difficulty={difficulty} effort={effort} ({kind})",
            "",
            "## task (XTML, as the model sees it)",
            prompt,
            "",
            f"## reference trajectory ({ep.turns} assistant turns)",
            trajectory,
            "",
            f"## verdict: reward {reward}" + (f"  {dict(verdict.components)}" if verdict is not None else ""),
        ]
    )


def check_family(family: str, *, n: int = 8, seed: int = 0, difficulty: int = 1) -> tuple[bool, str]:
    """Run ``family``'s own gates on ``n`` tasks (see the module docstring); returns (passed, report text)."""
    from k3post.envs.episode import run_episode_sync
    from k3post.envs.families.registry import get_family
    from k3post.envs.task import canonical_json
    from k3post.synth.samples import count_sample_tokens

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"--n must be a positive integer, got {n!r}")
    try:
        fam = get_family(family)
        tasks = fam.generate(n, seed=seed, difficulty=difficulty)
        again = fam.generate(n, seed=seed, difficulty=difficulty)
    except ValueError as e:
        raise UserError(str(e)) from None
    failures: list[str] = []
    if [canonical_json(t.to_dict()) for t in tasks] != [canonical_json(t.to_dict()) for t in again]:
        failures.append(f"generate({n}, seed={seed}, difficulty={difficulty}) is not a pure function of its arguments")
    tokens: dict[str, list[int]] = {e: [] for e in EFFORTS}
    n_wrong = 0
    for task in tasks:
        for effort in EFFORTS:
            ep = run_episode_sync(fam.reference_policy(task, effort), fam.make_env(task), task)
            reward = None if ep.verdict is None else ep.verdict.reward
            if reward != 1.0:
                detail = "" if ep.verdict is None else f": {ep.verdict.diagnostics[:160]}"
                failures.append(f"{task.id} reference at {effort}: reward {reward}, expected 1{detail}")
            tokens[effort].append(count_sample_tokens(ep.messages, ep.tools or None, effort)["output"])
        for name, policy in fam.wrong_policies(task).items():
            n_wrong += 1
            ep = run_episode_sync(policy, fam.make_env(task), task)
            reward = None if ep.verdict is None else ep.verdict.reward
            if reward is None or reward > 0.0:
                failures.append(f"{task.id} wrong policy {name!r}: reward {reward}, expected 0 (a hack that pays)")
    mean = {e: sum(v) / len(v) for e, v in tokens.items()}
    if not mean["low"] <= mean["high"] <= mean["max"]:
        failures.append(f"reference output tokens (words) low {mean['low']:.1f} / high {mean['high']:.1f} / max "
                        f"{mean['max']:.1f}: they must not grow as the effort falls")
    lines = [f"# {fam.name}: {n} tasks (seed {seed}, difficulty {difficulty}), reference at {'/'.join(EFFORTS)}, "
             f"{n_wrong} wrong-policy episodes",
             "reference output tokens (words): " + ", ".join(f"{e} {mean[e]:.1f}" for e in EFFORTS)]
    lines += [f"FAIL {f}" for f in failures] or ["ok: every gate passed"]
    return not failures, "\n".join(lines)


def cmd_tasks_check(ns: argparse.Namespace) -> int:
    """``k3post tasks check FAMILY``: exit 0 when every gate passes, 1 otherwise."""
    ok, text = check_family(ns.family, n=ns.n, seed=ns.seed, difficulty=ns.difficulty)
    print(text)
    return 0 if ok else 1


def cmd_tasks_list(ns: argparse.Namespace) -> int:
    """``k3post tasks list``."""
    print(list_text(ns.domain))
    return 0


def cmd_tasks_sample(ns: argparse.Namespace) -> int:
    """``k3post tasks sample FAMILY``."""
    if ns.synth_tasks:
        if ns.family != "agents.search":
            raise UserError("--synth-tasks: only agents.search draws from a synthesised set")
        from k3post.envs.families.agents.family import SEARCH

        try:
            SEARCH.use_synth_tasks(ns.synth_tasks)
        except ValueError as e:
            raise UserError(str(e)) from None
    print(sample_text(ns.family, seed=ns.seed, effort=ns.effort, difficulty=ns.difficulty))
    return 0


def add_tasks_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tasks list`` / ``sample`` / ``check`` to ``subparsers``; returns the ``tasks`` parser."""
    p = subparsers.add_parser("tasks", help="list the task families, print a sample task, check a family's gates")
    sub = p.add_subparsers(dest="tasks_command", required=True)
    ls = sub.add_parser("list", help="families per domain with descriptions")
    ls.add_argument("--domain", choices=DOMAINS, default=None, help="only this domain")
    ls.set_defaults(fn=cmd_tasks_list)
    sm = sub.add_parser("sample", help="print one task (XTML) and its reference trajectory")
    sm.add_argument("family", help="family name, e.g. agents.search (see `k3post tasks list`)")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--effort", choices=EFFORTS, default="max")
    sm.add_argument("--difficulty", type=int, default=1)
    sm.add_argument("--synth-tasks", help="agents.search only: draw from this kg_tasks.jsonl (k3post synth-tasks)")
    sm.set_defaults(fn=cmd_tasks_sample)
    ck = sub.add_parser("check", help="a family's gates: seeded tasks, reference scores 1, every hack scores 0")
    ck.add_argument("family", help="family name (a built-in or a plugin's, see `k3post tasks list`)")
    ck.add_argument("--n", type=int, default=8, help="tasks to check (default 8)")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--difficulty", type=int, default=1)
    ck.set_defaults(fn=cmd_tasks_check)
    return p
