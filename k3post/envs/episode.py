"""Running episodes: policies, `run_episode`, pause / resume, an OpenAI policy, a gym wrapper.

A **policy** is any callable ``policy(messages, tools) -> assistant message``,
sync or async: a scripted solver in tests, the rollout engine, or `OpenAIPolicy`
for any OpenAI-compatible endpoint. ``messages`` is what the policy should see
(the harness's view of the transcript) and ``tools`` the tools of the global
XTML ``tool-declare`` message (OpenAI function specs). Tools announced later
arrive as input option messages ``{"role": "system", "type": "tool-declare",
"tools": [...]}`` inside ``messages``; `offered_tools` collects both.

One loop, as in the report::

    runner = EpisodeRunner(env, policy, harness)
    await runner.start(task)
    while not runner.done:
        messages, tools = runner.view()
        await runner.advance(await call_policy(policy, messages, tools))
    episode = runner.result()              # verdict from the final env state

`run_episode` is that loop. ``pause_after=k`` stops after k turns and returns an
`Episode` whose ``checkpoint`` (JSON) `resume_episode` continues, in this or
another process, exactly where it stopped.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k3post.constants import Policy
from k3post.envs.env import Environment, StepResult
from k3post.envs.harness import Harness, HarnessConfig
from k3post.envs.task import Task, Verdict
from k3post.urls import is_url

__all__ = [
    "EndpointHTTPError",
    "Policy",
    "Episode",
    "EpisodeRunner",
    "call_policy",
    "offered_tools",
    "to_openai_chat",
    "run_episode",
    "run_episode_sync",
    "resume_episode",
    "resume_episode_sync",
    "OpenAIPolicy",
    "GymEnv",
    "CHECKPOINT_VERSION",
]

if TYPE_CHECKING:
    import httpx

CHECKPOINT_VERSION = 1



def offered_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """All tools the policy may call: ``tools`` plus those of mid-session ``tool-declare`` messages.

    A later declaration of a name replaces an earlier one; order is first appearance.
    """
    from k3post.xtml import is_tool_declaration  # here: the envs import no tokenizer stack

    out: dict[str, dict[str, Any]] = {}
    declared = [list(tools)] + [
        list(m.get("tools") or []) for m in messages if is_tool_declaration(m)
    ]
    for group in declared:
        for t in group:
            fn = t.get("function", t)
            out[fn["name"]] = copy.deepcopy(dict(t))
    return list(out.values())


async def call_policy(policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Call a sync or async policy on copies of its inputs and check it returned an assistant message."""
    out = policy(copy.deepcopy(messages), copy.deepcopy(tools))
    if inspect.isawaitable(out):
        out = await out
    if not isinstance(out, Mapping):
        raise ValueError(f"a policy must return an assistant message (a dict), got {type(out).__name__}")
    msg = dict(out)
    role = msg.setdefault("role", "assistant")
    if role != "assistant":
        raise ValueError(f"a policy must return a message with role 'assistant', got {role!r}")
    return msg


@dataclass
class Episode:
    """One finished (or paused) episode.

    Attributes:
        task: the task.
        messages: the full transcript as the policy produced and saw it (presented tool names,
            harness system prompt, tool-declare messages; before context management).
        tools: the tools of the global tool-declare message (OpenAI format).
        verdict: the verifier's verdict on the final env state; None while paused or if not verified.
        turns: assistant turns taken.
        truncated / truncation: whether (and which) limit ended the episode.
        turn_info: per turn, a dict: ``index`` (position of the assistant message in
            ``messages``), ``env`` (the env step info), ``harness`` (harness-side info:
            aliasing, skills loaded, sub-agent episodes, ...) and ``view`` (the exact
            messages the policy saw when context management changed them, else None).
        harness: the harness configuration used (`HarnessConfig.to_dict`).
        checkpoint: the JSON state to resume from when the episode was paused, else None.
    """

    task: Task
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    verdict: Verdict | None
    turns: int
    truncated: bool
    truncation: str | None
    turn_info: list[dict[str, Any]] = field(default_factory=list)
    harness: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None

    @property
    def paused(self) -> bool:
        """True when the episode stopped early and can be resumed from ``checkpoint``."""
        return self.checkpoint is not None

    @property
    def reward(self) -> float | None:
        """The verdict's reward, or None."""
        return None if self.verdict is None else self.verdict.reward

    @property
    def final_answer(self) -> str | None:
        """Content of the last assistant message, or None if there is none."""
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                c = m.get("content")
                return c if isinstance(c, str) else None
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (tasks, verdict and checkpoint included)."""
        return {
            "task": self.task.to_dict(),
            "messages": copy.deepcopy(self.messages),
            "tools": copy.deepcopy(self.tools),
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "turns": self.turns,
            "truncated": self.truncated,
            "truncation": self.truncation,
            "turn_info": copy.deepcopy(self.turn_info),
            "harness": copy.deepcopy(self.harness),
            "checkpoint": copy.deepcopy(self.checkpoint),
        }


class EpisodeRunner:
    """Drives one episode of ``env`` under a harness, one assistant message at a time.

    Use it directly when something else produces the assistant messages (a rollout
    engine, `GymEnv`); `run_episode` wraps it with a policy.
    """

    def __init__(self, env: Environment, policy: Policy | None = None, harness: Harness | None = None) -> None:
        """Args:
            env: the environment.
            policy: the policy; only needed by harness modules that run nested episodes (sub-agents).
            harness: the harness (default: the identity harness, `HarnessConfig()`).
        """
        if not isinstance(env, Environment):
            raise ValueError(f"env must be an Environment, got {type(env).__name__}")
        if harness is not None and not isinstance(harness, Harness):
            raise ValueError(f"harness must be a Harness, got {type(harness).__name__}")
        self.env = env
        self.policy = policy
        self.harness = harness or Harness(HarnessConfig())
        self.applied: Any = None
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.turn_info: list[dict[str, Any]] = []

    @property
    def started(self) -> bool:
        """Whether `start` (or `restore`) has run."""
        return self.applied is not None

    @property
    def done(self) -> bool:
        """Whether the episode has ended."""
        return self.started and self.env.done

    async def start(self, task: Task) -> None:
        """Reset the env for ``task`` and apply the harness."""
        env_msgs = await self.env.reset(task)
        self.applied = self.harness.apply(task, self.env, self.policy, run_episode)
        self.messages = self.applied.initial_messages(env_msgs)
        self.tools = self.applied.tools
        self.turn_info = []

    def view(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(messages, tools)`` to give the policy now (copies)."""
        if not self.started:
            raise ValueError("view() before start(): call `await runner.start(task)` first")
        return copy.deepcopy(self.applied.view(self.messages)), copy.deepcopy(self.tools)

    async def advance(self, reply: Mapping[str, Any]) -> StepResult:
        """Apply the policy's assistant message; returns the env's `StepResult`."""
        if not self.started:
            raise ValueError("advance() before start(): call `await runner.start(task)` first")
        if self.env.done:
            raise ValueError("advance() after the episode ended")
        if not isinstance(reply, Mapping):
            raise ValueError(f"advance() takes an assistant message (a dict), got {type(reply).__name__}")
        view = self.applied.view(self.messages)
        hstep = await self.applied.step(dict(reply), len(self.turn_info))
        index = len(self.messages)
        self.messages.append(hstep.reply)
        self.messages.extend(hstep.messages)
        self.turn_info.append(
            {
                "index": index,
                "env": copy.deepcopy(hstep.result.info),
                "harness": hstep.info,
                "view": None if view == self.messages[:index] else copy.deepcopy(view),
            }
        )
        return hstep.result

    def result(self, *, verify: bool = True) -> Episode:
        """The `Episode`; verified when the env is done and ``verify`` is set, else a paused one."""
        if not self.started:
            raise ValueError("result() before start()")
        done = self.env.done
        assert self.env.task is not None
        return Episode(
            task=self.env.task,
            messages=copy.deepcopy(self.messages),
            tools=copy.deepcopy(self.tools),
            verdict=self.env.verify() if (done and verify) else None,
            turns=self.env.turns,
            truncated=self.env.truncated,
            truncation=self.env.truncation,
            turn_info=copy.deepcopy(self.turn_info),
            harness=self.harness.config.to_dict(),
            checkpoint=None if done else self.state_dict(),
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON checkpoint: transcript, env state, harness config and state."""
        if not self.started:
            raise ValueError("state_dict() before start()")
        state = {
            "version": CHECKPOINT_VERSION,
            "messages": self.messages,
            "tools": self.tools,
            "turn_info": self.turn_info,
            "env": self.env.state_dict(),
            "harness": {"config": self.harness.config.to_dict(), "state": self.applied.state_dict()},
        }
        return json.loads(json.dumps(state, ensure_ascii=False))

    @classmethod
    def restore(
        cls,
        state: Mapping[str, Any],
        env: Environment,
        policy: Policy | None = None,
        harness: Harness | None = None,
    ) -> "EpisodeRunner":
        """A runner continuing the checkpoint ``state`` on ``env`` (built like the original one).

        ``harness`` defaults to one built from the saved config (memory stores reopen their file).
        """
        if not isinstance(state, Mapping) or state.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"not an episode checkpoint of version {CHECKPOINT_VERSION}")
        if harness is None:
            harness = Harness(HarnessConfig.from_dict(state["harness"]["config"]))
        runner = cls(env, policy, harness)
        env.load_state_dict(state["env"])
        assert env.task is not None
        runner.applied = harness.apply(env.task, env, policy, run_episode)
        runner.applied.load_state_dict(state["harness"]["state"])
        runner.messages = copy.deepcopy(list(state["messages"]))
        runner.tools = copy.deepcopy(list(state["tools"]))
        runner.turn_info = copy.deepcopy(list(state["turn_info"]))
        return runner


async def _drive(runner: EpisodeRunner, policy: Policy, pause_after: int | None, verify: bool) -> Episode:
    if pause_after is not None and (isinstance(pause_after, bool) or not isinstance(pause_after, int) or pause_after < 0):
        raise ValueError(f"pause_after must be a non-negative int or None, got {pause_after!r}")
    taken = 0
    while not runner.done and (pause_after is None or taken < pause_after):
        messages, tools = runner.view()
        await runner.advance(await call_policy(policy, messages, tools))
        taken += 1
    return runner.result(verify=verify)


async def run_episode(
    policy: Policy,
    env: Environment,
    task: Task,
    harness: Harness | None = None,
    *,
    pause_after: int | None = None,
    verify: bool = True,
) -> Episode:
    """Run ``policy`` on ``task`` in ``env`` (under ``harness``) until the episode ends.

    Args:
        pause_after: stop after this many turns if not done; the episode comes back with
            ``checkpoint`` set (see `resume_episode`).
        verify: compute the verdict at the end (sub-agent episodes skip it).
    """
    runner = EpisodeRunner(env, policy, harness)
    await runner.start(task)
    return await _drive(runner, policy, pause_after, verify)


async def resume_episode(
    policy: Policy,
    env: Environment,
    checkpoint: Mapping[str, Any],
    harness: Harness | None = None,
    *,
    pause_after: int | None = None,
    verify: bool = True,
) -> Episode:
    """Continue a paused episode from its JSON ``checkpoint`` on a fresh ``env``."""
    runner = EpisodeRunner.restore(checkpoint, env, policy, harness)
    return await _drive(runner, policy, pause_after, verify)


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise ValueError("the *_sync helpers cannot run inside an event loop; await the async function instead")


def run_episode_sync(
    policy: Policy,
    env: Environment,
    task: Task,
    harness: Harness | None = None,
    *,
    pause_after: int | None = None,
    verify: bool = True,
) -> Episode:
    """Synchronous `run_episode` (runs its own event loop)."""
    return _run_sync(run_episode(policy, env, task, harness, pause_after=pause_after, verify=verify))


def resume_episode_sync(
    policy: Policy,
    env: Environment,
    checkpoint: Mapping[str, Any],
    harness: Harness | None = None,
    *,
    pause_after: int | None = None,
    verify: bool = True,
) -> Episode:
    """Synchronous `resume_episode`."""
    return _run_sync(resume_episode(policy, env, checkpoint, harness, pause_after=pause_after, verify=verify))


# --------------------------------------------------------------------------- OpenAI-compatible policy

_OPENAI_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def to_openai_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    *,
    keep_reasoning: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Messages and tools as the OpenAI chat API takes them.

    Mid-session ``tool-declare`` messages are folded into the tool list (the API has no
    such message); dict arguments become JSON strings; keys the API does not know are
    dropped (``reasoning_content`` is kept when ``keep_reasoning``). Image parts of tool results (the visual
    family's ``python`` tool) move into one user message after the run of tool messages, since the API takes
    images in user messages only.
    """
    from k3post.xtml import is_tool_declaration  # here: the envs import no tokenizer stack

    out: list[dict[str, Any]] = []
    pending_images: list[dict[str, Any]] = []  # image parts of tool results, sent in a user message after them
    for m in messages:
        if is_tool_declaration(m):
            continue
        keys = _OPENAI_MESSAGE_KEYS + (("reasoning_content",) if keep_reasoning else ())
        msg = {k: copy.deepcopy(m[k]) for k in keys if k in m and m[k] is not None}
        if msg.get("role") == "assistant":
            msg.setdefault("content", "")
            calls = []
            for c in msg.get("tool_calls") or []:
                fn = dict(c.get("function", {}))
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
                calls.append({"id": c.get("id", ""), "type": "function", "function": fn})
            if calls:
                msg["tool_calls"] = calls
            else:
                msg.pop("tool_calls", None)
        if msg.get("role") == "tool":
            msg.pop("name", None)
            pending_images.extend(_split_tool_images(msg))
        elif pending_images:
            out.append({"role": "user", "content": pending_images})
            pending_images = []
        out.append(msg)
    if pending_images:
        out.append({"role": "user", "content": pending_images})
    return out, offered_tools(messages, tools)


def _split_tool_images(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """Remove the image parts of a tool message (the chat API takes images in user messages only) and return
    them; the tool message keeps its text."""
    content = msg.get("content")
    if not isinstance(content, list) or not any(isinstance(p, Mapping) and p.get("type") in ("image", "image_url") for p in content):
        return []
    images = [p for p in content if isinstance(p, Mapping) and p.get("type") in ("image", "image_url")]
    msg["content"] = "".join(p if isinstance(p, str) else p.get("text", "") for p in content if p not in images)
    return images


class EndpointHTTPError(RuntimeError):
    """An OpenAI-compatible endpoint answered an HTTP status other than 200 (``status``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)


class OpenAIPolicy:
    """A policy backed by an OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, ...).

    The returned assistant message carries ``content``, ``tool_calls`` (OpenAI format,
    arguments as JSON strings), ``reasoning_content`` when the server sends one, and
    ``num_tokens`` from ``usage.completion_tokens`` when present.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        keep_reasoning: bool = False,
        transport: "httpx.AsyncBaseTransport | None" = None,
    ) -> None:
        """Args:
            base_url: server root, with or without the trailing ``/v1`` (e.g. ``http://127.0.0.1:8000``).
            model: model name sent in the request.
            api_key: sent as a Bearer token when given.
            temperature / max_tokens: sampling parameters (omitted when None).
            extra_body: more request fields (e.g. ``{"top_p": 0.95}``).
            timeout_s: request timeout.
            keep_reasoning: send ``reasoning_content`` of past assistant messages back.
            transport: an httpx transport (for tests or custom networking).
        """
        if not is_url(base_url):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string")
        root = base_url.rstrip("/")
        self.url = root + ("/chat/completions" if root.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self.timeout_s = timeout_s
        self.keep_reasoning = keep_reasoning
        self.transport = transport

    def request_body(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The JSON body posted for ``messages`` and ``tools``."""
        msgs, tls = to_openai_chat(messages, tools, keep_reasoning=self.keep_reasoning)
        body: dict[str, Any] = {"model": self.model, "messages": msgs}
        if tls:
            body["tools"] = tls
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    async def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        """POST the chat request and return the first choice's message."""
        import httpx  # imported on use: `import k3post.envs` stays light

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        async with httpx.AsyncClient(timeout=self.timeout_s, transport=self.transport) as client:
            resp = await client.post(self.url, json=self.request_body(messages, tools), headers=headers)
        if resp.status_code != 200:
            raise EndpointHTTPError(resp.status_code, f"{self.url} answered HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            data = resp.json()
            choice = data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"{self.url} returned no chat completion choice: {resp.text[:500]}") from e
        msg: dict[str, Any] = {"role": "assistant", "content": choice.get("content") or ""}
        reasoning = choice.get("reasoning_content", choice.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            msg["reasoning_content"] = reasoning
        calls = []
        for c in choice.get("tool_calls") or []:
            fn = c.get("function") or {}
            args = fn.get("arguments", "{}")
            calls.append(
                {
                    "id": c.get("id") or f"call_{len(calls)}",
                    "type": "function",
                    "function": {
                        "name": fn.get("name", ""),
                        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    },
                }
            )
        if calls:
            msg["tool_calls"] = calls
        usage = data.get("usage") or {}
        if isinstance(usage.get("completion_tokens"), int):
            msg["num_tokens"] = usage["completion_tokens"]
        return msg


# --------------------------------------------------------------------------- gym-style wrapper


class GymEnv:
    """A synchronous, gymnasium-style view of an environment.

    ``reset(seed) -> (obs, info)``; ``step(action) -> (obs, reward, terminated, truncated, info)``.
    ``obs`` is the list of messages the policy should see now (the harness view); an
    action is one assistant message. The reward is 0 until the last step, which carries
    the verdict's reward (and ``info["verdict"]``). ``info["tools"]`` holds the tools offered.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        env: Environment,
        task_sampler: Callable[[random.Random], Task] | Sequence[Task],
        harness: Harness | None = None,
    ) -> None:
        """Args:
            env: the environment.
            task_sampler: ``sampler(rng) -> Task`` or a non-empty sequence of tasks (drawn uniformly).
            harness: the harness applied to every episode (default: identity).
        """
        if isinstance(task_sampler, Sequence):
            tasks = list(task_sampler)
            if not tasks:
                raise ValueError("task_sampler: the task list is empty")
            self._sample: Callable[[random.Random], Task] = lambda rng: rng.choice(tasks)
        elif callable(task_sampler):
            self._sample = task_sampler
        else:
            raise ValueError("task_sampler must be a callable rng -> Task or a list of tasks")
        self.env = env
        self.harness = harness
        self.rng = random.Random(0)
        self.runner: EpisodeRunner | None = None
        self.episode: Episode | None = None
        self._loop = asyncio.new_event_loop()

    def reset(self, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Start an episode of a sampled task; ``options={"task": task}`` forces one."""
        if seed is not None:
            self.rng = random.Random(seed)
        task = (options or {}).get("task") or self._sample(self.rng)
        if not isinstance(task, Task):
            raise ValueError(f"the task sampler returned {type(task).__name__}, not a Task")
        self.runner = EpisodeRunner(self.env, None, self.harness)
        self.episode = None
        self._loop.run_until_complete(self.runner.start(task))
        obs, tools = self.runner.view()
        return obs, {"task_id": task.id, "tools": tools}

    def step(self, action: Mapping[str, Any]) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Apply one assistant message."""
        if self.runner is None:
            raise ValueError("step() before reset()")
        if self.runner.done:
            raise ValueError("step() after the episode ended; call reset()")
        result = self._loop.run_until_complete(self.runner.advance(action))
        obs, tools = self.runner.view()
        info: dict[str, Any] = {"tools": tools, "env": result.info}
        reward = 0.0
        if result.done:
            self.episode = self.runner.result()
            assert self.episode.verdict is not None
            reward = self.episode.verdict.reward
            info["verdict"] = self.episode.verdict.to_dict()
        return obs, reward, result.done and not result.truncated, result.truncated, info

    def close(self) -> None:
        """Close the private event loop."""
        if not self._loop.is_closed():
            self._loop.close()
