"""What every route of `k3post serve` shares: the server's settings (`ServeConfig`, `ServeLimits`), the state behind
the routes (`ServerState`), its OpenAI-shaped errors (`APIError`) and the bounded JSON body reader (`json_body`).
`k3post.serve.app` (the OpenAI API) and `k3post.serve.engine_api` (the engine protocol) both build on it; it imports
neither, nor FastAPI (the CLI reads `ServeLimits` from here without it).

Shape legend: none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k3post.constants import DEFAULT_EFFORT
from k3post.scoring import micro_batches
from k3post.tokenizer import decode
from k3post.xtml import EFFORTS, XTML, XTMLParseError

if TYPE_CHECKING:
    from fastapi import Request

    from k3post.serve.runner import EngineRunner

__all__ = ["APIError", "EFFORT_CHOICES", "INSTRUCT_EFFORT", "ServeConfig", "ServeLimits", "ServerState", "json_body", "too_large"]

INSTRUCT_EFFORT = "none"
"""The ``thinking_effort`` value that selects instruct mode."""

EFFORT_CHOICES: tuple[str, ...] = EFFORTS + (INSTRUCT_EFFORT,)
"""Accepted ``thinking_effort`` values: ``low``, ``high``, ``max`` (think mode) and ``none`` (instruct)."""

@dataclass(frozen=True)
class ServeLimits:
    """Bounds that keep the server up under load and bad input (``k3post serve --limit KEY=VALUE``).

    Fields:
        max_body_bytes: largest request body (413).
        max_prompts: most prompts in one ``/v1/completions`` request (400).
        max_n: most choices ``n`` in one request (400).
        max_tokens: most new tokens one choice may ask for (400).
        max_inflight: most engine requests (choices) queued or running for HTTP clients at once;
            a request that would exceed it is a 429 with ``Retry-After``.
        request_timeout_s: wall-clock seconds a request may take (504; streams end with the error).
        echo_batch_tokens: padded tokens per scoring forward of ``echo`` (one engine-thread call
            each, so generation for other clients goes on between them).
        retry_after_s: the ``Retry-After`` seconds of a 429.
        max_prompt_chars: most characters of text one request asks the server to tokenise (the prompt
            strings of ``/v1/completions``, every string of a chat request's messages and tools; 400).
            Tokenising runs in a worker thread, off the event loop, so a long prompt delays only itself.
        max_json_depth: deepest nesting of arrays and objects in a request body (400).
        max_weight_values: most values ``/get_weights_by_name`` returns (``truncate_size``; 400).
        max_drain_bytes: a body refused before it was read (413, 401, ...) is read and discarded up to
            this many bytes, so the client sees the answer instead of a connection reset; a longer one
            is cut off. A client that sent ``Expect: 100-continue`` is answered without reading.
    """

    max_body_bytes: int = 8 * 1024**2
    max_prompts: int = 64
    max_n: int = 16
    max_tokens: int = 8192
    max_inflight: int = 256
    request_timeout_s: float = 600.0
    echo_batch_tokens: int = 8192
    retry_after_s: int = 1
    max_prompt_chars: int = 1024**2
    max_json_depth: int = 64
    max_weight_values: int = 65536
    max_drain_bytes: int = 64 * 1024**2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ServeLimits.{f.name} must be a positive number, got {v!r}")

    @classmethod
    def parse(cls, items: Sequence[str]) -> "ServeLimits":
        """From ``KEY=VALUE`` strings (``max_n=4``); an unknown key or bad value is a ValueError naming it."""
        kinds = {f.name: (float if f.type in ("float", float) else int) for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"--limit {item!r}: expected KEY=VALUE with KEY one of {sorted(kinds)}")
            try:
                values[key] = kinds[key](raw)
            except ValueError:
                raise ValueError(f"--limit {key}: {raw!r} is not a {kinds[key].__name__}") from None
        return cls(**values)


@dataclass(frozen=True)
class ServeConfig:
    """Server settings.

    Fields:
        model_name: the id served by ``/v1/models`` and expected in requests' ``model``.
        default_effort: ``thinking_effort`` for requests that give none (``low`` | ``high`` |
            ``max`` | ``none`` for instruct mode); `k3post.constants.DEFAULT_EFFORT` (``max``) as the
            shipped K3 encoder.
        default_max_tokens: cap on output tokens for requests without ``max_tokens`` (1024;
            None: the room left under ``max_model_len``, which lets one request hold a slot for
            the whole context).
        api_key: when set, every route but ``/health`` (``/v1/*`` and the engine API, which can
            pause the engine and replace its weights) needs ``Authorization: Bearer <api_key>``, and
            ``/health`` reports liveness only.
        model_path: the served model folder (reported by ``/get_model_info``), when known.
        limits: request bounds (`ServeLimits`).
    """

    model_name: str
    default_effort: str = DEFAULT_EFFORT
    default_max_tokens: int | None = 1024
    api_key: str | None = None
    model_path: str | None = None
    limits: ServeLimits = ServeLimits()

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("ServeConfig.model_name must be a non-empty string")
        if self.default_effort not in EFFORT_CHOICES:
            raise ValueError(f"ServeConfig.default_effort must be one of {EFFORT_CHOICES}, got {self.default_effort!r}")
        if self.default_max_tokens is not None and (
            not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1
        ):
            raise ValueError(f"ServeConfig.default_max_tokens must be an int >= 1 or None, got {self.default_max_tokens!r}")


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_

    def payload(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes (ServeLimits.max_body_bytes)", status=413,
                    code="request_too_large")


def _nesting_ok(obj: Any, limit: int) -> bool:
    """Whether ``obj``'s arrays and objects nest at most ``limit`` deep (the outermost is level 1); iterative."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        children = o.values() if isinstance(o, dict) else o
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def _too_deep(limit: int) -> APIError:
    return APIError(f"the request body nests arrays / objects deeper than {limit} levels (ServeLimits.max_json_depth)",
                    code="limit_exceeded")


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object body; a 400 when it is not valid JSON, not an object or nested deeper
    than ``ServeLimits.max_json_depth``, a 413 when it is larger than ``ServeLimits.max_body_bytes``
    (read in chunks: a body without Content-Length is cut off at the limit, never buffered whole).
    A large body is parsed in a worker thread."""
    limits = request.app.state.server.config.limits
    limit = limits.max_body_bytes
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large(limit)
    try:
        data = bytes(raw)
        body = json.loads(data) if len(data) < _THREAD_BYTES else await asyncio.to_thread(json.loads, data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # nested deeper than the parser's stack allows
        raise _too_deep(limits.max_json_depth) from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if not _nesting_ok(body, limits.max_json_depth):
        raise _too_deep(limits.max_json_depth)
    return body


_THREAD_BYTES = 1 << 20
"""Bodies from this size on are parsed off the event loop."""


class ServerState:
    """The state behind the routes: the engine runner, the tokenizer and its XTML, the settings, the requests in flight."""

    def __init__(self, runner: EngineRunner, tokenizer: Any, config: ServeConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.xtml = XTML(tokenizer)
        self.config = config
        engine = runner.engine
        self.max_model_len = int(engine.max_model_len)
        embed = getattr(getattr(getattr(engine, "model", None), "model", None), "embed_tokens", None)
        self.vocab = int(embed.num_embeddings) if embed is not None else len(tokenizer)
        self.default_stop_ids: frozenset[int] = frozenset(getattr(engine, "default_stop_ids", frozenset([self.xtml.eom_id])))
        self.created = int(time.time())
        self.inflight = 0  # engine requests of HTTP clients queued or running (`_Inflight`)

    # ------------------------------------------------------------------ helpers
    def admit(self, k: int) -> None:
        """Room for ``k`` more engine requests: a 429 (retry later) when the server is full, a 400 when
        ``k`` alone is over the limit (retrying cannot help)."""
        limit = self.config.limits.max_inflight
        if k > limit:
            raise APIError(f"the request needs {k} engine requests (prompts x n), more than this server's limit of "
                           f"{limit} in flight (ServeLimits.max_inflight)", code="limit_exceeded")
        if self.inflight + k > limit:
            raise APIError(f"the server is busy: {self.inflight} requests in flight, the limit is {limit} "
                           "(ServeLimits.max_inflight); retry later", status=429, code="server_busy",
                           type_="rate_limit_error")

    async def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """The engine's `score` of ``prompts`` (``out[b][t - 1] = log p(prompts[b][t] | prompts[b][:t])``), one
        engine-thread call per batch of at most ``echo_batch_tokens`` padded tokens, so the engine steps other
        clients' generation in between; counted in flight (429 when full) and bounded by ``request_timeout_s``
        (504, checked between batches)."""
        limits = self.config.limits
        self.admit(len(prompts))
        deadline = time.monotonic() + limits.request_timeout_s
        scores: list[list[float]] = [[] for _ in prompts]
        self.inflight += len(prompts)
        try:
            for idx in micro_batches([len(p) for p in prompts], limits.echo_batch_tokens):
                if time.monotonic() > deadline:
                    raise APIError(f"the request took longer than {limits.request_timeout_s:g} s "
                                   "(ServeLimits.request_timeout_s)", status=504, code="timeout", type_="server_error")
                group = [prompts[i] for i in idx]
                out = await self.runner.call(lambda engine, group=group: engine.score(group))
                for i, lps in zip(idx, out):
                    scores[i] = lps
        finally:
            self.inflight -= len(prompts)
        return scores

    def check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            raise APIError(f"the model '{model}' does not exist; this server serves '{self.config.model_name}'",
                           param="model", status=404, code="model_not_found")

    def fingerprint(self) -> str:
        return f"k3post-v{getattr(self.runner.engine, 'version', 0)}"

    def token_str(self, tid: int) -> str:
        return decode(self.tokenizer, [tid])

    def logprob_entries(self, ids: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(ids, logprobs):
            s = self.token_str(t)
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
        return out

    def parse(self, ids: list[int], mode: str) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a completion; on malformed XTML the valid prefix and the error."""
        partial = not ids or ids[-1] != self.xtml.eom_id
        try:
            return self.xtml.parse(ids, mode=mode, partial=partial, after_prefix=True), None
        except XTMLParseError as e:
            try:
                msg = self.xtml.parse(ids[: e.position], mode=mode, partial=True, after_prefix=True)
            except XTMLParseError:
                msg = {"role": "assistant", "reasoning_content": None, "content": "", "tool_calls": []}
            if mode == "think" and msg["reasoning_content"] is None:  # the generation prefix opened `think`
                msg["reasoning_content"] = ""
            return msg, str(e)
