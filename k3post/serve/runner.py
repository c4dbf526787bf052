"""The engine-owner thread: continuous batching behind an asyncio front end.

`EngineRunner` owns one steppable engine (``EmbeddedEngine``) and drives it from a single
background thread, the only thread that ever touches the engine (it is single-threaded):

    loop:
        take new requests / aborts / calls from the thread-safe inbox  -> engine.add_request / abort / fn(engine)
        if nothing is queued or running, or generation is paused: sleep until the inbox wakes the thread
        finished = engine.step()              # admit + prefill new ones, decode one token for all
        for each streaming request: send the tokens sampled since the last step
        for each finished request:  send its GenerationResult

HTTP handlers run on an asyncio event loop. They ``submit`` a request together with an
``asyncio.Queue`` (the *sink*) and a tag; the thread hands events back with
``loop.call_soon_threadsafe(sink.put_nowait, event)``. Every request submitted while
others are in flight joins the running batch at the next step (continuous batching), so
concurrent HTTP requests are decoded together.

Events put on a sink: `TokenEvent` (new output tokens of a streaming request),
`FinishEvent` (the final result, always the last event of a request) or `ErrorEvent`
(the engine rejected or failed the request; also last).

Shape legend: none (no tensors here).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3post.rollout.engine import GenerationRequest, GenerationResult

__all__ = ["EngineRunner", "TokenEvent", "FinishEvent", "ErrorEvent", "RunnerEvent", "partial_outputs"]

log = logging.getLogger("k3post.serve")


@dataclass(frozen=True)
class TokenEvent:
    """Output tokens of request ``tag`` sampled since its previous event (streaming only).

    ``logprobs[i]`` is the raw-model log-prob of ``ids[i]`` (engine convention)."""

    tag: Any
    ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class FinishEvent:
    """Request ``tag`` finished (stop id, max_tokens, max_model_len, or aborted)."""

    tag: Any
    result: GenerationResult


@dataclass(frozen=True)
class ErrorEvent:
    """Request ``tag`` failed: the engine rejected it (ValueError) or a step raised."""

    tag: Any
    error: BaseException


RunnerEvent = TokenEvent | FinishEvent | ErrorEvent


@dataclass
class _Handle:
    """Runner-thread state of one submitted request."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    sink: "asyncio.Queue[RunnerEvent]"
    tag: Any
    stream: bool
    emitted: int = 0  # output tokens already sent as TokenEvents

    def put(self, event: RunnerEvent) -> bool:
        """Hand ``event`` to the sink's event loop; False when that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, event)
        except RuntimeError:  # event loop closed: the client is gone
            return False
        return True


def _settle(fut: "asyncio.Future[Any]", result: Any, error: BaseException | None) -> None:
    if fut.cancelled():  # the caller went away
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def partial_outputs(engine: Any) -> dict[str, tuple[list[int], list[float]]]:
    """Output ids and log-probs so far of every request holding a slot in ``engine``.

    The engine's ``partial_outputs()``; an engine without it (the step protocol does not require
    it) streams nothing until a request finishes. Only the runner thread calls this, between
    steps. The returned lists are the engine's own: read them, do not modify them.
    """
    public = getattr(engine, "partial_outputs", None)
    return public() if callable(public) else {}


@dataclass
class _Stats:
    """Counters of the runner (read by /health)."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    steps: int = 0
    generated_tokens: int = 0
    peak_running: int = 0
    started_at: float = field(default_factory=time.time)


class EngineRunner:
    """Drive a steppable engine from one background thread; async submission and results.

    Args:
        engine: an engine with ``add_request``, ``step``, ``has_unfinished``, ``abort``
            (``k3post.rollout.EmbeddedEngine``); from now on only the runner thread may use it.
        idle_wait_s: how long the idle thread sleeps between inbox checks (it is woken at
            once by a submission; this only bounds shutdown latency).
        torch_threads: ``torch.set_num_threads`` inside the engine thread (None: leave the
            default; OpenMP thread counts are per thread, so setting it in the main thread
            does not reach the engine thread).
    """

    def __init__(self, engine: Any, *, idle_wait_s: float = 0.5, torch_threads: int | None = None) -> None:
        if torch_threads is not None and (not isinstance(torch_threads, int) or torch_threads < 1):
            raise ValueError(f"torch_threads must be an int >= 1 or None, got {torch_threads!r}")
        self.torch_threads = torch_threads
        for attr in ("add_request", "step", "has_unfinished", "abort"):
            if not callable(getattr(engine, attr, None)):
                raise ValueError(f"EngineRunner needs a steppable engine; {type(engine).__name__} has no {attr}()")
        self.engine = engine
        self.idle_wait_s = float(idle_wait_s)
        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: dict[str, _Handle] = {}
        self._ids = itertools.count()
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._gen_paused = False  # written by the engine thread only

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        """True while the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "EngineRunner":
        """Start the engine thread (no-op when it already runs)."""
        if self.running:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="k3post-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still in flight are aborted and get an ErrorEvent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout_s} s (a step is still running)")
        self._thread = None

    def new_request_id(self, prefix: str = "req") -> str:
        """A request id unique within this runner."""
        return f"{prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ submission (any thread)
    def submit(
        self,
        request: GenerationRequest,
        sink: "asyncio.Queue[RunnerEvent]",
        tag: Any,
        *,
        stream: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Queue ``request``; its events go to ``sink`` (on ``loop``, default: the running
        loop), tagged ``tag``. ``stream``: also send a TokenEvent after every step that
        sampled tokens for it."""
        if not self.running:
            raise RuntimeError("the engine runner is not started (call start())")
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"submit takes a GenerationRequest, got {type(request).__name__}")
        loop = loop if loop is not None else asyncio.get_running_loop()
        self._inbox.put(("add", _Handle(request, loop, sink, tag, bool(stream))))
        self._wake.set()

    def abort(self, request_ids: Sequence[str], *, finish: bool = False) -> None:
        """Drop requests (queued or running); unknown or already finished ids are ignored.

        ``finish``: the sink of each aborted request gets a last `FinishEvent` with its
        partial result (finish_reason "abort": the tokens sampled so far); otherwise
        (the submitter is gone or stopped reading) it gets no further events."""
        for rid in request_ids:
            self._inbox.put(("abort", (rid, bool(finish))))
        self._wake.set()

    def abort_all(self, *, finish: bool = False) -> None:
        """`abort` every request in flight at the time the engine thread reads the inbox."""
        self._inbox.put(("abort", (None, bool(finish))))
        self._wake.set()

    async def pause_generation(self) -> None:
        """Stop stepping the engine (returns once no step is running); queued and running
        requests keep their state, new submissions are queued. `continue_generation`
        restarts. Aborts and `call` still run while paused."""
        await self._control("pause")

    async def continue_generation(self) -> None:
        """Restart stepping after `pause_generation` (no-op when not paused)."""
        await self._control("continue")

    @property
    def generation_paused(self) -> bool:
        """True between `pause_generation` and `continue_generation`."""
        return self._gen_paused

    async def _control(self, kind: str) -> None:
        if not self.running:
            raise RuntimeError("the engine runner is not started (call start())")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._inbox.put((kind, (loop, fut)))
        self._wake.set()
        await fut

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one request to completion (aborted if the awaiting task is cancelled)."""
        sink: asyncio.Queue[RunnerEvent] = asyncio.Queue()
        self.submit(request, sink, request.request_id)
        try:
            event = await sink.get()
        except asyncio.CancelledError:
            self.abort([request.request_id])
            raise
        if isinstance(event, ErrorEvent):
            raise event.error
        assert isinstance(event, FinishEvent)
        return event.result

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (the only thread that touches the
        engine and its model), e.g. a prefill-only scoring pass; returns its result or raises its error."""
        if not self.running:
            raise RuntimeError("the engine runner is not started (call start())")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(("call", (fn, loop, fut)))
        self._wake.set()
        return await fut

    def stats(self) -> dict[str, Any]:
        """Counters: requests submitted / finished / aborted / failed, engine steps, generated
        tokens, ``peak_running`` (most requests decoded in one step), and the engine's current
        ``num_running`` / ``num_queued``."""
        with self._lock:
            s = self._stats
            out: dict[str, Any] = {
                "requests": s.requests, "finished": s.finished, "aborted": s.aborted, "failed": s.failed,
                "steps": s.steps, "generated_tokens": s.generated_tokens, "peak_running": s.peak_running,
                "uptime_s": round(time.time() - s.started_at, 3),
            }
        out["num_running"] = int(getattr(self.engine, "num_running", 0))
        out["num_queued"] = int(getattr(self.engine, "num_queued", 0))
        out["max_batch_size"] = getattr(self.engine, "max_batch_size", None)
        out["weight_version"] = int(getattr(self.engine, "version", 0))
        out["generation_paused"] = self._gen_paused
        return out

    # ------------------------------------------------------------------ the engine thread
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                h: _Handle = item
                rid = h.request.request_id
                try:
                    if rid in self._handles:
                        raise ValueError(f"request id {rid!r} is already in flight")
                    self.engine.add_request(h.request)
                except Exception as e:  # rejected: tell the submitter
                    with self._lock:
                        self._stats.failed += 1
                    h.put(ErrorEvent(h.tag, e))
                    continue
                self._handles[rid] = h
                with self._lock:
                    self._stats.requests += 1
            elif kind == "call":
                fn, loop, fut = item
                try:
                    result, error = fn(self.engine), None
                except Exception as e:  # handed to the awaiting caller
                    result, error = None, e
                loop.call_soon_threadsafe(_settle, fut, result, error)
            elif kind in ("pause", "continue"):
                self._gen_paused = kind == "pause"
                loop, fut = item
                loop.call_soon_threadsafe(_settle, fut, None, None)
            else:
                rid, finish = item
                for r in list(self._handles) if rid is None else [rid]:
                    self._abort_one(r, finish)

    def _abort_one(self, rid: str, finish: bool) -> None:
        h = self._handles.pop(rid, None)
        if h is None:  # finished (or never added): nothing to do
            return
        try:
            partial = self.engine.abort([rid])
        except ValueError:  # not in the engine any more
            partial = []
        except Exception as e:  # the engine failed: tell the submitter, keep the thread alive
            log.exception("abort of %s failed", rid)
            h.put(ErrorEvent(h.tag, RuntimeError(f"abort failed: {type(e).__name__}: {e}")))
            with self._lock:
                self._stats.failed += 1
            return
        with self._lock:
            self._stats.aborted += 1
        if finish and partial:
            h.put(FinishEvent(h.tag, partial[0]))

    def _fail_all(self, error: BaseException) -> None:
        ids = list(self._handles)
        if ids:
            try:
                self.engine.abort(ids)
            except Exception:  # the engine is broken; nothing more to do for it
                log.exception("abort after a failed step")
        for rid in ids:
            h = self._handles.pop(rid)
            h.put(ErrorEvent(h.tag, error))
        with self._lock:
            self._stats.failed += len(ids)

    def _loop(self) -> None:
        if self.torch_threads is not None:
            import torch

            torch.set_num_threads(self.torch_threads)
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self._gen_paused or not self.engine.has_unfinished():
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                try:
                    finished = self.engine.step()
                except Exception as e:  # a broken step fails every request in flight
                    log.exception("engine step failed")
                    self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                    continue
                self._after_step(finished)
        finally:
            self._drain_inbox()
            self._fail_all(RuntimeError("the server is shutting down"))

    def _after_step(self, finished: list[GenerationResult]) -> None:
        n_running = int(getattr(self.engine, "num_running", 0)) + len(finished)
        if any(h.stream for h in self._handles.values()):
            for rid, (ids, logprobs) in partial_outputs(self.engine).items():
                h = self._handles.get(rid)
                if h is not None and h.stream and len(ids) > h.emitted:
                    h.put(TokenEvent(h.tag, list(ids[h.emitted :]), list(logprobs[h.emitted :])))
                    h.emitted = len(ids)
        n_done = 0
        for res in finished:
            h = self._handles.pop(res.request_id, None)
            if h is None:  # aborted by the client in the meantime
                continue
            n_done += 1
            if h.stream and res.num_tokens > h.emitted:
                h.put(TokenEvent(h.tag, list(res.output_ids[h.emitted :]), list(res.output_logprobs[h.emitted :])))
            h.put(FinishEvent(h.tag, res))
        with self._lock:
            s = self._stats
            s.steps += 1
            s.finished += n_done
            s.peak_running = max(s.peak_running, n_running)
            s.generated_tokens += n_running  # every request in the step sampled one token
