"""The engine server against a hostile or careless client (issue 30, section 5).

* A weight update is all or nothing: a checkpoint that lacks some of the served model's tensors (a Qwen3
  checkpoint without ``q_norm`` / ``k_norm``), or has a tensor of another dtype kind, is a 400 naming what
  differs, and the weights and version stay.
* What an unauthenticated caller can reach is bounded and documented: ``/get_weights_by_name`` reads at most
  ``ServeLimits.max_weight_values`` values, ``/get_model_info`` shows folder names, not paths, ``k3post serve``
  on a non-loopback host needs a key or ``--allow-unauthenticated-engine-api`` (exit 2 otherwise), and the
  README's Security section lists every route with its risk.
* One client cannot stall the others: tokenising runs off the event loop (``/health`` answers while a prompt
  is being tokenised), prompts are bounded (``ServeLimits.max_prompt_chars``).
* Bad bodies get 4xx answers: a deeply nested JSON body is a 400 (``ServeLimits.max_json_depth``), ``/generate``
  over ``ServeLimits.max_tokens`` is a 400, and an oversized body is read and discarded (up to
  ``ServeLimits.max_drain_bytes``) so the client sees the 413 instead of a connection reset.

Servers run in process through httpx's ASGI transport, except the body-size case, which needs a real socket
(uvicorn on a free loopback port).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from safetensors.torch import load_file, save_file  # noqa: E402

from k3post.models import build_tiny_family, save_model  # noqa: E402
from k3post.serve.app import ServeLimits  # noqa: E402
from k3post.serve.cli import build_server  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]


def _qwen3(tok: Any, seed: int) -> Any:
    return build_tiny_family("qwen3", len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Path:
    return save_model(_qwen3(xtml_tokenizer, 0), tmp_path_factory.mktemp("sec") / "qwen3", xtml_tokenizer)


def _run(model_dir: Path, go: Callable[[httpx.AsyncClient, Any], Awaitable[Any]], **kw: Any) -> Any:
    app = build_server(model_dir, model_name="m", max_batch_size=2, qat=False, torch_threads=1, **kw)
    runner = app.state.server.runner
    runner.start()

    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await go(c, app)

    try:
        return asyncio.run(main())
    finally:
        runner.stop()


async def _weights(c: httpx.AsyncClient, name: str) -> list[float]:
    r = await c.post("/get_weights_by_name", json={"name": name, "truncate_size": 8})
    assert r.status_code == 200, r.text
    return r.json()["values"]


# --------------------------------------------------------------------------- all-or-nothing weight updates


def test_a_partial_or_mistyped_weight_update_is_refused_and_changes_nothing(model_dir: Path, xtml_tokenizer: Any,
                                                                          tmp_path: Path) -> None:
    """Before: a Qwen3 checkpoint without q_norm / k_norm answered 200 and the server served the new layers with
    the old norms. Now: 400 naming the missing tensors, the same for a tensor subset by name and for an integer
    tensor in place of a float one; a DiskSync version missing a tensor too. The full checkpoint loads, and a
    bf16 copy of it is cast to the model's fp32 (a float-to-float cast is allowed, documented)."""
    from k3post.distributed.weight_sync import DiskSync, named_weights

    other = _qwen3(xtml_tokenizer, 1)
    with torch.no_grad():  # norms other than the served model's ones, so a lost q_norm shows
        for n, p in other.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(n)))
    full = save_model(other, tmp_path / "full", xtml_tokenizer)
    [shard] = sorted(full.glob("*.safetensors"))
    tensors = load_file(str(shard))
    assert any("q_norm" in n for n in tensors)

    def folder(name: str, content: dict[str, torch.Tensor], *, hf: bool) -> str:
        d = tmp_path / name
        d.mkdir()
        if hf:  # a Hugging Face checkpoint folder: config.json next to the shard
            (d / "config.json").write_text((full / "config.json").read_text())
        save_file(content, str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)

    no_norms = {n: t for n, t in tensors.items() if "q_norm" not in n and "k_norm" not in n}
    first = sorted(tensors)[0]
    cases = [
        (folder("no_norms", no_norms, hf=True), "k_norm"),
        (folder("subset", {first: tensors[first]}, hf=False), "missing"),
        (folder("int", {**tensors, first: tensors[first].to(torch.int32)}, hf=False), "dtype int32"),
    ]
    sync = DiskSync(tmp_path / "sync").push([(n, t) for n, t in named_weights(other) if "q_norm" not in n], 5)
    cases.append((sync.location, "q_norm"))

    async def go(c: httpx.AsyncClient, app: Any) -> None:
        before = await _weights(c, "model.layers.0.self_attn.q_norm.weight")
        embed = await _weights(c, "model.embed_tokens.weight")
        for path, needle in cases:
            r = await c.post("/update_weights_from_disk", json={"model_path": path})
            assert r.status_code == 400, (path, r.text)
            body = r.json()
            assert not body["success"] and needle in body["message"] and body["weight_version"] == 0, (path, body)
            assert await _weights(c, "model.embed_tokens.weight") == embed
        assert (await c.get("/get_weight_version")).json() == {"weight_version": 0}
        r = await c.post("/update_weights_from_disk", json={"model_path": str(full)})
        assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
        after = await _weights(c, "model.layers.0.self_attn.q_norm.weight")
        want = other.model.layers[0].self_attn.q_norm.weight.detach().reshape(-1)[:8].tolist()
        assert after == want and after != before
        half = folder("bf16", {n: t.to(torch.bfloat16) for n, t in tensors.items()}, hf=False)
        r = await c.post("/update_weights_from_disk", json={"model_path": half})
        assert r.status_code == 200 and r.json()["weight_version"] == 2, r.text
        d = (await c.post("/get_weights_by_name", json={"name": first, "truncate_size": 8})).json()
        assert d["dtype"] == "float32"
        assert d["values"] == tensors[first].to(torch.bfloat16).float().reshape(-1)[:8].tolist()

    _run(model_dir, go)


# --------------------------------------------------------------------------- what an anonymous caller reaches


def test_weight_reads_are_capped_and_model_info_shows_no_paths(model_dir: Path) -> None:
    """Before: ``truncate_size`` had no bound (a whole embedding as JSON) and ``/get_model_info`` showed the
    server's absolute model path. Now: more than ``max_weight_values`` values is a 400 naming the setting, and
    the info carries the folder's name only."""
    async def go(c: httpx.AsyncClient, app: Any) -> None:
        name = "model.embed_tokens.weight"
        r = await c.post("/get_weights_by_name", json={"name": name, "truncate_size": 65})
        assert r.status_code == 400 and "ServeLimits.max_weight_values" in r.json()["error"]["message"], r.text
        r = await c.post("/get_weights_by_name", json={"name": name, "truncate_size": 64})
        assert r.status_code == 200 and len(r.json()["values"]) == 64
        info = (await c.get("/get_model_info")).json()
        assert info["model_path"] == info["tokenizer_path"] == model_dir.name
        assert str(model_dir.parent) not in str(info)

    _run(model_dir, go, limits=ServeLimits(max_weight_values=64))


def test_serve_beyond_loopback_needs_a_key_or_the_explicit_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`k3post serve --host 0.0.0.0` without a key exits 2 before loading anything (the model folder does not
    even exist here), naming the key and the flag; loopback hosts, a key, or the flag pass the check."""
    from k3post.cli import main
    from k3post.serve.cli import check_exposure

    monkeypatch.delenv("K3POST_API_KEY", raising=False)
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.org"):
        assert main(["serve", str(tmp_path / "nothing"), "--host", host]) == 2
        err = capsys.readouterr().err
        assert f"--host {host}" in err and "--api-key" in err and "--allow-unauthenticated-engine-api" in err, err
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        check_exposure(host, None, False)
    check_exposure("0.0.0.0", "k", False)
    check_exposure("0.0.0.0", None, True)
    assert "WARNING" in capsys.readouterr().err


def _security_routes() -> dict[str, tuple[str, str]]:
    """The README Security section's route table: path -> (what a caller can do, bound)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Security"):]
    section = section[: section.index("\n## ", 1)]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith(("`GET ", "`POST ")):
            for route in cells[0].split(","):
                method, path = route.strip().strip("`").split(" ", 1)
                rows[path] = (cells[1], cells[2])
    return rows


def test_the_readme_security_table_lists_every_route_with_its_risk(model_dir: Path) -> None:
    """Every route the server has (the OpenAI API, the engine API, FastAPI's docs) is a row of the Security
    section's table with what a caller can do and its bound, and the table names no route the server lacks."""
    app = build_server(model_dir, model_name="m", max_batch_size=2, qat=False, torch_threads=1)
    paths, todo = set(), list(app.routes)
    while todo:  # included routers (the engine API) hold their own routes
        r = todo.pop()
        if isinstance(getattr(r, "path", None), str):
            paths.add(r.path.replace("{model_id:path}", "{id}"))
        inner = getattr(r, "original_router", None) or getattr(r, "router", None) or r  # FastAPI's versions differ
        todo += getattr(inner, "routes", None) or []
    assert "/init_weights_update_group" in paths
    rows = _security_routes()
    assert paths == set(rows), (sorted(paths - set(rows)), sorted(set(rows) - paths))
    assert all(what and bound for what, bound in rows.values())
    assert "all or nothing" in rows["/update_weights_from_disk"][1]
    assert "max_weight_values" in rows["/get_weights_by_name"][1]
    assert "any host:port" in rows["/init_weights_update_group"][0]


# --------------------------------------------------------------------------- one client cannot stall the others


def test_tokenising_runs_off_the_event_loop_and_prompts_are_bounded(model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a prompt was tokenised on the event loop, so ``/health`` (and every other client) waited for it
    (four 7.4 MiB bodies: ``/health`` stalled 46 s). Now the tokenizer runs in a worker thread: while it is
    held inside the tokenizer, ``/health`` answers. (The held tokenizer waits for that answer; on the old code
    it would wait forever, so it gives up after 60 s and the test fails.) Text over ``max_prompt_chars`` is a
    400 naming the setting, for completions and for chat."""
    import threading

    import k3post.xtml.template

    async def go(c: httpx.AsyncClient, app: Any) -> None:
        srv = app.state.server
        answered: list[bool] = []
        for route in ("completions", "chat"):
            entered, health = threading.Event(), threading.Event()

            def held(real: Callable[..., Any]) -> Callable[..., Any]:
                def encode(*a: Any, **kw: Any) -> Any:
                    if not entered.is_set():
                        entered.set()
                        answered.append(health.wait(60))
                    return real(*a, **kw)
                return encode

            with pytest.MonkeyPatch.context() as mp:
                if route == "completions":
                    mp.setattr(srv.tokenizer, "encode", held(srv.tokenizer.encode))
                    call = c.post("/v1/completions", json={"prompt": "hello " * 50, "max_tokens": 1})
                else:
                    mp.setattr(k3post.xtml.template, "encode_text", held(k3post.xtml.template.encode_text))
                    call = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 1})
                task = asyncio.ensure_future(call)
                while not entered.is_set() and not task.done():
                    await asyncio.sleep(0.01)
                r = await c.get("/health")
                assert r.status_code == 200
                health.set()
                assert (await task).status_code == 200, route
        assert answered == [True, True]
        r = await c.post("/v1/completions", json={"prompt": ["x" * 600, "y" * 401], "max_tokens": 1})
        assert r.status_code == 400 and "1001 characters" in r.text and "ServeLimits.max_prompt_chars" in r.text
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 1001}]})
        assert r.status_code == 400 and "ServeLimits.max_prompt_chars" in r.text, r.text
        r = await c.post("/v1/completions", json={"prompt": "x" * 990, "max_tokens": 1})
        assert r.status_code == 200, r.text

    _run(model_dir, go, limits=ServeLimits(max_prompt_chars=1000))


def test_encode_text_releases_the_gil(xtml_tokenizer: Any) -> None:
    """`k3post.tokenizer.encode_text` (what chat rendering tokenises with) encodes through ``encode_batch``,
    which releases the GIL (the tokenizers library's ``encode`` holds it): another thread runs while a long
    text is encoded, and the ids are those ``encode`` gives."""
    import threading

    from k3post.tokenizer import _text_backend, encode_text

    text = "The quick brown fox, <|end_of_msg|> 1234. " * 40000
    ticks, done = [0], threading.Event()
    _text_backend(xtml_tokenizer)  # built (pure Python) before the measurement

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            done.wait(0.0005)

    t = threading.Thread(target=tick)
    t.start()
    seen = [ticks[0]]
    ids = encode_text(xtml_tokenizer, text)
    seen.append(ticks[0])
    done.set()
    t.join()
    assert ids == list(_text_backend(xtml_tokenizer).encode(text, add_special_tokens=False).ids)
    # ~0.5 s of encoding at one tick per 0.5 ms: hundreds of ticks when the GIL is released, a few when held
    assert seen[1] - seen[0] > 20, seen


# --------------------------------------------------------------------------- bad bodies


def test_deep_json_and_generate_over_max_tokens_are_400(model_dir: Path) -> None:
    """Before: ``[[[[...]]]]`` 100,000 deep answered 500 (RecursionError), and ``/generate`` took any
    ``max_new_tokens``. Now both are 400s naming the setting; nesting at the limit is accepted."""
    async def go(c: httpx.AsyncClient, app: Any) -> None:
        for depth in (100_000, 9):
            raw = '{"prompt": ' + "[" * depth + "1" + "]" * depth + "}"
            r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "ServeLimits.max_json_depth" in r.json()["error"]["message"], r.text
        r = await c.post("/v1/completions", json={"prompt": [[[1]]], "max_tokens": 1, "tools": [{"a": {"b": [{}]}}]})
        assert r.status_code == 400 and "max_json_depth" not in r.text  # 8 levels: parsed, then refused as a prompt
        r = await c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 33}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "ServeLimits.max_tokens" in err["message"] and err["param"] == "sampling_params.max_new_tokens"
        r = await c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 32}})
        assert r.status_code == 200, r.text

    _run(model_dir, go, limits=ServeLimits(max_tokens=32, max_json_depth=8))


def test_an_oversized_body_gets_the_413_not_a_connection_reset(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a client sending a 32 MB body to a server with an 8 MiB limit got a connection reset (the server
    answered 413 and closed while the client was still sending). Now the server reads and discards the body
    (up to ``max_drain_bytes``) and the client reads the 413; a 401 for a large body the same way. A client
    that sends ``Expect: 100-continue`` gets the 413 without sending the body."""
    import socket
    import threading

    import uvicorn

    monkeypatch.delenv("K3POST_API_KEY", raising=False)
    app = build_server(model_dir, model_name="m", max_batch_size=2, qat=False, torch_threads=1, api_key="k")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started:
                break
            threading.Event().wait(0.05)
        assert server.started
        n = 32 * 1000**2
        for auth, status in ((b"Authorization: Bearer k\r\n", b"413"), (b"", b"401")):
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # a client that sends it all,
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + auth +  # then reads the answer
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % n)
                sock.sendall(b"x" * n)  # the old server reset the connection here
                head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 " + status), head
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # sends the headers only
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 33554432\r\nExpect: 100-continue\r\n\r\n")
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head
    finally:
        server.should_exit = True
        thread.join(30)
