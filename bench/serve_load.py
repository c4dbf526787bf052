"""`k3post serve` under load: N concurrent clients on loopback against the tiny model (issue 20).

    python bench/serve_load.py [--clients 16] [--requests 400] [--duration 90] [--model DIR]

Starts ``python -m k3post serve`` on a fresh ``k3post init-model`` folder (or ``--model``) as a child
process, then runs ``--clients`` asyncio clients that together send ``--requests`` requests (or stop at
``--duration`` seconds, whichever is first; the run stops by itself well within 3 minutes by default).
Each request is drawn, seeded, from a mix:

- ``chat``: a valid chat completion; ``stream``: the same streamed to ``[DONE]``;
- ``tools``: a chat with tools declared and a tool-call / tool-result history (``tool_choice`` set);
- ``completion``: ``/v1/completions`` on token ids;
- ``cancel``: a stream read to its first chunk, then the connection closed;
- ``malformed``: one of `MALFORMED` (bad JSON, wrong types, unknown roles, over-limit ``n`` /
  ``max_tokens`` / body, out-of-vocabulary prompt ids, invalid UTF-8, tool-call arguments that are not
  JSON, ...), each of which must be answered with a 4xx.

Printed: requests/s, p50 / p99 latency of the answered valid requests, counts by kind and by class
(``2xx``, ``4xx:<code>``, ``5xx:<code>``, ``exc:<type>``, ``cancelled``), the server's RSS at start and
its peak (``VmHWM`` of /proc), whether it is healthy afterwards (``/health`` 200, nothing left running,
one more chat answered), and the machine state (`bench.common.machine_state`). The last line is JSON.

Shape legend: none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine_state  # noqa: E402

MODEL = "tiny"
USER = [{"role": "user", "content": "How is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_HISTORY = USER + [
    {"role": "assistant", "content": "", "reasoning_content": "look it up",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
]  # fmt: skip
BODY_LIMIT = 64 * 1024  # --limit max_body_bytes for the run: an over-limit body is cheap to send


def _chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": max_tokens, "temperature": 1.0, **extra}


# name -> (body bytes or JSON, content type); every one must get a 4xx
MALFORMED: dict[str, Any] = {
    "not_json": b"{not json",
    "empty_body": b"",
    "invalid_utf8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "array_body": [],
    "messages_string": {"model": MODEL, "messages": "hello"},
    "unknown_role": {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
    "content_number": {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
    "n_over_limit": _chat(4, n=10_000),
    "max_tokens_over_limit": _chat(10**9),
    "max_tokens_negative": _chat(-3),
    "temperature_string": _chat(4, temperature="hot"),
    "bad_effort": _chat(4, thinking_effort="medium"),
    "body_too_large": {"model": MODEL, "messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 10)}]},
    "prompt_ids_out_of_vocab": {"model": MODEL, "prompt": [1, 10**9], "max_tokens": 4},
    "prompt_ids_negative": {"model": MODEL, "prompt": [-1, 5], "max_tokens": 4},
    "prompt_nested": {"model": MODEL, "prompt": [[[1]]], "max_tokens": 4},
    "tool_result_no_call": {"model": MODEL, "max_tokens": 4, "messages": USER + [
        {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
    "tool_call_not_dict": {"model": MODEL, "max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": "", "tool_calls": ["f"]}]},
    "tools_not_list": _chat(4, tools="get_weather"),
    "body_nested_deeply": b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "max_tokens_nan": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}',
    "max_tokens_bool": _chat(True),
    "n_float": _chat(4, n=1.5),
    "stream_string": _chat(4, stream="yes"),
    "message_null": {"model": MODEL, "messages": [None]},
    "prompt_float_ids": {"model": MODEL, "prompt": [1.5, 2], "max_tokens": 4},
    "prompt_empty": {"model": MODEL, "prompt": [], "max_tokens": 4},
    "logprobs_string": _chat(4, logprobs="yes"),
    "unknown_model": {"model": "gpt-4", "messages": USER},
}  # fmt: skip
VALID = ("chat", "stream", "tools", "completion")
KINDS = {"chat": 3, "stream": 3, "tools": 2, "completion": 2, "cancel": 2, "malformed": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_kib(pid: int, field: str) -> int | None:
    """A ``VmRSS`` / ``VmHWM`` (peak RSS) line of /proc/PID/status in KiB; None if unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def start_server(model_dir: Path, port: int, max_tokens: int, max_inflight: int | None, log: Path) -> subprocess.Popen:
    """``python -m k3post serve`` with one torch thread and a small body limit; returns once /health is up."""
    cmd = [sys.executable, "-m", "k3post", "serve", str(model_dir), "--port", str(port), "--model-name", MODEL,
           "--threads", "1", "--no-qat", "--log-level", "warning", "--default-max-tokens", str(max_tokens),
           "--limit", f"max_body_bytes={BODY_LIMIT}"]  # fmt: skip
    if max_inflight is not None:
        cmd += ["--limit", f"max_inflight={max_inflight}"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not come up in 120 s: {log.read_text()[-2000:]}")
        time.sleep(0.2)


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, max_tokens: int) -> tuple[str, str]:
    """Send one request of ``kind``; returns (kind or malformed:<name>, class)."""
    if kind == "malformed":
        name = rng.choice(sorted(MALFORMED))
        body = MALFORMED[name]
        path = "/v1/completions" if "prompt" in name else "/v1/chat/completions"
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await client.post(path, content=content, headers={"content-type": "application/json"})
        return f"malformed:{name}", _cls(r.status_code, r.headers)
    if kind == "completion":
        body = {"model": MODEL, "prompt": [rng.randrange(6, 300) for _ in range(rng.randint(1, 40))],
                "max_tokens": max_tokens, "temperature": 1.0}
        r = await client.post("/v1/completions", json=body)
        return kind, _cls(r.status_code, r.headers)
    if kind == "tools":
        body = {"model": MODEL, "messages": TOOL_HISTORY, "tools": TOOLS, "max_tokens": max_tokens,
                "tool_choice": rng.choice(["auto", "required", "none"])}
        r = await client.post("/v1/chat/completions", json=body)
        return kind, _cls(r.status_code, r.headers)
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json=_chat(max_tokens, thinking_effort=rng.choice(["low", "none"])))
        return kind, _cls(r.status_code, r.headers)
    stream = _chat(max_tokens if kind == "stream" else 1000, stream=True, ignore_eos=kind == "cancel")
    async with client.stream("POST", "/v1/chat/completions", json=stream) as r:
        if r.status_code != 200:
            await r.aread()
            return kind, _cls(r.status_code, r.headers)
        async for line in r.aiter_lines():
            if kind == "cancel" and line.startswith("data: "):
                return kind, "cancelled"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return kind, "2xx"
            if line.startswith("data: ") and '"error"' in line:
                return kind, "stream_error"
    return kind, "stream_unterminated"


def _cls(status: int, headers: httpx.Headers | None = None) -> str:
    """``2xx`` or ``<h>xx:<status>``; a 429 without ``Retry-After`` is ``4xx:429-no-retry-after``."""
    if status == 429 and headers is not None and "retry-after" not in headers:
        return "4xx:429-no-retry-after"
    return "2xx" if status < 300 else f"{status // 100}xx:{status}"


async def load(url: str, clients: int, requests: int, duration: float, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """Run the clients; one record per request: kind, class, latency (s)."""
    records: list[dict[str, Any]] = []
    issued = 0
    stop_at = time.perf_counter() + duration
    kinds, weights = list(KINDS), list(KINDS.values())

    async def worker(i: int) -> None:
        nonlocal issued
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
            while issued < requests and time.perf_counter() < stop_at:
                issued += 1
                kind = rng.choices(kinds, weights)[0]
                t0 = time.perf_counter()
                try:
                    name, cls = await one_request(client, kind, rng, max_tokens)
                except httpx.HTTPError as e:
                    name, cls = kind, f"exc:{type(e).__name__}"
                records.append({"kind": name, "class": cls, "latency_s": time.perf_counter() - t0})

    await asyncio.gather(*(worker(i) for i in range(clients)))
    return records


def healthy_after(url: str, max_tokens: int) -> dict[str, Any]:
    """/health is 200 with nothing left running (cancelled streams were aborted), and a chat is answered."""
    deadline = time.time() + 30
    eng: dict[str, Any] = {}
    while time.time() < deadline:
        r = httpx.get(f"{url}/health", timeout=10)
        eng = r.json().get("engine", {})
        if r.status_code == 200 and eng.get("num_running", 0) == 0 and eng.get("num_waiting", 0) == 0:
            break
        time.sleep(0.2)
    chat = httpx.post(f"{url}/v1/chat/completions", json=_chat(max_tokens), timeout=60)
    return {"health_status": r.status_code, "left_running": eng.get("num_running"), "aborted": eng.get("aborted"),
            "chat_after_status": chat.status_code}


def run(model_dir: Path | None, clients: int, requests: int, duration: float, max_tokens: int, seed: int,
        max_inflight: int | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        if model_dir is None:
            from k3post.recipes.commands import init_model

            model_dir = init_model(Path(tmp) / "model", preset="tiny", seed=seed)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(model_dir, port, max_tokens, max_inflight, Path(tmp) / "server.log")
        rss_MiB: list[float] = []  # sampled every 0.25 s during the load
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                kib = proc_kib(proc.pid, "VmRSS")
                if kib:
                    rss_MiB.append(kib / 1024)

        sampler = threading.Thread(target=sample, daemon=True)
        try:
            rss_start = proc_kib(proc.pid, "VmRSS")
            sampler.start()
            t0 = time.perf_counter()
            records = asyncio.run(load(url, clients, requests, duration, max_tokens, seed))
            wall = time.perf_counter() - t0
            done.set()
            after = healthy_after(url, max_tokens)
            rss_end, rss_peak = proc_kib(proc.pid, "VmRSS"), proc_kib(proc.pid, "VmHWM")
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        server_log = (Path(tmp) / "server.log").read_text()
    valid = [r for r in records if r["kind"] in VALID and r["class"] == "2xx"]
    lat_ms = sorted(r["latency_s"] * 1000 for r in valid)
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r["kind"].split(":")[0], Counter())[r["class"]] += 1
    malformed = Counter(r["kind"].split(":", 1)[1] + " " + r["class"] for r in records if r["kind"].startswith("malformed:"))
    return {
        "clients": clients, "requests": len(records), "wall_s": round(wall, 2),
        "requests_per_s": round(len(records) / wall, 2),
        "latency_p50_ms": round(statistics.median(lat_ms), 1) if lat_ms else None,
        "latency_p99_ms": round(lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))], 1) if lat_ms else None,
        "by_class": dict(Counter(r["class"] for r in records)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "valid_5xx": sum(1 for r in records if r["kind"] in VALID and r["class"].startswith("5xx")),
        "valid_unanswered": sum(1 for r in records if r["kind"] in VALID and r["class"].startswith(("exc", "stream_"))),
        "malformed_not_4xx": sorted({k for k in malformed if " 4xx:" not in k}),
        "server_rss_start_mib": round(rss_start / 1024, 1) if rss_start else None,
        "server_rss_end_mib": round(rss_end / 1024, 1) if rss_end else None,
        "server_rss_peak_mib": round(rss_peak / 1024, 1) if rss_peak else None,
        # RSS after the first quarter of the load (warm) and at its end: growth under steady load
        "server_rss_warm_mib": round(rss_MiB[len(rss_MiB) // 4], 1) if rss_MiB else None,
        "server_rss_load_end_mib": round(rss_MiB[-1], 1) if rss_MiB else None,
        **after,
        "server_tracebacks": server_log.count("Traceback"),
        "machine": machine_state(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--requests", type=int, default=1500, help="requests in all (the run stops at this count)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds at most (the run stops then)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each generating request")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: a fresh k3post init-model tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-inflight", type=int, default=None,
                   help="serve --limit max_inflight=N (small: valid requests meet 429 + Retry-After)")
    a = p.parse_args(argv)
    if a.clients < 1 or a.requests < 1 or a.duration <= 0:
        raise SystemExit("--clients, --requests and --duration must be positive")
    out = run(a.model, a.clients, a.requests, a.duration, a.max_tokens, a.seed, a.max_inflight)
    for key in ("requests", "wall_s", "requests_per_s", "latency_p50_ms", "latency_p99_ms", "server_rss_start_mib",
                "server_rss_warm_mib", "server_rss_load_end_mib", "server_rss_peak_mib", "valid_5xx", "valid_unanswered", "malformed_not_4xx"):
        print(f"{key}: {out[key]}")
    print(f"by_kind: {out['by_kind']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
