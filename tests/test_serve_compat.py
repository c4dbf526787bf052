"""Issue 34: OpenAI compatibility of `k3post serve` where it accepted and ignored. A field the server cannot
honour is a 400 naming it (as `presence_penalty` already was), never a silent no-op; what the OpenAI API and
vLLM accept (a lower-case ``bearer`` scheme) is accepted."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from k3post.serve.app import ServeLimits  # noqa: E402
from test_serve_limits import KEY, MSG, _run, model_dir  # noqa: E402,F401  (model_dir: the fixture)

ROOMY = ServeLimits(request_timeout_s=300)  # a loaded machine must not turn a served request into a 504

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _named_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param", [
    ({"tools": [TOOL], "tool_choice": NAMED}, "tool_choice"),  # was accepted and not enforced
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [_named_tool("a b")]}, "tools[0].function.name"),  # names the OpenAI API refuses
    ({"tools": [_named_tool("a<|close|>b")]}, "tools[0].function.name"),
    ({"tools": [TOOL, _named_tool("x" * 65)]}, "tools[1].function.name"),
    ({"tools": [_named_tool("get.weather")]}, "tools[0].function.name"),
    ({"min_tokens": 5}, "min_tokens"),  # was silently ignored while presence_penalty was a 400
    ({"presence_penalty": 0.5}, "presence_penalty"),
])  # fmt: skip
def test_what_the_server_cannot_honour_is_a_400_naming_the_field(model_dir, body, param):
    async def go(c: httpx.AsyncClient, runner: Any) -> httpx.Response:
        return await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body})

    r = _run(model_dir, go, ROOMY)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("body", [
    {"tools": [TOOL, _named_tool("Get-Weather_2"), _named_tool("x" * 64)], "tool_choice": "auto"},
    {"tools": [TOOL], "tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": "none"},
    {"min_tokens": 0},
])  # fmt: skip
def test_what_it_honours_is_served(model_dir, body):
    async def go(c: httpx.AsyncClient, runner: Any) -> httpx.Response:
        return await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body})

    r = _run(model_dir, go, ROOMY)
    assert r.status_code == 200, r.text


def test_the_bearer_scheme_is_case_insensitive(model_dir):
    """RFC 7235 §2.1: the auth scheme is case-insensitive; `bearer KEY` got a 401. The key itself is not."""
    async def go(c: httpx.AsyncClient, runner: Any) -> list[int]:
        anon = httpx.AsyncClient(transport=c._transport, base_url="http://t")
        codes = [(await anon.get("/v1/models", headers={"Authorization": h})).status_code
                 for h in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer {KEY}", f"bearer {KEY.upper()}", f"Basic {KEY}",
                           KEY, f"bearer{KEY}")]
        await anon.aclose()
        return codes

    assert _run(model_dir, go, ROOMY) == [200, 200, 200, 401, 401, 401, 401]
