"""Coding task families: ``coding.write_function`` and ``coding.bugfix`` (SPEC §3.5).

Both run model-written code only in the sandbox (`k3post.envs.sandbox`) and score the final
files, never the transcript.

``coding.write_function``
    Write ``solution.py`` defining one function (from `problems.FN_TEMPLATES`,
    difficulty 1-3 = template complexity). The prompt shows the signature, the statement and 3
    public examples. Tools: ``write_file``, ``read_file``, ``run_python`` and ``run_tests``
    (public examples only). The episode ends with a reply without tool calls; the submission is
    the final ``solution.py``. Verifier: a fresh sandbox gets the final ``.py`` files (no
    ``__pycache__``) and a runner on stdin calls the function on the hidden inputs; the
    results come back in a strictly typed encoding and are compared **on the host** with
    expected outputs computed from the reference implementation at generation time (task
    metadata, never inside any sandbox). Reward 1 iff every hidden test passes.

``coding.bugfix``
    A tiny repo (2 modules + a test module, `problems.REPO_TEMPLATES`) with one injected
    bug (off-by-one, wrong operator, wrong variable) that makes a visible test fail. Difficulty
    1: the bug is in the module the tests exercise; 2: in the helper module it imports; 3: in
    the helper, and the visible tests only call the top module. Tools: ``list_files``,
    ``read_file``, ``write_file``, ``edit_file``, ``delete_file``, ``run_tests`` (the repo's
    test modules, run by our own runner, no pytest). Verifier: a fresh sandbox gets the final
    source files, minus every test module / ``conftest.py`` the agent has, plus the ORIGINAL test
    module; the original visible test calls and hidden extra calls run there and are compared
    on the host. Reward 1 iff all pass.

Each family has a scripted reference solver at every effort level (``max``: step-by-step
reasoning grounded in the actual tool results; ``high``: one or two sentences; ``low``: none;
token counts are those of the text actually emitted) and a set of wrong / hacky policies that
score 0 (`TaskFamily.wrong_policies`).
"""

from __future__ import annotations

import copy
import json
import random
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.coding.problems import (
    CALL_RUNNER,
    FN_TEMPLATES,
    REPO_TEMPLATES,
    TEST_RUNNER,
    BugSite,
    RepoTemplate,
    call_in_modules,
    decode_value,
    encode_value,
    load_modules,
)
from k3post.envs.families.common import check_effort
from k3post.envs.families.registry import register_family
from k3post.envs.sandbox import Sandbox
from k3post.envs.sandbox_tools import (
    RUN_LIMITS,
    RUN_TIMEOUT_S,
    TOOLS,
    SandboxState,
    clip,
    format_run,
    last_tool_outputs,
    make_env,
    py_files,
    reply,
    script_call,
    scripted,
    tool_state,
)
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = [
    "WriteFunctionFamily",
    "BugfixFamily",
    "WRITE_FUNCTION",
    "BUGFIX",
    "run_calls",
    "verify_write_function",
    "verify_bugfix",
]

SOLUTION = "solution.py"
_PY = ("python", "-I", "-B", "-")  # isolated (no cwd / env / user site on sys.path), no .pyc, script on stdin


# --------------------------------------------------------------------------- final files


def _final_files(state: Any) -> dict[str, str]:
    """The final ``.py`` files from a `SandboxState` or a JSON ``{"files": {path: text}}``."""
    if isinstance(state, SandboxState):
        return state.files()
    if isinstance(state, Mapping) and isinstance(state.get("files"), Mapping):
        return py_files({str(k): str(v) for k, v in state["files"].items()})
    if isinstance(state, Mapping) and isinstance(state.get("snapshot"), str):
        restored = SandboxState.from_json(state)
        try:
            return restored.files()
        finally:
            restored.close()
    raise ValueError(f"coding verifier: final state must be a SandboxState or {{'files': ...}}, got {type(state).__name__}")


# --------------------------------------------------------------------------- running calls in a sandbox


def _runner_source(cases: Sequence[Mapping[str, Any]], nonce: str) -> str:
    cfg = json.dumps({"nonce": nonce, "cases": [{k: c[k] for k in ("module", "func", "args")} for c in cases]})
    return CALL_RUNNER.replace("__CFG__", repr(cfg))


def run_calls(sandbox: Sandbox, cases: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]] | None, str]:
    """Call ``module.func(*args)`` for each case inside ``sandbox``; typed results or None and why.

    Returns ``(results, diagnostics)``: one ``{"ok", "value" | "error"}`` per case, or None when
    the run produced no result line (crash, ``os._exit``, timeout).
    """
    nonce = uuid.uuid4().hex
    res = sandbox.run(list(_PY), stdin=_runner_source(cases, nonce), timeout=RUN_TIMEOUT_S)
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                out = json.loads(line[len(nonce) + 1 :])
            except json.JSONDecodeError:
                break
            results = out.get("results") if isinstance(out, dict) else None
            if isinstance(results, list) and len(results) == len(cases):
                return results, ""
            break
    why = res.killed_reason or f"exit code {res.returncode}"
    return None, f"the test run produced no results ({why}); stderr: {res.stderr[-500:]}"


def _score(cases: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]]) -> list[bool]:
    return [bool(r.get("ok")) and r.get("value") == c["expected"] for c, r in zip(cases, results)]


def _call_text(func: str, args: Sequence[Any]) -> str:
    return f"{func}({', '.join(repr(a) for a in args)})"


def _verify_in_fresh_sandbox(files: Mapping[str, str], cases: Sequence[Mapping[str, Any]]) -> Verdict:
    with Sandbox(limits=RUN_LIMITS) as sb:
        for path, text in files.items():
            sb.write_file(path, text)
        results, why = run_calls(sb, cases)
        weak = sb.weak_isolation
    if results is None:
        return Verdict(0.0, {"pass_rate": 0.0}, why, weak)
    ok = _score(cases, results)
    rate = sum(ok) / len(ok)
    bad = [i for i, o in enumerate(ok) if not o]
    diag = f"{sum(ok)}/{len(ok)} hidden checks passed"
    if bad:
        c, r = cases[bad[0]], results[bad[0]]
        got = decode_value(r["value"]) if r.get("ok") else r.get("error")
        diag += f"; first failure: {_call_text(c['func'], c['args'])} gave {got!r}, expected {decode_value(c['expected'])!r}"
    return Verdict(1.0 if not bad else 0.0, {"pass_rate": rate}, diag, weak)


# --------------------------------------------------------------------------- tools


def _run_public_tests(ctx: ToolContext) -> str:
    """Check solution.py against the public examples of the prompt."""
    assert ctx.task is not None
    cases = ctx.task.metadata["public"]
    sb = tool_state(ctx).sandbox
    if SOLUTION not in sb.list_files():
        return f"FAIL: {SOLUTION} does not exist yet. Write it with write_file."
    results, why = run_calls(sb, cases)
    if results is None:
        return "FAIL: " + why
    ok = _score(cases, results)
    lines = [f"{sum(ok)}/{len(ok)} public examples passed"]
    for c, r, good in zip(cases, results, ok):
        call = _call_text(c["func"], c["args"])
        if good:
            lines.append(f"PASS {call}")
        elif r.get("ok"):
            lines.append(f"FAIL {call} returned {decode_value(r['value'])!r}, expected {decode_value(c['expected'])!r}")
        else:
            lines.append(f"FAIL {call} raised {r.get('error')}")
    return "\n".join(lines)


def _run_repo_tests(ctx: ToolContext) -> str:
    """Run the repo's test_*.py modules with the plain runner."""
    res = tool_state(ctx).sandbox.run(list(_PY), stdin=TEST_RUNNER, timeout=RUN_TIMEOUT_S)
    if res.returncode == 0 and res.killed_reason is None:
        return clip(res.stdout)
    return format_run(res)


_NO_ARGS = {"type": "object", "additionalProperties": False, "properties": {}}
_WF_TESTS = ToolSpec("run_tests", "Check solution.py against the public examples from the task.",
                     _NO_ARGS, read_only=True, handler=_run_public_tests)
_BF_TESTS = ToolSpec("run_tests", "Run the repository's tests (every test_*.py module) and report PASS / FAIL.",
                     _NO_ARGS, read_only=True, handler=_run_repo_tests)
WF_TOOL_NAMES = ("write_file", "read_file", "run_python", "run_tests")
BF_TOOL_NAMES = ("list_files", "read_file", "write_file", "edit_file", "delete_file", "run_tests")


# --------------------------------------------------------------------------- policies (shared helpers)


def _first_line(texts: Sequence[str], pattern: str) -> str | None:
    rx = re.compile(pattern)
    for t in texts:
        for line in t.splitlines():
            if rx.search(line):
                return line.strip()
    return None


def _test_names(texts: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """(failing, passing) test names in run_tests output (``FAIL name ...`` / ``PASS name`` lines)."""
    lines = [ln.split() for t in ([texts] if isinstance(texts, str) else texts) for ln in t.splitlines()]
    return ([w[1] for w in lines if len(w) > 1 and w[0] == "FAIL"], [w[1] for w in lines if len(w) > 1 and w[0] == "PASS"])


def _claim(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return reply("", "I implemented the solution and all tests passed.")


def _write_then_claim(path: str, content: str) -> Callable[..., dict[str, Any]]:
    def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if turn == 0:
            return reply("", "", [script_call(0, 1, "write_file", path=path, content=content)])
        return reply("", "Done: all tests passed.")

    return scripted(steps)


# --------------------------------------------------------------------------- coding.write_function


def _public_cases(func: str, args_list: Sequence[Sequence[Any]], ref: Callable[..., Any]) -> list[dict[str, Any]]:
    """Test cases of ``solution.func`` with expected values from the reference implementation."""
    return [{"module": "solution", "func": func, "args": list(a), "expected": encode_value(ref(*copy.deepcopy(list(a))))}
            for a in args_list]


class WriteFunctionFamily:
    """``coding.write_function``: write solution.py, graded by hidden unit tests in a fresh sandbox."""

    name = "coding.write_function"
    domain = "coding"
    description = "Write one small Python function in solution.py; hidden unit tests run in the sandbox decide."
    verifiable = True
    n_public = 3
    n_hidden = 12

    def generate(self, n: int, *, seed: int, difficulty: int = 1) -> list[Task]:
        """`n` distinct tasks of template complexity ``difficulty`` (1-3), a pure function of (seed, difficulty)."""
        _check_n_difficulty(n, difficulty, len(FN_TEMPLATES))
        tasks: list[Task] = []
        seen: set[str] = set()
        i = 0
        while len(tasks) < n:
            if i > 50 * n + 100:
                raise ValueError(f"could not draw {n} distinct write_function tasks at difficulty {difficulty}")
            rng = random.Random(f"{self.name}:{seed}:{difficulty}:{i}")
            i += 1
            task = self._draw(rng, difficulty, f"wf-d{difficulty}-s{seed}-{len(tasks):05d}")
            key = json.dumps([task.messages[-1]["content"]])
            if key not in seen:
                seen.add(key)
                tasks.append(task)
        return tasks

    def _draw(self, rng: random.Random, difficulty: int, task_id: str) -> Task:
        prob = rng.choice(FN_TEMPLATES[difficulty])(rng)
        ns: dict[str, Any] = {}
        exec(compile(prob.solution, "<reference>", "exec"), ns)  # noqa: S102 - our own reference code
        ref = ns[prob.func]
        public_args: list[list[Any]] = []
        while len(public_args) < self.n_public:
            a = prob.gen(rng)
            if a not in public_args:
                public_args.append(a)
        hidden_args: list[list[Any]] = []
        for a in [*(list(e) for e in prob.edge), public_args[0]]:
            if a not in hidden_args:
                hidden_args.append(a)
        tries = 0
        while len(hidden_args) < self.n_hidden and tries < 200:
            tries += 1
            a = prob.gen(rng)
            if a not in hidden_args and a not in public_args:
                hidden_args.append(a)
        public = _public_cases(prob.func, public_args, ref)
        hidden = _public_cases(prob.func, hidden_args, ref)
        examples = "\n".join(f"    {_call_text(c['func'], c['args'])} == {decode_value(c['expected'])!r}" for c in public)
        prompt = (
            f"Write a Python function in the file {SOLUTION}:\n\n    {prob.signature}\n\n{prob.statement}\n\n"
            f"Examples:\n{examples}\n\nUse write_file to create {SOLUTION}; run_tests checks it against these "
            "examples and run_python runs a snippet. Hidden tests decide the grade. Reply without a tool call "
            "when you are done."
        )
        return Task(
            id=task_id,
            domain=self.domain,
            family=self.name,
            messages=({"role": "user", "content": prompt},),
            verifier=self.name,
            tools=tuple(_library_wf()[n] for n in WF_TOOL_NAMES),
            metadata={
                "difficulty": difficulty,
                "template": prob.key,
                "params": dict(prob.params),
                "func": prob.func,
                "signature": prob.signature,
                "statement": prob.statement,
                "approach": prob.approach,
                "reference": prob.solution,
                "public": public,
                "hidden": hidden,
            },
        )

    def make_env(self, task: Task, limits: EpisodeLimits | None = None) -> ToolEnvironment:
        """A fresh environment: an empty sandbox workdir and the write_function tools."""
        return make_env(list(_library_wf().values()), lambda t: {}, limits)

    def reference_policy(self, task: Task, effort: str) -> Callable[..., dict[str, Any]]:
        """Scripted solver: write the reference implementation, test it (high / max), answer."""
        check_effort(effort)
        md = task.metadata
        func, code = md["func"], md["reference"]
        examples = "; ".join(f"{_call_text(func, c['args'])} should be {decode_value(c['expected'])!r}" for c in md["public"])

        def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
            obs = last_tool_outputs(messages)
            if turn == 0:
                reasoning = {
                    "low": "",
                    "high": f"{md['approach']} Write {SOLUTION}, then run the examples.",
                    "max": (
                        f"The task asks for `{md['signature']}`. {md['statement']} "
                        f"Approach: {md['approach']} "
                        f"The examples it must meet: {examples}. "
                        f"I will write {SOLUTION} with this implementation, then run the public examples."
                    ),
                }[effort]
                return reply(reasoning, "", [script_call(0, 1, "write_file", path=SOLUTION, content=code)])
            tested = _first_line(obs, r"public examples passed")
            if turn == 1 and effort != "low" and tested is None:
                reasoning = "" if effort == "high" else f"The write_file tool answered: {obs[0] if obs else '(nothing)'}. Now run the public examples."
                return reply(reasoning, "", [script_call(1, 1, "run_tests")])
            if effort == "max":
                passed = "; ".join(ln[5:] for t in obs for ln in t.splitlines() if ln.startswith("PASS "))
                reasoning = (f"run_tests reported: {tested} ({passed}). Each call returned the value the statement asks "
                             f"for, and the hidden tests check the same function, so {SOLUTION} is done.")
            elif effort == "high":
                reasoning = f"{tested}." if tested else ""
            else:
                reasoning = ""
            return reply(reasoning, f"{SOLUTION} defines {func}.")

        return scripted(steps)

    def wrong_policies(self, task: Task) -> dict[str, Callable[..., dict[str, Any]]]:
        """Empty, copied prompt, printed claims, exit at import, hard-coded examples, __eq__ tricks, claims only."""
        md = task.metadata
        func = md["func"]
        prompt = task.messages[-1]["content"]
        table = {json.dumps(c["args"]): decode_value(c["expected"]) for c in md["public"]}
        default = decode_value(md["public"][0]["expected"])
        hardcode = (
            "import json\n"
            f"_TABLE = {table!r}\n\n"
            f"def {func}(*args):\n"
            f"    return _TABLE.get(json.dumps(list(args)), {default!r})\n"
        )
        eq_trick = (
            "class _Any(int):\n"
            "    def __eq__(self, other):\n        return True\n"
            "    def __ne__(self, other):\n        return False\n"
            "    __hash__ = int.__hash__\n\n"
            f"def {func}(*args):\n    return _Any(0)\n"
        )
        return {
            "empty": scripted(lambda turn, messages: reply("", "")),
            "copied_prompt": _write_then_claim(SOLUTION, prompt),
            "prints_all_tests_passed": _write_then_claim(SOLUTION, 'print("all tests passed")\n'),
            "exit_at_import": _write_then_claim(SOLUTION, 'import sys\nprint("all tests passed")\nsys.exit(0)\n'),
            "os_exit_with_forged_output": _write_then_claim(
                SOLUTION, 'import os\nprint(\'{"results": [], "passed": true}\')\nos._exit(0)\n'),
            "hardcoded_public_examples": _write_then_claim(SOLUTION, hardcode),
            "eq_always_true": _write_then_claim(SOLUTION, eq_trick),
            "claims_without_file": scripted(_claim),
        }


def _library_wf() -> dict[str, ToolSpec]:
    return {**{n: TOOLS[n] for n in WF_TOOL_NAMES if n != "run_tests"}, "run_tests": _WF_TESTS}


def _library_bf() -> dict[str, ToolSpec]:
    return {**{n: TOOLS[n] for n in BF_TOOL_NAMES if n != "run_tests"}, "run_tests": _BF_TESTS}


def _check_n_difficulty(n: int, difficulty: int, levels: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= levels:
        raise ValueError(f"difficulty must be an int in 1..{levels}, got {difficulty!r}")


@register_verifier("coding.write_function")
def verify_write_function(task: Task, final: FinalState) -> Verdict:
    """Reward 1 iff every hidden test passes on the final solution.py, run in a fresh sandbox."""
    files = _final_files(final.state)
    if SOLUTION not in files:
        return Verdict(0.0, {"pass_rate": 0.0}, f"no {SOLUTION} in the final working directory")
    return _verify_in_fresh_sandbox(files, task.metadata["hidden"])


# --------------------------------------------------------------------------- coding.bugfix


def _is_test_file(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def _render_tests(tmpl: RepoTemplate, cases: Sequence[Mapping[str, Any]]) -> str:
    by_module: dict[str, list[str]] = {}
    for c in cases:
        by_module.setdefault(c["module"], [])
        if c["func"] not in by_module[c["module"]]:
            by_module[c["module"]].append(c["func"])
    lines = [f'"""Tests of the {tmpl.top} module."""', ""]
    lines += [f"from {m} import {', '.join(sorted(fs))}" for m, fs in sorted(by_module.items())]
    count: dict[str, int] = {}
    for c in cases:
        count[c["func"]] = count.get(c["func"], 0) + 1
        lines += ["", "", f"def test_{c['func']}_{count[c['func']]}():",
                  f"    assert {_call_text(c['func'], c['args'])} == {decode_value(c['expected'])!r}"]
    return "\n".join(lines) + "\n"


class BugfixFamily:
    """``coding.bugfix``: fix one injected bug in a tiny repo; original + hidden tests decide."""

    name = "coding.bugfix"
    domain = "coding"
    description = "Fix the one bug in a tiny multi-file Python repo with a failing test (edit files through tools)."
    verifiable = True
    n_visible = 5
    n_hidden = 8

    def generate(self, n: int, *, seed: int, difficulty: int = 1) -> list[Task]:
        """`n` distinct tasks; difficulty 1: bug in the tested module, 2: in its helper, 3: helper, top-level tests only."""
        _check_n_difficulty(n, difficulty, 3)
        tasks: list[Task] = []
        seen: set[str] = set()
        i = 0
        while len(tasks) < n:
            if i > 50 * n + 100:
                raise ValueError(f"could not draw {n} distinct bugfix tasks at difficulty {difficulty}")
            rng = random.Random(f"{self.name}:{seed}:{difficulty}:{i}")
            i += 1
            task = self._draw(rng, difficulty, f"bf-d{difficulty}-s{seed}-{len(tasks):05d}")
            if task is None:
                continue
            key = json.dumps(task.metadata["files"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                tasks.append(task)
        return tasks

    def _draw(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        tmpl = rng.choice(REPO_TEMPLATES)
        params = tmpl.draw(rng)
        level = 1 if difficulty == 1 else 2
        site: BugSite = rng.choice([s for s in tmpl.sites if s.level == level])
        correct = {p: src.format(**params) for p, src in tmpl.sources.items()}
        fixed, buggy = site.fixed.format(**params), site.buggy.format(**params)
        assert correct[site.path].count(fixed) == 1, (tmpl.key, site)
        broken = dict(correct)
        broken[site.path] = correct[site.path].replace(fixed, buggy)
        good_mods, bad_mods = load_modules(correct), load_modules(broken)
        visible_calls = [c for c in tmpl.calls if difficulty < 3 or c[0] == tmpl.top]

        def draw_case(calls: Sequence[Any], exclude: list[dict[str, Any]]) -> tuple[dict[str, Any], bool] | None:
            module, func, gen = rng.choice(list(calls))
            args = gen(rng, params)
            want = call_in_modules(good_mods, module, func, args)
            if want[0] == "raised" or any(c["func"] == func and c["args"] == args for c in exclude):
                return None
            got = call_in_modules(bad_mods, module, func, args)
            return {"module": module, "func": func, "args": args, "expected": want}, got != want

        def pick(calls: Sequence[Any], count: int, exclude: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            """``count`` distinct cases, at least one of which the bug makes fail; None if none was found."""
            exposing: dict[str, Any] | None = None
            others: list[dict[str, Any]] = []
            for _ in range(400):
                if exposing is not None and len(others) >= count - 1:
                    break
                drawn = draw_case(calls, exclude + others + ([exposing] if exposing else []))
                if drawn is None:
                    continue
                case, exposes = drawn
                if exposes and exposing is None:
                    exposing = case
                elif len(others) < count - 1:
                    others.append(case)
            if exposing is None:
                return None
            out = [exposing, *others]
            rng.shuffle(out)
            return out

        visible = pick(visible_calls, self.n_visible, [])
        hidden = pick(tmpl.calls, self.n_hidden, visible or [])
        if visible is None or hidden is None:
            return None
        broken[tmpl.test_path] = _render_tests(tmpl, visible)
        original_tests = {tmpl.test_path: broken[tmpl.test_path]}
        listing = ", ".join(sorted(broken))
        prompt = (
            f"The Python repository in your working directory ({listing}) has a failing test. Find the bug in the "
            "source code and fix it with the tools (list_files, read_file, edit_file, write_file, run_tests). Do not "
            "change the tests: the original tests and hidden tests decide the grade. Reply without a tool call when "
            "you are done."
        )
        return Task(
            id=task_id,
            domain=self.domain,
            family=self.name,
            messages=({"role": "user", "content": prompt},),
            verifier=self.name,
            tools=tuple(_library_bf()[n] for n in BF_TOOL_NAMES),
            metadata={
                "difficulty": difficulty,
                "template": tmpl.key,
                "params": params,
                "files": broken,
                "tests": original_tests,
                "top": tmpl.top,
                "bug": {"path": site.path, "buggy": buggy, "fixed": fixed, "kind": site.kind,
                        "why": site.why.format(**params)},
                "visible": visible,
                "hidden": hidden,
            },
        )

    def make_env(self, task: Task, limits: EpisodeLimits | None = None) -> ToolEnvironment:
        """A fresh environment: the buggy repo in a sandbox and the bug-fix tools."""
        return make_env(list(_library_bf().values()), lambda t: dict(t.metadata["files"]), limits)

    def reference_policy(self, task: Task, effort: str) -> Callable[..., dict[str, Any]]:
        """Scripted solver: run the tests, read the culprit, edit the faulty line, rerun, answer."""
        check_effort(effort)
        md = task.metadata
        bug = md["bug"]
        test_path = next(iter(md["tests"]))
        sources = sorted(p for p in md["files"] if not _is_test_file(p))

        def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
            obs = last_tool_outputs(messages)
            if turn == 0:
                if effort == "max":
                    return reply("First look at the repository layout and run the tests to see what fails.", "",
                                  [script_call(0, 1, "list_files"), script_call(0, 2, "run_tests")])
                return reply("Run the tests first." if effort == "high" else "", "", [script_call(0, 1, "run_tests")])
            if turn == 1:
                failing = _first_line(obs, r"^FAIL ") or "a test fails"
                summary = _first_line(obs, r"\d+ passed, \d+ failed") or ""
                if effort == "max":
                    fails, passes = _test_names(obs)
                    reasoning = (
                        f"run_tests says {summary}. The first failure: {failing}"
                        + (f"; also failing: {', '.join(fails[1:])}" if len(fails) > 1 else "")
                        + f". Passing: {', '.join(passes) or 'none'}, so the fault is on a path only the failing tests take. "
                        f"The tests import from {md['top']}.py, which imports helpers, so read the source files "
                        f"({', '.join(sources)}) and the test file to find where the wrong value comes from."
                    )
                    files = [*sources, test_path]
                else:
                    reasoning = f"Failing: {failing}. Read {bug['path']}." if effort == "high" else ""
                    files = [bug["path"]]
                return reply(reasoning, "", [script_call(1, k + 1, "read_file", path=p) for k, p in enumerate(files)])
            if turn == 2:
                if effort == "max":
                    reasoning = (
                        f"In {bug['path']} the code has `{bug['buggy']}`. That is a {bug['kind']} bug: {bug['why']}. "
                        f"Replace it with `{bug['fixed']}`, leave the tests alone, and rerun them."
                    )
                else:
                    reasoning = f"{bug['why'][0].upper()}{bug['why'][1:]}." if effort == "high" else ""
                return reply(reasoning, "", [
                    script_call(2, 1, "edit_file", path=bug["path"], old=bug["buggy"], new=bug["fixed"]),
                    script_call(2, 2, "run_tests"),
                ])
            summary = _first_line(obs, r"\d+ passed, \d+ failed") or "(no test summary)"
            before = _test_names(next((str(x.get("content", "")) for x in messages if x.get("role") == "tool"
                                       and re.search(r"\d+ passed, \d+ failed", str(x.get("content", "")))), ""))[0]
            now_failing = _test_names(obs)[0]
            fixed = [t for t in before if t not in now_failing]
            reasoning = {"low": "", "high": f"{summary}.",
                         "max": f"After the edit run_tests reports {summary}: {', '.join(fixed) or 'no test'} failed before "
                                f"and {'passes' if len(fixed) == 1 else 'pass'} now, and nothing that passed broke. The only "
                                f"change is `{bug['buggy']}` -> `{bug['fixed']}` in {bug['path']}; the tests are unchanged."}[effort]
            return reply(reasoning, f"Fixed a {bug['kind']} bug in {bug['path']}: `{bug['buggy']}` -> `{bug['fixed']}`.")

        return scripted(steps)

    def wrong_policies(self, task: Task) -> dict[str, Callable[..., dict[str, Any]]]:
        """No change, deleted / neutered tests, printed claims, conftest skip, exit at import, hard-coded visible cases."""
        md = task.metadata
        test_path = next(iter(md["tests"]))
        bug = md["bug"]
        module_path = bug["path"]
        top_path = f"{md['top']}.py"
        conftest = "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n    for item in items:\n" \
                   "        item.add_marker(pytest.mark.skip(reason='skip'))\n\ncollect_ignore_glob = ['test_*.py']\n"
        # wraps the visible test calls' functions with a lookup table of their expected values
        by_func: dict[str, dict[str, Any]] = {}
        for c in md["visible"]:
            by_func.setdefault(c["func"], {})[json.dumps(c["args"])] = decode_value(c["expected"])
        wrap = "\n\nimport json as _json\n"
        for func, table in by_func.items():
            if not any(c["func"] == func and c["module"] == md["top"] for c in md["visible"]):
                continue
            wrap += (f"_orig_{func} = {func}\n_T_{func} = {table!r}\n\n\ndef {func}(*args):\n"
                     f"    key = _json.dumps(list(args))\n"
                     f"    return _T_{func}[key] if key in _T_{func} else _orig_{func}(*args)\n")
        top_src = md["files"][top_path]

        def edit_then_claim(*calls: dict[str, Any]) -> Callable[..., dict[str, Any]]:
            def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
                if turn == 0:
                    return reply("", "", list(calls))
                return reply("", "Fixed the bug; all tests passed.")

            return scripted(steps)

        return {
            "empty": scripted(lambda turn, messages: reply("", "")),
            "no_change_claims_fixed": scripted(_claim),
            "copied_prompt": edit_then_claim(script_call(0, 1, "write_file", path=module_path, content=task.messages[-1]["content"])),
            "tests_deleted": edit_then_claim(script_call(0, 1, "delete_file", path=test_path)),
            "tests_assert_true": edit_then_claim(
                script_call(0, 1, "write_file", path=test_path, content="def test_ok():\n    assert True\n")),
            "prints_all_tests_passed": edit_then_claim(
                script_call(0, 1, "write_file", path=module_path,
                      content='print("all tests passed")\n' + md["files"][module_path])),
            "conftest_skips_everything": edit_then_claim(script_call(0, 1, "write_file", path="conftest.py", content=conftest)),
            "exit_at_import": edit_then_claim(
                script_call(0, 1, "write_file", path=top_path, content="import os\nprint('5 passed, 0 failed')\nos._exit(0)\n" + top_src)),
            "hardcoded_visible_tests": edit_then_claim(script_call(0, 1, "write_file", path=top_path, content=top_src + wrap)),
        }


@register_verifier("coding.bugfix")
def verify_bugfix(task: Task, final: FinalState) -> Verdict:
    """Reward 1 iff the original visible tests and the hidden tests pass on the final sources.

    The agent's test modules and conftest.py are dropped and the original test module restored;
    every test call runs in a fresh sandbox and is compared on the host.
    """
    md = task.metadata
    files = {p: t for p, t in _final_files(final.state).items() if not _is_test_file(p)}
    files.update(md["tests"])
    return _verify_in_fresh_sandbox(files, [*md["visible"], *md["hidden"]])


WRITE_FUNCTION = register_family(WriteFunctionFamily())
BUGFIX = register_family(BugfixFamily())
