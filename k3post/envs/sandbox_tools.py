"""The sandbox tool kit the file-editing task families share: a per-episode sandbox working directory
(`SandboxState`), the file and Python tools that act on it (`TOOLS`), the environment that holds it
(`make_env`), and the helpers their scripted policies are written with (`script_call`, `reply`, `scripted`,
`last_tool_outputs`).

``coding.write_function`` / ``coding.bugfix`` (`k3post.envs.families.coding.family`), the AET families, the kernel, web
development and workflow families build on it:

    env = make_env([TOOLS["write_file"], TOOLS["read_file"], my_tests], lambda task: task.metadata["files"], None)
    policy = scripted(lambda turn, messages: reply("", "", [script_call(turn, 1, "read_file", path="x.py")])
                      if turn == 0 else reply("", "done"))

Every tool runs model-written code only in the sandbox (`k3post.envs.sandbox`) under `RUN_LIMITS`; observations are
clipped to `MAX_OBS_CHARS` (`clip`).

Shape legend: none.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.envs.task import Task
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = [
    "MAX_FILES",
    "MAX_FILE_CHARS",
    "MAX_OBS_CHARS",
    "RUN_LIMITS",
    "RUN_TIMEOUT_S",
    "TOOLS",
    "SandboxState",
    "clip",
    "final_text_files",
    "format_run",
    "last_tool_outputs",
    "make_env",
    "py_files",
    "reply",
    "script_call",
    "scripted",
    "tool_state",
]

RUN_LIMITS = SandboxLimits(cpu_s=5.0, wall_s=10.0, memory_bytes=1024**3, max_output_bytes=256 * 1024)
"""Limits of every sandboxed run (agent tools and verification)."""
RUN_TIMEOUT_S = 10.0
MAX_FILE_CHARS = 100_000
MAX_FILES = 32
MAX_OBS_CHARS = 4000


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
        return py_files({p: self.sandbox.read_file(p) for p in self.sandbox.list_files() if _is_source(p)})

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


def py_files(files: Mapping[str, str]) -> dict[str, str]:
    """The ``.py`` files of ``files`` (path -> text, sorted; ``__pycache__`` and files over `MAX_FILE_CHARS`
    left out), at most `MAX_FILES`."""
    out = {p: t for p, t in sorted(files.items()) if _is_source(p) and len(t) <= MAX_FILE_CHARS}
    return dict(list(out.items())[:MAX_FILES])


# --------------------------------------------------------------------------- tools


def clip(text: str, limit: int = MAX_OBS_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with a note of how many were left out."""
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters]"


def tool_state(ctx: ToolContext) -> SandboxState:
    """The `SandboxState` of the environment a tool runs in (ValueError for any other state)."""
    if not isinstance(ctx.state, SandboxState):
        raise ValueError("this tool needs a coding environment state")
    return ctx.state


def _write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file in the working directory."""
    if len(content) > MAX_FILE_CHARS:
        raise ValueError(f"content is {len(content)} characters; the limit is {MAX_FILE_CHARS}")
    sb = tool_state(ctx).sandbox
    if path not in sb.list_files() and len(sb.list_files()) >= MAX_FILES:
        raise ValueError(f"the working directory already holds {MAX_FILES} files")
    sb.write_file(path, content)
    return f"Wrote {len(content.splitlines())} lines to {path}."


def _read_file(ctx: ToolContext, path: str) -> str:
    """Return a text file of the working directory."""
    return clip(tool_state(ctx).sandbox.read_file(path), 3 * MAX_OBS_CHARS)


def _list_files(ctx: ToolContext) -> str:
    """List the files of the working directory."""
    files = [p for p in tool_state(ctx).sandbox.list_files() if "__pycache__" not in PurePosixPath(p).parts]
    return "\n".join(files) if files else "(no files)"


def _edit_file(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace the unique occurrence of ``old`` in a file with ``new``."""
    sb = tool_state(ctx).sandbox
    text = sb.read_file(path)
    n = text.count(old) if old else 0
    if n != 1:
        raise ValueError(f"`old` must occur exactly once in {path}; it occurs {n} times")
    sb.write_file(path, text.replace(old, new, 1))
    return f"Edited {path}: replaced 1 occurrence."


def _delete_file(ctx: ToolContext, path: str) -> str:
    """Delete a file of the working directory."""
    sb = tool_state(ctx).sandbox
    if path not in sb.list_files():
        raise ValueError(f"no such file: {path!r}")
    (sb.workdir / PurePosixPath(path)).unlink()
    return f"Deleted {path}."


def format_run(res: Any) -> str:
    """A sandbox run's result as a tool observation: exit code (and why it was killed), stdout, stderr; clipped."""
    parts = [f"exit code {res.returncode}" + (f" ({res.killed_reason})" if res.killed_reason else "")]
    if res.stdout:
        parts.append("stdout:\n" + res.stdout)
    if res.stderr:
        parts.append("stderr:\n" + res.stderr)
    return clip("\n".join(parts))


def _run_python(ctx: ToolContext, code: str) -> str:
    """Run a Python snippet in the working directory (it can import solution)."""
    res = tool_state(ctx).sandbox.run(["python", "-B", "-"], stdin=code, timeout=RUN_TIMEOUT_S)
    return format_run(res)


_PATH = {"type": "string", "description": "Path relative to the working directory."}
_S = {"type": "object", "additionalProperties": False}
TOOLS: dict[str, ToolSpec] = {
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


def make_env(library: Sequence[ToolSpec], files: Callable[[Task], Mapping[str, str]],
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


# --------------------------------------------------------------------------- scripted policies


def script_call(turn: int, k: int, name: str, **args: Any) -> dict[str, Any]:
    """The ``k``-th tool call of assistant turn ``turn`` of a scripted policy (id ``call_<turn>_<k>``)."""
    return {"id": f"call_{turn}_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def reply(reasoning: str, content: str = "", calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """An assistant message: ``reasoning`` in the think channel, ``content``, optional tool ``calls``."""
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


def _turn(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant")


def last_tool_outputs(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tool messages' contents after the last assistant message, in order."""
    out: list[str] = []
    for m in reversed(messages):
        if m.get("role") == "assistant":
            break
        if m.get("role") == "tool":
            out.append(str(m.get("content", "")))
    return out[::-1]


def scripted(steps: Callable[[int, list[dict[str, Any]]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A policy from a function of (turn index, messages)."""

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        return steps(_turn(messages), messages)

    return policy
