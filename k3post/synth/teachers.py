"""Teachers: where SFT trajectories come from (SPEC §2, data synthesis).

A **teacher** turns a task and an effort level into a policy (``policy(messages, tools) ->
assistant message``, see `k3post.envs.episode`); `k3post.synth.pipeline.synthesize` runs that
policy through the task family's environment, so tool results in a trajectory always come from
the real environment, never from the teacher.

* `ReferenceTeacher`  - the family's programmatic reference solver (built-in families).
* `EndpointTeacher`   - any OpenAI-compatible ``/v1/chat/completions`` server (vLLM, SGLang,
                        k3post's own server), with a concurrency limit and retries with
                        exponential backoff on HTTP 429 / 5xx and connection errors.
* `LocalModelTeacher` - a local Hugging Face checkpoint: XTML render → ``model.generate`` (stop
                        on ``<|end_of_msg|>``) → `XTML.parse`. This is the stand-in for the rollout
                        engine: when `k3post.rollout` exists it replaces `LocalModelTeacher.generate`
                        (same inputs: token ids + sampling; same output: completion ids).

Every teacher has a ``name`` (recorded in each sample) and ``concurrency`` (how many episodes
`synthesize` may run at once with it).
"""

from __future__ import annotations

import asyncio
import email.utils
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from k3post.envs.episode import OpenAIPolicy, Policy
from k3post.envs.task import Task

if TYPE_CHECKING:
    import httpx
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "Teacher",
    "ReferenceTeacher",
    "EndpointTeacher",
    "RetryTransport",
    "RetryStats",
    "LocalModelTeacher",
    "SamplingParams",
]

EFFORTS: tuple[str, ...] = ("low", "high", "max")


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


@dataclass
class RetryStats:
    """Counters of a `RetryTransport` (shared by all requests of one teacher)."""

    requests: int = 0  # logical requests
    attempts: int = 0  # HTTP attempts, retries included
    retries: int = 0  # attempts beyond the first
    failures: int = 0  # requests that still failed after all retries


_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class RetryTransport:
    """An httpx async transport that limits concurrency and retries transient failures.

    Retried: HTTP 408 / 409 / 425 / 429 / 500 / 502 / 503 / 504 and transport errors (connection
    refused or reset, timeouts, a server closing the connection mid-response). Attempt k (from 0)
    waits ``min(backoff_s * 2**k, max_backoff_s)`` before the next one, or the server's
    ``Retry-After`` when that is longer (capped at ``max_backoff_s``). Each attempt uses a fresh
    connection, and the body is read before the response is handed back, so a client closing
    the transport never cuts a response short.
    """

    def __init__(
        self,
        *,
        concurrency: int = 8,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        inner_factory: Any = None,
    ) -> None:
        """Args:
            concurrency: requests in flight at once (an asyncio semaphore, per event loop).
            retries: extra attempts after the first.
            backoff_s: first wait; doubles per retry.
            max_backoff_s: cap on one wait.
            inner_factory: ``() -> httpx.AsyncBaseTransport`` for each attempt (default
                ``httpx.AsyncHTTPTransport``).
        """
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative int, got {retries!r}")
        if not backoff_s >= 0 or not max_backoff_s >= 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s!r}, {max_backoff_s!r}")
        self.concurrency = concurrency
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.inner_factory = inner_factory
        self.stats = RetryStats()
        self._sems: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.concurrency)
        return sem

    def _wait_s(self, attempt: int, retry_after: str | None) -> float:
        wait = min(self.backoff_s * (2**attempt), self.max_backoff_s)
        if retry_after:
            try:
                ra = float(retry_after)
            except ValueError:
                try:  # an HTTP date
                    ra = max(0.0, email.utils.parsedate_to_datetime(retry_after).timestamp() - time.time())
                except (TypeError, ValueError):
                    ra = 0.0
            wait = max(wait, min(ra, self.max_backoff_s))
        return wait

    async def _attempt(self, request: "httpx.Request") -> "httpx.Response":
        import httpx

        inner = self.inner_factory() if self.inner_factory is not None else httpx.AsyncHTTPTransport()
        async with inner:
            resp = await inner.handle_async_request(request)
            body = await resp.aread()
            await resp.aclose()
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    async def handle_async_request(self, request: "httpx.Request") -> "httpx.Response":
        """Send ``request`` with retries (the httpx transport interface)."""
        import httpx

        self.stats.requests += 1
        async with self._semaphore():
            attempt = 0
            while True:
                self.stats.attempts += 1
                try:
                    resp = await self._attempt(request)
                except httpx.TransportError:
                    if attempt >= self.retries:
                        self.stats.failures += 1
                        raise
                    wait = self._wait_s(attempt, None)
                else:
                    if resp.status_code not in _RETRY_STATUS or attempt >= self.retries:
                        if resp.status_code in _RETRY_STATUS:
                            self.stats.failures += 1
                        return resp
                    wait = self._wait_s(attempt, resp.headers.get("retry-after"))
                attempt += 1
                self.stats.retries += 1
                await asyncio.sleep(wait)

    async def aclose(self) -> None:
        """Nothing to close: every attempt owns its connection."""

    async def __aenter__(self) -> "RetryTransport":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _as_transport(t: RetryTransport) -> Any:
    """Wrap `RetryTransport` in a real ``httpx.AsyncBaseTransport`` subclass (httpx checks the type)."""
    import httpx

    class _T(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await t.handle_async_request(request)

        async def aclose(self) -> None:
            await t.aclose()

    return _T()


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
            self._transport = _as_transport(self.retry)
        return OpenAIPolicy(self.url, self.model, extra_body=body, transport=self._transport, **self._kw)


# --------------------------------------------------------------------------- local model teacher


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for `LocalModelTeacher`. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")


class LocalModelTeacher:
    """A local Hugging Face checkpoint, sampled with ``transformers.generate`` on XTML.

    Per turn: render the conversation with the effort option and the generation prefix
    (`XTML.render(..., add_generation_prompt=True)`), sample until ``<|end_of_msg|>`` or
    ``max_new_tokens``, and parse the completion with `XTML.parse`. A completion that does not
    parse (or never ends) still becomes an assistant message, so the episode goes on and the
    sample is recorded: its ``content`` is the decoded text and ``xtml_error`` says what was
    wrong, which the structure stage rejects. ``num_tokens`` is the exact completion length.

    This is the path the rollout engine will replace: `generate` has the engine's shape
    (prompt ids + sampling in, completion ids out).
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model: "PreTrainedModel | None" = None,
        tokenizer: "PreTrainedTokenizerBase | None" = None,
        sampling: SamplingParams | None = None,
        mode: str = "think",
    ) -> None:
        """Args:
            model_dir: a folder holding the model and its tokenizer (``k3post init-model``, an SFT
                ``final/``); or pass ``model`` and ``tokenizer`` directly.
            sampling: sampling parameters (default `SamplingParams()`).
            mode: XTML mode, ``think`` or ``instruct``.
        """
        from k3post.xtml import XTML

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
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.xtml = XTML(tokenizer)
        self.sampling = sampling or SamplingParams()
        self.mode = mode
        self.name = f"local:{model_dir}" if model_dir is not None else f"local:{type(model).__name__}"
        self.concurrency = 1
        self._calls = 0

    def generate(self, prompt_ids: list[int]) -> list[int]:
        """Completion ids for ``prompt_ids`` (ends with ``<|end_of_msg|>`` unless cut at max_new_tokens)."""
        import torch

        sp = self.sampling
        gen = torch.Generator().manual_seed(sp.seed * 1_000_003 + self._calls)
        self._calls += 1
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sp.max_new_tokens,
            eos_token_id=self.xtml.eom_id,
            pad_token_id=self.xtml.pad_id,
            attention_mask=torch.ones_like(ids),
        )
        if sp.temperature == 0:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            out = self.model.generate(ids, **kwargs)
        return [int(t) for t in out[0, len(prompt_ids) :]]

    def policy(self, task: Task, effort: str) -> Policy:
        """A sync policy: render → generate → parse (see the class docstring)."""
        from k3post.tokenizer import decode
        from k3post.xtml import XTMLParseError

        eff = _check_effort(effort) if self.mode == "think" else None

        def run(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
            prompt = self.xtml.render(messages, tools=tools or None, effort=eff, mode=self.mode, add_generation_prompt=True)
            completion = self.generate(prompt.ids)
            n = len(completion)
            if self.xtml.eom_id in completion:
                completion = completion[: completion.index(self.xtml.eom_id) + 1]
                n = len(completion)
            try:
                if completion[-1:] != [self.xtml.eom_id]:
                    raise XTMLParseError(len(completion), f"no <|end_of_msg|> within max_new_tokens={self.sampling.max_new_tokens}")
                msg = self.xtml.parse(completion, mode=self.mode)
            except XTMLParseError as e:
                return {"role": "assistant", "content": decode(self.tokenizer, completion), "reasoning_content": "",
                        "num_tokens": n, "xtml_error": str(e)}
            msg["num_tokens"] = n
            if not msg.get("tool_calls"):
                msg.pop("tool_calls", None)
            return msg

        return run
