"""The OpenAI-compatible HTTP API (FastAPI): chat completions over XTML, completions, models.

Endpoints:

* ``POST /v1/chat/completions``: OpenAI chat messages (system / developer / user / assistant
  with ``tool_calls`` and ``reasoning_content`` / tool results) rendered with XTML (SPEC §1):
  ``tools`` become the global ``tool-declare`` message, ``tool_choice`` and
  ``response_format`` the one-shot option messages, ``thinking_effort`` the
  ``thinking-effort`` message. The sampled completion is parsed back (``XTML.parse`` /
  ``XTML.stream``) into ``reasoning_content``, ``content`` and ``tool_calls``.
  Streaming (``stream: true``) sends server-sent events, ``chat.completion.chunk`` objects
  with ``delta.reasoning_content``, ``delta.content`` and ``delta.tool_calls`` (OpenAI's
  streaming form: the first delta of a call carries ``index``, ``id``, ``type`` and
  ``function.name``, the next one ``function.arguments``), a last chunk per choice with
  its ``finish_reason``, a usage chunk when ``stream_options.include_usage``, then
  ``data: [DONE]``.
* ``POST /v1/completions``: raw continuation of a prompt string (encoded with the
  tokenizer, no chat template; special-token strings such as ``<|open|>`` become their
  special ids, so an XTML context from ``render_text`` can be continued), a list of token
  ids, or a batch of either. Optional ``logprobs`` and ``stop`` strings; streaming as above
  (``text_completion`` chunks).
* ``GET /v1/models``, ``GET /v1/models/{id}``: the served model.
* ``GET /health``: liveness plus the engine runner's counters (``peak_running``,
  ``weight_version`` etc.); with an API key set, liveness only (``{"status": "ok"}``).
* The engine protocol with SGLang's names (``/generate`` on token ids with log-probs and
  versions, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
  ``/update_weights_from_disk``, ...): `k3post.serve.engine_api`.

Decisions (ours):

* **Thinking effort.** ``thinking_effort`` (alias ``reasoning_effort``; both given must
  agree) is ``low`` | ``high`` | ``max``: thinking mode with that effort message, or
  ``none``: instruct mode (no ``think`` channel, the generation prefix opens ``response``,
  ``reasoning_content`` is null). Absent: the server default (``ServeConfig.default_effort``,
  ``max``, the shipped K3 encoder's default). Any other value (including ``medium``, which the template reserves but the
  policy is not trained on) is a 400 naming the field.
* **Sampling.** ``temperature`` (default 1), ``top_p``, ``top_k`` (extension, 0 disables),
  ``seed``, ``max_tokens`` / ``max_completion_tokens`` (the latter wins), ``n``. Choice i of
  a seeded request samples with seed ``seed`` (i = 0) or ``request_seed(seed, "choice-i")``,
  so n > 1 gives n distinct, reproducible samples; without a seed every request gets a
  fresh one. The engine's counter-based sampler makes a seeded request's tokens
  independent of what else is in the batch. ``stop_token_ids`` (extension, as in vLLM) add
  stop ids to ``<|end_of_msg|>``; ``ignore_eos`` (extension) is passed through.
* **Stop strings.** Supported on ``/v1/completions`` (text is cut before the first match,
  generation is aborted there, ``finish_reason`` "stop"). On chat completions a non-empty
  ``stop`` is a 400: a chat turn ends at ``<|end_of_msg|>`` and cutting inside XTML
  structure would break the parse.
* **Log-probs.** The engine records the log-prob of the sampled token under the raw model
  distribution (temperature 1, no top-k / top-p), so chat ``logprobs: true`` returns that
  per token (``top_logprobs`` is ``[]``; asking for ``top_logprobs`` > 0 is a 400) and
  completions ``logprobs`` accepts 0 or 1 (``token_logprobs``; ``top_logprobs`` null).
* **Malformed output.** When the model's completion is not valid XTML the message holds
  what parsed before the first bad token (complete tool calls included), and the choice
  carries a non-standard ``xtml_error`` string (streaming: on its final chunk).
* **Context length.** A prompt that leaves no room under ``max_model_len``, or
  ``max_tokens`` beyond the room left, is a 400 with code ``context_length_exceeded``.
  Without ``max_tokens`` a request may use the whole room (capped by
  ``ServeConfig.default_max_tokens`` when set).
* **Prompt scoring.** ``/v1/completions`` with ``echo: true, max_tokens: 0`` scores each prompt
  in one prefill and returns it as ``text`` with ``logprobs.token_logprobs[t] = log p(prompt[t] |
  prompt[:t])`` (None first), the vLLM convention: MOPD teachers (``mopd.experts`` given as this
  server's URL) and log-likelihood evaluations use it. ``echo`` with generation, streaming or
  ``n`` > 1 is a 400.
* Unsupported options with a non-default value (``presence_penalty``,
  ``frequency_penalty``, ``min_tokens``, ``logit_bias``, ``suffix``, ``best_of`` > 1, a
  ``tool_choice`` naming a function, which the engine cannot enforce, the legacy
  ``functions``) are a 400 naming the field; options without effect here
  (``parallel_tool_calls``, ``user``, ``metadata``, ...) are ignored. A tool name must match
  ``^[a-zA-Z0-9_-]{1,64}$`` as in the OpenAI API (400 naming ``tools[i].function.name``).
  ``Authorization`` takes the ``Bearer`` scheme in any case (RFC 7235).
* ``system_fingerprint`` is ``k3post-v<policy version>`` of the engine.

* **Limits** (`ServeLimits`, each a setting with a safe default; the error names it): request
  body size (413 ``request_too_large``), prompts per ``/v1/completions`` request (400),
  ``n`` (400), ``max_tokens`` (400; without ``max_tokens`` a request gets
  ``ServeConfig.default_max_tokens``, 1024 by default, not the rest of the context), engine
  requests in flight (429 ``server_busy`` with ``Retry-After``), seconds per request (504
  ``timeout``; a stream ends with that error event). Prompt scoring (``echo``) runs in forwards
  of at most ``echo_batch_tokens`` padded tokens, each its own call between engine steps, so
  other clients' generation goes on in between.
* **Tokenising** (chat rendering, string prompts) runs in a worker thread (``asyncio.to_thread``; the
  tokenizer releases the GIL while it encodes), so one long prompt does not stall the event loop,
  and is bounded by ``ServeLimits.max_prompt_chars`` (400). A body nested deeper than
  ``ServeLimits.max_json_depth`` is a 400. A body the server answers before reading it (413 on its
  Content-Length, 401) is read and discarded up to ``ServeLimits.max_drain_bytes``, so the client gets
  the answer instead of a connection reset; ``Expect: 100-continue`` is answered without reading.
* **API key** compared in constant time (`hmac.compare_digest`).

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400
for invalid requests, 401 for a wrong API key, 404 for an unknown model, 413 / 429 / 504 for
the limits above, 500 when the engine fails.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from k3post.rollout.engine import GenerationRequest, GenerationResult
from k3post.serve.engine_api import engine_router
from k3post.serve.runner import EngineRunner, ErrorEvent, FinishEvent, RunnerEvent, TokenEvent
from k3post.serve.server import (EFFORT_CHOICES, INSTRUCT_EFFORT, APIError, ServeConfig, ServeLimits, ServerState,
                                 json_body, too_large)
from k3post.serve.validate import (authorized, boolean, check_prompt_chars, integer, parse_effort, parse_messages,
                                   parse_prompts, parse_tools, render_param, sampling, text_chars, wants_usage)
from k3post.tokenizer import decode, text_offsets
from k3post.xtml import TextDelta, ToolCall, ToolCallStart, XTMLParseError

__all__ = ["ServeConfig", "ServeLimits", "APIError", "create_app", "EFFORT_CHOICES", "INSTRUCT_EFFORT"]

# --------------------------------------------------------------------------- in-flight requests


class _Inflight:
    """The engine requests of one HTTP request (its n choices) and their event stream.

    Admission: more than ``limits.max_inflight`` engine requests in flight is a 429; the
    request's wall clock starts here and ends it with a 504 after ``limits.request_timeout_s``.
    """

    def __init__(self, srv: "ServerState", requests: list[GenerationRequest], *, stream: bool) -> None:
        limits = srv.config.limits
        srv.admit(len(requests))
        self.srv = srv
        self.runner = srv.runner
        self.requests = requests
        self.sink: asyncio.Queue[RunnerEvent] = asyncio.Queue()
        self.pending = set(range(len(requests)))
        self.deadline = time.monotonic() + limits.request_timeout_s
        srv.inflight += len(requests)
        self.counted = len(requests)
        for i, r in enumerate(requests):
            self.runner.submit(r, self.sink, i, stream=stream)

    def _release(self, k: int) -> None:
        k = min(k, self.counted)
        self.counted -= k
        self.srv.inflight -= k

    async def events(self) -> AsyncIterator[RunnerEvent]:
        """Events until every choice has finished, failed or been dropped; a 504 at the deadline."""
        while self.pending:
            try:
                ev = await asyncio.wait_for(self.sink.get(), max(0.0, self.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.close()
                limit = self.srv.config.limits.request_timeout_s
                raise APIError(f"the request took longer than {limit:g} s (ServeLimits.request_timeout_s)",
                               status=504, code="timeout", type_="server_error") from None
            if ev.tag not in self.pending:  # dropped earlier
                continue
            if isinstance(ev, (FinishEvent, ErrorEvent)):
                self.pending.discard(ev.tag)
                self._release(1)
            yield ev

    def drop(self, i: int) -> None:
        """Stop choice ``i`` early (a stop string matched)."""
        if i in self.pending:
            self.pending.discard(i)
            self._release(1)
            self.runner.abort([self.requests[i].request_id])

    def close(self) -> None:
        """Abort whatever is still running (client gone, error)."""
        if self.pending:
            self.runner.abort([self.requests[i].request_id for i in self.pending])
            self.pending.clear()
        self._release(self.counted)


def _raise_error_event(ev: ErrorEvent) -> None:
    err = ev.error
    if isinstance(err, ValueError):
        raise APIError(str(err))
    raise APIError(str(err), status=500, type_="server_error")


class _DrainUnreadBody:
    """ASGI middleware: a response that starts before its request's body was read (a 413 on the
    Content-Length, a 401, a 413 in the middle of a chunked body) first reads and discards the rest of
    the body, up to ``max_drain_bytes`` and ``timeout_s``, so the client, still sending, gets the answer
    rather than a connection reset. A client that sent ``Expect: 100-continue`` and was not asked for the
    body yet is answered at once (it sends nothing until told to)."""

    def __init__(self, app: Any, max_drain_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_drain_bytes = max_drain_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        waits_for_continue = b"100-continue" in headers.get(b"expect", b"").lower()
        length = headers.get(b"content-length", b"")
        state = {"asked": False, "done": False}

        async def rcv() -> Any:
            state["asked"] = True
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                state["done"] = True
            return msg

        async def drain() -> None:
            seen = 0
            while not state["done"] and seen <= self.max_drain_bytes:
                seen += len((await rcv()).get("body", b""))

        async def snd(msg: Any) -> None:
            if (msg["type"] == "http.response.start" and not state["done"]
                    and not (waits_for_continue and not state["asked"])
                    and not (length.isdigit() and int(length) > self.max_drain_bytes)):
                try:
                    await asyncio.wait_for(drain(), self.timeout_s)
                except asyncio.TimeoutError:
                    pass
            await send(msg)

        await self.app(scope, rcv, snd)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- the app


def create_app(runner: EngineRunner, tokenizer: Any, config: ServeConfig, *, manage_runner: bool = True) -> FastAPI:
    """The FastAPI app serving ``runner``'s engine.

    Args:
        runner: the engine runner (started on app startup when ``manage_runner``).
        tokenizer: the model's tokenizer (with the XTML special tokens).
        config: server settings.
        manage_runner: start the runner on startup and stop it on shutdown.
    """
    srv = ServerState(runner, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_runner:
            runner.start()
        try:
            yield
        finally:
            if manage_runner:
                runner.stop()

    app = FastAPI(title="k3post", description="OpenAI-compatible server over the k3post embedded engine",
                  lifespan=lifespan)
    app.state.server = srv
    app.include_router(engine_router(srv))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type_="server_error")
        return JSONResponse(err.payload(), status_code=500)

    @app.middleware("http")
    async def _auth_and_size(request: Request, call_next: Any) -> Any:
        key = config.api_key
        if key and request.url.path != "/health":  # the engine API too: it can replace the weights
            if not authorized(request.headers.get("authorization", ""), key):
                err = APIError("invalid or missing API key", status=401, type_="authentication_error",
                               code="invalid_api_key")
                return JSONResponse(err.payload(), status_code=401)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > config.limits.max_body_bytes:  # refused before reading it
            err = too_large(config.limits.max_body_bytes)
            return JSONResponse(err.payload(), status_code=413, headers={"Connection": "close"})
        return await call_next(request)

    app.add_middleware(_DrainUnreadBody, max_drain_bytes=config.limits.max_drain_bytes,  # outermost
                       timeout_s=config.limits.request_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": str(config.limits.retry_after_s)} if exc.status == 429 else None
        return JSONResponse(exc.payload(), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = runner.running
        if config.api_key:  # liveness only: no model name, sizes or counters for anonymous callers
            return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)
        return JSONResponse({"status": "ok" if ok else "stopped", "model": config.model_name,
                             "max_model_len": srv.max_model_len, "engine": runner.stats()},
                            status_code=200 if ok else 503)

    def model_card() -> dict[str, Any]:
        return {"id": config.model_name, "object": "model", "created": srv.created, "owned_by": "k3post",
                "max_model_len": srv.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        srv.check_model({"model": model_id})
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _chat_completions(srv, await json_body(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _completions(srv, await json_body(request))

    return app


# --------------------------------------------------------------------------- chat completions


async def _chat_completions(srv: ServerState, body: dict[str, Any]) -> Any:
    """``POST /v1/chat/completions``: render the messages (XTML), sample ``n`` choices, parse each into an
    assistant message (reasoning, content, tool calls); streamed as server-sent events when asked."""
    srv.check_model(body)
    messages = parse_messages(body)
    tools = parse_tools(body)
    mode, effort = parse_effort(body, srv.config.default_effort)
    stop = body.get("stop")
    if stop:
        raise APIError("'stop' strings are not supported on chat completions (a turn ends at <|end_of_msg|>); "
                       "use /v1/completions or 'stop_token_ids'", param="stop", code="unsupported_parameter")
    want_logprobs = boolean(body, "logprobs")
    top_lp = integer(body, "top_logprobs", lo=0, hi=20)
    if top_lp:
        raise APIError("'top_logprobs' > 0 is not supported: only the sampled token's log-prob is recorded",
                       param="top_logprobs", code="unsupported_parameter")
    stream = boolean(body, "stream")
    include_usage = stream and wants_usage(body)
    check_prompt_chars(srv.config.limits, text_chars(messages, tools, body.get("tool_choice"),
                                                   body.get("response_format")), "messages")
    try:  # tokenising in a worker thread: the event loop (other clients, /health) goes on meanwhile
        rendered = await asyncio.to_thread(
            srv.xtml.render, messages, tools=tools, effort=effort, mode=mode, add_generation_prompt=True,
            tool_choice=body.get("tool_choice"), response_format=body.get("response_format"))
    except ValueError as e:
        raise APIError(str(e), param=render_param(str(e))) from None
    prompt = rendered.ids
    samp = sampling(body, prompt_len=len(prompt), max_model_len=srv.max_model_len, vocab=srv.vocab,
                     default_stop_ids=srv.default_stop_ids, default_max_tokens=srv.config.default_max_tokens,
                     prompt_param="messages", limits=srv.config.limits)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    reqs = [GenerationRequest(f"{cid}-{i}", prompt, sampling=sp) for i, sp in enumerate(samp.params)]
    base = {"id": cid, "created": created, "model": srv.config.model_name}

    def finish_reason(res: GenerationResult, msg: Mapping[str, Any]) -> str:
        if res.finish_reason == "length":
            return "length"
        return "tool_calls" if msg.get("tool_calls") else "stop"

    def usage(results: Sequence[GenerationResult]) -> dict[str, int]:
        c = sum(r.num_tokens for r in results)
        return {"prompt_tokens": len(prompt), "completion_tokens": c, "total_tokens": len(prompt) + c}

    if stream:
        inflight = _Inflight(srv, reqs, stream=True)
        return StreamingResponse(
            _chat_stream(srv, inflight, mode, base, want_logprobs, include_usage, finish_reason, usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
        )
    inflight = _Inflight(srv, reqs, stream=False)
    results: dict[int, GenerationResult] = {}
    try:
        async for ev in inflight.events():
            if isinstance(ev, ErrorEvent):
                _raise_error_event(ev)
            if isinstance(ev, FinishEvent):
                results[ev.tag] = ev.result
    finally:
        inflight.close()
    choices = []
    for i in range(samp.n):
        res = results[i]
        msg, err = srv.parse(res.output_ids, mode)
        calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": dict(c["function"])}
            for c in msg["tool_calls"]
        ]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": msg["content"] if (msg["content"] or not calls) else None,
            "reasoning_content": msg["reasoning_content"],
        }
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish_reason(res, msg),
                                  "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = {"content": srv.logprob_entries(res.output_ids, res.output_logprobs)}
        if err is not None:
            choice["xtml_error"] = err
        choices.append(choice)
    ordered = [results[i] for i in range(samp.n)]
    return {**base, "object": "chat.completion", "system_fingerprint": srv.fingerprint(), "choices": choices,
            "usage": usage(ordered)}


# --------------------------------------------------------------------------- completions


async def _completions(srv: ServerState, body: dict[str, Any]) -> Any:
    """``POST /v1/completions``: token-id or text prompts, ``n`` choices each, stop strings, ``echo`` for prompt
    scoring; streamed as server-sent events when asked."""
    srv.check_model(body)
    chars = text_chars(body.get("prompt"))
    check_prompt_chars(srv.config.limits, chars, "prompt")
    # string prompts are tokenised in a worker thread: the event loop goes on meanwhile
    prompts = await asyncio.to_thread(parse_prompts, body, srv) if chars else parse_prompts(body, srv)
    if len(prompts) > srv.config.limits.max_prompts:
        raise APIError(f"'prompt' holds {len(prompts)} prompts; this server's limit is {srv.config.limits.max_prompts} "
                       "(ServeLimits.max_prompts)", param="prompt", code="limit_exceeded")
    if body.get("suffix"):
        raise APIError("'suffix' is not supported by this server", param="suffix", code="unsupported_parameter")
    lp = integer(body, "logprobs", lo=0, hi=20)
    if lp is not None and lp > 1:
        raise APIError("'logprobs' > 1 is not supported: only the sampled token's log-prob is recorded",
                       param="logprobs", code="unsupported_parameter")
    if boolean(body, "echo"):
        return await _echo(srv, body, prompts, lp is not None)
    stops = body.get("stop")
    if stops is None:
        stops = []
    elif isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError("'stop' must be a non-empty string or a list of them", param="stop")
    stream = boolean(body, "stream")
    include_usage = stream and wants_usage(body)
    cid = f"cmpl-{uuid.uuid4().hex}"
    reqs: list[GenerationRequest] = []
    stop_ids: frozenset[int] = srv.default_stop_ids
    for p, ids in enumerate(prompts):
        samp = sampling(body, prompt_len=len(ids), max_model_len=srv.max_model_len, vocab=srv.vocab,
                         default_stop_ids=srv.default_stop_ids, default_max_tokens=srv.config.default_max_tokens,
                         prompt_param="prompt", limits=srv.config.limits)
        stop_ids = samp.stop_ids
        for j, sp in enumerate(samp.params):
            reqs.append(GenerationRequest(f"{cid}-{p}-{j}", ids, sampling=sp))
    base = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": srv.config.model_name}
    n_prompt = sum(len(ids) for ids in prompts)
    # stop strings need the tokens as they come, so choices stream internally when there are any
    inflight = _Inflight(srv, reqs, stream=stream or bool(stops))
    texts = [_CompletionText(srv, stops, stop_ids) for _ in reqs]
    gen = _completion_events(srv, inflight, texts, lp is not None)
    if stream:
        async def sse() -> AsyncIterator[str]:
            total = 0
            try:
                async for i, text, finish, logprobs, n_tokens in gen:
                    total += n_tokens
                    yield _sse({**base, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                                      "finish_reason": finish}]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": total,
                                                                 "total_tokens": n_prompt + total}})
            except APIError as e:
                yield _sse(e.payload())
            finally:
                inflight.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    parts: dict[int, list[str]] = {i: [] for i in range(len(reqs))}
    lps: dict[int, dict[str, Any]] = {}
    finishes: dict[int, str] = {}
    total = 0
    try:
        async for i, text, finish, logprobs, n_tokens in gen:
            parts[i].append(text)
            total += n_tokens
            if logprobs is not None:
                acc = lps.setdefault(i, {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []})
                for key in ("tokens", "token_logprobs", "text_offset"):
                    acc[key] += logprobs[key]
            if finish is not None:
                finishes[i] = finish
    finally:
        inflight.close()
    choices = [
        {"index": i, "text": "".join(parts[i]), "logprobs": lps.get(i) if lp is not None else None,
         "finish_reason": finishes.get(i, "stop")}
        for i in range(len(reqs))
    ]
    return {**base, "system_fingerprint": srv.fingerprint(), "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": total, "total_tokens": n_prompt + total}}


# --------------------------------------------------------------------------- prompt scoring (echo)


async def _echo(srv: ServerState, body: Mapping[str, Any], prompts: list[list[int]], want_logprobs: bool) -> dict[str, Any]:
    """``echo`` with ``max_tokens: 0``: each prompt scored by the served model in one prefill (the vLLM
    convention MOPD teachers and log-likelihood evaluations use): ``text`` is the prompt, ``logprobs``
    its tokens with ``token_logprobs[t] = log p(prompt[t] | prompt[:t])`` (None for the first token)."""
    if integer(body, "max_tokens", lo=0) != 0:
        raise APIError("'echo' is supported for prompt scoring only: set 'max_tokens' to 0", param="echo",
                       code="unsupported_parameter")
    if boolean(body, "stream"):
        raise APIError("'echo' cannot be streamed", param="stream", code="unsupported_parameter")
    if (integer(body, "n", lo=1) or 1) != 1:
        raise APIError("'echo' scores each prompt once: 'n' must be 1", param="n", code="unsupported_parameter")
    for i, ids in enumerate(prompts):
        if len(ids) > srv.max_model_len:
            raise APIError(f"prompt {i} has {len(ids)} tokens, more than the model's {srv.max_model_len}", param="prompt")
    scores = await srv.score(prompts)
    choices = []
    for i, (ids, lps) in enumerate(zip(prompts, scores)):
        logprobs = None
        if want_logprobs:
            logprobs = {"tokens": [srv.token_str(t) for t in ids], "token_logprobs": [None, *lps],
                        "top_logprobs": None, "text_offset": text_offsets(srv.tokenizer, ids)}
        choices.append({"index": i, "text": decode(srv.tokenizer, ids), "logprobs": logprobs, "finish_reason": "length"})
    n_prompt = sum(len(ids) for ids in prompts)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": srv.config.model_name, "system_fingerprint": srv.fingerprint(), "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}}


# --------------------------------------------------------------------------- chat streaming


async def _chat_stream(
    srv: ServerState,
    inflight: _Inflight,
    mode: str,
    base: dict[str, Any],
    want_logprobs: bool,
    include_usage: bool,
    finish_reason: Callable[[GenerationResult, Mapping[str, Any]], str],
    usage: Callable[[Sequence[GenerationResult]], dict[str, int]],
) -> AsyncIterator[str]:
    """SSE body of a streaming chat completion (see the module docstring)."""
    n = len(inflight.requests)
    parsers = [srv.xtml.stream(mode) for _ in range(n)]
    errors: list[str | None] = [None] * n
    call_ids: dict[tuple[int, int], str] = {}
    results: list[GenerationResult] = []
    head = {**base, "object": "chat.completion.chunk", "system_fingerprint": srv.fingerprint()}

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              **extra: Any) -> str:
        return _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                                          **extra}]})

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for ev in inflight.events():
            i = ev.tag
            if isinstance(ev, ErrorEvent):
                _raise_error_event(ev)
            if isinstance(ev, TokenEvent):
                delta: dict[str, Any] = {}
                for tid in ev.ids:
                    if errors[i] is not None:
                        break
                    try:
                        events = parsers[i].feed(tid)
                    except XTMLParseError as e:
                        errors[i] = str(e)
                        break
                    for pe in events:
                        _merge_event(delta, pe, i, call_ids)
                lp = {"content": srv.logprob_entries(ev.ids, ev.logprobs)} if want_logprobs else None
                if delta or lp is not None:
                    yield chunk(i, delta, logprobs=lp)
            elif isinstance(ev, FinishEvent):
                results.append(ev.result)
                msg = parsers[i].message
                extra = {"xtml_error": errors[i]} if errors[i] is not None else {}
                yield chunk(i, {}, finish=finish_reason(ev.result, msg), **extra)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage(results)})
    except APIError as e:
        yield _sse(e.payload())
    finally:
        inflight.close()
    yield "data: [DONE]\n\n"


def _merge_event(delta: dict[str, Any], ev: Any, choice: int, call_ids: dict[tuple[int, int], str]) -> None:
    """Fold one XTML stream event into a chunk's delta."""
    if isinstance(ev, TextDelta):
        key = "reasoning_content" if ev.channel == "think" else "content"
        delta[key] = delta.get(key, "") + ev.text
    elif isinstance(ev, ToolCallStart):
        cid = call_ids.setdefault((choice, ev.index), f"call_{uuid.uuid4().hex[:24]}")
        delta.setdefault("tool_calls", []).append(
            {"index": ev.index - 1, "id": cid, "type": "function", "function": {"name": ev.name, "arguments": ""}}
        )
    elif isinstance(ev, ToolCall):
        delta.setdefault("tool_calls", []).append(
            {"index": ev.index - 1, "function": {"arguments": ev.call["function"]["arguments"]}}
        )


# --------------------------------------------------------------------------- completions helpers


class _CompletionText:
    """Incremental text of one completion choice with stop strings.

    Text is emitted only up to a point that cannot still become part of a stop string
    (the last ``max(len(stop)) - 1`` characters are held back) and never ends in a
    partially decoded character."""

    def __init__(self, srv: ServerState, stops: list[str], stop_ids: frozenset[int]) -> None:
        self.srv = srv
        self.stops = stops
        self.stop_ids = stop_ids
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.emitted_chars = 0
        self.emitted_tokens = 0
        self.stopped = False

    def _cut(self, text: str) -> str:
        hits = [k for k in (text.find(s) for s in self.stops) if k >= 0]
        if hits:
            self.stopped = True
            return text[: min(hits)]
        return text

    def push(self, ids: Sequence[int], logprobs: Sequence[float]) -> str:
        """New emittable text after these tokens (sets ``stopped`` on a stop-string match)."""
        self.ids += ids
        self.logprobs += logprobs
        text = self._cut(decode(self.srv.tokenizer, self.ids))
        end = len(text) if self.stopped else max(len(text.rstrip("\ufffd")) - self.hold, 0)
        if end <= self.emitted_chars:
            return ""
        out = text[self.emitted_chars : end]
        self.emitted_chars = end
        return out

    def finish(self, res: GenerationResult) -> str:
        """The remaining text once the request finished (its stop id is not part of the text)."""
        ids = list(res.output_ids)
        if res.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        self.ids, self.logprobs = ids, list(res.output_logprobs[: len(ids)])
        text = self._cut(decode(self.srv.tokenizer, ids))
        out = text[self.emitted_chars :]
        self.emitted_chars = len(text)
        return out

    def token_logprobs(self) -> dict[str, Any]:
        """Legacy logprobs of the tokens not reported yet that start within the emitted text
        (``text_offset``: character offset of each token in the whole completion text)."""
        tok = self.srv.tokenizer
        tokens, lps, offs = [], [], []
        k = self.emitted_tokens
        while k < len(self.ids):
            start = len(decode(tok, self.ids[:k]))
            if start >= self.emitted_chars:
                break
            tokens.append(self.srv.token_str(self.ids[k]))
            lps.append(self.logprobs[k])
            offs.append(start)
            k += 1
        self.emitted_tokens = k
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offs}


async def _completion_events(
    srv: ServerState, inflight: _Inflight, texts: list[_CompletionText], want_logprobs: bool,
) -> AsyncIterator[tuple[int, str, str | None, dict[str, Any] | None, int]]:
    """(choice, new text, finish_reason or None, logprobs or None, tokens counted) per step."""
    async for ev in inflight.events():
        i = ev.tag
        t = texts[i]
        if isinstance(ev, ErrorEvent):
            _raise_error_event(ev)
        elif isinstance(ev, TokenEvent):
            text = t.push(ev.ids, ev.logprobs)
            if t.stopped:  # a stop string matched: end this choice here
                n_tok = len(t.ids)
                inflight.drop(i)
                yield i, text, "stop", t.token_logprobs() if want_logprobs else None, n_tok
            elif text:
                yield i, text, None, t.token_logprobs() if want_logprobs else None, 0
        elif isinstance(ev, FinishEvent):
            text = t.finish(ev.result)
            finish = "stop" if (t.stopped or ev.result.finish_reason == "stop") else "length"
            yield i, text, finish, t.token_logprobs() if want_logprobs else None, ev.result.num_tokens
