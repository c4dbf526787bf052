"""The one retrying HTTP client: what every k3post caller of a remote model shares.

Callers: OpenAI-compatible teachers (`k3post.synth.teachers.EndpointTeacher`), the GRM judge behind a URL
(`k3post.rewards.grm.PolicyJudge.from_url`), MOPD teachers behind a URL (`k3post.stages.mopd.Teachers`) and the
HTTP rollout engine's per-server retries (`k3post.rollout.http_engine`, which adds rerouting and dead
servers on top and retries transport errors only: a status is the engine's answer). One rule for all:

- **Retried**: HTTP `RETRY_STATUS` (408 / 409 / 425 / 429 / 500 / 502 / 503 / 504) and httpx transport errors
  (connection refused or reset, timeouts, a server closing the connection mid-response).
- **Waits**: attempt k (from 0) waits ``min(backoff_s * 2**k, max_backoff_s)`` (`backoff_wait`), or the
  server's ``Retry-After`` (seconds or an HTTP date) when that is longer, capped at ``max_backoff_s``.
- **Counted**: `RetryStats` (requests, attempts, retries, failures) per transport.

`RetryTransport` is an httpx transport for both clients: ``httpx.AsyncClient(transport=async_transport(t))``
and ``httpx.Client(transport=sync_transport(t))`` (`retrying_client` builds the latter). Each attempt uses a
fresh connection and reads the body before handing the response back, so a client closing the transport never
cuts a response short. The async side limits requests in flight (``concurrency``, a semaphore per event loop).
"""

from __future__ import annotations

import asyncio
import email.utils
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = ["RETRY_STATUS", "RetryStats", "RetryTransport", "async_transport", "backoff_wait", "retrying_client",
           "sync_transport"]

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
"""HTTP statuses a retry may cure (timeouts, conflicts, rate limits, an overloaded or restarting server)."""


def backoff_wait(attempt: int, backoff_s: float, max_backoff_s: float, retry_after: str | None = None) -> float:
    """Seconds to wait after failed attempt ``attempt`` (from 0): ``min(backoff_s * 2**attempt, max_backoff_s)``,
    or the ``Retry-After`` header's value (seconds or an HTTP date) when longer, capped at ``max_backoff_s``."""
    wait = min(backoff_s * (2**attempt), max_backoff_s)
    if retry_after:
        try:
            ra = float(retry_after)
        except ValueError:
            try:  # an HTTP date
                ra = max(0.0, email.utils.parsedate_to_datetime(retry_after).timestamp() - time.time())
            except (TypeError, ValueError):
                ra = 0.0
        wait = max(wait, min(ra, max_backoff_s))
    return wait


@dataclass
class RetryStats:
    """Counters of a `RetryTransport` (shared by all requests through it)."""

    requests: int = 0  # logical requests
    attempts: int = 0  # HTTP attempts, retries included
    retries: int = 0  # attempts beyond the first
    failures: int = 0  # requests that still failed after all retries


class RetryTransport:
    """Retries transient failures (module doc) for httpx's async and sync clients.

    Wrap it with `async_transport` / `sync_transport` to hand it to a client (httpx checks the type)."""

    def __init__(
        self,
        *,
        concurrency: int = 8,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        inner_factory: Any = None,
        sync_inner_factory: Any = None,
    ) -> None:
        """Args:
            concurrency: async requests in flight at once (an asyncio semaphore, per event loop).
            retries: extra attempts after the first.
            backoff_s: first wait; doubles per retry.
            max_backoff_s: cap on one wait.
            inner_factory / sync_inner_factory: ``() -> httpx.AsyncBaseTransport`` / ``httpx.BaseTransport``
                for each attempt (default ``httpx.AsyncHTTPTransport`` / ``httpx.HTTPTransport``).
        """
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative int, got {retries!r}")
        if not backoff_s >= 0 or not max_backoff_s >= 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s!r}, {max_backoff_s!r}")
        self.concurrency = concurrency
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.inner_factory = inner_factory
        self.sync_inner_factory = sync_inner_factory
        self.stats = RetryStats()
        self._lock = threading.Lock()  # the counters, from sync clients on several threads
        self._sems: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.concurrency)
        return sem

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _next_wait(self, attempt: int, resp: "httpx.Response | None") -> float | None:
        """None when the outcome of ``attempt`` is final (a response not to retry, or no retry left), else the wait
        before the next attempt (counted as a retry). ``resp`` None: a transport error."""
        if resp is not None and resp.status_code not in RETRY_STATUS:
            return None
        if attempt >= self.retries:
            self._count(failures=1)
            return None
        self._count(retries=1)
        return backoff_wait(attempt, self.backoff_s, self.max_backoff_s, None if resp is None else resp.headers.get("retry-after"))

    async def _attempt(self, request: "httpx.Request") -> "httpx.Response":
        import httpx

        inner = self.inner_factory() if self.inner_factory is not None else httpx.AsyncHTTPTransport()
        async with inner:
            resp = await inner.handle_async_request(request)
            body = await resp.aread()
            await resp.aclose()
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    def _attempt_sync(self, request: "httpx.Request") -> "httpx.Response":
        import httpx

        inner = self.sync_inner_factory() if self.sync_inner_factory is not None else httpx.HTTPTransport()
        with inner:
            resp = inner.handle_request(request)
            body = resp.read()
            resp.close()
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    async def handle_async_request(self, request: "httpx.Request") -> "httpx.Response":
        """Send ``request`` with retries (httpx's async transport interface)."""
        import httpx

        self._count(requests=1)
        async with self._semaphore():
            attempt = 0
            while True:
                self._count(attempts=1)
                try:
                    resp: httpx.Response | None = await self._attempt(request)
                except httpx.TransportError:
                    if (wait := self._next_wait(attempt, None)) is None:
                        raise
                else:
                    if (wait := self._next_wait(attempt, resp)) is None:
                        return resp  # type: ignore[return-value]
                attempt += 1
                await asyncio.sleep(wait)

    def handle_request(self, request: "httpx.Request") -> "httpx.Response":
        """Send ``request`` with retries (httpx's sync transport interface; no concurrency limit: a sync
        client sends one request at a time per thread)."""
        import httpx

        self._count(requests=1)
        attempt = 0
        while True:
            self._count(attempts=1)
            try:
                resp: httpx.Response | None = self._attempt_sync(request)
            except httpx.TransportError:
                if (wait := self._next_wait(attempt, None)) is None:
                    raise
            else:
                if (wait := self._next_wait(attempt, resp)) is None:
                    return resp  # type: ignore[return-value]
            attempt += 1
            time.sleep(wait)

    async def aclose(self) -> None:
        """Nothing to close: every attempt owns its connection."""

    def close(self) -> None:
        """Nothing to close: every attempt owns its connection."""


def async_transport(t: RetryTransport) -> Any:
    """``t`` as a real ``httpx.AsyncBaseTransport`` (for ``httpx.AsyncClient(transport=...)``)."""
    import httpx

    class _Async(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await t.handle_async_request(request)

        async def aclose(self) -> None:
            await t.aclose()

    return _Async()


def sync_transport(t: RetryTransport) -> Any:
    """``t`` as a real ``httpx.BaseTransport`` (for ``httpx.Client(transport=...)``)."""
    import httpx

    class _Sync(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return t.handle_request(request)

        def close(self) -> None:
            t.close()

    return _Sync()


def retrying_client(timeout_s: float, retry: RetryTransport | None = None) -> "httpx.Client":
    """A sync ``httpx.Client`` whose requests go through ``retry`` (default `RetryTransport()`)."""
    import httpx

    return httpx.Client(timeout=timeout_s, transport=sync_transport(retry if retry is not None else RetryTransport()))
