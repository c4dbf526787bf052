"""The one retrying HTTP client (`k3post.httpclient`): its wait rule, both client kinds, and its callers
(MOPD endpoint teachers had no retry before it; the judge's transport-failure test uses its status set)."""

from __future__ import annotations

import asyncio
import email.utils
import time

import httpx
import pytest

from k3post.httpclient import RETRY_STATUS, RetryTransport, async_transport, backoff_wait, retrying_client


def test_backoff_wait_doubles_caps_and_honours_retry_after() -> None:
    assert [backoff_wait(k, 0.5, 30.0) for k in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff_wait(0, 0.5, 30.0, "2") == 2.0  # longer than the backoff: the server's word
    assert backoff_wait(3, 0.5, 30.0, "2") == 4.0  # shorter: the backoff
    assert backoff_wait(0, 0.5, 30.0, "100") == 30.0  # capped
    assert backoff_wait(0, 0.5, 30.0, "soon") == 0.5  # unreadable: ignored
    past = email.utils.formatdate(time.time() - 60, usegmt=True)
    assert backoff_wait(1, 0.5, 30.0, past) == 1.0
    future = email.utils.formatdate(time.time() + 10, usegmt=True)
    assert 8.0 <= backoff_wait(0, 0.5, 30.0, future) <= 10.0


def _flaky(statuses: list[int], seen: list[str]) -> httpx.MockTransport:
    """Answers the given statuses in turn (the last one from then on)."""
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content.decode())
        code = statuses[min(len(seen) - 1, len(statuses) - 1)]
        return httpx.Response(code, json={"n": len(seen)}, headers={"retry-after": "0"})
    return httpx.MockTransport(handler)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_retries_transient_statuses_then_answers(kind: str) -> None:
    seen: list[str] = []
    t = RetryTransport(retries=3, backoff_s=0.0, max_backoff_s=0.0, inner_factory=lambda: _flaky([503, 429, 200], seen),
                       sync_inner_factory=lambda: _flaky([503, 429, 200], seen))
    if kind == "sync":
        with retrying_client(5.0, t) as client:
            resp = client.post("http://x.invalid/v1/completions", json={"a": 1})
    else:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=async_transport(t)) as client:
                return await client.post("http://x.invalid/v1/completions", json={"a": 1})
        resp = asyncio.run(go())
    assert resp.status_code == 200 and resp.json() == {"n": 3} and seen == ['{"a":1}'] * 3  # the body re-sent each time
    assert (t.stats.requests, t.stats.attempts, t.stats.retries, t.stats.failures) == (1, 3, 2, 0)


def test_a_final_status_is_returned_at_once_and_exhausted_retries_count_a_failure() -> None:
    seen: list[str] = []
    t = RetryTransport(retries=2, backoff_s=0.0, max_backoff_s=0.0, sync_inner_factory=lambda: _flaky([400], seen))
    with retrying_client(5.0, t) as client:
        assert client.get("http://x.invalid/").status_code == 400
    assert (t.stats.attempts, t.stats.retries, t.stats.failures) == (1, 0, 0) and 400 not in RETRY_STATUS
    seen.clear()
    t = RetryTransport(retries=2, backoff_s=0.0, max_backoff_s=0.0, sync_inner_factory=lambda: _flaky([502], seen))
    with retrying_client(5.0, t) as client:
        assert client.get("http://x.invalid/").status_code == 502  # the last answer, after 1 + 2 attempts
    assert (t.stats.attempts, t.stats.retries, t.stats.failures) == (3, 2, 1)


def test_transport_errors_are_retried_then_raised() -> None:
    calls: list[int] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    t = RetryTransport(retries=2, backoff_s=0.0, max_backoff_s=0.0, sync_inner_factory=lambda: httpx.MockTransport(refuse))
    with retrying_client(5.0, t) as client, pytest.raises(httpx.ConnectError):
        client.get("http://x.invalid/")
    assert len(calls) == 3 and t.stats.failures == 1
    with pytest.raises(ValueError, match="retries must be a non-negative int"):
        RetryTransport(retries=-1)


def test_mopd_endpoint_teacher_retries_a_busy_server() -> None:
    """A teacher behind a URL answered 503 once: scored on the retry (before the one client it raised at once)."""
    from k3post.rollout.teachers import TeacherPool

    answers = iter([httpx.Response(503, text="busy"),
                    httpx.Response(200, json={"choices": [{"index": 0, "logprobs": {"token_logprobs": [None, -0.5, -0.25]}}]})])
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        bodies.append(json.loads(request.content))
        return next(answers)

    retry = RetryTransport(retries=2, backoff_s=0.0, max_backoff_s=0.0, sync_inner_factory=lambda: httpx.MockTransport(handler))
    pool = TeacherPool({"general.max": "http://teacher.invalid/v1#served"}, retry=retry)
    try:
        assert pool.score("general.max", [[5, 6, 7]], [[1, 2]]) == [[-0.5, -0.25]]
    finally:
        pool.close()
    assert len(bodies) == 2 and bodies[0]["model"] == "served" and bodies[0]["echo"] is True
    assert (retry.stats.requests, retry.stats.retries) == (1, 1) and pool.stats["endpoint_requests"] == 1


def test_judge_transport_failure_uses_the_clients_status_set() -> None:
    """What the client retries and, still failing, makes the judge unavailable are one set."""
    from k3post.envs.episode import EndpointHTTPError
    from k3post.rewards.grm import judge_transport_failure

    for code in RETRY_STATUS:
        assert judge_transport_failure(EndpointHTTPError(code, "x")), code
    for code in (400, 401, 404, 422, 501):
        assert not judge_transport_failure(EndpointHTTPError(code, "x")), code
