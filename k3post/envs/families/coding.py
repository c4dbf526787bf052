"""Coding task families: ``coding.write_function`` and ``coding.bugfix`` (SPEC §3.5).

Both run model-written code only in the sandbox (`k3post.envs.sandbox`) and score the final
files, never the transcript.

``coding.write_function``
    Write ``solution.py`` defining one function (from `coding_problems.FN_TEMPLATES`,
    difficulty 1-3 = template complexity). The prompt shows the signature, the statement and 3
    public examples. Tools: ``write_file``, ``read_file``, ``run_python`` and ``run_tests``
    (public examples only). The episode ends with a reply without tool calls; the submission is
    the final ``solution.py``. Verifier: a fresh sandbox gets the final ``.py`` files (no
    ``__pycache__``) and a runner on stdin calls the function on the hidden inputs; the
    results come back in a strictly typed encoding and are compared **on the host** with
    expected outputs computed from the reference implementation at generation time (task
    metadata, never inside any sandbox). Reward 1 iff every hidden test passes.

``coding.bugfix``
    A tiny repo (2 modules + a test module, `coding_problems.REPO_TEMPLATES`) with one injected
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

import base64
import copy
import json
import random
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.coding_problems import (
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
from k3post.envs.families.registry import EFFORTS, register_family
from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = [
    "SandboxState",
    "WriteFunctionFamily",
    "BugfixFamily",
    "WRITE_FUNCTION",
    "BUGFIX",
    "run_calls",
    "verify_write_function",
    "verify_bugfix",
]

RUN_LIMITS = SandboxLimits(cpu_s=5.0, wall_s=10.0, memory_bytes=1024**3, max_output_bytes=256 * 1024)
"""Limits of every sandboxed run (agent tools and verification)."""
RUN_TIMEOUT_S = 10.0
MAX_FILE_CHARS = 100_000
MAX_FILES = 32
MAX_OBS_CHARS = 4000
SOLUTION = "solution.py"
_PY = ("python", "-I", "-B", "-")  # isolated (no cwd / env / user site on sys.path), no .pyc, script on stdin


# --------------------------------------------------------------------------- per-episode state


class SandboxState:
    """The per-episode state of a coding environment: one sandbox working directory.

    Serialises as ``{"snapshot": base64 tar.gz of the workdir}`` (`to_json` / `from_json`), so a
    paused episode resumes with exactly the files it had.
    """

    def __init__(self, files: Mapping[str, str] | None = None) -> None:
        """Args: files: initial files (relative path -> text) written into a fresh sandbox."""
        self.sandbox = Sandbox(limits=RUN_LIMITS)
        for path, text in (files or {}).items():
            self.sandbox.write_file(path, text)

    def files(self) -> dict[str, str]:
        """The workdir's ``.py`` files (path -> text), ``__pycache__`` excluded, at most `MAX_FILES`."""
        return _py_files({p: self.sandbox.read_file(p) for p in self.sandbox.list_files() if _is_source(p)})

    def to_json(self) -> dict[str, Any]:
        """JSON form: the workdir snapshot, base64."""
        return {"snapshot": base64.b64encode(self.sandbox.snapshot()).decode("ascii")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SandboxState":
        """A new sandbox restored from `to_json` output."""
        if not isinstance(data, Mapping) or not isinstance(data.get("snapshot"), str):
            raise ValueError("a SandboxState needs {'snapshot': base64 string}")
        state = cls()
        state.sandbox.restore(base64.b64decode(data["snapshot"]))
        return state

    def close(self) -> None:
        """Remove the sandbox's working directory."""
        self.sandbox.close()


def final_text_files(state: Any, keep: Callable[[str], bool], who: str) -> dict[str, str]:
    """The files (path -> text, sorted) whose path passes ``keep``, of a `SandboxState`, its JSON form
    ``{"snapshot": ...}`` or ``{"files": {path: text}}``; ``who`` names the caller in the error."""
    if isinstance(state, Mapping) and isinstance(state.get("snapshot"), str):
        restored = SandboxState.from_json(state)
        try:
            return final_text_files(restored, keep, who)
        finally:
            restored.close()
    if isinstance(state, SandboxState):
        sb = state.sandbox
        files = {p: sb.read_file(p) for p in sb.list_files() if keep(p)}
    elif isinstance(state, Mapping) and isinstance(state.get("files"), Mapping):
        files = {str(k): str(v) for k, v in state["files"].items()}
    else:
        raise ValueError(f"{who}: final state must be a SandboxState or {{'files': ...}}, got {type(state).__name__}")
    return {p: t for p, t in sorted(files.items()) if keep(p)}


def _is_source(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return path.endswith(".py") and "__pycache__" not in parts


def _py_files(files: Mapping[str, str]) -> dict[str, str]:
    out = {p: t for p, t in sorted(files.items()) if _is_source(p) and len(t) <= MAX_FILE_CHARS}
    return dict(list(out.items())[:MAX_FILES])


def _final_files(state: Any) -> dict[str, str]:
    """The final ``.py`` files from a `SandboxState` or a JSON ``{"files": {path: text}}``."""
    if isinstance(state, SandboxState):
        return state.files()
    if isinstance(state, Mapping) and isinstance(state.get("files"), Mapping):
        return _py_files({str(k): str(v) for k, v in state["files"].items()})
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


def _clip(text: str, limit: int = MAX_OBS_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters]"


def _state(ctx: ToolContext) -> SandboxState:
    if not isinstance(ctx.state, SandboxState):
        raise ValueError("this tool needs a coding environment state")
    return ctx.state


def _write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file in the working directory."""
    if len(content) > MAX_FILE_CHARS:
        raise ValueError(f"content is {len(content)} characters; the limit is {MAX_FILE_CHARS}")
    sb = _state(ctx).sandbox
    if path not in sb.list_files() and len(sb.list_files()) >= MAX_FILES:
        raise ValueError(f"the working directory already holds {MAX_FILES} files")
    sb.write_file(path, content)
    return f"Wrote {len(content.splitlines())} lines to {path}."


def _read_file(ctx: ToolContext, path: str) -> str:
    """Return a text file of the working directory."""
    return _clip(_state(ctx).sandbox.read_file(path), 3 * MAX_OBS_CHARS)


def _list_files(ctx: ToolContext) -> str:
    """List the files of the working directory."""
    files = [p for p in _state(ctx).sandbox.list_files() if "__pycache__" not in PurePosixPath(p).parts]
    return "\n".join(files) if files else "(no files)"


def _edit_file(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace the unique occurrence of ``old`` in a file with ``new``."""
    sb = _state(ctx).sandbox
    text = sb.read_file(path)
    n = text.count(old) if old else 0
    if n != 1:
        raise ValueError(f"`old` must occur exactly once in {path}; it occurs {n} times")
    sb.write_file(path, text.replace(old, new, 1))
    return f"Edited {path}: replaced 1 occurrence."


def _delete_file(ctx: ToolContext, path: str) -> str:
    """Delete a file of the working directory."""
    sb = _state(ctx).sandbox
    if path not in sb.list_files():
        raise ValueError(f"no such file: {path!r}")
    (sb.workdir / PurePosixPath(path)).unlink()
    return f"Deleted {path}."


def _format_run(res: Any) -> str:
    parts = [f"exit code {res.returncode}" + (f" ({res.killed_reason})" if res.killed_reason else "")]
    if res.stdout:
        parts.append("stdout:\n" + res.stdout)
    if res.stderr:
        parts.append("stderr:\n" + res.stderr)
    return _clip("\n".join(parts))


def _run_python(ctx: ToolContext, code: str) -> str:
    """Run a Python snippet in the working directory (it can import solution)."""
    res = _state(ctx).sandbox.run(["python", "-B", "-"], stdin=code, timeout=RUN_TIMEOUT_S)
    return _format_run(res)


def _run_public_tests(ctx: ToolContext) -> str:
    """Check solution.py against the public examples of the prompt."""
    assert ctx.task is not None
    cases = ctx.task.metadata["public"]
    sb = _state(ctx).sandbox
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
    res = _state(ctx).sandbox.run(list(_PY), stdin=TEST_RUNNER, timeout=RUN_TIMEOUT_S)
    if res.returncode == 0 and res.killed_reason is None:
        return _clip(res.stdout)
    return _format_run(res)


_PATH = {"type": "string", "description": "Path relative to the working directory."}
_S = {"type": "object", "additionalProperties": False}
_TOOLS: dict[str, ToolSpec] = {
    t.name: t
    for t in (
        ToolSpec("write_file", "Create or overwrite a text file in the working directory.",
                 {**_S, "properties": {"path": _PATH, "content": {"type": "string"}}, "required": ["path", "content"]},
                 handler=_write_file),
        ToolSpec("read_file", "Read a text file of the working directory.",
                 {**_S, "properties": {"path": _PATH}, "required": ["path"]}, read_only=True, handler=_read_file),
        ToolSpec("list_files", "List the files of the working directory.", {**_S, "properties": {}},
                 read_only=True, handler=_list_files),
        ToolSpec("edit_file", "Replace the single occurrence of `old` in a file with `new`.",
                 {**_S, "properties": {"path": _PATH, "old": {"type": "string"}, "new": {"type": "string"}},
                  "required": ["path", "old", "new"]}, handler=_edit_file),
        ToolSpec("delete_file", "Delete a file of the working directory.",
                 {**_S, "properties": {"path": _PATH}, "required": ["path"]}, handler=_delete_file),
        ToolSpec("run_python", "Run a Python snippet in the sandbox's working directory; returns exit code, stdout, stderr.",
                 {**_S, "properties": {"code": {"type": "string"}}, "required": ["code"]}, read_only=True,
                 handler=_run_python),
    )
}
_WF_TESTS = ToolSpec("run_tests", "Check solution.py against the public examples from the task.",
                     {**_S, "properties": {}}, read_only=True, handler=_run_public_tests)
_BF_TESTS = ToolSpec("run_tests", "Run the repository's tests (every test_*.py module) and report PASS / FAIL.",
                     {**_S, "properties": {}}, read_only=True, handler=_run_repo_tests)
WF_TOOL_NAMES = ("write_file", "read_file", "run_python", "run_tests")
BF_TOOL_NAMES = ("list_files", "read_file", "write_file", "edit_file", "delete_file", "run_tests")


def _make_env(library: Sequence[ToolSpec], files: Callable[[Task], Mapping[str, str]],
              limits: EpisodeLimits | None) -> ToolEnvironment:
    """A ToolEnvironment whose state is a `SandboxState` seeded with ``files(task)``; ends on a plain reply."""
    return ToolEnvironment(
        library,
        initial_state=lambda t: SandboxState(files(t)),
        end_on_text=True,
        limits=limits or EpisodeLimits(max_turns=16),
        dump_state=lambda s: s.to_json(),
        load_state=SandboxState.from_json,
    )


# --------------------------------------------------------------------------- policies (shared helpers)


def _call(turn: int, k: int, name: str, **args: Any) -> dict[str, Any]:
    return {"id": f"call_{turn}_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _reply(reasoning: str, content: str = "", calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


def _turn(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant")


def _last_tool_outputs(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    for m in reversed(messages):
        if m.get("role") == "assistant":
            break
        if m.get("role") == "tool":
            out.append(str(m.get("content", "")))
    return out[::-1]


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


def _check_effort(effort: str) -> None:
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}; expected one of {EFFORTS}")


def _scripted(steps: Callable[[int, list[dict[str, Any]]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A policy from a function of (turn index, messages)."""

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        return steps(_turn(messages), messages)

    return policy


def _claim(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return _reply("", "I implemented the solution and all tests passed.")


def _write_then_claim(path: str, content: str) -> Callable[..., dict[str, Any]]:
    def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if turn == 0:
            return _reply("", "", [_call(0, 1, "write_file", path=path, content=content)])
        return _reply("", "Done: all tests passed.")

    return _scripted(steps)


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
        return _make_env(list(_library_wf().values()), lambda t: {}, limits)

    def reference_policy(self, task: Task, effort: str) -> Callable[..., dict[str, Any]]:
        """Scripted solver: write the reference implementation, test it (high / max), answer."""
        _check_effort(effort)
        md = task.metadata
        func, code = md["func"], md["reference"]
        examples = "; ".join(f"{_call_text(func, c['args'])} should be {decode_value(c['expected'])!r}" for c in md["public"])

        def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
            obs = _last_tool_outputs(messages)
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
                return _reply(reasoning, "", [_call(0, 1, "write_file", path=SOLUTION, content=code)])
            tested = _first_line(obs, r"public examples passed")
            if turn == 1 and effort != "low" and tested is None:
                reasoning = "" if effort == "high" else f"The write_file tool answered: {obs[0] if obs else '(nothing)'}. Now run the public examples."
                return _reply(reasoning, "", [_call(1, 1, "run_tests")])
            if effort == "max":
                passed = "; ".join(ln[5:] for t in obs for ln in t.splitlines() if ln.startswith("PASS "))
                reasoning = (f"run_tests reported: {tested} ({passed}). Each call returned the value the statement asks "
                             f"for, and the hidden tests check the same function, so {SOLUTION} is done.")
            elif effort == "high":
                reasoning = f"{tested}." if tested else ""
            else:
                reasoning = ""
            return _reply(reasoning, f"{SOLUTION} defines {func}.")

        return _scripted(steps)

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
            "empty": _scripted(lambda turn, messages: _reply("", "")),
            "copied_prompt": _write_then_claim(SOLUTION, prompt),
            "prints_all_tests_passed": _write_then_claim(SOLUTION, 'print("all tests passed")\n'),
            "exit_at_import": _write_then_claim(SOLUTION, 'import sys\nprint("all tests passed")\nsys.exit(0)\n'),
            "os_exit_with_forged_output": _write_then_claim(
                SOLUTION, 'import os\nprint(\'{"results": [], "passed": true}\')\nos._exit(0)\n'),
            "hardcoded_public_examples": _write_then_claim(SOLUTION, hardcode),
            "eq_always_true": _write_then_claim(SOLUTION, eq_trick),
            "claims_without_file": _scripted(_claim),
        }


def _library_wf() -> dict[str, ToolSpec]:
    return {**{n: _TOOLS[n] for n in WF_TOOL_NAMES if n != "run_tests"}, "run_tests": _WF_TESTS}


def _library_bf() -> dict[str, ToolSpec]:
    return {**{n: _TOOLS[n] for n in BF_TOOL_NAMES if n != "run_tests"}, "run_tests": _BF_TESTS}


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
        return _make_env(list(_library_bf().values()), lambda t: dict(t.metadata["files"]), limits)

    def reference_policy(self, task: Task, effort: str) -> Callable[..., dict[str, Any]]:
        """Scripted solver: run the tests, read the culprit, edit the faulty line, rerun, answer."""
        _check_effort(effort)
        md = task.metadata
        bug = md["bug"]
        test_path = next(iter(md["tests"]))
        sources = sorted(p for p in md["files"] if not _is_test_file(p))

        def steps(turn: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
            obs = _last_tool_outputs(messages)
            if turn == 0:
                if effort == "max":
                    return _reply("First look at the repository layout and run the tests to see what fails.", "",
                                  [_call(0, 1, "list_files"), _call(0, 2, "run_tests")])
                return _reply("Run the tests first." if effort == "high" else "", "", [_call(0, 1, "run_tests")])
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
                return _reply(reasoning, "", [_call(1, k + 1, "read_file", path=p) for k, p in enumerate(files)])
            if turn == 2:
                if effort == "max":
                    reasoning = (
                        f"In {bug['path']} the code has `{bug['buggy']}`. That is a {bug['kind']} bug: {bug['why']}. "
                        f"Replace it with `{bug['fixed']}`, leave the tests alone, and rerun them."
                    )
                else:
                    reasoning = f"{bug['why'][0].upper()}{bug['why'][1:]}." if effort == "high" else ""
                return _reply(reasoning, "", [
                    _call(2, 1, "edit_file", path=bug["path"], old=bug["buggy"], new=bug["fixed"]),
                    _call(2, 2, "run_tests"),
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
            return _reply(reasoning, f"Fixed a {bug['kind']} bug in {bug['path']}: `{bug['buggy']}` -> `{bug['fixed']}`.")

        return _scripted(steps)

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
                    return _reply("", "", list(calls))
                return _reply("", "Fixed the bug; all tests passed.")

            return _scripted(steps)

        return {
            "empty": _scripted(lambda turn, messages: _reply("", "")),
            "no_change_claims_fixed": _scripted(_claim),
            "copied_prompt": edit_then_claim(_call(0, 1, "write_file", path=module_path, content=task.messages[-1]["content"])),
            "tests_deleted": edit_then_claim(_call(0, 1, "delete_file", path=test_path)),
            "tests_assert_true": edit_then_claim(
                _call(0, 1, "write_file", path=test_path, content="def test_ok():\n    assert True\n")),
            "prints_all_tests_passed": edit_then_claim(
                _call(0, 1, "write_file", path=module_path,
                      content='print("all tests passed")\n' + md["files"][module_path])),
            "conftest_skips_everything": edit_then_claim(_call(0, 1, "write_file", path="conftest.py", content=conftest)),
            "exit_at_import": edit_then_claim(
                _call(0, 1, "write_file", path=top_path, content="import os\nprint('5 passed, 0 failed')\nos._exit(0)\n" + top_src)),
            "hardcoded_visible_tests": edit_then_claim(_call(0, 1, "write_file", path=top_path, content=top_src + wrap)),
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
