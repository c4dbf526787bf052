"""`HTTPEngine` against SGLang and vLLM servers (`k3post.rollout.server_dialects`).

CPU tests replay the servers from recorded request / response shapes
(``tests/fixtures/engine_api/{sglang,vllm}/*.json``, each naming the source it was read from):
an ``httpx.MockTransport`` in HTTPEngine's own event loop checks every request body against the
recorded fields (required keys, JSON types, no unknown keys: a 400 naming the key, as SGLang's
``SamplingParams(**d)`` would) and answers in the recorded response shapes. Pauses are
deterministic: a held ``/generate`` answers only once its ``/abort_request`` arrived (SGLang),
a held stream is closed by the client once the test has seen its tokens arrive (vLLM).

``gpu`` tests start a real ``sglang`` / ``vllm`` server over a tiny model when the package and a
CUDA device are there, and compare its log-probs with the model's own (the `EmbeddedEngine` one).

Shape legend: none (token lists).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import re
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from k3post.config.rollout import EngineConfig
from k3post.rollout.engine import GenerationRequest, SamplingParams
from k3post.rollout.http_engine import HTTPEngine
from k3post.rollout.server_dialects import (
    DialectError,
    K3postDialect,
    SGLangDialect,
    VLLMDialect,
    parse_version,
    sglang_init_group_body,
    sglang_update_distributed_body,
    vllm_nccl_init_body,
    vllm_nccl_update_body,
)

FIX = Path(__file__).resolve().parent / "fixtures" / "engine_api"
URL = "http://sglang-a:30000"
VURL = "http://vllm-a:8000"
PROMPT = [151644, 872, 198, 17, 10, 18]
EOS = 151645


def fixture(dialect: str, name: str) -> dict[str, Any]:
    return json.loads((FIX / dialect / f"{name}.json").read_text())


def _is(v: Any, types: str) -> bool:
    for t in types.split("|"):
        if (t == "null" and v is None or t == "str" and isinstance(v, str) or t == "bool" and isinstance(v, bool)
                or t == "int" and isinstance(v, int) and not isinstance(v, bool)
                or t == "number" and isinstance(v, (int, float)) and not isinstance(v, bool)
                or t == "object" and isinstance(v, dict)
                or t.startswith("list[") and isinstance(v, list) and all(_is(x, t[5:-1]) for x in v)):
            return True
    return False


def body_errors(body: Any, fields: dict[str, str], required: list[str], prefix: str = "") -> list[str]:
    """What a server with these recorded fields would reject in ``body``: unknown keys, wrong
    JSON types, missing required keys (dotted names for nested objects)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        return [f"body is {type(body).__name__}, not an object"]
    errors = [f"missing required key {k!r}" for k in required if not prefix and k not in body]
    for k, v in body.items():
        key = prefix + k
        if key not in fields:
            errors.append(f"unknown key {key!r}")
        elif not _is(v, fields[key]):
            errors.append(f"{key!r} = {v!r} is not {fields[key]}")
        elif isinstance(v, dict) and any(f.startswith(key + ".") for f in fields):
            errors += body_errors(v, fields, [], key + ".")
    return errors


# --------------------------------------------------------------------------- replay servers
class Replay:
    """A recorded server: every call is checked against its fixture and recorded in ``calls``."""

    dialect = ""
    routes: dict[str, str] = {}

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[tuple[str, Any]] = []
        self.errors: list[str] = []
        self.overrides: dict[str, Callable[[Any], httpx.Response]] = {}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path not in self.routes:
            return httpx.Response(404, json={"detail": "Not Found"})
        fx = fixture(self.dialect, self.routes[path])
        method = fx["endpoint"].split()[0]
        if request.method != method and not fx["endpoint"].startswith("POST /init_weight_transfer_engine +"):
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        body = json.loads(request.content) if request.content else None
        self.calls.append((path, body))
        errors = body_errors(body, fx["request_fields"], fx["required"])
        if errors:
            self.errors += [f"{path}: {e}" for e in errors]
            return httpx.Response(400, json={"message": "; ".join(errors)})
        if path in self.overrides:
            return self.overrides[path](body)
        return await self.answer(path, body, fx, request)

    async def answer(self, path: str, body: Any, fx: dict[str, Any], request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=copy.deepcopy(fx["response"]))

    def bodies(self, path: str) -> list[Any]:
        return [b for p, b in self.calls if p == path]


def next_tokens(context: list[int], n: int) -> tuple[list[int], list[float]]:
    """The replay's deterministic 'model': token i after ``context`` and its log-prob."""
    ids = [100 + (sum(context) + 7 * (len(context) + i)) % 50 for i in range(n)]
    return ids, [-0.01 * (1 + (t % 13)) for t in ids]


class SGLangReplay(Replay):
    """SGLang's native API. ``stop_after``: emit the stop id (first of ``stop_token_ids``, else
    EOS) as token number ``stop_after``; ``hold``: answer the next /generate after this many tokens
    only once its rid was aborted (finish abort, partial output)."""

    dialect = "sglang"
    routes = {"/generate": "generate", "/abort_request": "abort_request", "/get_model_info": "get_model_info",
              "/get_server_info": "get_server_info", "/get_weight_version": "get_weight_version",
              "/update_weights_from_disk": "update_weights_from_disk", "/update_weight_version": "update_weight_version"}

    def __init__(self, url: str = URL) -> None:
        super().__init__(url)
        self.version = "default"
        self.stop_after: int | None = None
        self.hold: int | None = None
        self.held: dict[str, asyncio.Event] = {}
        self.aborted: set[str] = set()
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.server_info: dict[str, Any] = {}

    async def answer(self, path: str, body: Any, fx: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if path == "/get_model_info":
            out = copy.deepcopy(fx["response"])
            out["weight_version"] = self.version
            return httpx.Response(200, json=out)
        if path == "/get_server_info":
            return httpx.Response(200, json={**fx["response"], **self.server_info, "weight_version": self.version})
        if path == "/abort_request":
            self.aborted.add(body["rid"])
            if body["rid"] in self.held:
                self.held[body["rid"]].set()
            return httpx.Response(200)
        if path in ("/update_weights_from_disk", "/update_weight_version"):
            if path == "/update_weights_from_disk":
                folder = Path(body["model_path"])
                self.loaded.append({k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()})
            self.version = body.get("weight_version") or body.get("new_version") or self.version
            return httpx.Response(200, json=fx["response"])
        return await self.generate(body, fx)

    async def generate(self, body: dict[str, Any], fx: dict[str, Any]) -> httpx.Response:
        sp = body["sampling_params"]
        ctx = body["input_ids"]
        n = sp["max_new_tokens"]
        finish: dict[str, Any] = {"type": "length", "length": n}
        ids, lps = next_tokens(ctx, n)
        if self.stop_after is not None and self.stop_after <= n:
            stop = (sp.get("stop_token_ids") or [EOS])[0]
            ids, lps = ids[: self.stop_after], lps[: self.stop_after]
            ids[-1] = stop
            finish = {"type": "stop", "matched": stop}
        if self.hold is not None:
            k, self.hold = self.hold, None
            event = self.held.setdefault(body["rid"], asyncio.Event())
            if body["rid"] in self.aborted:
                event.set()
            await event.wait()
            ids, lps = ids[:k], lps[:k]
            finish = {"type": "abort", "message": "Abort in running batch"}
        out = copy.deepcopy(fx["response"])
        out["output_ids"] = ids
        out["text"] = ""
        meta = out["meta_info"]
        meta.update(id=body["rid"], finish_reason=finish, prompt_tokens=len(ctx), completion_tokens=len(ids),
                    weight_version=self.version, output_token_logprobs=[[lp, t, None] for t, lp in zip(ids, lps)])
        meta["weight_versions"] = [{"version": self.version, "start": 0, "end": len(ids)}]
        return httpx.Response(200, json=out)


class VLLMReplay(Replay):
    """vLLM's OpenAI server (streamed completions) and its dev-mode weight endpoints. ``hold``:
    the next stream sends this many tokens, then waits until the client closes it."""

    dialect = "vllm"
    routes = {"/v1/models": "models", "/v1/completions": "completions_stream",
              "/init_weight_transfer_engine": "init_weight_transfer_engine",
              "/start_weight_update": "start_weight_update", "/update_weights": "update_weights",
              "/finish_weight_update": "finish_weight_update", "/update_weight_version": "update_weight_version"}

    def __init__(self, url: str = VURL) -> None:
        super().__init__(url)
        self.stop_after: int | None = None
        self.hold: int | None = None
        self.disconnected: list[str] = []
        self.headers: list[str | None] = []
        self.loaded: list[dict[str, torch.Tensor]] = []

    async def answer(self, path: str, body: Any, fx: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if path == "/update_weights":
            folder = Path(body["update_info"]["path"])
            assert folder.is_absolute()
            self.loaded.append({k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()})
        if path != "/v1/completions":
            return await super().answer(path, body, fx, request)
        self.headers.append(request.headers.get("x-request-id"))
        assert self.headers[-1] == body["request_id"]
        n = body["max_tokens"]
        ids, lps = next_tokens(body["prompt"], n)
        finish = "length"
        if self.stop_after is not None and self.stop_after <= n:
            ids, lps = ids[: self.stop_after], lps[: self.stop_after]
            ids[-1] = (body.get("stop_token_ids") or [EOS])[0]
            finish = "stop"
        hold, self.hold = self.hold, None
        template = fx["response"][0]

        def event(t: int, lp: float, last: bool) -> bytes:
            d = copy.deepcopy(template)
            d["id"] = "cmpl-" + body["request_id"]
            c = d["choices"][0]
            c["logprobs"] = {"text_offset": [0], "token_logprobs": [lp], "tokens": [f"token_id:{t}"],
                             "top_logprobs": [{f"token_id:{t}": lp}]}
            c["finish_reason"] = finish if last else None
            return f"data: {json.dumps(d)}\n\n".encode()

        async def stream() -> AsyncIterator[bytes]:
            try:
                for i, (t, lp) in enumerate(zip(ids, lps)):
                    if hold is not None and i == hold:
                        await asyncio.Event().wait()  # until the client disconnects
                    yield event(t, lp, i == len(ids) - 1)
                yield b"data: [DONE]\n\n"
            finally:
                if hold is not None:
                    self.disconnected.append(body["request_id"])

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())


def engine_for(*replays: Replay, dialect: str, **kw: Any) -> HTTPEngine:
    by_host = {httpx.URL(r.url).host: r for r in replays}

    async def route(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].handle(request)

    kw.setdefault("backoff_s", 0.0)
    return HTTPEngine([r.url for r in replays], dialect=dialect, transport=httpx.MockTransport(route), **kw)


def req(rid: str, max_tokens: int = 6, **sp: Any) -> GenerationRequest:
    return GenerationRequest(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, **sp))


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``cond`` until true (a condition on state, never on timing)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def pause_after_three_and_resume(eng: HTTPEngine, max_tokens: int, held: Callable[[], bool]) -> Any:
    """Request "p" on a replay holding after 3 tokens: once ``held()``, pause it (a partial of those
    3 tokens, finish "paused"), resume it and check the final result: the 3 kept tokens with their
    log-probs, then what the replay samples after prompt + 3 tokens (a re-prefill), finish "length".
    Returns the partial."""
    eng.add_request(req("p", max_tokens=max_tokens, seed=3))
    wait_for(held, "the replay to hold request p after 3 tokens")
    part, = eng.pause(["p"])
    assert (part.finish_reason, part.output_ids) == ("paused", next_tokens(PROMPT, 3)[0])
    eng.resume(["p"])
    out: list[Any] = []
    while eng.has_unfinished():
        out += eng.step()
    (res,) = out
    rest_ids, rest_lps = next_tokens(PROMPT + part.output_ids, max_tokens - 3)
    assert res.output_ids == part.output_ids + rest_ids and res.finish_reason == "length"
    assert res.output_logprobs == part.output_logprobs + rest_lps
    return part


# --------------------------------------------------------------------------- the fixtures themselves
def test_fixtures_name_their_source_and_pass_their_own_schema() -> None:
    for f in sorted(FIX.glob("*/*.json")):
        fx = json.loads(f.read_text())
        assert fx["source"] and all(("sglang" in s or "vllm" in s) and "/" in s for s in fx["source"]), f
        assert any("@" in s for s in fx["source"]), f"{f}: no source pinned to a commit"
        assert body_errors(fx["request"], fx["request_fields"], fx["required"]) == [], f
    assert body_errors({"rid": "x", "input_ids": [1], "return_logprob": True, "sampling_params": {"max_tokens": 3}},
                       fixture("sglang", "generate")["request_fields"], ["rid"]) == ["unknown key 'sampling_params.max_tokens'"]


def test_request_builders_equal_the_recorded_requests() -> None:
    r = GenerationRequest("t", list(PROMPT), SamplingParams(max_tokens=4, seed=1234))
    rid = fixture("sglang", "generate")["request"]["rid"]
    assert SGLangDialect().generate_call(rid, r, [], None).body == fixture("sglang", "generate")["request"]
    v = VLLMDialect()
    v.model = "/models/qwen3-tiny"
    call = v.generate_call(rid, r, [], None)
    assert call.body == fixture("vllm", "completions_stream")["request"] and call.headers == {"X-Request-Id": rid}
    path = "/shared/k3post-weights-x/v00000004"
    assert [c.body for c in SGLangDialect().disk_update_calls(path, 4)] == [fixture("sglang", "update_weights_from_disk")["request"]]
    assert [(c.path, c.body) for c in v.init_weight_calls() + v.disk_update_calls(path, 4)] == [
        ("/init_weight_transfer_engine", fixture("vllm", "init_weight_transfer_engine")["request"]),
        ("/start_weight_update", None), ("/update_weights", fixture("vllm", "update_weights")["request"]),
        ("/finish_weight_update", fixture("vllm", "finish_weight_update")["request"])]
    assert SGLangDialect().version_calls(5)[0].body == fixture("sglang", "update_weight_version")["request"]
    assert v.version_calls(5)[0].body == fixture("vllm", "update_weight_version")["request"]
    items = [("model.embed_tokens.weight", torch.zeros(256, 64, dtype=torch.bfloat16)),
             ("lm_head.weight", torch.zeros(256, 64, dtype=torch.bfloat16))]
    assert sglang_init_group_body("10.0.0.1", 29555, 1, 2, "k3post-1a2b3c4d") == fixture("sglang", "init_weights_update_group")["request"]
    assert sglang_update_distributed_body(items, "k3post-1a2b3c4d", 4) == fixture("sglang", "update_weights_from_distributed")["request"]
    nccl = fixture("vllm", "update_weights_nccl")
    assert vllm_nccl_init_body("10.0.0.1", 29555, 1, 2) == nccl["request"]
    assert vllm_nccl_update_body(items) == nccl["update_request"]
    assert body_errors(nccl["update_request"], nccl["update_request_fields"], ["update_info"]) == []


def test_parsers_read_the_recorded_responses() -> None:
    # generate.json: output_token_logprobs [[-0.105, 20], [-0.0031, 151645]], finish stop, version "3"
    p = SGLangDialect().parse_generate(URL, "r", fixture("sglang", "generate")["response"], version=0)
    assert (p.ids, p.logprobs, p.versions, p.finish) == ([20, EOS], [-0.105, -0.0031], [3, 3], "stop")
    p = SGLangDialect().parse_generate(URL, "r", fixture("sglang", "abort_request")["generate_response"], version=0)
    assert (p.ids, p.versions, p.finish) == ([16, 17], [3, 3], "abort")
    # spans: version 3 for token 0, version 4 for token 1 (an in-place update between them)
    d = copy.deepcopy(fixture("sglang", "generate")["response"])
    d["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    assert SGLangDialect().parse_generate(URL, "r", d, version=0).versions == [3, 4]
    events = fixture("vllm", "completions_stream")["response"]
    pieces = [VLLMDialect().parse_stream_line(VURL, "r", "data: " + (e if isinstance(e, str) else json.dumps(e)), 7)
              for e in events]
    assert pieces[2] is None
    assert [(q.ids, q.logprobs, q.versions, q.finish) for q in pieces[:2]] == [  # type: ignore[union-attr]
        ([20], [-0.105], [7], None), ([EOS], [-0.0031], [7], "stop")]
    assert parse_version("default", "x") == 0 and parse_version("12", "x") == 12
    with pytest.raises(DialectError, match="x: weight version 'policy-a'"):
        parse_version("policy-a", "x")


# --------------------------------------------------------------------------- SGLang through HTTPEngine
def test_sglang_model_info_generate_and_finish_reasons() -> None:
    srv = SGLangReplay()
    with engine_for(srv, dialect="sglang", default_stop_ids=[7]) as eng:
        # get_server_info.json: context_length null -> max_req_input_len 4095 + 1; max_running_requests 48
        assert (eng.max_model_len, eng.max_batch_size, eng.version) == (4096, 48, 0)
        srv.stop_after = 3
        a, = eng.generate([req("a", max_tokens=6, seed=5)])
        srv.stop_after = None
        b, = eng.generate([req("b", max_tokens=4, stop_ids=(9,))])
    assert srv.errors == []
    ids, lps = next_tokens(PROMPT, 3)
    assert (a.output_ids, a.output_logprobs, a.output_versions, a.finish_reason) == (ids[:2] + [7], lps, [0, 0, 0], "stop")
    assert (b.output_ids, b.finish_reason) == (next_tokens(PROMPT, 4)[0], "length")
    first, second = srv.bodies("/generate")
    assert first["input_ids"] == PROMPT and first["return_logprob"] is True
    assert first["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6,
                                        "stop_token_ids": [7], "ignore_eos": False, "skip_special_tokens": False,
                                        "sampling_seed": 5, "no_stop_trim": True}
    assert second["sampling_params"]["stop_token_ids"] == [9]
    assert len(first["rid"]) == len(second["rid"]) == 32 and first["rid"] != second["rid"]  # prefix-free rids


def test_sglang_pause_returns_partial_and_resume_reprefills() -> None:
    srv = SGLangReplay()
    srv.hold = 3
    with engine_for(srv, dialect="sglang") as eng:
        part = pause_after_three_and_resume(eng, 8, lambda: len(srv.held) == 1)
    rid = srv.bodies("/generate")[0]["rid"]
    assert srv.bodies("/abort_request")[-1] == {"rid": rid}
    cont = srv.bodies("/generate")[1]
    assert cont["input_ids"] == PROMPT + part.output_ids and cont["sampling_params"]["max_new_tokens"] == 5


def test_sglang_weight_update_by_disk_and_versions() -> None:
    srv = SGLangReplay()
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with engine_for(srv, dialect="sglang") as eng:
        assert eng.update_weights({"model.norm.weight": w}) == 1
        assert eng.update_weights({}, version=3) == 3  # version only: /update_weight_version
        r, = eng.generate([req("v", max_tokens=2)])
        srv.hold = 1
        eng.add_request(req("run", max_tokens=4))
        wait_for(lambda: len(srv.held) == 1, "the held /generate")
        with pytest.raises(ValueError, match=r"requests \['run'\] are running on sglang servers"):
            eng.update_weights({"model.norm.weight": w})
        eng.abort(["run"])
        srv.overrides["/update_weights_from_disk"] = lambda body: httpx.Response(
            400, json=fixture("sglang", "update_weights_from_disk")["error_response"])
        with pytest.raises(ValueError, match=rf"{URL}/update_weights_from_disk: HTTP 400: Failed to get weights"):
            eng.update_weights({"model.norm.weight": w})
        assert eng.version == 3
    assert srv.errors == []
    assert srv.bodies("/update_weights_from_disk")[0]["weight_version"] == "1"
    assert torch.equal(srv.loaded[0]["model.norm.weight"], w)  # a plain safetensors folder, HF names
    assert srv.bodies("/update_weight_version") == [{"new_version": "3", "abort_all_requests": False}]
    assert r.output_versions == [3, 3]


def test_sglang_errors_name_the_server_and_field() -> None:
    srv = SGLangReplay()
    srv.server_info = {"max_running_requests": None}
    with pytest.raises(DialectError, match=rf"{URL}/get_server_info: max_running_requests is null"):
        engine_for(srv, dialect="sglang")
    srv.server_info = {}

    def no_logprobs(body: Any) -> httpx.Response:
        out = copy.deepcopy(fixture("sglang", "generate")["response"])
        del out["meta_info"]["output_token_logprobs"]
        return httpx.Response(200, json=out)

    srv.overrides["/generate"] = no_logprobs
    with engine_for(srv, dialect="sglang", server_slots=4) as eng:
        with pytest.raises(DialectError, match=rf"{URL}/generate \(request 'e'\).*output_token_logprobs"):
            eng.generate([req("e")])
    with pytest.raises(ValueError, match="weight_sync='distributed' is not available with dialect='sglang'"):
        HTTPEngine([URL], dialect="sglang", weight_sync="distributed")


# --------------------------------------------------------------------------- vLLM through HTTPEngine
def test_vllm_generate_stream_and_finish_reasons() -> None:
    srv = VLLMReplay()
    with engine_for(srv, dialect="vllm", server_slots=16) as eng:
        assert (eng.max_model_len, eng.max_batch_size, eng.version) == (4096, 16, 0)
        srv.stop_after = 2
        a, = eng.generate([req("a", max_tokens=5, seed=11)])
        srv.stop_after = None
        b, = eng.generate([req("b", max_tokens=3, ignore_eos=True)])
    assert srv.errors == []
    ids, lps = next_tokens(PROMPT, 2)
    assert (a.output_ids, a.output_logprobs, a.finish_reason) == ([ids[0], EOS], lps, "stop")
    assert (b.output_ids, b.finish_reason) == (next_tokens(PROMPT, 3)[0], "length")
    first, second = srv.bodies("/v1/completions")
    assert first["model"] == "/models/qwen3-tiny" and first["prompt"] == PROMPT and first["seed"] == 11
    assert first["stream"] is True and first["logprobs"] == 0 and first["return_tokens_as_token_ids"] is True
    assert second["stop_token_ids"] == [] and second["ignore_eos"] is True
    assert srv.headers == [first["request_id"], second["request_id"]]


def test_vllm_pause_closes_the_stream_and_keeps_what_arrived() -> None:
    srv = VLLMReplay()
    srv.hold = 3
    with engine_for(srv, dialect="vllm", server_slots=4) as eng:
        part = pause_after_three_and_resume(eng, 7, lambda: len(eng._reqs["p"].ids) == 3)
    first, cont = srv.bodies("/v1/completions")
    wait_for(lambda: srv.disconnected == [first["request_id"]], "the server to see the disconnect")
    assert cont["prompt"] == PROMPT + part.output_ids and cont["max_tokens"] == 4


def test_vllm_weight_update_by_disk() -> None:
    srv = VLLMReplay()
    w = torch.ones(3)
    with engine_for(srv, dialect="vllm", server_slots=4) as eng:
        assert eng.update_weights({"lm_head.bias": w}) == 1
        assert eng.update_weights({"lm_head.bias": 2 * w}) == 2
        r, = eng.generate([req("v", max_tokens=2)])
        srv.overrides["/start_weight_update"] = lambda body: httpx.Response(404, json={"detail": "Not Found"})
        with pytest.raises(ValueError, match=rf"{VURL}/start_weight_update: HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
            eng.update_weights({"lm_head.bias": w})
    assert srv.errors == []
    assert [p for p, _ in srv.calls if p not in ("/v1/models", "/v1/completions")] == [
        "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
        "/start_weight_update", "/update_weights", "/finish_weight_update", "/start_weight_update"]
    assert [b["weight_version"] for b in srv.bodies("/finish_weight_update")] == ["1", "2"]
    assert torch.equal(srv.loaded[1]["lm_head.bias"], 2 * w)
    assert r.output_versions == [2, 2]


def test_vllm_errors_name_the_server_and_field() -> None:
    srv = VLLMReplay()
    with pytest.raises(DialectError, match=rf"{VURL}/v1/models: vLLM reports no batch size"):
        engine_for(srv, dialect="vllm")
    bad = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
           "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]}
    with pytest.raises(DialectError, match=rf"{VURL}/v1/completions \(request 'q'\): choices\[0\].logprobs is missing"):
        VLLMDialect().parse_stream_line(VURL, "q", "data: " + json.dumps(bad), 0)
    with pytest.raises(DialectError, match=r"tokens entry 'x' is not 'token_id:<id>'"):
        bad["choices"][0]["logprobs"] = {"tokens": ["x"], "token_logprobs": [-1.0]}
        VLLMDialect().parse_stream_line(VURL, "q", "data: " + json.dumps(bad), 0)
    with pytest.raises(DialectError, match="mid-stream"):
        VLLMDialect().parse_stream_line(VURL, "q", 'data: {"error": {"message": "boom"}}', 0)


def test_engine_config_dialect() -> None:
    assert EngineConfig(kind="http", urls=[URL], dialect="sglang").dialect == "sglang"
    with pytest.raises(ValueError, match="engine.dialect must be one of"):
        EngineConfig(dialect="tgi")
    with pytest.raises(ValueError, match="engine.dialect 'vllm' needs engine.weight_sync=disk"):
        EngineConfig(kind="http", urls=[URL], dialect="vllm", weight_sync="distributed")


# --------------------------------------------------------------------------- real servers (gpu)
def _real_server_or_skip(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Path:
    from k3post.models import build_tiny_moe, save_model
    from k3post.xtml import EOM

    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    return save_model(model, tmp_path_factory.mktemp("dialects") / "tiny", tok)


def _launch(cmd: list[str], url: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{url} not ready after 600 s: {log.read_text()[-2000:]}")


def _reference_logprobs(model_dir: Path, prompt: list[int], ids: list[int]) -> list[float]:
    """Raw-model log-probs of ``ids`` after ``prompt`` (what EmbeddedEngine reports for them)."""
    from k3post.models import load_model

    model = load_model(model_dir).eval()
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]


def _drive_real(eng: HTTPEngine, model_dir: Path, tmp: Path) -> None:
    prompt = [5, 17, 42, 99, 120, 7, 64]
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    r, = eng.generate([GenerationRequest("g", prompt, sp)])
    ref = _reference_logprobs(model_dir, prompt, r.output_ids)
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 2e-2  # bf16 / fp16 kernels vs fp32
    eng.add_request(GenerationRequest("p", prompt, sp))
    part, = eng.pause(["p"])
    eng.resume(["p"])
    done: list[Any] = []
    while eng.has_unfinished():
        done += eng.step()
    assert done[0].output_ids[: len(part.output_ids)] == part.output_ids and len(done[0].output_ids) == 24
    from k3post.models import load_model

    named = {n: p.detach() * 1.0 for n, p in load_model(model_dir).named_parameters()}
    v = eng.update_weights(named)
    r2, = eng.generate([GenerationRequest("after", prompt, sp)])
    assert r2.output_versions == [v] * len(r2.output_ids)


@pytest.mark.gpu
def test_real_sglang_server(gpu_model_dir: Path, tmp_path: Path) -> None:
    _real_server_or_skip("sglang")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch([sys.executable, "-m", "sglang.launch_server", "--model-path", str(gpu_model_dir), "--port",
                    str(port), "--skip-tokenizer-init", "--max-running-requests", "8", "--weight-version", "0",
                    "--dtype", "float32"], url, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, tmp_path / "sglang.log")
    try:
        with HTTPEngine([url], dialect="sglang", weights_dir=tmp_path / "w") as eng:
            _drive_real(eng, gpu_model_dir, tmp_path)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.gpu
def test_real_vllm_server(gpu_model_dir: Path, tmp_path: Path) -> None:
    _real_server_or_skip("vllm")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _launch([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(gpu_model_dir),
                    "--port", str(port), "--max-num-seqs", "8", "--dtype", "float32",
                    "--weight-transfer-config", json.dumps({"backend": "disk"})], url,
                   {"VLLM_SERVER_DEV_MODE": "1"}, tmp_path / "vllm.log")
    try:
        with HTTPEngine([url], dialect="vllm", server_slots=8, weights_dir=tmp_path / "w") as eng:
            _drive_real(eng, gpu_model_dir, tmp_path)
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- scoring (ScoringEngine over HTTP)


def _scoring_servers(dialect: str, down: tuple[str, ...] = ()) -> tuple[HTTPEngine, list[tuple[str, Any]]]:
    """An HTTPEngine over servers a and b speaking ``dialect``, whose 'model' gives token t after any context the
    log-prob -0.001 * t; the servers in ``down`` refuse every connection. Returns the engine and the scoring
    calls (host, body) the servers answered."""
    seen: list[tuple[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host in down:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/get_model_info":
            return httpx.Response(200, json={"weight_version": "3", "is_generation": True, "max_batch_size": 4,
                                             "max_model_len": 64, "qat": None})
        if path == "/get_server_info":
            return httpx.Response(200, json={"context_length": 64, "max_running_requests": 4})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 64}]})
        body = json.loads(request.content)
        seen.append((host, body))
        if dialect == "k3post":
            return httpx.Response(200, json={"logprobs": [[-0.001 * t for t in s[1:]] for s in body["input_ids"]],
                                             "weight_version": 3})
        if dialect == "sglang":
            assert body["sampling_params"] == {"max_new_tokens": 0} and body["logprob_start_len"] == 0
            return httpx.Response(200, json=[{"text": "", "meta_info": {"input_token_logprobs": [
                [None if i == 0 else -0.001 * t, t, None] for i, t in enumerate(s)]}} for s in body["input_ids"]])
        assert body["echo"] is True and body["max_tokens"] == 1 and body["model"] == "m"
        return httpx.Response(200, json={"choices": [{"index": i, "text": "", "logprobs": {
            "tokens": [f"token_id:{t}" for t in s + [9]], "token_logprobs": [None] + [-0.001 * t for t in s[1:]] + [-0.5]}}
            for i, s in enumerate(body["prompt"])]})

    eng = HTTPEngine(["http://a", "http://b"], dialect=dialect, transport=httpx.MockTransport(handle), backoff_s=0.0,
                     max_retries=1, server_slots=4)
    return eng, seen


@pytest.mark.parametrize("dialect", ["k3post", "sglang", "vllm"])
def test_http_engine_scores_through_every_dialect(dialect: str) -> None:
    """`HTTPEngine.score` sends each dialect's scoring call (k3post ``/score``, SGLang's prefill-only ``/generate``,
    vLLM's ``echo`` completion), splits the sequences over the live servers and returns one log-prob per token
    after the first, in the order given (vLLM's extra sampled token dropped); when a server is down its share is
    scored on the other."""
    from k3post.rollout.engine import ScoringEngine

    ids = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    want = [[-0.001 * t for t in s[1:]] for s in ids]
    eng, seen = _scoring_servers(dialect)
    with eng:
        assert isinstance(eng, ScoringEngine)
        assert eng.score(ids) == want
    assert sorted(h for h, _ in seen) == ["a", "b"]  # one call per server
    eng, seen = _scoring_servers(dialect, down=("a",))
    with eng:
        assert eng.score(ids) == want
    assert {h for h, _ in seen} == {"b"}


@pytest.mark.parametrize("dialect", ["k3post", "sglang", "vllm"])
def test_scoring_answers_that_do_not_fit_are_dialect_errors(dialect: str) -> None:
    """A scoring answer with the wrong number of log-probs, a null or text log-prob, other token ids than the
    ones sent, or too few answers is a `DialectError` naming the server, never a silent misalignment."""
    d = {"k3post": K3postDialect(), "sglang": SGLangDialect(), "vllm": VLLMDialect()}[dialect]
    ids = [[5, 6, 7]]
    good = {"k3post": {"logprobs": [[-0.1, -0.2]]},
            "sglang": [{"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.1, 6, None], [-0.2, 7, None]]}}],
            "vllm": {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:5", "token_id:6", "token_id:7", "token_id:1"],
                                                          "token_logprobs": [None, -0.1, -0.2, -0.9]}}]}}[dialect]
    assert d.parse_score(URL, good, ids) == [[-0.1, -0.2]]
    bad = json.loads(json.dumps(good).replace("-0.2", "null"))
    shifted = json.loads(json.dumps(good).replace('"token_id:6"', '"token_id:4"').replace("[-0.1, 6,", "[-0.1, 4,"))
    short = {"k3post": {"logprobs": [[-0.1]]}, "sglang": [], "vllm": {"choices": []}}[dialect]
    for answer in ([bad, short] + ([shifted] if dialect != "k3post" else [])):
        with pytest.raises(DialectError, match="^" + re.escape(URL)):
            d.parse_score(URL, answer, ids)
