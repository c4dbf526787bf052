"""The agent loop: multi-turn episodes on a steppable rollout engine, one resumable state
machine per trajectory (issue 6 part 2).

One turn of a trajectory:

    request  = token_ids[:segment_start]  (+ the turn's tokens sampled before a pause, as
               the engine's ``given`` continuation)
    engine   -> sampled ids, their log-probs and versions, ending in <|end_of_msg|>
    parse    the sampled ids with the streaming XTML parser -> assistant message
    env.step(message) -> StepResult(messages, done, truncated, info)
    done     -> env.verify() -> reward
    not done -> XTML.extend(token_ids, result.messages, add_generation_prompt=True): the tool
                results / user turns and the next generation prefix are appended as env
                tokens after the sampled ones, which are kept exactly as sampled (never
                re-rendered); the next turn is a new request whose prompt is the whole context.

Every context token records whether the model sampled it, its behaviour log-prob and the
policy version (`k3post.rollout.trajectory.Trajectory`).

Design decisions:

* **Tail-only prefill per turn.** With ``reuse_kv`` (default) and an engine that keeps the
  KV of finished requests (``take_kv``, e.g. `EmbeddedEngine`), every turn is requested
  with ``keep_kv=True``; when it stops, its KV (the context up to its last sampled token)
  is taken from the engine and handed to the next turn's ``add_request(..., kv=)``, so
  the engine prefills only the tail: the last sampled token, the env's tool results and
  the next generation prefix. The KV is reused only when it covers a prefix of the next
  context and was computed under the engine's current weight version (else the turn
  re-prefills: same tokens, counter-based sampling). Without it each new turn prefills the
  whole context. Within one turn, pause / resume keeps the KV (engine-resident or the CPU
  pool, see `k3post.rollout.scheduler`).
* **Seeds.** Turn t of a trajectory samples with ``request_seed(traj.seed, str(t))``; with
  counter-based sampling a trajectory's tokens depend only on its seed, its context and the
  weights, never on batching, scheduling, pausing or KV hit / miss.
* **Failures are outcomes, never crashes.** Whatever the policy samples, the episode ends
  with a verdict. A turn that stops at max_tokens without ``<|end_of_msg|>`` ends the
  episode with finish "length"; a context that reaches the engine's ``max_model_len`` ends
  it with "context"; anything else that stops the episode ends it with "malformed" and a
  reason (`MALFORMED_REASONS`): ids that are not a valid XTML assistant message, a message
  the env rejects, an env or verifier that raises on it, a reply that cannot be rendered.
  All get reward 0.0 and a verdict saying why (the env is not asked to verify an unfinished
  episode). Tool calls with bad names or arguments are the env's business: it answers with
  error observations and the episode goes on.
* **Infrastructure failures are not outcomes.** When the env's step or verifier raises a
  `k3post.errors.InfrastructureError` (in its cause chain): the environment worker lost for good
  (``env_lost``), the sandbox or the browser unavailable, the episode ends with finish "infra",
  ``Trajectory.infra`` = the kind and reward None: the group masks it out (`k3post.loop`), it is
  counted, and it never becomes a reward.
* **One parse per turn.** The sampled ids are parsed as a completion after the generation
  prefix (`XTML.stream`), i.e. exactly as they read inside the context; the env answers the
  calls of that message (ids ``call_<index>``), and `XTML.extend` binds the results to the
  calls it finds in the same tokens, so an env can never answer a call the renderer does not
  know.
* **Env state.** Environments live in this loop keyed by trajectory id; on pause the env's
  ``state_dict`` (which includes any sandbox snapshot) is stored in the trajectory, so a
  restored run rebuilds the env with ``env_factory(task)`` + ``load_state_dict``.
* Early abort on malformed XTML mid-turn is not possible: the engine reports requests only
  when they finish, so the streaming parser runs over the finished turn.

Shape legend: none (token lists only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from k3post.envs.env import Environment
from k3post.envs.task import Task, Verdict
from k3post.envs.tools import openai_tools
from k3post.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    KVState,
    SamplingParams,
    SteppableEngine,
    request_seed,
)
from k3post.errors import infra_kind
from k3post.rollout.trajectory import MALFORMED_REASONS, Trajectory
from k3post.xtml import XTML, XTMLParseError

log = logging.getLogger(__name__)

__all__ = ["AgentLoop", "EnvFactory", "SamplingFn", "trajectory_seed"]

EnvFactory = Callable[[Task], Environment]
"""Builds a fresh environment for one episode of a task (e.g. ``get_family(name).make_env``)."""

SamplingFn = Callable[[Trajectory, int], SamplingParams]
"""Per-trajectory, per-turn sampling parameters (the seed is overridden by the loop)."""

_T = TypeVar("_T")


def trajectory_seed(base_seed: int, group_id: int, sample_index: int) -> int:
    """The sampling seed of sample ``sample_index`` of group ``group_id`` in a run seeded
    ``base_seed``; independent of scheduling, so synchronous and partial rollout agree."""
    return request_seed(base_seed, f"{group_id}/{sample_index}")


class AgentLoop:
    """Runs multi-turn episodes for many trajectories over one shared steppable engine.

    Args:
        engine: a `SteppableEngine` (``add_request`` / ``step`` / ``pause`` ...).
        xtml: the `XTML` renderer / parser of the engine's tokenizer.
        env_factory: task -> fresh `Environment`.
        sampling: default sampling of every turn (its seed is replaced per turn).
        sampling_fn: optional per-(trajectory, turn) sampling, e.g. drawn lengths.
        effort: thinking effort rendered into the prompt (think mode), or None.
        effort_fn: optional per-task effort (e.g. MOPD samples an effort per prompt); when
            given it replaces ``effort``. It must be a pure function of the task (resume).
        mode: XTML mode, "think" or "instruct".
        reuse_kv: carry the KV cache of a finished turn into the next turn of the same
            trajectory (tail-only prefill) when the engine supports it (``take_kv``).
    """

    def __init__(
        self,
        engine: SteppableEngine,
        xtml: XTML,
        env_factory: EnvFactory,
        *,
        sampling: SamplingParams | None = None,
        sampling_fn: SamplingFn | None = None,
        effort: str | None = None,
        effort_fn: Callable[[Task], str | None] | None = None,
        mode: str = "think",
        reuse_kv: bool = True,
    ) -> None:
        if not isinstance(engine, SteppableEngine):
            raise ValueError(f"engine must implement SteppableEngine, got {type(engine).__name__}")
        if not isinstance(xtml, XTML):
            raise ValueError(f"xtml must be an XTML, got {type(xtml).__name__}")
        if not callable(env_factory):
            raise ValueError("env_factory must be callable: task -> Environment")
        if mode not in ("think", "instruct"):
            raise ValueError(f"mode must be 'think' or 'instruct', got {mode!r}")
        self.engine = engine
        self.xtml = xtml
        self.env_factory = env_factory
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.sampling_fn = sampling_fn
        self.effort = effort
        self.effort_fn = effort_fn
        self.mode = mode
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)
        self._envs: dict[str, Environment] = {}
        take = getattr(engine, "take_kv", None)
        self._take_kv: Callable[[str], KVState | None] | None = take if (reuse_kv and callable(take)) else None
        self._turn_kv: dict[str, KVState] = {}  # trajectory id -> KV of its last finished turn
        self._aio = asyncio.new_event_loop()

    # ------------------------------------------------------------------ helpers
    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return self._aio.run_until_complete(coro)

    def close(self) -> None:
        """Release every live environment and the event loop."""
        for tid in list(self._envs):
            self.release(tid)
        self._aio.close()

    @property
    def reuse_kv(self) -> bool:
        """True when finished turns hand their KV cache to the next turn (tail-only prefill)."""
        return self._take_kv is not None

    def turn_kv(self, traj: Trajectory, request: GenerationRequest) -> KVState | None:
        """Take the KV cache kept from ``traj``'s previous turn for ``request`` (its next
        turn): returned only when its ``context_ids`` are a proper prefix of the request's
        context and it was computed under the engine's current weight version (so the turn
        samples exactly what a full re-prefill would); otherwise it is dropped and None
        returned (the engine then prefills the whole context)."""
        kv = self._turn_kv.pop(traj.traj_id, None)
        if kv is None:
            return None
        context = request.prompt_ids + request.given_ids
        n = kv.num_tokens
        if n >= len(context) or kv.context_ids != context[:n] or kv.weight_version != self.engine.version:
            return None
        return kv

    def take_turn_kv(self, traj_id: str) -> KVState | None:
        """Remove and return the KV cache kept from a trajectory's previous turn (None when
        there is none), e.g. to move it into the CPU pool when the trajectory is paused before
        its next turn was submitted."""
        return self._turn_kv.pop(traj_id, None)

    def drop_turn_kv(self, traj_id: str) -> None:
        """Forget the KV cache kept from a trajectory's previous turn (e.g. when it is
        paused before its next turn was submitted)."""
        self._turn_kv.pop(traj_id, None)

    def release(self, traj_id: str) -> None:
        """Drop (and close, when it can) the live environment of a trajectory, and any KV
        cache kept from its previous turn."""
        self._turn_kv.pop(traj_id, None)
        env = self._envs.pop(traj_id, None)
        close = getattr(env, "close", None)
        if callable(close):
            close()

    def env(self, traj: Trajectory) -> Environment:
        """The live environment of ``traj``, rebuilt from its saved state when needed."""
        env = self._envs.get(traj.traj_id)
        if env is None:
            if traj.env_state is None:
                raise ValueError(f"trajectory {traj.traj_id!r} has no live environment and no saved env_state")
            env = self.env_factory(traj.task_obj)
            env.load_state_dict(traj.env_state)
            self._envs[traj.traj_id] = env
        return env

    @staticmethod
    def request_id(traj: Trajectory) -> str:
        """Engine request id of the trajectory's current turn."""
        return f"{traj.traj_id}#t{traj.turns}"

    # ------------------------------------------------------------------ the state machine
    def start(self, traj: Trajectory) -> None:
        """Reset a fresh environment for the trajectory's task and render the prompt."""
        if traj.token_ids:
            raise ValueError(f"trajectory {traj.traj_id!r} already started")
        task = traj.task_obj
        env = self.env_factory(task)
        messages = self._run(env.reset(task))
        tools = openai_tools(env.tool_specs())
        prompt = self.xtml.render(
            messages, tools=tools or None, effort=self.effort_fn(task) if self.effort_fn is not None else self.effort,
            mode=self.mode, add_generation_prompt=True
        ).ids
        self._envs[traj.traj_id] = env
        traj.tools = tools
        traj.domain = task.domain
        traj.append(prompt)
        traj.prompt_len = traj.segment_start = len(prompt)
        traj.status = "running"

    def turn_sampling(self, traj: Trajectory) -> SamplingParams | None:
        """The sampling of the current turn (seeded per turn, capped by the room left under
        max_model_len); None when no room is left."""
        base = self.sampling_fn(traj, traj.turns) if self.sampling_fn is not None else self.sampling
        max_tokens = base.max_tokens
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - traj.segment_start)
        if max_tokens < 1 or max_tokens <= len(traj.segment_ids):
            return None
        return dataclasses.replace(base, seed=request_seed(traj.seed, str(traj.turns)), max_tokens=max_tokens)

    def make_request(self, traj: Trajectory) -> GenerationRequest | None:
        """The engine request continuing the current turn (None when the context is full:
        the trajectory is then finished with "context")."""
        sp = self.turn_sampling(traj)
        if sp is None:
            self._end_unverified(traj, "context", f"no room for turn {traj.turns} under max_model_len={self.max_model_len}")
            return None
        k = traj.segment_start
        return GenerationRequest(
            self.request_id(traj), traj.token_ids[:k], sp,
            given_ids=traj.token_ids[k:], given_logprobs=traj.logprobs[k:], given_versions=traj.versions[k:],
            keep_kv=self.reuse_kv, given_kv_versions=traj.kv_versions[k:],
        )

    def absorb_partial(self, traj: Trajectory, partial: GenerationResult) -> None:
        """Record a paused turn: its tokens so far replace the segment; the env state is saved."""
        self._check_result(traj, partial)
        traj.truncate_segment()
        traj.append(partial.output_ids, logprobs=partial.output_logprobs, versions=partial.output_versions,
                    kv_versions=partial.output_kv_versions)
        traj.set_routes(partial.routes)
        self.save_env(traj)
        traj.status = "paused"
        traj.pauses += 1

    def save_env(self, traj: Trajectory) -> None:
        """Store the live env's ``state_dict`` (sandbox snapshot included) in the trajectory."""
        env = self._envs.get(traj.traj_id)
        if env is not None:
            traj.env_state = env.state_dict()

    def _check_result(self, traj: Trajectory, res: GenerationResult) -> None:
        if res.request_id != self.request_id(traj):
            raise ValueError(f"result {res.request_id!r} does not belong to the current turn of {traj.traj_id!r}")
        if res.prompt_ids != traj.token_ids[: traj.segment_start]:
            raise ValueError(f"result {res.request_id!r}: prompt differs from the trajectory's context")

    def _end(self, traj: Trajectory, finish: str, verdict: Verdict) -> None:
        traj.status = "done"
        traj.finish = finish
        traj.reward = verdict.reward
        traj.verdict = verdict.to_dict()
        traj.env_state = None
        self.release(traj.traj_id)

    def _end_unverified(self, traj: Trajectory, finish: str, detail: str, reason: str | None = None) -> None:
        """End an episode the env cannot verify: reward 0.0, a verdict that says why. ``reason``
        (one of `MALFORMED_REASONS`) marks a "malformed" end."""
        assert (finish == "malformed") == (reason in MALFORMED_REASONS), (finish, reason)
        traj.malformed = reason
        if reason is not None:
            traj.info.append({"turn": traj.turns, "error": f"{reason}: {detail}"})
        self._end(traj, finish, Verdict(0.0, {finish: 1.0}, f"{finish}: {f'{reason}: ' if reason else ''}{detail}"))

    def _env_defect(self, traj: Trajectory, reason: str, what: str, err: BaseException) -> None:
        """An env / verifier / renderer failure on this episode: logged with its traceback, the
        episode ends "malformed" with ``reason`` (the run goes on)."""
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        log.warning("%s: %s on task %r (%s), turn %d; the episode ends malformed (%s)\n%s",
                    traj.traj_id, what, traj.task.get("id"), traj.task.get("family"), traj.turns, reason, tb)
        self._end_unverified(traj, "malformed", f"{what}: {type(err).__name__}: {err}", reason)

    def _env_failure(self, traj: Trajectory, reason: str, what: str, err: BaseException) -> None:
        """The env's step / verifier raised ``err``: an infrastructure failure ends the episode "infra"
        (`end_infra`), anything else is an env defect (`_env_defect`, malformed ``reason``)."""
        kind = infra_kind(err)
        if kind is not None:
            self.end_infra(traj, kind, f"{what}: {type(err).__name__}: {err}", err)
        else:
            self._env_defect(traj, reason, what, err)

    def end_infra(self, traj: Trajectory, kind: str, detail: str, err: BaseException | None = None) -> None:
        """End an episode whose infrastructure failed (``kind``, `k3post.errors.INFRA_KINDS`): finish
        "infra", reward None (never a reward), a verdict that says so; logged with the traceback."""
        tb = "" if err is None else "".join(traceback.format_exception(type(err), err, err.__traceback__))
        log.warning("%s: infrastructure failure (%s) on task %r (%s), turn %d: %s; the episode is masked out of "
                    "its group\n%s", traj.traj_id, kind, traj.task.get("id"), traj.task.get("family"), traj.turns,
                    detail, tb)
        traj.info.append({"turn": traj.turns, "error": f"infra/{kind}: {detail}"})
        self._end(traj, "infra", Verdict(0.0, {"infra": 1.0}, f"infra ({kind}), not a reward: {detail}"))
        traj.infra, traj.reward = kind, None

    def finish_turn(self, traj: Trajectory, res: GenerationResult) -> bool:
        """Apply a finished engine result to ``traj``: record the sampled tokens, parse the
        message, step the env, append its reply. Returns True when the episode is over;
        otherwise the trajectory is ready for its next turn (`make_request`; its KV cache,
        when the engine kept it, waits in `turn_kv`)."""
        self._check_result(traj, res)
        if res.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_turn needs a finished result, got finish_reason {res.finish_reason!r}")
        kv = self._take_kv(res.request_id) if self._take_kv is not None else None  # always taken: no leak
        traj.truncate_segment()
        seg = list(res.output_ids)
        traj.append(seg, logprobs=res.output_logprobs, versions=res.output_versions, kv_versions=res.output_kv_versions)
        traj.set_routes(res.routes)
        traj.output_tokens += len(seg)
        if self.mode == "think":
            close = self.xtml.close_id
            traj.thinking_tokens += seg.index(close) if close in seg else len(seg)
        if res.finish_reason == "length":
            full = self.max_model_len is not None and len(traj.token_ids) >= self.max_model_len
            if full:
                self._end_unverified(traj, "context", f"the context reached max_model_len={self.max_model_len}")
            else:
                self._end_unverified(traj, "length", f"turn {traj.turns} reached max_tokens ({len(seg)} tokens) "
                                                     "without <|end_of_msg|>")
            return True
        parser = self.xtml.stream(self.mode)
        try:
            for t in seg:
                parser.feed(t)
            message = parser.finish()
        except XTMLParseError as e:
            self._end_unverified(traj, "malformed", f"turn {traj.turns}: {e}", "xtml")
            return True
        message["num_tokens"] = len(seg)
        env = self.env(traj)
        try:
            result = self._run(env.step(message))
        except ValueError as e:  # the env refused the message itself (not a tool error)
            self._end_unverified(traj, "malformed", f"turn {traj.turns}: the env rejected the message: {e}", "env_rejected")
            return True
        except Exception as e:  # noqa: BLE001 - an env defect must not end a training run
            self._env_failure(traj, "env_error", "env.step raised", e)  # infra (env_lost, sandbox ...) or a defect
            return True
        traj.turns += 1
        traj.info.append(dict(result.info))
        if result.done:
            try:
                verdict = env.verify()
            except Exception as e:  # noqa: BLE001 - as above
                self._env_failure(traj, "verifier_error", "env.verify raised", e)
                return True
            self._end(traj, "truncated" if result.truncated else str(result.info.get("end", "answer")), verdict)
            return True
        try:
            ext = self.xtml.extend(traj.token_ids, result.messages, add_generation_prompt=True, mode=self.mode)
        except ValueError as e:
            self._env_defect(traj, "unrenderable_reply", "XTML.extend refused the env's reply", e)
            return True
        traj.append(ext.ids[len(traj.token_ids) :])
        traj.segment_start = len(traj.token_ids)
        if self.max_model_len is not None and traj.segment_start >= self.max_model_len:
            self._end_unverified(traj, "context", f"the env's reply filled the context (max_model_len={self.max_model_len})")
            return True
        if kv is not None:
            self._turn_kv[traj.traj_id] = kv
        return False

    # ------------------------------------------------------------------ a synchronous driver
    def run(self, trajectories: Sequence[Trajectory], *,
            on_done: Callable[[Trajectory], Any] | None = None) -> list[Trajectory]:
        """Run every trajectory to the end (the synchronous rollout): start them, submit
        all turns, step the engine until all are done. The engine must be idle. ``on_done(traj)``
        is called as each one ends (a progress bar)."""
        if self.engine.has_unfinished():
            raise ValueError("AgentLoop.run needs an idle engine")
        live: dict[str, Trajectory] = {}
        for traj in trajectories:
            if not traj.token_ids:
                self.start(traj)
            self._submit(traj, live)
            if on_done is not None and traj.status == "done":  # no room for even one turn
                on_done(traj)
        while self.engine.has_unfinished():
            for res in self.engine.step():
                traj = live.pop(res.request_id)
                if not self.finish_turn(traj, res):
                    self._submit(traj, live)
                if on_done is not None and traj.status == "done":
                    on_done(traj)
        return list(trajectories)

    def _submit(self, traj: Trajectory, live: dict[str, Trajectory]) -> None:
        req = self.make_request(traj)
        if req is not None:
            traj.status = "running"
            self.engine.add_request(req, kv=self.turn_kv(traj, req))
            live[req.request_id] = traj
