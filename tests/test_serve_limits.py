"""The server's bounds (issue 20): each limit answers its 4xx / 504 with a message naming the setting,
the API key is compared in constant time, and /health says nothing beyond liveness when a key is set.

A tiny Qwen3-MoE folder is served through httpx's ASGI transport; requests are held in the engine by
pausing generation, so the queue and timeout cases do not depend on timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from k3post.models import build_tiny_moe, save_model  # noqa: E402
from k3post.serve.app import ServeLimits  # noqa: E402
from k3post.serve.cli import build_server  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = ServeLimits(max_body_bytes=4096, max_prompts=3, max_n=2, max_tokens=32, max_inflight=2,
                     request_timeout_s=0.5, echo_batch_tokens=8)
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Path:
    tok = xtml_tokenizer
    path = tmp_path_factory.mktemp("limits") / "moe"
    save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id), path, tok)
    return path


def _run(model_dir: Path, go: Callable[[httpx.AsyncClient, Any], Awaitable[Any]], limits: ServeLimits = LIMITS,
         **kw: Any) -> Any:
    app = build_server(model_dir, model_name="m", max_batch_size=4, qat=False, torch_threads=1, api_key=KEY,
                       limits=limits, **kw)
    runner = app.state.server.runner
    runner.start()

    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", headers=AUTH) as c:
            return await go(c, runner)

    try:
        return asyncio.run(main())
    finally:
        runner.stop()


def _err(r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert all(n in msg for n in needles), msg


def test_request_limits_answer_4xx_naming_the_setting(model_dir: Path) -> None:
    async def go(c: httpx.AsyncClient, runner: Any) -> None:
        big = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}]})
        _err(big, 413, "4096 bytes", "ServeLimits.max_body_bytes")
        async def body() -> Any:  # no Content-Length: cut off while reading
            for _ in range(6):
                yield b"x" * 1000

        chunked = await c.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
        _err(chunked, 413, "ServeLimits.max_body_bytes")
        _err(await c.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1}), 400,
             "4 prompts", "ServeLimits.max_prompts")
        _err(await c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1}), 400,
             "needs 4 engine requests", "ServeLimits.max_inflight")
        _err(await c.post("/v1/chat/completions", json={"messages": MSG, "n": 3}), 400, "'n'=3",
             "ServeLimits.max_n")
        for key in ("max_tokens", "max_completion_tokens"):
            r = await c.post("/v1/chat/completions", json={"messages": MSG, key: 33})
            _err(r, 400, f"'{key}'=33", "ServeLimits.max_tokens")
            assert r.json()["error"]["param"] == key
        # without max_tokens the default cap applies, not the rest of the context
        ok = await c.post("/v1/completions", json={"prompt": "hi", "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5

    _run(model_dir, go, default_max_tokens=5)


def test_stream_options_of_the_wrong_type_are_a_400_naming_the_field(model_dir: Path) -> None:
    """Found by tests/test_fuzz_serve.py: ``stream_options: true`` with ``stream: true`` was a 500 (the server read it
    as an object). Either endpoint now answers 400 naming the field; a well-formed one still streams its usage."""
    async def go(c: httpx.AsyncClient, runner: Any) -> None:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSG})):
            for opts, param in ((True, "stream_options"), ([1], "stream_options"),
                                ({"include_usage": "yes"}, "stream_options.include_usage")):
                r = await c.post(path, json={**body, "max_tokens": 1, "stream": True, "stream_options": opts})
                assert r.status_code == 400, (path, opts, r.text)
                assert r.json()["error"]["param"] == param
        ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True,
                                                   "stream_options": {"include_usage": True}})
        assert ok.status_code == 200 and '"usage"' in ok.text

    _run(model_dir, go)


def test_full_queue_is_429_with_retry_after_and_slow_request_504(model_dir: Path) -> None:
    async def go(c: httpx.AsyncClient, runner: Any) -> None:
        await runner.pause_generation()  # requests stay queued
        held = asyncio.create_task(c.post("/v1/chat/completions", json={"messages": MSG, "n": 2, "max_tokens": 4}))
        await asyncio.sleep(0.1)
        busy = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        _err(busy, 429, "ServeLimits.max_inflight")
        assert busy.headers["retry-after"] == "1"
        echo = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0, "echo": True})
        _err(echo, 429, "ServeLimits.max_inflight")
        _err(await held, 504, "0.5 s", "ServeLimits.request_timeout_s")
        assert app_inflight(runner) == 0  # the timed-out choices were aborted and released
        await runner.continue_generation()
        after = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert after.status_code == 200
        stream = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert stream.status_code == 200 and "[DONE]" in stream.text

    def app_inflight(runner: Any) -> int:
        return int(state["srv"].inflight)

    state: dict[str, Any] = {}
    app = build_server(model_dir, model_name="m", max_batch_size=4, qat=False, torch_threads=1, api_key=KEY,
                       limits=LIMITS)
    state["srv"] = app.state.server
    runner = app.state.server.runner
    runner.start()

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", headers=AUTH) as c:
            await go(c, runner)

    try:
        asyncio.run(main())
    finally:
        runner.stop()


def test_echo_scores_in_bounded_steps(model_dir: Path) -> None:
    """Three 3-token prompts with echo_batch_tokens=8: two forwards (2 rows, then 1), each its own
    engine-thread call, and the same log-probs as one forward of all three."""
    from k3post.scoring import sequence_logprobs

    calls: list[int] = []

    async def go(c: httpx.AsyncClient, runner: Any) -> Any:
        real = runner.call

        async def counting(fn: Any) -> Any:
            calls.append(1)
            return await real(fn)

        runner.call = counting
        prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
        r = await c.post("/v1/completions", json={"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        whole = await real(lambda engine: sequence_logprobs(engine.model, prompts, 10_000))
        return r.json(), whole

    body, whole = _run(model_dir, go, ServeLimits(max_inflight=3, echo_batch_tokens=8))
    assert len(calls) == 2
    for choice, ref in zip(body["choices"], whole):
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(ref[1:], abs=1e-5)


def test_api_key_constant_time_and_health_reveals_only_liveness(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    import k3post.serve.validate as app_mod  # the API key check (`authorized`)

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_mod.hmac, "compare_digest", spy)

    async def go(c: httpx.AsyncClient, runner: Any) -> None:
        assert (await c.get("/v1/models")).status_code == 200
        for bad in ("Bearer sekreT", "Bearer sekret ", "", "Bearer sekre"):
            r = await c.get("/v1/models", headers={"Authorization": bad})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        anon = httpx.AsyncClient(transport=c._transport, base_url="http://t")
        h = await anon.get("/health")
        await anon.aclose()
        assert h.status_code == 200 and h.json() == {"status": "ok"}

    _run(model_dir, go)
    assert len(compared) == 5 and compared[0] == (b"sekret", b"sekret")  # the key, after the scheme


def test_the_api_key_guards_the_engine_api_too(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: with a key set, the engine API (which pauses the engine and loads weights from a path) needs it
    as /v1/* does; `HTTPEngine` sends it (argument, or K3POST_API_KEY)."""
    from k3post.rollout.http_engine import HTTPEngine

    async def go(c: httpx.AsyncClient, runner: Any) -> None:
        anon = httpx.AsyncClient(transport=c._transport, base_url="http://t")
        for method, path in (("GET", "/get_model_info"), ("POST", "/pause_generation"), ("POST", "/flush_cache"),
                             ("POST", "/update_weights_from_disk"), ("POST", "/generate"), ("GET", "/docs")):
            r = await anon.request(method, path, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        await anon.aclose()
        assert (await c.get("/get_model_info")).status_code == 200

    _run(model_dir, go)
    app = build_server(model_dir, model_name="m", max_batch_size=4, qat=False, torch_threads=1, api_key=KEY,
                       limits=LIMITS)
    runner = app.state.server.runner
    runner.start()
    try:
        monkeypatch.delenv("K3POST_API_KEY", raising=False)
        with pytest.raises(Exception, match="get_model_info answered 401.*invalid or missing API key"):
            HTTPEngine(["http://t"], transport=httpx.ASGITransport(app=app), max_retries=0)
        with HTTPEngine(["http://t"], transport=httpx.ASGITransport(app=app), api_key=KEY) as eng:
            assert eng.version == 0
        monkeypatch.setenv("K3POST_API_KEY", KEY)
        with HTTPEngine(["http://t"], transport=httpx.ASGITransport(app=app)) as eng:
            assert eng.version == 0
    finally:
        runner.stop()


def test_serve_limits_parse() -> None:
    assert ServeLimits.parse(["max_n=4", "request_timeout_s=2.5"]) == ServeLimits(max_n=4, request_timeout_s=2.5)
    with pytest.raises(ValueError, match="max_nn"):
        ServeLimits.parse(["max_nn=4"])
    with pytest.raises(ValueError, match="max_n"):
        ServeLimits.parse(["max_n=0"])
