"""`HTTPEngine`: the steppable rollout-engine protocol over one or more engine servers.

The partial-rollout scheduler and the agent loop drive an engine through ``add_request`` /
``step`` / ``pause`` / ``resume`` / ``abort`` / ``update_weights`` (`SteppableEngine`).
`HTTPEngine` implements that protocol against ``k3post serve`` processes (the engine API of
`k3post.serve.engine_api`, SGLang's endpoint names), so the RL loop runs against engine
servers instead of the in-process `EmbeddedEngine`:

* ``add_request``: the request goes to the live server with the fewest requests in flight
  from this client (``POST /generate`` with ``return_logprob``); a background thread runs an
  asyncio loop with one ``httpx.AsyncClient`` holding every HTTP call.
* ``step``: the results that finished since the last call; blocks until at least one
  finishes while any request is running (servers step on their own, continuously).
* ``pause(ids)``: aborts the requests on their servers (``POST /abort_request``); the
  partial outputs (tokens, log-probs, versions) are kept here and returned with finish
  "paused". A request that finished on its server before the abort reached it is reported
  one token short of its end, and ``resume`` hands back its final result (the same tokens).
* ``resume(ids)``: resubmits paused requests as continuations to any live server, which
  re-prefills prompt + tokens so far and samples the rest. No KV cache crosses the wire
  (``kv_transfer = False``): KV may be lost, tokens never are; counter-based sampling makes
  the continuation draw the tokens the uninterrupted request would have.
* ``update_weights(named, version)``: the tensors are written as a ``DiskSync`` weight version
  (``k3post.distributed.weight_sync``: shards + manifest with sha256 and the servers' QAT scheme)
  to a folder every server can read (loopback / shared disk for now) and loaded by each live
  server with ``POST /update_weights_from_disk``, all at the same version. With
  ``weight_sync="distributed"`` they travel by ``torch.distributed`` broadcast instead (no disk):
  the first update creates a sync group (this process is rank 0, a ``DistributedSync`` at
  ``tcp://sync_address:<free port>``; each live server joins as rank 1, 2, ... through
  ``POST /init_weights_update_group``, all called concurrently while the group is built), and
  every update POSTs ``/update_weights_from_distributed`` to the servers concurrently while
  this thread broadcasts the buckets. All or nothing across the servers: a rejected or
  interrupted sync raises ``WeightSyncError`` naming each server's reason and leaves every
  server on its old weights and version (an interrupted group is dropped and rebuilt at the
  next update; so is a group with a server that died).

**Faults.** A call that fails at the transport level (connection refused, reset, the server
died mid-request) is retried on the same server with exponential backoff
(``backoff_s * 2**i``, capped at ``backoff_max_s``, ``max_retries`` times: `k3post.httpclient.backoff_wait`,
the one retrying client's rule); then the server is
marked dead for good and the request re-routed to the least-loaded live server, restarting
from its last known continuation (the tokens it had when it was submitted; every re-route is
logged). When no server is left, `EngineUnavailableError` names every URL. An HTTP error
answer (400 for a bad request, 500 for a failed engine step) is not retried: ``step`` raises it.

**Dialects.** ``dialect="k3post"`` (the default) is everything above. ``"sglang"`` and ``"vllm"``
drive an SGLang or a vLLM server through its own API (`k3post.rollout.server_dialects`, which
holds each wire format and its limits): a continuation is a plain re-prefill (prompt + tokens so
far, the rest of the budget), so it draws other tokens than an uninterrupted request would; new
tokens are stamped with the server's weight version of the answer (SGLang) or the version this
client last loaded (vLLM), so ``update_weights`` refuses to run while a request is running there
(pause first); a pause aborts the request (``/abort_request`` on SGLang, closing the stream on
vLLM, which streams so the tokens received are known); weights go by disk only.

Shape legend: none (token lists; ``update_weights`` takes tensors by name, any shape).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from k3post.httpclient import backoff_wait
from k3post.rollout import server_dialects
from k3post.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    KVState,
    NamedTensors,
    check_score_ids,
    generate_by_stepping,
    request_seed,
)
from k3post.routing_replay import decode_routes
from k3post.urls import is_url

__all__ = ["HTTPEngine", "EngineUnavailableError"]

log = logging.getLogger("k3post.rollout.http")


class EngineUnavailableError(RuntimeError):
    """No engine server is left (every one refused or died); the message names the URLs."""


async def _gather(coros: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coros))


class _ServerDown(Exception):
    """The server of one call is (now) dead: re-route."""


@dataclass
class _Server:
    url: str
    alive: bool = True
    load: int = 0  # requests in flight there from this client (event-loop thread only)
    max_batch_size: int = 1
    max_model_len: int = 0
    weights_ready: bool = False  # the server's weight-transfer engine is initialised (vllm dialect)


@dataclass
class _Req:
    """Client-side state of one request."""

    request: GenerationRequest  # as added (its seed made explicit)
    ids: list[int]  # the last known continuation: output tokens so far
    logprobs: list[float]
    versions: list[int]
    kv_versions: list[int]  # per output token, as `GenerationResult.output_kv_versions` (-1: the server did not say)
    state: str = "running"  # "running" | "paused"
    server: _Server | None = None
    wire_rid: str | None = None  # the rid of the current /generate call
    calls: int = 0
    future: concurrent.futures.Future[GenerationResult] | None = None
    pausing: bool = False
    final: GenerationResult | None = None  # finished on its server before a pause reached it
    history: list[str] = field(default_factory=list)  # servers it ran on, in order
    halt: asyncio.Event | None = None  # set to close a streamed call (vllm dialect), keeping what arrived

    def partial(self, finish: str) -> GenerationResult:
        r = self.request
        return GenerationResult(r.request_id, list(r.prompt_ids), list(self.ids), list(self.logprobs),
                                list(self.versions), finish, list(self.kv_versions))  # type: ignore[arg-type]


class HTTPEngine:
    """A `SteppableEngine` over ``k3post serve`` engine servers (module doc).

    Args:
        urls: base URLs of the servers (``http://127.0.0.1:8000``), at least one.
        seed: engine seed for requests whose ``SamplingParams.seed`` is None (the seed is
            derived here, ``request_seed(seed, request_id)``, so it does not depend on the server).
        max_retries: transport-level retries on one server before it is marked dead.
        backoff_s / backoff_max_s: first retry delay and its cap (doubling in between).
        connect_timeout_s: timeout of a TCP connect.
        read_timeout_s: longest wait for one ``/generate`` answer (None: no limit; a
            generation may take long, and a server that dies closes its connections).
        weights_dir: folder for ``update_weights``' safetensors file (default: a temporary
            folder); it must be readable by every server at the same path.
        shard_mb: most MB per safetensors shard written by ``update_weights``.
        abort_timeout_s: longest wait for aborted requests' ``/generate`` calls to answer in
            ``pause`` / ``abort`` (a live server answers at its next step); then RuntimeError.
        weight_sync: ``"disk"`` (safetensors in ``weights_dir``) or ``"distributed"``
            (broadcast, gloo; buckets of at most ``shard_mb`` MB) (module doc).
        sync_address: the address servers reach this process at for the ``distributed`` group.
        sync_timeout_s: longest wait of a ``distributed`` rendezvous or collective (a server that
            refuses before joining makes the trainer wait this long).
        dialect: the servers' API: ``"k3post"``, ``"sglang"`` or ``"vllm"`` (module doc;
            `k3post.rollout.server_dialects`). ``sglang`` / ``vllm`` need ``weight_sync="disk"``.
        default_stop_ids: stop ids of requests whose ``SamplingParams.stop_ids`` is None on an
            SGLang / vLLM server (None: the server's own EOS ids; a k3post server has its own default).
        server_slots: requests one SGLang / vLLM server runs at once when it does not report it
            (vLLM never does: its ``--max-num-seqs``).
        transport: the httpx transport (tests replay recorded servers through ``httpx.MockTransport``).
        api_key: sent as ``Authorization: Bearer <api_key>`` on every call (a ``k3post serve --api-key``
            server wants it on the engine API too; SGLang / vLLM servers started with a key on theirs);
            default: the ``K3POST_API_KEY`` environment variable, when set.
    """

    kv_transfer = False
    """No KV cache crosses the wire: paused requests re-prefill (the scheduler then keeps no
    engine-resident KV bookkeeping and never calls ``export_kv``)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        seed: int = 0,
        max_retries: int = 3,
        backoff_s: float = 0.1,
        backoff_max_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        weights_dir: str | Path | None = None,
        shard_mb: float = 512,
        abort_timeout_s: float = 60.0,
        weight_sync: str = "disk",
        sync_address: str = "127.0.0.1",
        sync_timeout_s: float = 300.0,
        dialect: str = "k3post",
        default_stop_ids: Sequence[int] | None = None,
        server_slots: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        record_routes: bool = False,
    ) -> None:
        if isinstance(urls, str) or not urls or not all(is_url(u) for u in urls):
            raise ValueError(f"urls must be a non-empty list of http(s):// base URLs, got {urls!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"urls has duplicates: {list(urls)}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if not (backoff_s >= 0 and backoff_max_s >= backoff_s):
            raise ValueError(f"need 0 <= backoff_s <= backoff_max_s, got {backoff_s} and {backoff_max_s}")
        self._close_hooks: list[Callable[[], None]] = []
        self.seed = int(seed)
        self.max_retries = max_retries
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.abort_timeout_s = float(abort_timeout_s)
        self.shard_mb = float(shard_mb)
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync must be 'disk' or 'distributed', got {weight_sync!r}")
        self.weight_sync = weight_sync
        self.dialect = server_dialects.make_dialect(dialect)
        if dialect != "k3post" and weight_sync != "disk":
            raise ValueError(f"weight_sync={weight_sync!r} is not available with dialect={dialect!r}: its servers "
                             "receive broadcasts in their own protocol, not k3post's DistributedSync buckets; use "
                             "weight_sync='disk'")
        if record_routes and dialect != "k3post":
            raise ValueError(f"record_routes (routing replay) needs k3post serve --record-routes servers: the {dialect} "
                             "dialect returns no routed experts")
        self.record_routes = bool(record_routes)
        self.default_stop_ids = None if default_stop_ids is None else [int(t) for t in default_stop_ids]
        self.server_slots = server_slots
        self.sync_address, self.sync_timeout_s = sync_address, float(sync_timeout_s)
        self._sync: Any = None  # the DistributedSync of the current group
        self._sync_group: str | None = None
        self._sync_servers: list[_Server] = []  # rank i + 1 of the group
        self.last_sync_stats: Any = None  # SyncStats of the last distributed update
        self._servers = [_Server(u.rstrip("/")) for u in urls]
        self._reqs: dict[str, _Req] = {}
        self._finished: OrderedDict[str, GenerationResult | BaseException] = OrderedDict()
        self._cond = threading.Condition()
        self.stats: dict[str, int] = {
            "requests": 0, "reroutes": 0, "reroute_kept_tokens": 0, "retries": 0, "dead_servers": 0, "pauses": 0,
        }
        self.calls_per_server: Counter[str] = Counter()  # /generate calls sent to each URL
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="k3post-http-engine", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        key = api_key if api_key is not None else os.environ.get("K3POST_API_KEY") or None
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self._client: httpx.AsyncClient = self._call(self._make_client(timeout, limits, transport, headers))
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """Read every server's model info; the unreachable ones are marked dead."""
        infos = self._call(_gather([self._info(s) for s in self._servers]))
        live = [(s, i) for s, i in zip(self._servers, infos) if i is not None]
        if not live:
            raise EngineUnavailableError(f"no engine server reachable: {', '.join(s.url for s in self._servers)}")
        versions = {int(i["weight_version"]) for _, i in live}
        if len(versions) > 1:
            log.warning("engine servers are at different weight versions %s; using the newest", sorted(versions))
        self._version = max(versions)
        schemes = {json.dumps(i.get("qat"), sort_keys=True) for _, i in live}
        if len(schemes) > 1:
            raise ValueError(f"engine servers run different QAT schemes: {sorted(schemes)}")
        self._qat: dict[str, Any] | None = live[0][1].get("qat")
        for s, i in live:
            s.max_batch_size = int(i.get("max_batch_size") or 1)
            s.max_model_len = int(i["max_model_len"])

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    async def _make_client(timeout: httpx.Timeout, limits: httpx.Limits,
                           transport: httpx.AsyncBaseTransport | None,
                           headers: dict[str, str] | None) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport, headers=headers)

    def _call(self, coro: Any) -> Any:
        """Run a coroutine on the client's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _backoff(self, attempt: int) -> None:
        self.stats["retries"] += 1
        await asyncio.sleep(backoff_wait(attempt, self.backoff_s, self.backoff_max_s))

    def _mark_dead(self, server: _Server, error: BaseException) -> None:
        if server.alive:
            server.alive = False
            self.stats["dead_servers"] += 1
            log.warning("engine server %s marked dead after %d retries (%s: %s)", server.url, self.max_retries,
                        type(error).__name__, error)

    async def _post(self, server: _Server, path: str, body: dict[str, Any] | None = None, *, get: bool = False) -> httpx.Response:
        """One call with transport-level retries; raises _ServerDown once the server is dead."""
        for attempt in range(self.max_retries + 1):
            if not server.alive:
                raise _ServerDown(server.url)
            try:
                if get:
                    return await self._client.get(server.url + path)
                return await self._client.post(server.url + path, json=body)
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    self._mark_dead(server, e)
                    raise _ServerDown(server.url) from e
                await self._backoff(attempt)
        raise AssertionError("unreachable")

    async def _info(self, server: _Server) -> dict[str, Any] | None:
        """The server's model info in k3post's shape (its dialect reads its own endpoints)."""
        answers: dict[str, Any] = {}
        for call in self.dialect.info_calls():
            try:
                r = await self._post(server, call.path, get=True)
            except _ServerDown:
                return None
            if r.status_code != 200:
                raise ValueError(f"{server.url}{call.path} answered {r.status_code}: not a {self.dialect.name} engine "
                                 f"server ({r.text[:200]})")
            answers[call.path] = r.json()
        return self.dialect.parse_info(server.url, answers, server_slots=self.server_slots)

    def _live(self) -> list[_Server]:
        return [s for s in self._servers if s.alive]

    def _pick(self) -> _Server:
        live = self._live()
        if not live:
            raise EngineUnavailableError(
                f"no engine server left: {', '.join(s.url + ' (dead)' for s in self._servers)}")
        return min(live, key=lambda s: s.load)  # ties: the first in the given order

    # ------------------------------------------------------------------ public state
    @property
    def version(self) -> int:
        """Policy version of the servers (set by ``update_weights``)."""
        return self._version

    @property
    def urls(self) -> list[str]:
        """Every server URL, as given."""
        return [s.url for s in self._servers]

    @property
    def live_urls(self) -> list[str]:
        """The servers not marked dead."""
        return [s.url for s in self._live()]

    @property
    def max_batch_size(self) -> int:
        """Slots over the live servers (the scheduler's default concurrency bound)."""
        return max(1, sum(s.max_batch_size for s in self._live()))

    @property
    def max_model_len(self) -> int:
        """Smallest max_model_len of the live servers."""
        return min((s.max_model_len for s in self._live()), default=0)

    def has_unfinished(self) -> bool:
        """True while any request is running (its result not yet returned by ``step``)."""
        return any(rq.state == "running" for rq in self._reqs.values())

    def server_of(self, request_id: str) -> str | None:
        """URL of the server a running request was last sent to (None when not running)."""
        rq = self._reqs.get(request_id)
        return rq.server.url if rq is not None and rq.server is not None and rq.state == "running" else None

    # ------------------------------------------------------------------ requests
    def add_request(self, request: GenerationRequest, kv: KVState | None = None) -> None:
        """Send ``request`` to the least-loaded live server. ``kv`` is ignored (no KV
        transfer: the server prefills the whole context, with identical results)."""
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"add_request takes a GenerationRequest, got {type(request).__name__}")
        rid = request.request_id
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already running or paused in this engine")
        n = len(request.prompt_ids) + len(request.given_ids)
        if n >= self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt + given tokens = {n} positions leave no room under "
                             f"max_model_len={self.max_model_len}")
        if request.sampling.seed is None:
            sampling = dataclasses.replace(request.sampling, seed=request_seed(self.seed, rid))
            request = dataclasses.replace(request, sampling=sampling)
        rq = _Req(request, list(request.given_ids), list(request.given_logprobs), list(request.given_versions),
                  list(request.given_kv_versions))
        self._reqs[rid] = rq
        self.stats["requests"] += 1
        self._launch(rq)

    def _launch(self, rq: _Req) -> None:
        rq.state = "running"
        rq.future = asyncio.run_coroutine_threadsafe(self._drive(rq), self._loop)
        rq.future.add_done_callback(lambda f, rq=rq: self._on_done(rq, f))

    def _on_done(self, rq: _Req, fut: concurrent.futures.Future[GenerationResult]) -> None:
        with self._cond:
            if rq.pausing:  # pause() / abort() collect it themselves
                return
            err = fut.exception()
            self._finished[rq.request.request_id] = err if err is not None else fut.result()
            self._cond.notify_all()

    async def _drive(self, rq: _Req) -> GenerationResult:
        """Run one request to its end on some server, re-routing when its server dies."""
        while True:
            server = self._pick()
            rq.server = server
            rq.history.append(server.url)
            self.calls_per_server[server.url] += 1
            server.load += 1
            try:
                return await self._generate_on(server, rq)
            except _ServerDown:
                if rq.pausing:  # being paused anyway: keep what is known
                    return rq.partial("abort")
                self.stats["reroutes"] += 1
                self.stats["reroute_kept_tokens"] += len(rq.ids)
                live = self._live()
                log.warning("re-routing request %s from dead server %s to %s (restarting from %d tokens)",
                            rq.request.request_id, server.url, min(live, key=lambda s: s.load).url if live else "none",
                            len(rq.ids))
            finally:
                server.load -= 1

    async def _generate_on(self, server: _Server, rq: _Req) -> GenerationResult:
        if self.dialect.name != "k3post":
            return await self._generate_dialect(server, rq)
        r = rq.request
        sp = r.sampling
        rq.calls += 1
        rq.wire_rid = f"{r.request_id}~{rq.calls}"  # fresh per call: a retry never collides with an old call
        params: dict[str, Any] = {
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_tokens,
            "ignore_eos": sp.ignore_eos, "seed": sp.seed,
        }
        if sp.stop_ids is not None:
            params["stop_ids"] = list(sp.stop_ids)
        body = {
            "rid": rq.wire_rid, "input_ids": list(r.prompt_ids), "sampling_params": params, "return_logprob": True,
            "continuation": {"output_ids": rq.ids, "output_logprobs": rq.logprobs, "output_versions": rq.versions},
        }
        resp = await self._post(server, "/generate", body)
        if resp.status_code != 200:
            raise RuntimeError(f"{server.url}/generate answered {resp.status_code} for request "
                               f"{r.request_id!r}: {resp.text[:500]}")
        return self._result(rq, resp.json(), server.url, self.record_routes)

    @staticmethod
    def _result(rq: _Req, d: dict[str, Any], url: str, want_routes: bool = False) -> GenerationResult:
        r = rq.request
        ids = [int(t) for t in d["output_ids"]]
        meta = d["meta_info"]
        pairs = meta["output_token_logprobs"]
        if [int(p[1]) for p in pairs] != ids or len(meta["versions"]) != len(ids):
            raise RuntimeError(f"{url}/generate: request {r.request_id!r}: output_token_logprobs / versions do not "
                               "match output_ids")
        if ids[: len(rq.ids)] != rq.ids:
            raise RuntimeError(f"{url}/generate: request {r.request_id!r}: the output does not start with the "
                               f"{len(rq.ids)} continuation tokens sent")
        finish = meta["finish_reason"]["type"]
        # the continuation's KV versions are known here (the server re-prefilled it: its own say -1 for them)
        kv = [int(v) for v in meta.get("kv_versions") or [-1] * len(ids)]
        if len(kv) != len(ids):
            raise RuntimeError(f"{url}/generate: request {r.request_id!r}: kv_versions do not match output_ids")
        kv[: len(rq.kv_versions)] = rq.kv_versions
        routes = None
        if want_routes:
            if not isinstance(meta.get("routes"), str):
                raise RuntimeError(f"{url}/generate returned no routes for request {r.request_id!r}: routing replay "
                                   "needs servers started with k3post serve --record-routes")
            routes = decode_routes(meta["routes"], f"{url}/generate meta_info.routes")
        return GenerationResult(r.request_id, list(r.prompt_ids), ids, [float(p[0]) for p in pairs],
                                [int(v) for v in meta["versions"]], finish, kv, routes)

    async def _generate_dialect(self, server: _Server, rq: _Req) -> GenerationResult:
        """One SGLang / vLLM generate call continuing ``rq`` from its tokens so far; the new
        tokens are appended to ``rq`` as they arrive (a pause or a re-route keeps them)."""
        r = rq.request
        rq.calls += 1
        rq.wire_rid = uuid.uuid4().hex  # fixed width: never a prefix of another rid (SGLang aborts by prefix)
        call = self.dialect.generate_call(rq.wire_rid, r, rq.ids, self.default_stop_ids)
        if not self.dialect.streams:
            resp = await self._post(server, call.path, call.body)
            if resp.status_code != 200:
                raise RuntimeError(f"{server.url}{call.path} answered {resp.status_code} for request "
                                   f"{r.request_id!r}: {resp.text[:500]}")
            piece = self.dialect.parse_generate(server.url, r.request_id, resp.json(), self._version)
            self._extend(rq, piece)
            return rq.partial(piece.finish or "abort")
        return await self._stream_on(server, rq, call)

    @staticmethod
    def _extend(rq: _Req, piece: server_dialects.Piece) -> None:
        rq.ids += piece.ids
        rq.logprobs += piece.logprobs
        rq.versions += piece.versions
        rq.kv_versions += [-1] * len(piece.ids)  # SGLang / vLLM do not say

    async def _stream_on(self, server: _Server, rq: _Req, call: server_dialects.Call) -> GenerationResult:
        """A streamed generate call (vllm): deltas are kept as they arrive; ``rq.halt`` closes the
        stream (vLLM aborts the request on disconnect) and returns what arrived, finish "abort"."""
        r = rq.request
        halt = rq.halt = asyncio.Event()
        dialect: Any = self.dialect

        async def read() -> str:
            async with self._client.stream("POST", server.url + call.path, json=call.body,
                                           headers=call.headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"{server.url}{call.path} answered {resp.status_code} for request "
                                       f"{r.request_id!r}: {text[:500]}")
                async for line in resp.aiter_lines():
                    piece = dialect.parse_stream_line(server.url, r.request_id, line, self._version)
                    if piece is None:
                        continue
                    self._extend(rq, piece)
                    if piece.finish is not None:
                        return piece.finish
            raise server_dialects.DialectError(f"{server.url}{call.path} (request {r.request_id!r}): the stream "
                                               "ended without a finish_reason")

        for attempt in range(self.max_retries + 1):
            if not server.alive:
                raise _ServerDown(server.url)
            task = asyncio.ensure_future(read())
            stop = asyncio.ensure_future(halt.wait())
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not task.done():  # halted: close the stream, keep what arrived
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return rq.partial("abort")
            try:
                return rq.partial(task.result())
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    self._mark_dead(server, e)
                    raise _ServerDown(server.url) from e
                await self._backoff(attempt)
                rq.calls += 1
                rq.wire_rid = uuid.uuid4().hex
                call = self.dialect.generate_call(rq.wire_rid, r, rq.ids, self.default_stop_ids)
        raise AssertionError("unreachable")

    def step(self) -> list[GenerationResult]:
        """The results that finished since the last call (finish "stop" / "length"); blocks
        until at least one is there while any request is running. Raises the error of a
        failed request (`EngineUnavailableError` when no server is left)."""
        with self._cond:
            if not self.has_unfinished():
                return []
            while not self._finished:
                self._cond.wait(1.0)
            items = list(self._finished.items())
            self._finished.clear()
        out: list[GenerationResult] = []
        error: BaseException | None = None
        for rid, item in items:
            self._reqs.pop(rid, None)
            if isinstance(item, BaseException):
                error = error or item
            else:
                out.append(item)
        if error is not None:
            raise error
        return out

    def _stop(self, request_ids: Sequence[str], what: str) -> list[_Req]:
        """Bring running requests to a halt (abort on their servers), keeping their tokens;
        a request that had finished keeps its result in ``final``."""
        if isinstance(request_ids, str):
            raise ValueError(f"{what} takes a sequence of request ids, not a single str")
        wanted = list(dict.fromkeys(request_ids))
        unknown = [r for r in wanted if r not in self._reqs]
        if unknown:
            raise ValueError(f"{what}: unknown request ids {unknown} (not running or paused)")
        halting: list[_Req] = []
        with self._cond:
            for rid in wanted:
                rq = self._reqs[rid]
                if rq.state != "running":
                    continue
                item = self._finished.pop(rid, None)
                if isinstance(item, BaseException):
                    raise item
                if item is not None:
                    rq.final = item
                else:
                    rq.pausing = True
                    halting.append(rq)
        if halting:
            self._call(self._abort_remote(halting))
        for rq in halting:
            res = rq.future.result() if rq.future is not None else rq.partial("abort")
            rq.pausing = False
            if res.finish_reason == "abort":
                rq.ids, rq.logprobs, rq.versions = list(res.output_ids), list(res.output_logprobs), list(res.output_versions)
                rq.kv_versions = list(res.output_kv_versions)
            else:
                rq.final = res
        return [self._reqs[r] for r in wanted]

    async def _abort_remote(self, reqs: list[_Req]) -> None:
        """Abort each request on its server until its /generate call has answered (an abort
        that overtakes its /generate finds nothing there: it is sent again)."""
        pending = [rq for rq in reqs if rq.future is not None]
        deadline = self._loop.time() + self.abort_timeout_s
        while pending:
            if self._loop.time() > deadline:
                where = sorted({rq.server.url for rq in pending if rq.server is not None})
                raise RuntimeError(f"aborted requests {[rq.request.request_id for rq in pending]} got no answer from "
                                   f"{where} within {self.abort_timeout_s} s")
            for rq in pending:
                if rq.halt is not None:  # a streamed call: closing it aborts the request on its server
                    rq.halt.set()
                    continue
                if rq.server is not None and rq.server.alive and rq.wire_rid is not None:
                    call = self.dialect.abort_call(rq.wire_rid)
                    if call is None:
                        continue
                    try:
                        await self._client.post(rq.server.url + call.path, json=call.body)
                    except httpx.TransportError:
                        pass  # the server is going away: its /generate call fails and returns the partial
            await asyncio.sleep(0.05)
            pending = [rq for rq in pending if rq.future is not None and not rq.future.done()]

    def pause(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Stop running requests, keeping their tokens, log-probs and versions here; partial
        results with finish "paused" (module doc: a request that had already finished is
        reported one token short, and ``resume`` returns its final result)."""
        already = [r for r in request_ids if r in self._reqs and self._reqs[r].state == "paused"]
        if already:
            raise ValueError(f"pause: requests {already} are already paused")
        out = []
        for rq in self._stop(request_ids, "pause"):
            if rq.final is not None:  # the last token stays with the final result
                f = rq.final
                rq.ids, rq.logprobs, rq.versions = f.output_ids[:-1], f.output_logprobs[:-1], f.output_versions[:-1]
                rq.kv_versions = f.output_kv_versions[:-1]
            rq.state = "paused"
            rq.future = None
            self.stats["pauses"] += 1
            out.append(rq.partial("paused"))
        return out

    def resume(self, request_ids: Sequence[str]) -> None:
        """Resubmit paused requests as continuations (to any live server), in the given order."""
        if isinstance(request_ids, str):
            raise ValueError("resume takes a sequence of request ids, not a single str")
        missing = [r for r in request_ids if r not in self._reqs or self._reqs[r].state != "paused"]
        if missing:
            raise ValueError(f"resume: requests {missing} are not paused in this engine")
        for rid in dict.fromkeys(request_ids):
            rq = self._reqs[rid]
            if rq.final is not None:
                rq.state = "running"
                with self._cond:
                    self._finished[rid] = rq.final
                    self._cond.notify_all()
                rq.final = None
            else:
                self._launch(rq)

    def abort(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Drop running or paused requests; partial results (finish "abort")."""
        out = []
        for rq in self._stop(request_ids, "abort"):
            f = rq.final
            out.append(rq.partial("abort") if f is None else dataclasses.replace(f, finish_reason="abort"))
            del self._reqs[rq.request.request_id]
        return out

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results in request order (the engine must be idle)."""
        return generate_by_stepping(self, requests)

    def score(self, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """`k3post.rollout.engine.ScoringEngine.score` on the servers (their dialect's scoring call: ``/score`` on
        ``k3post serve``, a prefill-only ``/generate`` on SGLang, an ``echo`` completion on vLLM): the sequences
        are split over the live servers, one call each; the share of a server that dies is scored again on
        another. A server's refusal (HTTP 4xx / 5xx) is a ValueError naming it and its message; every answer is
        checked (`server_dialects`: one finite log-prob per token after the first, the token ids echoed)."""
        seqs = check_score_ids(ids, max_model_len=self.max_model_len)  # the servers check the vocabulary
        out: list[list[float]] = [[] for _ in seqs]

        async def on(server: _Server, idx: list[int]) -> list[list[float]]:
            chunk = [seqs[i] for i in idx]
            call = self.dialect.score_call(chunk)
            r = await self._post(server, call.path, call.body)
            if r.status_code != 200:
                raise ValueError(f"score: {server.url}{call.path} answered HTTP {r.status_code}: {r.text[:300]}")
            return self.dialect.parse_score(server.url, r.json(), chunk)

        async def spread(idx: list[int]) -> list[Any]:
            live = self._live()
            if not live:
                raise EngineUnavailableError(f"no engine server left: {', '.join(s.url + ' (dead)' for s in self._servers)}")
            parts = [(s, idx[k::len(live)]) for k, s in enumerate(live)]
            results = await asyncio.gather(*[on(s, p) for s, p in parts if p], return_exceptions=True)
            return list(zip([p for _, p in parts if p], results))

        pending = list(range(len(seqs)))
        while pending:
            retry: list[int] = []
            for idx, res in self._call(spread(pending)):
                if isinstance(res, _ServerDown):
                    retry += idx
                elif isinstance(res, BaseException):
                    raise res
                else:
                    for i, lps in zip(idx, res):
                        out[i] = lps
            pending = retry
        return out

    def export_kv(self, request_id: str) -> KVState:
        """Not supported: no KV cache crosses the wire (``kv_transfer = False``)."""
        raise ValueError(f"export_kv({request_id!r}): HTTPEngine cannot transfer KV caches (kv_transfer = False)")

    def import_kv(self, request_id: str, kv: KVState) -> None:
        """Not supported: no KV cache crosses the wire (``kv_transfer = False``)."""
        raise ValueError(f"import_kv({request_id!r}): HTTPEngine cannot transfer KV caches (kv_transfer = False)")

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Write the tensors (by HF parameter name) as a ``DiskSync`` weight version (safetensors
        shards + manifest with sha256 and the servers' QAT scheme) and load it on every live
        server at ``version`` (default current + 1); returns the new version."""
        from k3post.distributed.weight_sync import DiskSync
        from k3post.quant.qat import QATConfig

        new = self._version + 1 if version is None else int(version)
        if new <= self._version:
            raise ValueError(f"update_weights: version {new} must exceed the current version {self._version}")
        self._check_idle("update_weights")
        items = list(named_tensors.items()) if hasattr(named_tensors, "items") else list(named_tensors)  # type: ignore[union-attr]
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"update_weights: {name} is a {type(t).__name__}, not a tensor")
        qat = QATConfig(**self._qat) if self._qat is not None else None
        if not items and self.dialect.name != "k3post":  # nothing to load: only the version moves
            return self._run_weight_calls(self.dialect.version_calls(new), new, "update_weights")
        if self.weight_sync == "distributed":
            return self._update_distributed([(name, t.detach().to("cpu").contiguous()) for name, t in items], new, qat)
        items = [(name, t.detach().to("cpu").contiguous().clone()) for name, t in items]  # clone: no shared storage
        if self.weights_dir is not None:
            self.weights_dir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="k3post-weights-", dir=self.weights_dir))
        try:
            stats = DiskSync(root, shard_mb=self.shard_mb, qat=qat).push(items, new)
            return self.update_weights_from_disk(stats.location or root, new)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def init_weights_update_group(self) -> None:
        """Create the ``distributed`` sync group with every live server (module doc); a no-op when
        it exists. Raises WeightSyncError naming the servers that could not join."""
        import socket

        from k3post.distributed.weight_sync import DistributedSync, WeightSyncError
        from k3post.quant.qat import QATConfig

        if self._sync is not None:
            return
        live = self._live()
        if not live:
            raise EngineUnavailableError(f"no engine server left: {', '.join(s.url + ' (dead)' for s in self._servers)}")
        with socket.socket() as sock:
            sock.bind((self.sync_address, 0))
            port = int(sock.getsockname()[1])
        name, world = f"k3post-{uuid.uuid4().hex[:8]}", 1 + len(live)

        async def join(rank: int, s: _Server) -> str | None:
            body = {"master_address": self.sync_address, "master_port": port, "rank_offset": rank, "world_size": world,
                    "group_name": name, "backend": "gloo", "timeout_s": self.sync_timeout_s}
            try:
                r = await self._post(s, "/init_weights_update_group", body)
            except _ServerDown:
                return f"{s.url}: unreachable"
            return None if r.status_code == 200 else f"{s.url}: {r.json().get('message', r.text)}"

        joins = asyncio.run_coroutine_threadsafe(_gather([join(i + 1, s) for i, s in enumerate(live)]), self._loop)
        qat = QATConfig(**self._qat) if self._qat is not None else None
        try:  # blocks until every server joined (they are called concurrently above)
            sync = DistributedSync(f"tcp://{self.sync_address}:{port}", world, bucket_mb=self.shard_mb, qat=qat,
                                   timeout_s=self.sync_timeout_s)
        except Exception as e:  # noqa: BLE001 - reported with the servers' answers
            errors = [x for x in joins.result() if x]
            raise WeightSyncError(f"weight-sync group of {world} ranks not formed ({type(e).__name__}: {e}); "
                                  + ("; ".join(errors) or "every server answered the join")) from e
        errors = [x for x in joins.result() if x]
        if errors:
            sync.close(notify=False)
            raise WeightSyncError("init_weights_update_group failed on " + "; ".join(errors))
        self._sync, self._sync_group, self._sync_servers = sync, name, live
        log.info("weight-sync group %s: trainer + %d servers at tcp://%s:%d", name, len(live), self.sync_address, port)

    def destroy_weights_update_group(self) -> None:
        """Leave the ``distributed`` sync group (``/destroy_weights_update_group`` on its live
        servers); the next update creates a new one."""
        sync, servers, name = self._sync, self._sync_servers, self._sync_group
        self._sync, self._sync_group, self._sync_servers = None, None, []
        if sync is None:
            return

        async def leave(s: _Server) -> None:
            try:
                await self._post(s, "/destroy_weights_update_group", {"group_name": name})
            except _ServerDown:
                pass

        self._call(_gather([leave(s) for s in servers if s.alive]))
        sync.close(notify=False)

    def _update_distributed(self, items: list[tuple[str, torch.Tensor]], new: int, qat: Any) -> int:
        """One broadcast sync to every server of the group at version ``new`` (module doc)."""
        from k3post.distributed.weight_sync import WeightSyncError

        if self._sync is not None and not all(s.alive for s in self._sync_servers):
            log.warning("a server of weight-sync group %s died: building a new group", self._sync_group)
            self.destroy_weights_update_group()
        self.init_weights_update_group()
        servers = self._sync_servers
        body = {"names": [n for n, _ in items], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items], "group_name": self._sync_group, "weight_version": new,
                "flush_cache": True}

        async def one(s: _Server) -> str | None:
            try:
                r = await self._post(s, "/update_weights_from_distributed", body)
            except _ServerDown:
                return f"{s.url}: died during the sync"
            return None if r.status_code == 200 else f"{s.url}: {r.json().get('message', r.text)}"

        answers = asyncio.run_coroutine_threadsafe(_gather([one(s) for s in servers]), self._loop)
        error: WeightSyncError | None = None
        try:
            stats = self._sync.push(items, new)
        except (WeightSyncError, ValueError) as e:
            error = e if isinstance(e, WeightSyncError) else WeightSyncError(str(e))
        errors = [x for x in answers.result() if x]
        if error is None and not errors:
            self.last_sync_stats = stats
            self._version = new
            return new
        if self._sync._broken is not None:  # interrupted: the group is unusable
            self.destroy_weights_update_group()
        ranks = ", ".join(f"rank {i + 1} = {s.url}" for i, s in enumerate(servers))
        raise WeightSyncError(f"update_weights_from_distributed to version {new} failed, every server keeps version "
                              f"{self._version}: " + "; ".join(errors or [str(error)]) + f" ({ranks})")

    def _check_idle(self, what: str) -> None:
        """SGLang / vLLM stamp a response with one version, so weights must not change under a
        running request there (module doc): ValueError naming the running requests."""
        running = [rid for rid, rq in self._reqs.items() if rq.state == "running"]
        if self.dialect.name != "k3post" and running:
            raise ValueError(f"{what}: requests {running[:8]}{' ...' if len(running) > 8 else ''} are running on "
                             f"{self.dialect.name} servers, which cannot version tokens across an update: pause or "
                             "finish them first")

    def update_weights_from_disk(self, model_path: str | Path, version: int | None = None) -> int:
        """Load the weights of folder ``model_path`` on every live server with the same version
        (default current + 1): ``POST /update_weights_from_disk`` (k3post, SGLang) or vLLM's
        weight-transfer calls (`server_dialects`). Raises ValueError naming the servers that refused
        (they keep their old weights and version; the next update repairs them)."""
        new = self._version + 1 if version is None else int(version)
        path = str(Path(model_path).resolve())
        if self.dialect.name == "k3post":
            calls = [server_dialects.Call("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": new})]
        else:
            calls = self.dialect.init_weight_calls() + self.dialect.disk_update_calls(path, new)
        return self._run_weight_calls(calls, new, "update_weights_from_disk")

    def _run_weight_calls(self, calls: list[server_dialects.Call], new: int, what: str) -> int:
        """Make ``calls`` in order on every live server (concurrently across servers) and move to
        version ``new``; a server's init calls run once (``weights_ready``)."""
        if new <= self._version:
            raise ValueError(f"{what}: version {new} must exceed the current version {self._version}")
        self._check_idle(what)
        init = {c.path for c in self.dialect.init_weight_calls()} if self.dialect.name != "k3post" else set()

        async def one(s: _Server) -> str | None:
            for call in calls:
                if call.path in init and s.weights_ready:
                    continue
                try:
                    r = await self._post(s, call.path, call.body)
                except _ServerDown:
                    return None  # dead: it gets no more requests
                if self.dialect.name == "k3post":
                    if r.status_code != 200:
                        return f"{s.url}: {r.json().get('message', r.text)}"
                    continue
                try:
                    d: Any = r.json()
                except ValueError:
                    d = r.text[:500]
                failure = self.dialect.update_failure(s.url, call, r.status_code, d)
                if failure is not None:
                    return failure
                if call.path in init:
                    s.weights_ready = True
            return None

        errors = [e for e in self._call(_gather([one(s) for s in self._live()])) if e]
        if not self._live():
            raise EngineUnavailableError(f"no engine server left: {', '.join(s.url + ' (dead)' for s in self._servers)}")
        if errors:
            raise ValueError(f"{what} to version {new} failed on " + "; ".join(errors))
        self._version = new
        return new

    # ------------------------------------------------------------------ lifecycle
    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the engine closes, after its client stopped (e.g. stop servers it owns)."""
        self._close_hooks.append(fn)

    def close(self) -> None:
        """Abort what is still running on the servers, stop the client thread, then run the `on_close`
        hooks (each once)."""
        try:
            self._close_client()
        finally:
            hooks, self._close_hooks = self._close_hooks, []
            for fn in reversed(hooks):
                fn()

    def _close_client(self) -> None:
        if not self._thread.is_alive():
            return
        if self._sync is not None:
            try:
                self.destroy_weights_update_group()
            except Exception:  # noqa: BLE001 - closing: the servers may be gone
                log.warning("close(): could not destroy the weight-sync group")
        running = [rid for rid, rq in self._reqs.items() if rq.state == "running"]
        if running:
            try:
                self.abort(running)
            except Exception:  # noqa: BLE001 - closing: the servers may be gone
                log.warning("close(): could not abort %d running requests", len(running))
        client = getattr(self, "_client", None)
        if client is not None:
            self._call(client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> "HTTPEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
