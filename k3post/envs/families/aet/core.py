"""Autonomous execution tasks (AET): verify-in-the-loop families (SPEC §3.5, issue 21).

An AET task gives the agent only a goal, an initial environment state (files in a sandbox working
directory), constraints and a verification interface. No reference trajectory is shown. The agent
works with generic tools (``list_files``, ``read_file``, ``write_file``, ``edit_file``,
``delete_file``, ``run_command``, ``run_python``), decides when to stop (a reply without tool calls
ends the episode) and may call the **public verifier**:

``submit``
    Runs the public scenarios (``checks/public.json`` in the working directory; the task metadata
    holds the authoritative copy, so editing that file changes nothing) against a copy of the
    current files in a fresh sandbox and answers with per-scenario diagnostics. Each call spends one
    unit of the submission budget (``metadata["budget"]``, shown in the prompt). A call past the
    budget is not evaluated: it ends the episode and the final reward loses ``metadata["penalty"]``.
    Submitting does not end the episode.

After the episode the **hidden verifier** builds the `verification_tree`: the agent's final files
where the task lets it write (``metadata["writable"]``, e.g. ``config/``; None: everywhere), the
task's initial files everywhere else (so code the agent must configure, not rewrite, is restored
and anything it added outside, such as a ``json.py`` or an ``app/router/`` package, is gone). That
tree goes into another fresh sandbox (never the agent's), bound read-only, and every held-out
scenario runs there in a namespace of its own started from the host (`Sandbox.run_hidden`:
``python -I``, no user site or ``.pth``, the tree last on ``sys.path``, source modules only, HOME
outside the tree, a fresh ``/tmp``); what it observes is compared **on the host** with expected
values computed at generation time. A scenario's own inputs are the only ones that reach a sandbox,
and only as that run's argv and stdin; expected values never reach any sandbox, and nothing of them
is mounted into the agent's view. The verdict reads the final state only:

    reward = max(0, 1[every hidden scenario passes] - penalty * 1[over budget])

with components ``hidden_pass_rate``, ``public_pass_rate`` (the public scenarios re-run on the
final files, in their own sandbox), ``submissions`` and ``over_budget``.

A scenario is JSON: ``argv`` (run as ``python ARGV`` with ``stdin`` in the read-only working directory),
``read`` (files whose text to observe, None if missing), ``list`` (directories whose file lists to
observe) and ``expected`` (``rc``, ``stdout``, ``files``, ``list``: each key given must match;
text is compared up to trailing newlines, ``.json`` files as parsed JSON).

Families subclass `AETFamily` and implement ``_make`` (the task data), ``work_turns`` (the
reference solver's work, before its single submission) and ``overfit_turns`` (a policy that
special-cases the public scenarios; it must pass them all and fail the hidden set).
"""

from __future__ import annotations

import json
import random
import shlex
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k3post.envs.env import EpisodeLimits, StepResult, ToolEnvironment
from k3post.envs.families.common import FamilyBase, check_effort
from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.envs.sandbox_tools import (
    TOOLS,
    SandboxState,
    clip,
    format_run,
    last_tool_outputs,
    reply,
    script_call,
    scripted,
)
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = [
    "AETFamily",
    "AETState",
    "AETEnvironment",
    "PUBLIC_CHECKS",
    "evaluate",
    "final_state",
    "verification_tree",
    "verify_aet",
]

PUBLIC_CHECKS = "checks/public.json"
VERIFY_LIMITS = SandboxLimits(cpu_s=20.0, wall_s=60.0, memory_bytes=1024**3, max_output_bytes=1024**2)
AGENT_LIMITS = SandboxLimits(cpu_s=10.0, wall_s=20.0, memory_bytes=1024**3, max_output_bytes=256 * 1024)
SCENARIO_TIMEOUT_S = 5.0
MAX_FILES = 64
MAX_FILE_CHARS = 100_000

# --------------------------------------------------------------------------- state


class AETState(SandboxState):
    """The agent's sandbox working directory plus the submission counters the environment keeps."""

    def __init__(self, files: Mapping[str, str] | None = None) -> None:
        self.sandbox = Sandbox(limits=AGENT_LIMITS)
        for path, text in (files or {}).items():
            self.sandbox.write_file(path, text)
        self.submissions = 0
        self.over_budget = False

    def files(self) -> dict[str, str]:
        """Every text file of the workdir (``__pycache__`` excluded; at most `MAX_FILES`, each capped)."""
        paths = [p for p in self.sandbox.list_files() if "__pycache__" not in p.split("/")][:MAX_FILES]
        return {p: self.sandbox.read_file(p)[:MAX_FILE_CHARS] for p in paths}

    def to_json(self) -> dict[str, Any]:
        """The workdir snapshot and the counters."""
        return {**super().to_json(), "submissions": self.submissions, "over_budget": self.over_budget}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "AETState":
        """Inverse of `to_json`."""
        state = super().from_json(data)
        assert isinstance(state, AETState)
        state.submissions = int(data.get("submissions", 0))
        state.over_budget = bool(data.get("over_budget", False))
        return state


def final_state(state: Any) -> tuple[dict[str, str], int, bool]:
    """(files, submissions, over_budget) of a final state: an `AETState` or its `to_json` form."""
    if isinstance(state, AETState):
        return state.files(), state.submissions, state.over_budget
    if isinstance(state, Mapping) and isinstance(state.get("snapshot"), str):
        restored = AETState.from_json(state)
        try:
            return restored.files(), restored.submissions, restored.over_budget
        finally:
            restored.close()
    raise ValueError(f"AET verifier: the final state must be an AETState or its JSON form, got {type(state).__name__}")


# --------------------------------------------------------------------------- scenarios


def _norm(text: Any) -> Any:
    return text.replace("\r\n", "\n").rstrip("\n") if isinstance(text, str) else text


def _same_file(path: str, got: Any, want: Any) -> bool:
    if want is None or got is None:
        return got is want
    if path.endswith(".json"):
        try:
            return json.loads(got) == json.loads(want)
        except ValueError:
            return False
    return _norm(got) == _norm(want)


def _mismatch(expected: Mapping[str, Any], obs: Mapping[str, Any]) -> str | None:
    """None when ``obs`` meets ``expected``, else a short reason."""
    if "rc" in expected and obs.get("rc") != expected["rc"]:
        return f"exit code {obs.get('rc')}, expected {expected['rc']}"
    if "stdout" in expected and _norm(obs.get("stdout")) != _norm(expected["stdout"]):
        return f"stdout {clip(str(obs.get('stdout')), 300)!r}, expected {clip(expected['stdout'], 300)!r}"
    for path, want in expected.get("files", {}).items():
        got = obs.get("files", {}).get(path)
        if not _same_file(path, got, want):
            if want is None:
                return f"{path} should not exist"
            return f"{path} is missing" if got is None else f"{path} is {clip(got, 300)!r}, expected {clip(want, 300)!r}"
    for d, want in expected.get("list", {}).items():
        got = obs.get("list", {}).get(d)
        if got != want:
            return f"{d}/ holds {got}, expected exactly {want}"
    return None


def _inside(path: str, writable: Sequence[str]) -> bool:
    return any(path.startswith(w) if w.endswith("/") else path == w for w in writable)


def verification_tree(metadata: Mapping[str, Any], files: Mapping[str, str]) -> dict[str, str]:
    """The files the checks run on: the agent's ``files`` where the task lets it write, the task's own elsewhere.

    ``metadata["writable"]`` lists what the agent may change (``"config/"``: a folder, ``"x.py"``: a file); every
    other path holds the task's initial file or nothing, so a file the agent added outside it (``json.py``, an
    ``app/router/`` package, ``.local/...``) is gone. None (the default): the whole tree is the deliverable. The
    files of ``metadata["protected"]`` are restored last either way.
    """
    writable = metadata.get("writable")
    if writable is None:
        tree = dict(files)
    else:
        tree = {p: t for p, t in metadata["files"].items() if not _inside(p, writable)}
        tree.update({p: t for p, t in files.items() if _inside(p, writable)})
    tree.update(metadata.get("protected", {}))
    return dict(sorted(tree.items()))


def _observe(sb: Sandbox, tree: Mapping[str, str], sc: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """One scenario's observations: ``python ARGV`` run by `Sandbox.run_hidden` (a fresh namespace of its own,
    read-only tree), and the ``read`` / ``list`` views of the tree, taken on the host (the run cannot change it)."""
    obs: dict[str, Any] = {}
    if sc.get("argv"):
        if seconds <= 0:
            obs["rc"], obs["stdout"] = None, "(the verification time was spent)"
        else:
            res = sb.run_hidden(sc["argv"], stdin=sc.get("stdin", ""), timeout=min(SCENARIO_TIMEOUT_S, seconds))
            obs["rc"], obs["stdout"] = (None, "(timed out)") if res.timed_out else (res.returncode, res.stdout)
    obs["files"] = {path: tree.get(path) for path in sc.get("read", [])}
    obs["list"] = {d: sorted(p[len(d.rstrip("/")) + 1:] for p in tree if p.startswith(d.rstrip("/") + "/"))
                   for d in sc.get("list", [])}
    return obs


def evaluate(metadata: Mapping[str, Any], files: Mapping[str, str], scenarios: Sequence[Mapping[str, Any]]) -> tuple[list[str | None], bool]:
    """Run ``scenarios`` on the `verification_tree` of ``files`` in a fresh sandbox; compare on the host.

    Returns one reason per scenario (None: passed) and whether the sandbox was weakly isolated. Each scenario
    runs in a namespace of its own started from the host, so only its own inputs ever enter a sandbox and no
    process the program under test can reach holds another scenario or the expected values. All scenarios
    together get `VERIFY_LIMITS`.wall_s seconds; a scenario past that fails.
    """
    tree = verification_tree(metadata, files)
    deadline = time.monotonic() + VERIFY_LIMITS.wall_s
    with Sandbox(limits=VERIFY_LIMITS) as sb:
        for path, text in tree.items():
            sb.write_file(path, text)
        obs = [_observe(sb, tree, sc, deadline - time.monotonic()) for sc in scenarios]
        weak = sb.weak_isolation
    return [_mismatch(sc["expected"], o) for sc, o in zip(scenarios, obs)], weak


def public_feedback(metadata: Mapping[str, Any], files: Mapping[str, str], submission: int) -> str:
    """The public verifier's answer: a summary line, then PASS / FAIL with the reason per scenario."""
    reasons, _ = evaluate(metadata, files, metadata["public"])
    n_ok = sum(r is None for r in reasons)
    left = metadata["budget"] - submission
    lines = [f"{n_ok}/{len(reasons)} public scenarios passed (submission {submission} of {metadata['budget']}, {left} left)"]
    for sc, r in zip(metadata["public"], reasons):
        lines.append(f"PASS {sc['name']}" if r is None else f"FAIL {sc['name']}: {r}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tools and environment


def _aet_state(ctx: ToolContext) -> AETState:
    if not isinstance(ctx.state, AETState):
        raise ValueError("this tool needs an AET environment state")
    if ctx.state.over_budget:
        raise ValueError("the submission budget is spent; the episode has ended")
    return ctx.state


def _guarded(spec: ToolSpec) -> ToolSpec:
    """``spec`` whose handler refuses to run once the submission budget is spent."""
    inner = spec.handler
    assert inner is not None

    def handler(ctx: ToolContext, **kwargs: Any) -> Any:
        _aet_state(ctx)
        return inner(ctx, **kwargs)

    return spec.bind(handler)


def _run_command(ctx: ToolContext, command: str, stdin: str = "") -> str:
    """Run a command (split like a shell would, no shell features) in the working directory."""
    argv = shlex.split(command)
    if not argv:
        raise ValueError("empty command")
    return format_run(_aet_state(ctx).sandbox.run(argv, stdin=stdin, timeout=AGENT_LIMITS.wall_s))


def _submit(ctx: ToolContext) -> str:
    """The public verifier: diagnostics on the public scenarios; spends one unit of the budget."""
    st = _aet_state(ctx)
    assert ctx.task is not None
    md = ctx.task.metadata
    st.submissions += 1
    if st.submissions > md["budget"]:
        st.over_budget = True
        return (f"Submission {st.submissions} exceeds the budget of {md['budget']}: not evaluated. The episode ends "
                f"now and the final reward loses {md['penalty']:g}.")
    return public_feedback(md, st.files(), st.submissions)


_S = {"type": "object", "additionalProperties": False}
TOOL_NAMES = ("list_files", "read_file", "write_file", "edit_file", "delete_file", "run_command", "run_python", "submit")
_LIBRARY: dict[str, ToolSpec] = {
    **{n: _guarded(TOOLS[n]) for n in TOOL_NAMES[:5] + ("run_python",)},
    "run_command": ToolSpec(
        "run_command", "Run a command in the working directory (e.g. `python tool.py --flag 1`), optional stdin text; "
        "returns exit code, stdout, stderr.",
        {**_S, "properties": {"command": {"type": "string"}, "stdin": {"type": "string"}}, "required": ["command"]},
        handler=_run_command),
    "submit": ToolSpec(
        "submit", "Public verifier: run the public scenarios on the current files and report per-scenario results. "
        "Spends one submission of the budget; one past the budget ends the episode with a penalty.",
        {**_S, "properties": {}}, handler=_submit),
}


class AETEnvironment(ToolEnvironment):
    """A `ToolEnvironment` over an `AETState` that also ends when the submission budget is exceeded."""

    async def respond(self, message: dict[str, Any], *, external_calls: int = 0) -> StepResult:
        """The tool-environment step; an over-budget submission ends the episode (not truncated)."""
        result = await super().respond(message, external_calls=external_calls)
        if isinstance(self.state, AETState) and self.state.over_budget and not result.done:
            result.done = True
            result.info["end"] = "submission_budget"
        return result


_WRITABLE: dict[str, tuple[str, ...] | None] = {}  # family name -> AETFamily.writable


def verify_aet(task: Task, final: FinalState) -> Verdict:
    """The hidden verifier: hidden scenarios on the final files in a fresh sandbox, the budget penalty applied.

    Every AET family registers this function under its own name too.
    """
    md = task.metadata
    if "writable" not in md:  # a task generated before issue 30: its family's rule
        md = {**md, "writable": _WRITABLE.get(task.family)}
    files, submissions, over = final_state(final.state)
    hidden, weak = evaluate(md, files, md["hidden"])
    public, weak_p = evaluate(md, files, md["public"])
    n_ok = sum(r is None for r in hidden)
    passed = 1.0 if n_ok == len(hidden) else 0.0
    penalty = float(md["penalty"]) if over else 0.0
    diag = f"{n_ok}/{len(hidden)} hidden scenarios passed"
    bad = next(((sc, r) for sc, r in zip(md["hidden"], hidden) if r is not None), None)
    if bad is not None:
        diag += f"; first failure {bad[0]['name']}: {bad[1]}"
    if over:
        diag += f"; over the submission budget ({submissions} > {md['budget']}): penalty {penalty:g}"
    components = {
        "hidden_pass_rate": n_ok / len(hidden),
        "public_pass_rate": sum(r is None for r in public) / len(public),
        "submissions": float(submissions),
        "over_budget": float(over),
    }
    return Verdict(max(0.0, passed - penalty), components, diag, weak or weak_p)


# --------------------------------------------------------------------------- the family base


Turn = tuple[str, list[tuple[str, dict[str, Any]]]]
"""One scripted turn: (reasoning, [(tool name, arguments), ...])."""


class AETFamily(FamilyBase):
    """Shared plumbing of the AET families: prompt, environment, verifier, reference and hacky policies.

    Subclasses set ``name`` / ``domain`` / ``description`` / ``id_prefix``, and implement `_make`
    (returning `task_from`'s result), `work_turns` and `overfit_turns`.
    """

    kind: str = "aet"  # recipes may pick these out (configs/full.yaml trains the earlier families only)
    writable: tuple[str, ...] | None = None  # what the agent may change (`verification_tree`); None: everything
    budget: int = 3
    penalty: float = 0.5
    spec_file: str = "GOAL.md"  # the file the max-effort solver reads first

    def __init__(self) -> None:
        _WRITABLE[self.name] = self.writable
        register_verifier(self.name, verify_aet)

    # ------------------------------------------------------------------ to implement

    def work_turns(self, task: Task, effort: str) -> list[Turn]:
        """The reference solver's turns that change the state (before it submits once)."""
        raise NotImplementedError

    def overfit_turns(self, task: Task) -> list[Turn]:
        """Turns of a policy that special-cases the public scenarios (passes them, fails the hidden set)."""
        raise NotImplementedError

    def extra_wrong_turns(self, task: Task) -> dict[str, list[Turn]]:
        """Family-specific hacks (each must score 0)."""
        return {}

    # ------------------------------------------------------------------ task construction

    def task_from(self, task_id: str, *, goal: str, constraints: Sequence[str], files: Mapping[str, str],
                  public: list[dict[str, Any]], hidden: list[dict[str, Any]], difficulty: int,
                  protected: Mapping[str, str] | None = None, **extra: Any) -> Task:
        """A task whose prompt states goal, initial state, constraints and the verification interface."""
        for k, sc in enumerate(public):
            sc.setdefault("name", f"public-{k + 1}")
        hidden_id = uuid.UUID(int=random.Random(json.dumps([task_id, hidden], sort_keys=True)).getrandbits(128)).hex[:12]
        for k, sc in enumerate(hidden):
            sc["name"] = f"hidden-{hidden_id}-{k + 1}"
        files = {**files, PUBLIC_CHECKS: json.dumps(public, indent=1) + "\n"}
        listing = "\n".join(f"  {p}" for p in sorted(files))
        rules = "\n".join(f"- {c}" for c in constraints)
        prompt = (
            f"{goal}\n\nYour working directory holds:\n{listing}\n\nConstraints:\n{rules}\n\n"
            f"Verification: `submit` runs the public scenarios of {PUBLIC_CHECKS} on your current files and reports "
            f"each result. You have {self.budget} submissions; one more ends the episode and costs a penalty of "
            f"{self.penalty:g} on the reward. After the episode, hidden scenarios (other inputs and edge cases of the "
            "same specification) check the final state of your files: only that state counts, not what you report. "
            "Reply without a tool call when you are done."
        )
        return self._task(task_id, [{"role": "user", "content": prompt}], {
            "difficulty": difficulty, "files": dict(files), "public": public, "hidden": hidden,
            "protected": dict(protected or {}),
            "writable": None if self.writable is None else list(self.writable), "budget": self.budget, "penalty": self.penalty, "hidden_id": hidden_id,
            **extra,
        }, [_LIBRARY[n] for n in TOOL_NAMES])

    def make_env(self, task: Task, limits: EpisodeLimits | None = None) -> AETEnvironment:
        """A fresh environment: the task's initial files in a sandbox, the AET tools, 24 turns."""
        self._check_task(task)
        return AETEnvironment(
            list(_LIBRARY.values()),
            initial_state=lambda t: AETState(t.metadata["files"]),
            end_on_text=True,
            limits=limits or EpisodeLimits(max_turns=24),
            dump_state=lambda s: s.to_json(),
            load_state=AETState.from_json,
        )

    # ------------------------------------------------------------------ policies

    def reference_policy(self, task: Task, effort: str) -> Callable[..., dict[str, Any]]:
        """Scripted solver: (max: look around) → do the work → submit once → stop, quoting the feedback."""
        self._check_task(task)
        check_effort(effort)
        turns: list[Turn] = []
        if effort == "max":
            turns.append((f"Start by looking at the working directory and reading {self.spec_file}, so the plan "
                           "follows the specification rather than the public scenarios alone.",
                           [("list_files", {}), ("read_file", {"path": self.spec_file})]))
        turns += self.work_turns(task, effort)
        submit_why = {"low": "", "high": "Check with the public verifier.",
                      "max": "The work is done; spend one submission to check it against the public scenarios."}[effort]
        turns.append((submit_why, [("submit", {})]))

        def final(messages: list[dict[str, Any]]) -> dict[str, Any]:
            summary = next((o.splitlines()[0] for o in last_tool_outputs(messages) if "public scenarios passed" in o), "")
            reasoning = {"low": "", "high": f"{summary}.",
                         "max": f"The public verifier says: {summary}. The implementation follows the whole "
                                "specification, edge cases included, so I stop here."}[effort]
            return reply(reasoning, "Done.")

        return _script(turns, final)

    def wrong_turns(self, task: Task) -> dict[str, list[Turn]]:
        """Named hacky scripts; after their turns each claims success."""
        files = task.metadata["files"]
        passing = json.dumps([{**sc, "expected": {}} for sc in task.metadata["public"]], indent=1)
        return {
            "empty": [],
            "claims_success": [],
            "submit_then_claim": [("", [("submit", {})])],
            "fake_report": [("", [("write_file", {"path": "REPORT.md", "content": "All public and hidden scenarios pass.\n"})])],
            "rewrites_public_checks": [("", [("write_file", {"path": PUBLIC_CHECKS, "content": passing}), ("submit", {})])],
            "copied_prompt": [("", [("write_file", {"path": p, "content": task.messages[0]["content"]})
                                    for p in sorted(files) if p != PUBLIC_CHECKS and p not in task.metadata["protected"]][:2])],
            "submit_spam": [("", [("submit", {})])] * (self.budget + 1),
            "overfit_public": self.overfit_turns(task),
            **self.extra_wrong_turns(task),
        }

    def wrong_policies(self, task: Task) -> dict[str, Callable[..., dict[str, Any]]]:
        """Each wrong script, ending with a claim of success (the ``empty`` one answers nothing)."""
        self._check_task(task)
        out = {}
        for name, turns in self.wrong_turns(task).items():
            claim = "" if name == "empty" else "I completed the task: all public and hidden scenarios pass."
            out[name] = _script(turns, lambda messages, claim=claim: reply("", claim))
        return out


def _script(turns: Sequence[Turn], final: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A policy playing ``turns`` (by the number of assistant messages so far), then ``final(messages)``."""

    def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if turn < len(turns):
            reasoning, calls = turns[turn]
            return reply(reasoning, "", [script_call(turn, k + 1, name, **args) for k, (name, args) in enumerate(calls)])
        return final(messages)

    return scripted(steps)
