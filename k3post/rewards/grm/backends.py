"""Judge backends (`JudgeBackend`): `PolicyJudge` (any episode policy, an OpenAI-compatible URL through the retrying
client), `EngineJudge` (judge episodes as `AgentLoop` trajectories on a steppable engine), and `run_judgements`
(retries an invalid judgement, then counts it a tie). See `k3post.rewards.grm` for the whole design."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from k3post.envs.env import EpisodeLimits
from k3post.constants import Policy
from k3post.envs.episode import run_episode
from k3post.envs.task import Task, Verdict
from k3post.errors import JudgeUnavailableError, infra_kind
from k3post.rewards.grm.protocol import GRMJudgeEnv, judgement_reason

if TYPE_CHECKING:
    from k3post.rollout.engine import SamplingParams, SteppableEngine
    from k3post.rollout.trajectory import Trajectory
    from k3post.xtml import XTML

log = logging.getLogger("k3post.rewards.grm")


# =========================================================================== backends


@runtime_checkable
class JudgeBackend(Protocol):
    """Runs judge episodes: one `judge_task` each, in `GRMJudgeEnv`, to a verdict per task."""

    def run(self, tasks: Sequence[Task]) -> list[Verdict]:
        """The judge-env verdict of one fresh episode per task, in order."""
        ...


class PolicyJudge:
    """Judge episodes driven by an episode policy through `run_episode` (up to ``concurrency`` at once).

    The policy is anything `run_episode` accepts: a scripted program, `OpenAIPolicy` for an
    OpenAI-compatible endpoint (`from_url`), ... Exceptions of the policy propagate: a broken judge
    must not silently turn rewards into ties. A transport failure after the transport's retries (the
    server unreachable, the connection lost, an overloaded answer: `judge_transport_failure`) is raised
    as `JudgeUnavailableError`: the RL loop then gives the group no reward (`k3post.rewards.judge.group_rewards`).
    """

    def __init__(self, policy: Policy, *, concurrency: int = 8, limits: EpisodeLimits | None = None) -> None:
        """Args:
            policy: ``policy(messages, tools) -> assistant message`` (sync or async).
            concurrency: judge episodes in flight at once.
            limits: per-episode limits of the judge env (default: `GRMJudgeEnv`'s).
        """
        if not callable(policy):
            raise ValueError("policy must be callable: (messages, tools) -> assistant message")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        self.policy = policy
        self.concurrency = concurrency
        self.limits = limits

    @classmethod
    def from_url(
        cls,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        concurrency: int = 8,
        retries: int = 4,
        backoff_s: float = 0.5,
        timeout_s: float = 120.0,
        limits: EpisodeLimits | None = None,
    ) -> "PolicyJudge":
        """A judge behind an OpenAI-compatible ``/v1/chat/completions`` endpoint: `OpenAIPolicy` over the
        retrying client's `k3post.httpclient.RetryTransport` (``concurrency`` requests in flight, ``retries`` with backoff)."""
        from k3post.envs.episode import OpenAIPolicy
        from k3post.httpclient import RetryTransport, async_transport

        transport = async_transport(RetryTransport(concurrency=concurrency, retries=retries, backoff_s=backoff_s))
        policy = OpenAIPolicy(base_url, model, api_key, temperature=temperature, max_tokens=max_tokens,
                              timeout_s=timeout_s, transport=transport)
        return cls(policy, concurrency=concurrency, limits=limits)

    async def _run_all(self, tasks: Sequence[Task]) -> list[Verdict]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(task: Task) -> Verdict:
            async with sem:
                try:
                    ep = await run_episode(self.policy, GRMJudgeEnv(self.limits), task)
                except Exception as e:
                    if judge_transport_failure(e):
                        raise JudgeUnavailableError(f"the GRM judge did not answer: {type(e).__name__}: {e}") from e
                    raise
            assert ep.verdict is not None
            return ep.verdict

        return list(await asyncio.gather(*(one(t) for t in tasks)))

    def run(self, tasks: Sequence[Task]) -> list[Verdict]:
        """One episode per task (runs its own event loop: call it outside a running loop)."""
        return asyncio.run(self._run_all(list(tasks))) if tasks else []


class EngineJudge:
    """Judge episodes as `AgentLoop` trajectories on a steppable engine (e.g. `EmbeddedEngine`).

    Each batch of tasks is one `AgentLoop.run`: rendered to XTML with the judge tools, decoded
    together, parsed, dispatched to `GRMJudgeEnv`, verified. A trajectory that ends without a
    verdict (finish ``malformed``, ``length`` or ``context``) is an invalid judgement whose reason is
    that finish. Trajectory seeds come from ``seed``, a batch counter and the task's position, so
    a retry samples afresh.
    """

    def __init__(
        self,
        engine: "SteppableEngine",
        xtml: "XTML",
        *,
        sampling: "SamplingParams | None" = None,
        effort: str | None = None,
        mode: str = "think",
        seed: int = 0,
        limits: EpisodeLimits | None = None,
    ) -> None:
        """Args:
            engine: the engine holding the judge model (idle between `run` calls).
            xtml: the XTML codec of the judge model's tokenizer.
            sampling: per-turn sampling (default `SamplingParams(max_tokens=512)`).
            effort / mode: XTML thinking effort and mode of the judge's prompt.
            seed: base sampling seed.
            limits: per-episode limits of the judge env (default: `GRMJudgeEnv`'s).
        """
        from k3post.rollout.agent_loop import AgentLoop
        from k3post.rollout.engine import SamplingParams

        self.limits = limits
        self.seed = int(seed)
        self.loop = AgentLoop(engine, xtml, lambda task: GRMJudgeEnv(self.limits),
                              sampling=sampling or SamplingParams(max_tokens=512), effort=effort, mode=mode)
        self.batches = 0

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        qat: bool = False,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        engine: Any = None,
        served: bool = False,
        **kwargs: Any,
    ) -> "EngineJudge":
        """Load a local checkpoint folder (model + XTML tokenizer) into the engine of ``engine`` (an
        `EngineConfig`; default: embedded; over ``http`` the judge gets launched servers of its own, or with
        ``served`` uses the servers in ``engine.urls``, started for this checkpoint: the judge actors on Ray).

        ``qat`` runs the experts MX fake-quantized (as the policy's rollouts do); other keyword
        arguments go to the constructor.
        """
        from k3post.quant.qat import QATConfig
        from k3post.rollout.factory import build_engine
        from k3post.tokenizer import load_tokenizer
        from k3post.xtml import XTML

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: not a model folder (no config.json)")
        tok = load_tokenizer(path, require_xtml=True)
        eng = build_engine(path, tok, engine=engine, role="GRM judge", max_batch_size=max_batch_size,
                           max_model_len=max_model_len, served=served, qat=QATConfig() if qat else None)
        return cls(eng, XTML(tok), **kwargs)

    def run(self, tasks: Sequence[Task]) -> list[Verdict]:
        """One trajectory per task, all decoded together."""
        from k3post.rollout.agent_loop import trajectory_seed
        from k3post.rollout.trajectory import Trajectory

        b = self.batches
        self.batches += 1
        trajs = [
            Trajectory(traj_id=f"grm{b}/s{k}", group_id=b, sample_index=k, seed=trajectory_seed(self.seed, b, k),
                       task=t.to_dict())
            for k, t in enumerate(tasks)
        ]
        # an episode that ended before its env could verify it carries a reward-0 verdict whose diagnostics
        # start with its finish ("malformed: ...", "length: ..."): no "valid" component, so it is retried
        out = []
        try:
            done = self.loop.run(trajs)
        except Exception as e:
            self._abandon(trajs)
            if judge_transport_failure(e):  # the judge's engine servers are gone (after their retries)
                raise JudgeUnavailableError(f"the GRM judge's engine did not answer: {type(e).__name__}: {e}") from e
            raise
        for t in done:
            if t.infra is not None:
                raise JudgeUnavailableError(f"judge episode {t.traj_id}: infrastructure failure ({t.infra})")
            assert t.verdict is not None, f"{t.traj_id} finished without a verdict"
            out.append(Verdict.from_dict(t.verdict))
        return out

    def _abandon(self, trajs: Sequence["Trajectory"]) -> None:
        """After a failed batch: abort its requests still in the engine and release its envs, so the next
        batch finds the engine idle (a dead engine's abort is best effort)."""
        live = [self.loop.request_id(t) for t in trajs if not t.done]
        try:
            if live and self.loop.engine.has_unfinished():
                self.loop.engine.abort(live)
        except Exception as e:  # noqa: BLE001 - the engine is what failed; the next batch will say so again
            log.warning("GRM judge: could not abort %d requests after a failed batch: %s", len(live), e)
        for t in trajs:
            self.loop.release(t.traj_id)

    def close(self) -> None:
        """Release the agent loop (its event loop and any live env) and the engine."""
        from k3post.rollout.factory import close_engine

        self.loop.close()
        close_engine(self.loop.engine)


def judge_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause) says the judge could not be reached, not that it answered wrongly: an
    `k3post.errors.InfrastructureError`, an httpx transport error (connection refused or reset, a timeout),
    `k3post.rollout.http_engine.EngineUnavailableError` (every judge server dead), or an HTTP status the
    retrying client retries (`k3post.envs.episode.EndpointHTTPError` with a `k3post.httpclient.RETRY_STATUS`:
    408 / 409 / 425 / 429 / 500 / 502 / 503 / 504) still failing."""
    import httpx

    from k3post.envs.episode import EndpointHTTPError
    from k3post.httpclient import RETRY_STATUS
    from k3post.rollout.http_engine import EngineUnavailableError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if infra_kind(e) is not None or isinstance(e, (httpx.TransportError, EngineUnavailableError)):
            return True
        if isinstance(e, EndpointHTTPError) and e.status in RETRY_STATUS:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


# =========================================================================== running judgements


@dataclass
class JudgementOutcome:
    """One judgement after retries: the valid verdict (None if every attempt was invalid), the
    attempts made and the reason of each invalid attempt."""

    verdict: Verdict | None
    attempts: int
    invalid_reasons: list[str]


def run_judgements(backend: JudgeBackend, tasks: Sequence[Task], max_retries: int = 1) -> list[JudgementOutcome]:
    """Run every task's judgement; invalid ones are re-run (in one batch per round) up to ``max_retries`` times."""
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    outs = [JudgementOutcome(None, 0, []) for _ in tasks]
    pending = list(range(len(tasks)))
    for _ in range(1 + max_retries):
        if not pending:
            break
        verdicts = backend.run([tasks[k] for k in pending])
        if len(verdicts) != len(pending):
            raise ValueError(f"the judge backend returned {len(verdicts)} verdicts for {len(pending)} tasks")
        again = []
        for k, v in zip(pending, verdicts):
            outs[k].attempts += 1
            if v.components.get("valid") == 1.0:
                outs[k].verdict = v
            else:
                outs[k].invalid_reasons.append(judgement_reason(v))
                again.append(k)
        pending = again
    return outs
