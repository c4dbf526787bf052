"""The OpenAI-compatible server (`k3post serve`): official `openai` client, streaming, batching.

A tiny dense Qwen3 is fine-tuned for a few seconds (AdamW, ~70 steps) to memorise one XTML
assistant turn (reasoning + a `get_weather` tool call) after a fixed prompt, so greedy
decoding reproduces it and the server's XTML parse path (tool_calls, reasoning_content,
streaming deltas) can be checked exactly. It is served for real on 127.0.0.1 (uvicorn in a
thread) and driven with the official `openai` client and httpx. One more test serves a
tiny Qwen3-MoE folder with MX QAT through the ASGI transport.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from k3post.models import build_tiny_moe, save_model  # noqa: E402
from k3post.serve.cli import add_serve_parser, build_server  # noqa: E402
from k3post.tokenizer import decode  # noqa: E402
from k3post.xtml import XTML, render_text  # noqa: E402

MODEL = "k3-test"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "How is the weather in Paris?"}]
REASONING = "Let me think step by step."
ARGS = {"city": "Paris", "days": 3}
REPLY = {
    "role": "assistant",
    "reasoning_content": REASONING,
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}],
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _memorised_model(tok: Any) -> Qwen3ForCausalLM:
    """A tiny dense Qwen3 that reproduces REPLY after MESSAGES + TOOLS at effort high (greedy)."""
    x = XTML(tok)
    r = x.render(MESSAGES + [REPLY], tools=TOOLS, effort="high")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
        eos_token_id=x.eom_id, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg)
    ids_1T = torch.tensor([r.ids])
    labels_1T = ids_1T.clone()
    labels_1T[0, ~torch.tensor(r.loss_mask)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(70):
        loss = model(input_ids=ids_1T, labels=labels_1T).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, f"memorisation did not converge (loss {loss.item():.3f})"
    return model.eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    app: Any
    tok: Any

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Iterator[Served]:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("serve") / "memorised"
    save_model(_memorised_model(xtml_tokenizer), path, xtml_tokenizer)
    app = build_server(path, model_name=MODEL, max_batch_size=8, qat=False, seed=0, torch_threads=1)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield Served(f"http://127.0.0.1:{port}", app, xtml_tokenizer)
    server.should_exit = True
    thread.join(15)


def _post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=60)


# --------------------------------------------------------------------------- chat


def test_models_and_health(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    h = httpx.get(f"{served.url}/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["max_model_len"] == 1024
    assert h["engine"]["max_batch_size"] == 8


def test_chat_tool_call_and_reasoning(served: Served) -> None:
    """Non-streaming: the memorised turn comes back as reasoning_content + an OpenAI tool call."""
    client = served.client()
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=160,
        extra_body={"thinking_effort": "high"},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.model_extra["reasoning_content"] == REASONING
    assert not msg.content
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    prompt = XTML(served.tok).render(MESSAGES, tools=TOOLS, effort="high", add_generation_prompt=True).ids
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(XTML(served.tok).render(MESSAGES + [REPLY], tools=TOOLS, effort="high").ids) - len(prompt)
    assert resp.system_fingerprint == "k3post-v0" and resp.model == MODEL
    # reasoning_effort is an alias; high is also the server default
    alias = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=160,
                                           reasoning_effort="high")
    assert alias.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_chat_streaming_matches(served: Served) -> None:
    """Streaming: reasoning / content deltas and OpenAI-style tool_call deltas add up to the same turn."""
    client = served.client()
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=160, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
    )
    reasoning, content, finish, usage, n_lp = "", "", None, None, 0
    calls: dict[int, dict[str, Any]] = {}
    roles = []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            roles.append(d.role)
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                acc["id"] = tc.id or acc["id"]
                if tc.function is not None:
                    acc["name"] += tc.function.name or ""
                    acc["arguments"] += tc.function.arguments or ""
            if ch.logprobs is not None:
                n_lp += len(ch.logprobs.content)
            finish = ch.finish_reason or finish
    assert roles[0] == "assistant"
    assert reasoning == REASONING and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == ARGS
    assert finish == "tool_calls"
    assert usage is not None and usage.completion_tokens == n_lp > 0


def test_chat_tool_result_round_trip_and_instruct(served: Served) -> None:
    """The tool call and a tool result go back in (bound by tool_call_id); instruct mode has no reasoning."""
    client = served.client()
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=160)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning_content": REASONING, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    inst = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=1,
                                          extra_body={"thinking_effort": "none"})
    assert inst.choices[0].message.model_extra["reasoning_content"] is None


def test_seeded_sampling_reproducible(served: Served) -> None:
    client = served.client()

    def sample(seed: int, n: int = 1) -> list[str]:
        r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=1.0, seed=seed,
                                      n=n, extra_body={"ignore_eos": True})
        return [c.text for c in r.choices]

    a = sample(7)
    assert a == sample(7)
    pair = sample(7, n=2)
    assert pair[0] == a[0] and pair[1] != pair[0]  # choice 0 keeps the seed, choice 1 gets a derived one
    assert sample(8) != a
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=10,
                                           temperature=1.0, seed=3, logprobs=True) for _ in range(2)]
    lp = [[t.logprob for t in c.choices[0].logprobs.content] for c in chat]
    assert lp[0] == lp[1] and len(lp[0]) == chat[0].usage.completion_tokens


def test_concurrent_requests_are_batched(served: Served) -> None:
    """Six concurrent requests run in one batch and each gets the answer it gets alone."""
    prompts = [[9 + i, 20, 30 + 2 * i, 11] for i in range(6)]

    def body(p: list[int]) -> dict[str, Any]:
        return {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def together() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body(p)) for p in prompts))
        return [r.json() for r in rs]

    before = httpx.get(f"{served.url}/health").json()["engine"]
    batched = asyncio.run(together())
    after = httpx.get(f"{served.url}/health").json()["engine"]
    alone = [_post(served, "/v1/completions", body(p)).json() for p in prompts]
    assert [r["choices"][0]["text"] for r in batched] == [r["choices"][0]["text"] for r in alone]
    assert all(r["usage"]["completion_tokens"] == 24 for r in batched)
    assert after["peak_running"] >= 3
    # 6 x 24 tokens took far fewer than the 144 steps of one-at-a-time decoding: they were decoded together
    assert after["steps"] - before["steps"] < 6 * 24 * 3 // 4


def test_client_disconnect_aborts_the_request(served: Served) -> None:
    """Closing a streaming response mid-way aborts its engine request (the slot is freed)."""
    before = httpx.get(f"{served.url}/health").json()["engine"]["aborted"]
    body = {"prompt": [5, 6], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert any(line.startswith("data: ") for line in r.iter_lines())  # one chunk, then hang up
    deadline = time.time() + 20
    while True:
        eng = httpx.get(f"{served.url}/health").json()["engine"]
        if eng["aborted"] > before and eng["num_running"] == 0:
            break
        assert time.time() < deadline, f"the request was not aborted: {eng}"
        time.sleep(0.05)


# --------------------------------------------------------------------------- completions


def test_completions_prompt_forms_logprobs_and_stop(served: Served) -> None:
    client = served.client()
    x = XTML(served.tok)
    prompt_text = render_text(MESSAGES, tools=TOOLS, effort="high", add_generation_prompt=True)
    prompt_ids = x.render(MESSAGES, tools=TOOLS, effort="high", add_generation_prompt=True).ids
    r_text = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=160, temperature=0)
    r_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=160, temperature=0, logprobs=1)
    full = render_text(MESSAGES + [REPLY], tools=TOOLS, effort="high")
    expected = full[len(prompt_text):].removesuffix("<|end_of_msg|>")  # the stop token is not part of the text
    assert r_text.choices[0].text == r_ids.choices[0].text == expected
    assert r_text.choices[0].finish_reason == "stop" and r_text.usage.prompt_tokens == len(prompt_ids)
    lp = r_ids.choices[0].logprobs
    assert "".join(lp.tokens) == expected and len(lp.tokens) == r_ids.usage.completion_tokens - 1
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0
    # stop strings: cut before the first match, also when streaming
    cut = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=160, temperature=0, stop=["Paris"])
    assert cut.choices[0].text == expected[: expected.index("Paris")] and cut.choices[0].finish_reason == "stop"
    parts = list(client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=160, temperature=0,
                                           stop=["Paris"], stream=True))
    assert "".join(c.choices[0].text for c in parts if c.choices) == cut.choices[0].text
    assert parts[-1].choices[0].finish_reason == "stop"
    # a batch of prompts: one choice each, in order
    batch = _post(served, "/v1/completions", {"prompt": [prompt_ids, [5, 6]], "max_tokens": 4, "temperature": 0}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["text"] == decode(served.tok, x.tokenizer.encode(expected, add_special_tokens=False)[:4])


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "thinking_effort": "medium"}, 400, "thinking_effort", None),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "tool", "tool_call_id": "nope", "content": "x"}]},
         400, "messages", None),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages",
         "context_length_exceeded"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["\n"]}, 400, "stop", "unsupported_parameter"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature", None),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "sometimes"}, 400, "tool_choice", None),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}, 404, "model", "model_not_found"),
        ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 5}, 400, "logprobs", "unsupported_parameter"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 4}, 400, "echo", "unsupported_parameter"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0, "stream": True}, 400, "stream",
         "unsupported_parameter"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0, "n": 2}, 400, "n", "unsupported_parameter"),
        ("/v1/completions", {"prompt": [5] * 1100, "echo": True, "max_tokens": 0}, 400, "prompt", None),
    ],
)
def test_errors_are_openai_shaped(served: Served, path: str, body: dict[str, Any], status: int, param: str,
                                  code: str | None) -> None:
    r = _post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["message"]
    assert err["type"] == ("invalid_request_error" if status != 500 else "server_error")


def test_errors_through_openai_client(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="thinking_effort"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"thinking_effort": "huge"})
    bad = httpx.post(f"{served.url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]


# --------------------------------------------------------------------------- prompt scoring (echo)


def test_echo_scores_prompts_and_serves_an_mopd_teacher(served: Served) -> None:
    """``echo: true, max_tokens: 0`` returns each prompt's per-token log-probs under the served model (the
    same numbers as a local forward); `TeacherPool` uses this server as an endpoint teacher."""
    from k3post.rollout.teachers import TeacherPool
    from k3post.scoring import sequence_logprobs

    model = served.app.state.server.runner.engine.model
    x = XTML(served.tok)
    ids = [x.render(MESSAGES + [REPLY], tools=TOOLS, effort="high").ids, served.tok.encode("Hello there", add_special_tokens=False)]
    local = sequence_logprobs(model, ids, 4096)
    r = _post(served, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0, "total_tokens": sum(map(len, ids))}
    for c, seq, lp in zip(body["choices"], ids, local):
        got = c["logprobs"]["token_logprobs"]
        assert got[0] is None and got[1:] == pytest.approx(lp[1:], abs=1e-5)
        assert c["text"] == decode(served.tok, seq) and c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == len(seq)
        offs = c["logprobs"]["text_offset"]
        assert offs[0] == 0 and offs == sorted(offs) and offs[-1] < len(c["text"])
    # the memorised reply is near-certain under the model, the rest of the prompt is not
    r_ids = x.render(MESSAGES + [REPLY], tools=TOOLS, effort="high")
    reply_lp = [lp for lp, m in zip(local[0], r_ids.loss_mask) if m]
    assert min(reply_lp) > -0.5

    pool = TeacherPool({"served": f"{served.url}/v1#{MODEL}"})
    pos = [list(range(1, len(ids[0]))), [1, len(ids[1]) - 1]]
    for got, lp, p in zip(pool.score("served", ids, pos), local, pos):
        assert got == pytest.approx([lp[k] for k in p], abs=1e-5)
    pool.close()


def _nested_close(got: list[list[float]], want: list[list[float]], tol: float = 1e-5) -> bool:
    """Same shape, every value within ``tol`` (the JSON round trip keeps float32 values exactly; batching
    other sequences beside one moves its last bits)."""
    return [len(g) for g in got] == [len(w) for w in want] and all(
        abs(a - b) <= tol for g, w in zip(got, want) for a, b in zip(g, w))


def test_score_route_and_http_engine_score_equal_the_local_forward(served: Served) -> None:
    """The engine API's ``POST /score`` gives each sequence's log-probs after its first token under the served
    model, the numbers of `EmbeddedEngine.score` and of the model's own forward; `HTTPEngine.score` (the
    `ScoringEngine` client) returns the same through the k3post dialect, in the order given; a one-token
    sequence scores to []; a token outside the vocabulary, an empty sequence or one over max_model_len is a 400
    naming it, and the client raises it as a ValueError naming the server."""
    from k3post.scoring import sequence_logprobs
    from k3post.rollout.engine import ScoringEngine
    from k3post.rollout.http_engine import HTTPEngine

    engine = served.app.state.server.runner.engine
    x = XTML(served.tok)
    ids = [x.render(MESSAGES + [REPLY], tools=TOOLS, effort="high").ids, served.tok.encode("Hello there", add_special_tokens=False),
           [7]]
    local = [lp[1:] for lp in sequence_logprobs(engine.model, ids, 4096)]
    assert isinstance(engine, ScoringEngine) and engine.score(ids) == local and local[2] == []
    r = _post(served, "/score", {"input_ids": ids})
    assert r.status_code == 200, r.text
    assert _nested_close(r.json()["logprobs"], local) and r.json()["weight_version"] == engine.version
    vocab = served.app.state.server.vocab
    for bad, what in (([[5, vocab]], f"sequence 0, position 1: {vocab} is not a token id"), ([[]], "sequence 0 must be"),
                      ([[5, 6], [5] * 1100], "sequence 1 has 1100 tokens, more than max_model_len"),
                      ([[5, True]], "position 1: True"), ("5 6", "'input_ids' must be")):
        r = _post(served, "/score", {"input_ids": bad})
        assert r.status_code == 400 and what in r.json()["error"]["message"], (bad, r.text)
    client = HTTPEngine([served.url], dialect="k3post")
    try:
        assert isinstance(client, ScoringEngine)
        assert _nested_close(client.score(ids[::-1]), local[::-1])
        with pytest.raises(ValueError, match=f"{served.url}/score answered HTTP 400"):
            client.score([[5, vocab]])
        with pytest.raises(ValueError, match="sequence 1, position 2"):
            client.score([[5, 6], [5, 6, -1]])  # checked before anything is sent
    finally:
        client.close()


def test_runner_call_runs_on_the_engine_thread_and_raises_its_error(served: Served) -> None:
    runner = served.app.state.server.runner

    async def go() -> tuple[str, BaseException | None]:
        name = await runner.call(lambda engine: threading.current_thread().name)
        try:
            await runner.call(lambda engine: 1 // 0)
        except ZeroDivisionError as e:
            return name, e
        return name, None

    name, err = asyncio.run(go())
    assert name == "k3post-engine" and isinstance(err, ZeroDivisionError)


# --------------------------------------------------------------------------- policy, MoE, CLI


def test_openai_policy_runs_an_episode(served: Served) -> None:
    """k3post.envs.OpenAIPolicy drives a built-in task end to end through the server."""
    from k3post.envs.episode import OpenAIPolicy, run_episode_sync
    from k3post.envs.families import get_family

    fam = get_family("general.arithmetic")
    (task,) = fam.generate(1, seed=0)
    policy = OpenAIPolicy(served.url, MODEL, temperature=0.0, max_tokens=16, extra_body={"thinking_effort": "low"})
    ep = run_episode_sync(policy, fam.make_env(task), task)
    assistants = [m for m in ep.messages if m["role"] == "assistant"]
    assert assistants and all(isinstance(m["content"], str) for m in assistants)
    assert all(m["role"] in ("system", "user", "assistant", "tool") for m in ep.messages)
    assert ep.reward is not None


def test_moe_folder_with_qat_over_asgi(tmp_path: Path, xtml_tokenizer: Any) -> None:
    """A tiny Qwen3-MoE folder (as `k3post init-model` writes) served with MX QAT, via the ASGI transport."""
    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id)
    save_model(model, tmp_path / "moe", tok)
    app = build_server(tmp_path / "moe", max_batch_size=4, qat=True, torch_threads=1, api_key="sekret")
    runner = app.state.server.runner
    assert runner.engine.qat_enabled
    runner.start()

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as anon:
            denied = await anon.get("/v1/models")
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert (await anon.get("/health")).status_code == 200  # /health needs no key
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": "Bearer sekret"}) as c:
            models = await c.get("/v1/models")
            chat = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 6,
                                                        "n": 2, "seed": 1, "thinking_effort": "max",
                                                        "tool_choice": "required",
                                                        "response_format": {"type": "json_object"}})
            comp = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0})
            chat_r, comp_r = await asyncio.gather(chat, comp)
        return models, chat_r, comp_r

    try:
        models, chat, comp = asyncio.run(go())
    finally:
        runner.stop()
    assert models.json()["data"][0]["id"] == "moe"
    assert chat.status_code == 200 and [c["index"] for c in chat.json()["choices"]] == [0, 1]
    for c in chat.json()["choices"]:
        assert c["finish_reason"] in ("stop", "length", "tool_calls")
        assert set(c["message"]) >= {"role", "content", "reasoning_content"}
        assert isinstance(c["message"]["reasoning_content"], str)  # think mode: never null
    assert comp.status_code == 200 and comp.json()["usage"]["prompt_tokens"] == len(tok.encode("Hello", add_special_tokens=False))


def test_cli_parser_and_bad_folder(tmp_path: Path) -> None:
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    add_serve_parser(sub)
    ns = p.parse_args(["serve", "m", "--port", "8123", "--no-qat", "--thinking-effort", "none", "--max-batch-size", "4"])
    assert (ns.model_dir, ns.host, ns.port, ns.qat, ns.thinking_effort, ns.max_batch_size) == ("m", "127.0.0.1", 8123, False, "none", 4)
    assert p.parse_args(["serve", "m"]).qat is True
    with pytest.raises(ValueError, match="no config.json"):
        build_server(tmp_path)


def test_serve_with_a_draft_model(served: Served, tmp_path: Any) -> None:
    """``k3post serve --draft DIR``: the engine decodes speculatively (here with the served model itself as a
    classic draft model), and a greedy chat answer is the plain server's."""
    from fastapi.testclient import TestClient

    path = Path(served.app.state.server.config.model_path)
    app = build_server(path, model_name=MODEL, max_batch_size=4, qat=False, seed=0, torch_threads=1, draft=str(path),
                       num_draft_tokens=3)
    engine = app.state.server.runner.engine
    assert engine.speculative is not None and engine.speculative.num_draft_tokens == 3
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 12}
    want = _post(served, "/v1/chat/completions", body).json()["choices"][0]["message"]
    with TestClient(app) as client:
        got = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert got == want and engine.stats["spec_target_forwards"] > 0
