"""Fuzzing the server's request parsing (issue 20): hypothesis posts request bodies built from the
fields the OpenAI endpoints know, each given an arbitrary JSON value (or a plausible one), plus chat
messages with arbitrary roles, content, names, tool calls and tool results, to ``/v1/chat/completions``
and ``/v1/completions`` of a tiny model behind httpx's ASGI transport. Property: the answer is a 2xx or
an OpenAI-shaped 4xx (``error.message`` set), never a 5xx, and the server still answers afterwards.

``max_tokens`` is capped by `ServeLimits` (8) so a generated request decodes a few tokens at most.

Shape legend: none.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from k3post.models import build_tiny_moe, save_model  # noqa: E402
from k3post.serve.app import ServeLimits  # noqa: E402
from k3post.serve.cli import build_server  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

leaf = st.none() | st.booleans() | st.integers(-3, 2**64) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
json_any = st.recursive(leaf, lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=6), k, max_size=3),
                        max_leaves=6)  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
plausible = {
    "model": st.sampled_from(["m", "x"]),
    "max_tokens": st.integers(-1, 12),
    "max_completion_tokens": st.integers(-1, 12),
    "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50),
    "seed": st.integers(-5, 2**70),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "logprobs": st.booleans() | st.integers(0, 3),
    "top_logprobs": st.integers(0, 3),
    "tools": st.just(TOOLS),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}]),
    "thinking_effort": st.sampled_from(["low", "high", "max", "none", "medium"]),
    "reasoning_effort": st.sampled_from(["low", "high", "none"]),
    "stop": st.lists(st.text(max_size=3), max_size=2),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-1, 500), max_size=2),
    "echo": st.booleans(),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 500), max_size=8),
                        st.lists(st.lists(st.integers(0, 300), max_size=4), max_size=2)),
}  # fmt: skip
def sometimes_any(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` four times in five, else any JSON value."""
    return st.integers(0, 4).flatmap(lambda k: json_any if k == 0 else good)


tool_call = st.fixed_dictionaries(
    {"id": st.text(max_size=3), "type": st.just("function"),
     "function": sometimes_any(st.fixed_dictionaries({"name": sometimes_any(st.sampled_from(["f", "g", ""]))},
                               optional={"arguments": sometimes_any(st.text(max_size=10) | st.just('{"a": 1}'))}))},
)
message = st.fixed_dictionaries(
    {"role": sometimes_any(st.sampled_from(["system", "user", "user", "assistant", "tool", "developer"]))},
    optional={
        "content": sometimes_any(st.text(max_size=12) | st.none() | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5)}), max_size=2)),
        "name": sometimes_any(st.text(max_size=5)),
        "reasoning_content": sometimes_any(st.text(max_size=8)),
        "tool_calls": sometimes_any(st.lists(sometimes_any(tool_call), max_size=2)),
        "tool_call_id": sometimes_any(st.text(max_size=3)),
        "tools": sometimes_any(st.just(TOOLS)),
    },
)  # fmt: skip


@st.composite
def bodies(draw: Any, chat: bool) -> Any:
    if draw(st.integers(0, 19)) == 0:
        return draw(json_any)  # not even an object, sometimes
    keys = draw(st.lists(st.sampled_from(sorted(plausible)), max_size=6, unique=True))
    body = {k: draw(sometimes_any(plausible[k])) for k in keys}
    if chat:
        body["messages"] = draw(sometimes_any(st.lists(message, min_size=1, max_size=4)))
    elif "prompt" not in body:
        body["prompt"] = draw(plausible["prompt"])
    return body


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Iterator[Any]:
    tok = xtml_tokenizer
    path: Path = tmp_path_factory.mktemp("fuzz_serve") / "moe"
    save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id), path, tok)
    app = build_server(path, model_name="m", max_batch_size=4, qat=False, torch_threads=1, default_max_tokens=4,
                       limits=ServeLimits(max_tokens=8, max_n=3, max_prompts=3, request_timeout_s=30))
    app.state.server.runner.start()
    yield app
    app.state.server.runner.stop()


def post(app: Any, path: str, body: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            r = await c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            await r.aread()
            return r

    return asyncio.run(go())


def check(r: httpx.Response, body: Any) -> None:
    event(f"status {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(SETTINGS, max_examples=2000)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@SETTINGS
@given(bodies(chat=True))
def test_fuzz_chat_requests(app: Any, body: Any) -> None:
    check(post(app, CHAT, body), body)


@SETTINGS
@given(bodies(chat=False))
def test_fuzz_completion_requests(app: Any, body: Any) -> None:
    check(post(app, COMPLETIONS, body), body)


@pytest.mark.slow
@SLOW
@given(st.sampled_from([CHAT, COMPLETIONS]).flatmap(lambda p: st.tuples(st.just(p), bodies(chat=p == CHAT))))
def test_fuzz_requests_large(app: Any, path_body: tuple[str, Any]) -> None:
    check(post(app, *path_body), path_body[1])


def test_still_healthy_after_fuzzing(app: Any) -> None:
    r = post(app, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_tool_call_arguments_nested_deeply_are_no_500(app: Any) -> None:
    """An assistant tool call in the history whose arguments string nests 1,500 deep (past the JSON
    parser's recursion limit) made the renderer raise RecursionError (a 500); it is kept as a
    JSON-fallback block now, as any arguments that are not a JSON object."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 1_500}}
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    r = post(app, CHAT, {"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]
