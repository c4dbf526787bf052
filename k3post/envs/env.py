"""The environment interface and a generic tool-calling environment.

An `Environment` runs one episode at a time:

    msgs   = await env.reset(task)            # initial messages (the task prompt)
    result = await env.step(assistant_msg)    # StepResult(messages, done, truncated, info)
    ...
    verdict = env.verify()                    # from the FINAL environment state

The base class owns the bookkeeping every environment needs (turn, token and
wall-time limits with truncation, done flag, `state_dict` / `load_state_dict`
for pausing a trajectory and resuming it exactly, possibly in another
process). Subclasses implement four hooks:

* ``async initial_messages(task) -> list[message]``
* ``async respond(assistant_message, external_calls=0) -> StepResult``
* ``final_state() -> FinalState`` (what the verifier reads)
* ``extra_state() -> dict`` / ``load_extra_state(dict)`` (JSON-able)

`ToolEnvironment` is the generic agentic environment: it dispatches the OpenAI
``tool_calls`` of each assistant message to `ToolSpec` handlers over a
per-episode state object and ends when the assistant answers without tool calls
(or calls the designated submit tool).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from k3post.errors import InfrastructureError
from k3post.envs.task import FinalState, Task, Verdict, run_verifier
from k3post.envs.tools import ToolContext, ToolSpec, call_tool

__all__ = [
    "EnvironmentLost",
    "EpisodeLimits",
    "StepResult",
    "Environment",
    "ToolEnvironment",
    "count_tokens",
    "STATE_VERSION",
]

STATE_VERSION = 1
"""Version of the `Environment.state_dict` layout."""


def count_tokens(message: Mapping[str, Any]) -> int:
    """Output tokens of an assistant message, for the ``max_tokens`` limit.

    Uses ``message["num_tokens"]`` when the producer (a rollout engine, an OpenAI
    ``usage`` field) recorded it. Otherwise a deterministic approximation: the number
    of whitespace-separated words in the reasoning, the content, the tool names and
    the tool-call arguments (SPEC §3.3: agentic tasks count all output tokens).
    """
    n = message.get("num_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    parts: list[str] = []
    for key in ("reasoning_content", "content"):
        v = message.get(key)
        if isinstance(v, str):
            parts.append(v)
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        if isinstance(fn, Mapping):
            parts.append(str(fn.get("name", "")))
            args = fn.get("arguments", "")
            parts.append(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return sum(len(p.split()) for p in parts)


class EnvironmentLost(InfrastructureError):
    """The process holding an episode's environment was lost and the episode could not be resumed from its
    saved state (`k3post.distributed.env_workers`); the agent loop ends it with finish "infra" (kind
    ``env_lost``): masked out of its group, never a reward."""

    kind = "env_lost"


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits; None disables one. An episode that hits one ends truncated.

    Attributes:
        max_turns: assistant messages per episode (the turn that reaches it still executes).
        max_tokens: total output tokens (`count_tokens`) over the episode; the turn that
            crosses it still executes, then the episode ends.
        max_wall_s: wall-clock seconds since `reset` (policy time included; time while the
            episode is paused between `state_dict` and `load_state_dict` is not counted).
    """

    max_turns: int | None = 32
    max_tokens: int | None = None
    max_wall_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"EpisodeLimits.{name} must be a positive int or None, got {v!r}")
        if self.max_wall_s is not None and (isinstance(self.max_wall_s, bool) or not self.max_wall_s > 0):
            raise ValueError(f"EpisodeLimits.max_wall_s must be a positive number or None, got {self.max_wall_s!r}")


@dataclass
class StepResult:
    """What one `Environment.step` returns.

    Attributes:
        messages: new messages for the model (tool results, in call order, then user turns).
        done: the episode is over (finished or truncated).
        truncated: it ended because of a limit, not because the agent finished.
        info: JSON-able details (tool errors, the truncation reason, ...).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of all environments: episode bookkeeping, limits, verification, state.

    Subclasses implement `initial_messages`, `respond`, `final_state` and, when they
    hold state of their own, `extra_state` / `load_extra_state`. The public methods
    `reset`, `step`, `verify`, `state_dict`, `load_state_dict` are not overridden.
    """

    def __init__(self, limits: EpisodeLimits | None = None) -> None:
        """Args: limits: per-episode limits (default `EpisodeLimits()`, 32 turns)."""
        if limits is not None and not isinstance(limits, EpisodeLimits):
            raise ValueError(f"limits must be an EpisodeLimits, got {type(limits).__name__}")
        self.limits = limits or EpisodeLimits()
        self.task: Task | None = None
        self.turns = 0
        self.tokens = 0
        self.done = False
        self.truncated = False
        self.truncation: str | None = None
        self._elapsed_before = 0.0
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ hooks

    async def initial_messages(self, task: Task) -> list[dict[str, Any]]:
        """Set up the episode's state for ``task`` and return the initial messages."""
        raise NotImplementedError

    async def respond(self, message: dict[str, Any], *, external_calls: int = 0) -> StepResult:
        """Apply one assistant message; ``external_calls`` counts calls a harness answered itself.

        With ``external_calls > 0`` the message is a turn that continues the episode even if
        none of its calls is for this environment.
        """
        raise NotImplementedError

    def final_state(self) -> FinalState:
        """The state the verifier reads."""
        raise NotImplementedError

    def extra_state(self) -> dict[str, Any]:
        """Subclass state for `state_dict` (JSON-able)."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `extra_state` returned."""

    def tool_specs(self) -> list[ToolSpec]:
        """The tools offered in the current episode (canonical names); empty for tool-less envs."""
        return []

    def subagent_env(self, limits: EpisodeLimits, *, read_only: bool = False) -> "Environment | None":
        """An environment for a sub-agent acting on this episode's state, or None if unsupported."""
        return None

    def count_tokens(self, message: Mapping[str, Any]) -> int:
        """Output tokens of ``message`` for the ``max_tokens`` limit (default `count_tokens`)."""
        return count_tokens(message)

    # ------------------------------------------------------------------ public API

    @property
    def elapsed_s(self) -> float:
        """Wall-clock seconds of the current episode (excluding paused time)."""
        return self._elapsed_before + (time.monotonic() - self._t0)

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        """Start an episode of ``task``; returns its initial messages."""
        if not isinstance(task, Task):
            raise ValueError(f"reset needs a Task, got {type(task).__name__}")
        self.task = task
        self.turns = 0
        self.tokens = 0
        self.done = False
        self.truncated = False
        self.truncation = None
        self._elapsed_before = 0.0
        self._t0 = time.monotonic()
        return await self.initial_messages(task)

    async def step(self, message: dict[str, Any], *, external_calls: int = 0) -> StepResult:
        """Apply one assistant message and check the limits.

        Args:
            message: an OpenAI assistant message (``content``, optional ``reasoning_content``,
                ``tool_calls``, optional ``num_tokens``).
            external_calls: number of calls in this turn that a harness answered itself.
        """
        if self.task is None:
            raise ValueError("step() before reset(): start an episode with `await env.reset(task)` first")
        if self.done:
            raise ValueError("step() after the episode ended; call reset() for a new episode")
        if not isinstance(message, Mapping) or message.get("role", "assistant") != "assistant":
            raise ValueError("step() takes an assistant message (a dict with role 'assistant')")
        self.turns += 1
        self.tokens += self.count_tokens(message)
        result = await self.respond(dict(message), external_calls=external_calls)
        if result.done:
            self.done = True
            if result.truncated:
                self.truncated = True
                self.truncation = self.truncation or str(result.info.get("truncation", "environment"))
        else:
            reason = None
            lim = self.limits
            if lim.max_turns is not None and self.turns >= lim.max_turns:
                reason = "max_turns"
            elif lim.max_tokens is not None and self.tokens > lim.max_tokens:
                reason = "max_tokens"
            elif lim.max_wall_s is not None and self.elapsed_s > lim.max_wall_s:
                reason = "max_wall_time"
            if reason is not None:
                self.done = self.truncated = True
                self.truncation = reason
                result.done = result.truncated = True
        if result.truncated:
            result.info["truncation"] = self.truncation
        result.info.setdefault("turn", self.turns)
        result.info.setdefault("tokens", self.tokens)
        return result

    def verify(self) -> Verdict:
        """Score the final environment state with the task's registered verifier."""
        if self.task is None:
            raise ValueError("verify() before reset(): there is no episode to verify")
        final = self.final_state()
        final.truncated, final.truncation = self.truncated, self.truncation
        return run_verifier(self.task, final)

    def state_dict(self) -> dict[str, Any]:
        """The full episode state as JSON-able data; `load_state_dict` on a fresh env resumes it."""
        if self.task is None:
            raise ValueError("state_dict() before reset(): there is no episode to save")
        state = {
            "version": STATE_VERSION,
            "env": type(self).__name__,
            "task": self.task.to_dict(),
            "turns": self.turns,
            "tokens": self.tokens,
            "done": self.done,
            "truncated": self.truncated,
            "truncation": self.truncation,
            "elapsed_s": self.elapsed_s,
            "limits": asdict(self.limits),
            "extra": self.extra_state(),
        }
        try:
            return json.loads(json.dumps(state, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{type(self).__name__}.state_dict() is not JSON-serialisable: {e}") from e

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore an episode saved by `state_dict` (this env must be built like the saving one)."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not an environment state of version {STATE_VERSION}")
        if state.get("env") != type(self).__name__:
            raise ValueError(f"state was saved by {state.get('env')!r}, cannot load into {type(self).__name__!r}")
        self.task = Task.from_dict(state["task"])
        self.turns = int(state["turns"])
        self.tokens = int(state["tokens"])
        self.done = bool(state["done"])
        self.truncated = bool(state["truncated"])
        self.truncation = state["truncation"]
        self._elapsed_before = float(state["elapsed_s"])
        self._t0 = time.monotonic()
        self.load_extra_state(copy.deepcopy(dict(state["extra"])))


def _json_state(state: Any) -> Any:
    try:
        return json.loads(json.dumps(state, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the episode state is not JSON-serialisable ({e}); give ToolEnvironment "
            "dump_state/load_state functions for this state type"
        ) from e


def _acknowledge_submit(ctx: ToolContext, **arguments: Any) -> str:
    """Default handler of a submit tool: the arguments become the submission."""
    return "Submitted."


class ToolEnvironment(Environment):
    """A generic tool-calling environment over a per-episode state object.

    Each assistant message's ``tool_calls`` run in order against the bound tools; their
    results come back as ``role="tool"`` messages (bad calls as error observations). The
    episode ends when the assistant answers without tool calls (its content is the
    submission) or calls ``submit_tool`` (its arguments are the submission).

    Example::

        env = ToolEnvironment(
            [ToolSpec("get", "Read a key", {...}, read_only=True, handler=get),
             ToolSpec("set", "Write a key", {...}, handler=set_)],
            initial_state=lambda task: {"store": dict(task.metadata["store"])},
        )
    """

    def __init__(
        self,
        tools: Sequence[ToolSpec],
        *,
        initial_state: Callable[[Task], Any] | None = None,
        submit_tool: str | None = None,
        end_on_text: bool = True,
        nudge: str = "Continue working on the task; call the submit tool when you are done.",
        limits: EpisodeLimits | None = None,
        dump_state: Callable[[Any], Any] | None = None,
        load_state: Callable[[Any], Any] | None = None,
    ) -> None:
        """Args:
            tools: the tool library, with handlers (a task's ``tools`` select and re-describe them).
            initial_state: builds the episode state from the task (default: an empty dict).
            submit_tool: name of a tool whose call ends the episode (its handler, if any, runs first).
            end_on_text: whether an answer without tool calls ends the episode; when False the
                environment replies with ``nudge`` as a user message instead.
            nudge: the user message sent when ``end_on_text`` is False.
            limits: per-episode limits.
            dump_state / load_state: convert the state to / from JSON-able data (default: the
                state must itself be JSON-able and is deep-copied).
        """
        super().__init__(limits)
        lib: dict[str, ToolSpec] = {}
        for t in tools:
            if not isinstance(t, ToolSpec):
                raise ValueError(f"tools must be ToolSpec objects, got {type(t).__name__}")
            if t.name in lib:
                raise ValueError(f"duplicate tool name {t.name!r}")
            if t.handler is None:
                if t.name != submit_tool:
                    raise ValueError(f"tool {t.name!r} has no handler; attach one with ToolSpec.bind")
                t = t.bind(_acknowledge_submit)
            lib[t.name] = t
        if submit_tool is not None and submit_tool not in lib:
            raise ValueError(f"submit_tool {submit_tool!r} is not one of the tools {sorted(lib)}")
        self.library = lib
        self.submit_tool = submit_tool
        self.end_on_text = end_on_text
        self.nudge = nudge
        self._initial_state = initial_state or (lambda task: {})
        self._dump = dump_state or _json_state
        self._load = load_state or copy.deepcopy
        self.state: Any = None
        self.submission: Any = None
        self.tools: dict[str, ToolSpec] = {}

    # ------------------------------------------------------------------ hooks

    def _bind_tools(self, task: Task) -> dict[str, ToolSpec]:
        if not task.tools:
            return dict(self.library)
        out: dict[str, ToolSpec] = {}
        for t in task.tools:
            impl = self.library.get(t.name)
            if impl is None:
                raise ValueError(
                    f"task {task.id!r} declares tool {t.name!r}, which this environment does not implement "
                    f"(it has {sorted(self.library)})"
                )
            assert impl.handler is not None
            out[t.name] = t.bind(impl.handler)
        if self.submit_tool is not None and self.submit_tool not in out:
            out[self.submit_tool] = self.library[self.submit_tool]
        return out

    async def initial_messages(self, task: Task) -> list[dict[str, Any]]:
        """Bind the task's tools, build the state, return the prompt."""
        self.tools = self._bind_tools(task)
        self.state = self._initial_state(task)
        self.submission = None
        return task.prompt()

    async def respond(self, message: dict[str, Any], *, external_calls: int = 0) -> StepResult:
        """Run the message's tool calls in order; end on a plain answer or a submit call."""
        calls = message.get("tool_calls") or []
        if not isinstance(calls, (list, tuple)):
            raise ValueError("assistant message: tool_calls must be a list")
        if not calls:
            if external_calls > 0:
                return StepResult([], False, False, {"tool_errors": []})
            content = message.get("content")
            if self.end_on_text:
                self.submission = content if isinstance(content, str) else ""
                return StepResult([], True, False, {"tool_errors": [], "end": "answer"})
            return StepResult([{"role": "user", "content": self.nudge}], False, False, {"tool_errors": []})
        ctx = ToolContext(self.state, self.task, self, "")
        out: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        submitted = False
        for k, call in enumerate(calls):
            outcome = await call_tool(call, self.tools, ctx)
            out.append(outcome.message)
            if outcome.error is not None:
                errors.append({"call": k, "tool": outcome.name, "kind": outcome.error})
            elif outcome.name == self.submit_tool:
                self.submission = outcome.arguments
                submitted = True
        info: dict[str, Any] = {"tool_errors": errors}
        if submitted:
            info["end"] = "submit"
        return StepResult(out, submitted, False, info)

    def final_state(self) -> FinalState:
        """The state object and the submission."""
        return FinalState(self.state, self.submission)

    def tool_specs(self) -> list[ToolSpec]:
        """The bound tools of the current episode, in declaration order."""
        return list(self.tools.values())

    def extra_state(self) -> dict[str, Any]:
        """The state (via ``dump_state``) and the submission."""
        return {"state": self._dump(self.state), "submission": _json_state(self.submission)}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Rebind the task's tools and restore the state and submission."""
        assert self.task is not None
        self.tools = self._bind_tools(self.task)
        self.state = self._load(state["state"])
        self.submission = state["submission"]

    def subagent_env(self, limits: EpisodeLimits, *, read_only: bool = False) -> "ToolEnvironment":
        """A `ToolEnvironment` over the same state object (changes are shared), without submit.

        With ``read_only`` only the read-only tools are offered.
        """
        tools = [t for t in self.tools.values() if t.name != self.submit_tool and (t.read_only or not read_only)]
        parent = self
        return ToolEnvironment(tools, initial_state=lambda task: parent.state, limits=limits)

