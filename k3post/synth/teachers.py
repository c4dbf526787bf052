"""Teachers: where SFT trajectories come from (SPEC §2, data synthesis).

A **teacher** turns a task and an effort level into a policy (``policy(messages, tools) ->
assistant message``, see `k3post.envs.episode`); `k3post.synth.pipeline.synthesize` runs that
policy through the task family's environment, so tool results in a trajectory always come from
the real environment, never from the teacher.

* `ReferenceTeacher`  - the family's programmatic reference solver (built-in families).
* `EndpointTeacher`   - any OpenAI-compatible ``/v1/chat/completions`` server (vLLM, SGLang,
                        k3post's own server), with a concurrency limit and retries with
                        exponential backoff on HTTP 429 / 5xx and connection errors
                        (`k3post.httpclient`, the one retrying client).
* `LocalModelTeacher` - a local Hugging Face checkpoint: XTML render → the rollout engine
                        (`k3post.rollout.EmbeddedEngine`, stop on ``<|end_of_msg|>``) →
                        `XTML.parse`; the turns of the episodes running at once are batched
                        in one engine (continuous batching).

Every teacher has a ``name`` (recorded in each sample) and ``concurrency`` (how many episodes
`synthesize` may run at once with it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from k3post.constants import EFFORTS
from k3post.httpclient import RetryStats, RetryTransport, async_transport
from k3post.constants import Policy
from k3post.envs.episode import OpenAIPolicy
from k3post.envs.task import Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from k3post.rollout.embedded import EmbeddedEngine
    from k3post.rollout.engine import GenerationRequest, GenerationResult, SamplingParams

__all__ = [
    "Teacher",
    "ReferenceTeacher",
    "EndpointTeacher",
    "RetryTransport",
    "RetryStats",
    "LocalModelTeacher",
    "EngineBatcher",
]



def _check_effort(effort: str) -> str:
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}; expected one of {EFFORTS}")
    return effort


@runtime_checkable
class Teacher(Protocol):
    """What `synthesize` needs from a teacher."""

    name: str  # recorded in every sample, e.g. "reference", "endpoint:gpt-x@http://...", "local:/ckpt"
    concurrency: int  # episodes that may run at once
    # optional: ``threaded = True`` runs each episode in its own thread (for blocking environments)

    def policy(self, task: Task, effort: str) -> Policy:
        """The policy that solves ``task`` at ``effort``."""
        ...


class ReferenceTeacher:
    """The task family's scripted reference solver (``family.reference_policy(task, effort)``)."""

    def __init__(self, family: Any, concurrency: int = 4) -> None:
        """Args:
            family: a `k3post.envs.families.registry.TaskFamily`.
            concurrency: episodes run at once, each in its own thread.
        """
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if not callable(getattr(family, "reference_policy", None)):
            raise ValueError(f"{family!r} has no reference_policy(task, effort); is it a TaskFamily?")
        self.family = family
        self.name = "reference"
        self.concurrency = concurrency
        self.threaded = True  # the policy is instant; environments may block (sandboxes), so episodes run in threads

    def policy(self, task: Task, effort: str) -> Policy:
        """The family's reference policy for ``task`` at ``effort``."""
        return self.family.reference_policy(task, _check_effort(effort))


# --------------------------------------------------------------------------- endpoint teacher


class EndpointTeacher:
    """Any OpenAI-compatible chat-completions endpoint, through `OpenAIPolicy`.

    The effort level is sent as ``effort_field`` (default ``reasoning_effort``; None sends
    nothing). Concurrency and retries live in one shared `RetryTransport`; its counters are
    ``teacher.stats``.
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        concurrency: int = 8,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        temperature: float | None = None,
        max_tokens: int | None = None,
        timeout_s: float = 120.0,
        effort_field: str | None = "reasoning_effort",
        extra_body: Mapping[str, Any] | None = None,
        inner_transport_factory: Any = None,
    ) -> None:
        """Args:
            url: server root (``http://host:port`` or ``.../v1``).
            model: model name for the request.
            api_key: Bearer token, if the server needs one.
            concurrency: episodes (and requests) in flight at once.
            retries / backoff_s / max_backoff_s: see `RetryTransport`.
            temperature / max_tokens / timeout_s / extra_body: passed to `OpenAIPolicy`.
            effort_field: request field carrying the effort level, or None.
            inner_transport_factory: per-attempt transport factory (tests, custom networking).
        """
        self.url = url
        self.model = model
        self.retry = RetryTransport(
            concurrency=concurrency, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
            inner_factory=inner_transport_factory,
        )
        self.concurrency = concurrency
        self.name = f"endpoint:{model}@{url}"
        self._kw: dict[str, Any] = dict(api_key=api_key, temperature=temperature, max_tokens=max_tokens, timeout_s=timeout_s)
        self.effort_field = effort_field
        self.extra_body = dict(extra_body or {})
        OpenAIPolicy(url, model)  # validates url and model now, with a clear ValueError
        self._transport: Any = None

    @property
    def stats(self) -> RetryStats:
        """Request / attempt / retry / failure counters."""
        return self.retry.stats

    def policy(self, task: Task, effort: str) -> Policy:
        """An `OpenAIPolicy` sending ``effort`` and retrying through the shared transport."""
        body = dict(self.extra_body)
        if self.effort_field:
            body[self.effort_field] = _check_effort(effort)
        if self._transport is None:
            self._transport = async_transport(self.retry)
        return OpenAIPolicy(self.url, self.model, extra_body=body, transport=self._transport, **self._kw)


# --------------------------------------------------------------------------- local model teacher


class EngineBatcher:
    """Lets many coroutines of one event loop share a steppable rollout engine: each awaits its
    own request while a driver task steps the engine, so requests submitted while others run
    join the running batch (continuous batching across episodes).

    Between two engine steps the driver yields to the event loop once, so an episode whose turn
    just ended can parse, step its environment and submit its next turn before the next step.
    An engine error fails every waiting request; a request whose waiter is cancelled (or whose
    event loop closed mid-run) is aborted, so the engine is left idle for the next event loop.
    """

    def __init__(self, engine: Any) -> None:
        """Args: engine: a `k3post.rollout.engine.SteppableEngine` (``add_request`` / ``step`` / ``abort``)."""
        self.engine = engine
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        self._driver: asyncio.Task[None] | None = None

    async def generate(self, request: "GenerationRequest") -> "GenerationResult":
        """Run ``request`` to its end in the shared engine; its finished result."""
        loop = asyncio.get_running_loop()
        if self._driver is not None and not self._driver.done() and self._driver.get_loop() is not loop:
            if not self._driver.get_loop().is_closed():
                raise ValueError("EngineBatcher is driving the engine from another running event loop")
            self.engine.abort(list(self._waiting))  # left by a loop closed mid-run
            self._waiting.clear()
            self._driver = None
        fut: asyncio.Future[Any] = loop.create_future()
        self.engine.add_request(request)
        self._waiting[request.request_id] = fut
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        try:
            return await fut
        finally:
            if self._waiting.get(request.request_id) is fut:  # cancelled while running: free its slot
                del self._waiting[request.request_id]
                self.engine.abort([request.request_id])

    async def _drive(self) -> None:
        try:
            while self.engine.has_unfinished():
                await asyncio.sleep(0)
                for res in self.engine.step():
                    fut = self._waiting.pop(res.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(res)
        except BaseException as e:  # noqa: BLE001 - handed to every waiter, the engine is emptied
            live = list(self._waiting)
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else RuntimeError(f"engine driver stopped: {e!r}"))
            self._waiting.clear()
            if live:
                self.engine.abort(live)


class LocalModelTeacher:
    """A local Hugging Face checkpoint, sampled with the rollout engine on XTML.

    Per turn: render the conversation with the effort option and the generation prefix
    (`XTML.render(..., add_generation_prompt=True)`), sample until ``<|end_of_msg|>`` or
    ``sampling.max_tokens`` with `k3post.rollout.EmbeddedEngine`, and parse the completion with
    `XTML.parse`. A completion that does not parse (or never ends) still becomes an assistant
    message, so the episode goes on and the sample is recorded: its ``content`` is the decoded
    text and ``xtml_error`` says what was wrong, which the structure stage rejects.
    ``num_tokens`` is the exact completion length.

    Up to ``concurrency`` episodes run at once on one event loop; their turns are requests of one
    shared engine (`EngineBatcher`), batched together. Turn t of the episode of ``task`` at
    ``effort`` samples with seed ``request_seed(sampling.seed or 0, f"{task.id}/{effort}/{t}")``: with the
    engine's counter-based sampling a trajectory depends only on (seed, task, effort, weights),
    never on the concurrency or the order in which episodes run.

    The environment, harness and the recorded sample stay the pipeline's (`synthesize` runs the
    policy through ``run_episode``), so multi-turn episodes go turn by turn through this policy
    rather than through `k3post.rollout.AgentLoop` (which owns its environments and records token
    trajectories, not messages); each turn re-prefills its rendered conversation.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model: "PreTrainedModel | None" = None,
        tokenizer: "PreTrainedTokenizerBase | None" = None,
        sampling: SamplingParams | None = None,
        mode: str = "think",
        concurrency: int = 8,
        engine: "EmbeddedEngine | None" = None,
    ) -> None:
        """Args:
            model_dir: a folder holding the model and its tokenizer (``k3post init-model``, an SFT
                ``final/``); or pass ``model`` and ``tokenizer`` directly.
            sampling: the engine's `k3post.rollout.SamplingParams` (default: T 1, ``max_tokens`` 512); its
                ``stop_ids`` are replaced by ``<|end_of_msg|>`` and its ``seed`` is the base of every turn's
                seed (None: 0).
            mode: XTML mode, ``think`` or ``instruct``.
            concurrency: episodes run at once (their turns decode together in the engine).
            engine: an `EmbeddedEngine` over ``model`` to sample with (default: one built here
                with ``concurrency`` slots). A QAT model (``apply_qat``) samples with its MX
                fake-quant forward either way.
        """
        from k3post.rollout.engine import SamplingParams
        from k3post.rollout.factory import build_engine
        from k3post.xtml import XTML

        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if model is None and engine is not None:
            model = engine.model
        if model is None or tokenizer is None:
            if model_dir is None:
                raise ValueError("LocalModelTeacher needs model_dir, or both model= and tokenizer=")
            from k3post.models import load_model
            from k3post.tokenizer import load_tokenizer

            p = Path(model_dir)
            if not (p / "config.json").is_file():
                raise ValueError(f"{p}: not a model folder (no config.json)")
            model = model if model is not None else load_model(p)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(p, require_xtml=True)
        if engine is not None and engine.model is not model:
            raise ValueError("engine runs a different model than model=; pass engine.model (or no model)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.xtml = XTML(tokenizer)
        self.sampling = sampling or SamplingParams(max_tokens=512)
        self.mode = mode
        self.name = f"local:{model_dir}" if model_dir is not None else f"local:{type(model).__name__}"
        self.concurrency = concurrency
        self.engine = engine if engine is not None else build_engine(model, tokenizer, max_batch_size=concurrency)
        self._batcher = EngineBatcher(self.engine)
        self._requests = 0

    async def generate(self, prompt_ids: list[int], seed: int) -> list[int]:
        """Completion ids for ``prompt_ids`` sampled with ``seed`` (ends with ``<|end_of_msg|>``
        unless cut at sampling.max_tokens); batched with the other running episodes' turns."""
        from k3post.rollout.engine import GenerationRequest

        self._requests += 1
        sampling = dataclasses.replace(self.sampling, stop_ids=(self.xtml.eom_id,), seed=seed)
        request = GenerationRequest(f"teacher-{self._requests}", list(prompt_ids), sampling)
        return (await self._batcher.generate(request)).output_ids

    def policy(self, task: Task, effort: str) -> Policy:
        """An async policy: render → generate → parse (see the class docstring)."""
        from k3post.rollout.engine import request_seed
        from k3post.tokenizer import decode
        from k3post.xtml import XTMLParseError

        eff = _check_effort(effort) if self.mode == "think" else None
        turn = 0

        async def run(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
            nonlocal turn
            prompt = self.xtml.render(messages, tools=tools or None, effort=eff, mode=self.mode, add_generation_prompt=True)
            completion = await self.generate(prompt.ids, request_seed(self.sampling.seed or 0, f"{task.id}/{effort}/{turn}"))
            turn += 1
            n = len(completion)
            if self.xtml.eom_id in completion:
                completion = completion[: completion.index(self.xtml.eom_id) + 1]
                n = len(completion)
            try:
                if completion[-1:] != [self.xtml.eom_id]:
                    raise XTMLParseError(len(completion), f"no <|end_of_msg|> within max_tokens={self.sampling.max_tokens}")
                msg = self.xtml.parse(completion, mode=self.mode, after_prefix=True)
            except XTMLParseError as e:
                return {"role": "assistant", "content": decode(self.tokenizer, completion), "reasoning_content": "",
                        "num_tokens": n, "xtml_error": str(e)}
            msg["num_tokens"] = n
            if not msg.get("tool_calls"):
                msg.pop("tool_calls", None)
            return msg

        return run
