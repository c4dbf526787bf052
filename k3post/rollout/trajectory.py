"""Data types of agentic rollouts: `Trajectory` (one sample of one prompt) and `Group` (the K
samples of one prompt, dispatched to training together).

A trajectory holds the whole token context of a multi-turn episode, token by token:

    token_ids[i]   the context token (prompt, sampled assistant tokens, tool results, ...)
    trainable[i]   True iff the model sampled it (env / template tokens are False)
    logprobs[i]    behaviour log-prob log pi_old of a sampled token (0.0 for env tokens)
    versions[i]    policy version that sampled it (-1 for env tokens)
    kv_versions[i] the oldest policy version among the KV entries a sampled token attended to (below
                   versions[i] when the engine kept KV computed before a weight update; -1 for env
                   tokens and where the engine does not say)

and, when the engine records them (routing replay), ``routes``: the experts each context position was routed
to in each MoE layer, [n <= T, M, K] as `k3post.routing_replay.encode_routes` text ("" when none), as the
engine last fed that position (a later turn's result covers every position before it);

so the trainer gets its loss mask, pi_old and staleness per token (STYLE.md point 5). The
current turn's request is ``token_ids[:segment_start]``; tokens after ``segment_start`` are
the part of the current turn sampled so far (non-empty only while paused mid-turn; they are
re-submitted as the engine's ``given`` continuation tokens).

Token accounting (SPEC §3.3): ``thinking_tokens`` counts sampled tokens inside the think
channel (from the start of a turn, which the generation prefix opens inside ``think``, up to
and excluding the first ``<|close|>``); ``output_tokens`` counts every sampled token across
turns (reasoning, response and tool-call arguments; tool results are env tokens and do not
count). `Trajectory.effort_tokens` picks the one SPEC §3.3 uses for a domain.

Everything here is JSON-serialisable (`to_dict` / `from_dict`), so paused and
finished-but-untrained trajectories are saved with the run.

Shape legend: T context tokens of one trajectory.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from k3post.envs.task import Task
from k3post.routing_replay import decode_routes, encode_routes

__all__ = ["TrajectoryStatus", "TRAJECTORY_STATUSES", "MALFORMED_REASONS", "Trajectory", "Group", "outcome_metrics",
           "infra_metrics", "counts_output_tokens"]

def counts_output_tokens(domain: str | None) -> bool:
    """Whether T(y) of SPEC §3.3 counts every output token in ``domain`` (the agentic domains "agents" and
    "coding": reasoning, responses and tool-call arguments) rather than the thinking tokens only."""
    return domain in ("agents", "coding")


TrajectoryStatus = Literal["running", "paused", "done"]
TRAJECTORY_STATUSES: tuple[str, ...] = ("running", "paused", "done")

MALFORMED_REASONS: tuple[str, ...] = ("xtml", "env_rejected", "env_error", "verifier_error", "unrenderable_reply")
"""Why an episode ended "malformed": ``xtml`` the sampled turn is not a valid XTML assistant message (a
dropped or cut-off call, duplicate or missing indices, a special token out of place, an empty turn);
``env_rejected`` the env refused the message with a ValueError; ``env_error`` / ``verifier_error`` the env's
step / verifier raised anything else on it; ``unrenderable_reply`` the env's reply could not be rendered
after the turn (`XTML.extend`). The last three are environment defects that the policy's output exposed:
the episode still ends with reward 0 (a long run goes on), and they are logged with their traceback.

An episode whose infrastructure failed (`k3post.errors.InfrastructureError`: the environment worker was
lost past ``distributed.env_retries``, the sandbox or the browser is unavailable) is not malformed: it
ends with finish "infra", ``infra`` set to the kind (`k3post.errors.INFRA_KINDS`) and reward None; it is
masked out of its group's advantages, counted, and never becomes a reward (`k3post.loop`)."""


@dataclass
class Trajectory:
    """One sample of one prompt: tokens, per-token provenance, env state, outcome.

    Attributes:
        traj_id: ``"g<group>/s<sample>"``, unique within a run.
        group_id: id of its group (one prompt).
        sample_index: 0..K-1 inside the group.
        seed: sampling seed; turn t samples with ``request_seed(seed, str(t))``.
        task: the task (`Task.to_dict`).
        tools: the OpenAI tool specs declared in the prompt.
        prompt_len: tokens of the initial rendered prompt.
        token_ids / trainable / logprobs / versions / kv_versions: per context token, see the module doc
            (``kv_versions`` left empty: -1 for every token, e.g. a trajectory saved before it existed).
        segment_start: where the current turn's sampled tokens start.
        turns: finished assistant turns.
        status: "running" (in the engine or about to be), "paused", "done".
        finish: why it ended: "answer" / "submit" (the env ended it), "truncated" (an env
            limit), "length" (a turn hit its max_tokens without ``<|end_of_msg|>``),
            "context" (the engine's max_model_len), "malformed" (see ``malformed``), "infra" (see
            ``infra``); None while running.
        malformed: why a "malformed" episode was ended, one of `MALFORMED_REASONS`; None otherwise.
        infra: the `k3post.errors.INFRA_KINDS` kind when the episode's infrastructure failed under it (finish
            "infra", set by the agent loop; "judge" set by the RL signal when the GRM could not score its
            group): not the policy's outcome, masked out of the group; None otherwise.
        reward: the verifier's reward when done (0.0 for length / context / malformed; None for infra).
        verdict: `Verdict.to_dict` of every finished episode: the verifier's, or reward 0.0 with
            the reason in ``diagnostics`` when the episode ended before the env could be verified
            (length / context / malformed; for infra a placeholder that says it is not a reward); None
            while running.
        env_state: `Environment.state_dict` captured at the last pause (sandbox snapshot
            included by the env), None otherwise.
        thinking_tokens / output_tokens: SPEC §3.3 accounting, see the module doc.
        domain: the task's domain (for `effort_tokens`).
        admitted_version: engine version when the trajectory was admitted.
        pauses: how many times it was paused.
        info: per-turn env step info (JSON-able).
    """

    traj_id: str
    group_id: int
    sample_index: int
    seed: int
    task: dict[str, Any]
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    routes: str = ""
    segment_start: int = 0
    turns: int = 0
    status: TrajectoryStatus = "running"
    finish: str | None = None
    malformed: str | None = None
    infra: str | None = None
    reward: float | None = None
    verdict: dict[str, Any] | None = None
    env_state: dict[str, Any] | None = None
    thinking_tokens: int = 0
    output_tokens: int = 0
    domain: str = ""
    admitted_version: int = 0
    pauses: int = 0
    info: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in TRAJECTORY_STATUSES:
            raise ValueError(f"trajectory {self.traj_id!r}: status must be one of {TRAJECTORY_STATUSES}, got {self.status!r}")
        n = len(self.token_ids)
        if not self.kv_versions:
            self.kv_versions = [-1] * n
        if not (len(self.trainable) == len(self.logprobs) == len(self.versions) == len(self.kv_versions) == n):
            raise ValueError(f"trajectory {self.traj_id!r}: token_ids, trainable, logprobs, versions and kv_versions "
                             "differ in length")

    # ------------------------------------------------------------------ views
    @property
    def task_obj(self) -> Task:
        """The task as a `Task`."""
        return Task.from_dict(self.task)

    @property
    def done(self) -> bool:
        """True once the episode ended."""
        return self.status == "done"

    @property
    def num_sampled(self) -> int:
        """Tokens the model sampled (trainable)."""
        return sum(self.trainable)

    @property
    def segment_ids(self) -> list[int]:
        """Sampled tokens of the unfinished current turn."""
        return self.token_ids[self.segment_start :]

    def oldest_version(self) -> int | None:
        """Smallest policy version among sampled tokens, None when nothing was sampled."""
        vs = [v for v, t in zip(self.versions, self.trainable) if t]
        return min(vs) if vs else None

    def effort_tokens(self) -> int:
        """T(y) of SPEC §3.3: all output tokens for agentic tasks (`counts_output_tokens`), thinking
        tokens otherwise."""
        return self.output_tokens if counts_output_tokens(self.domain) else self.thinking_tokens

    # ------------------------------------------------------------------ mutation
    def append(self, ids: list[int], *, logprobs: list[float] | None = None, versions: list[int] | None = None,
               kv_versions: list[int] | None = None) -> None:
        """Append context tokens: sampled ones when ``logprobs`` / ``versions`` are given
        (trainable; ``kv_versions`` when the engine gave them, else -1), else env tokens (log-prob 0,
        version -1)."""
        if (logprobs is None) != (versions is None):
            raise ValueError("give both logprobs and versions (sampled tokens) or neither (env tokens)")
        if logprobs is None or versions is None:
            if kv_versions is not None:
                raise ValueError("kv_versions belong to sampled tokens: give logprobs and versions too")
            self.token_ids.extend(int(t) for t in ids)
            self.trainable.extend([False] * len(ids))
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))
            self.kv_versions.extend([-1] * len(ids))
            return
        kv = [-1] * len(ids) if kv_versions is None else [int(v) for v in kv_versions]
        if not (len(logprobs) == len(versions) == len(kv) == len(ids)):
            raise ValueError("ids, logprobs, versions and kv_versions must have the same length")
        self.token_ids.extend(int(t) for t in ids)
        self.trainable.extend([True] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)
        self.kv_versions.extend(kv)

    def truncate_segment(self) -> None:
        """Drop the current turn's sampled tokens (they come back from the engine's result)."""
        k = self.segment_start
        del self.token_ids[k:], self.trainable[k:], self.logprobs[k:], self.versions[k:], self.kv_versions[k:]
        routes = self.routes_tensor()
        if routes is not None and routes.shape[0] > k:
            self.set_routes(routes[:k])

    def set_routes(self, routes_NMK: Any) -> None:
        """Record the engine's routes of context positions 0..n-1 ([n, M, K], `GenerationResult.routes`; they
        replace what was recorded before: the engine's latest forward of those positions). None: no change."""
        if routes_NMK is None:
            return
        if routes_NMK.shape[0] > len(self.token_ids):
            raise ValueError(f"trajectory {self.traj_id!r}: routes of {routes_NMK.shape[0]} positions for a context of "
                             f"{len(self.token_ids)} tokens")
        self.routes = encode_routes(routes_NMK)

    def routes_tensor(self) -> Any:
        """The recorded routes as a [n, M, K] int16 tensor, None when there are none."""
        if not self.routes:
            return None
        return decode_routes(self.routes, f"trajectory {self.traj_id!r} routes")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy."""
        return copy.deepcopy(asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Trajectory":
        """Inverse of `to_dict`."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a trajectory must be a mapping, got {type(data).__name__}")
        try:
            return cls(**copy.deepcopy(dict(data)))
        except TypeError as e:
            raise ValueError(f"not a trajectory dict: {e}") from e


@dataclass
class Group:
    """The K trajectories of one prompt, all finished: what training consumes.

    Attributes:
        group_id: the prompt's group id.
        task: the task (`Task.to_dict`).
        trajectories: the K samples, by sample index.
        dispatched_version: engine version when the group was dispatched.
    """

    group_id: int
    task: dict[str, Any]
    trajectories: list[Trajectory]
    dispatched_version: int = 0

    @property
    def rewards(self) -> list[float]:
        """Reward of each sample (None counts as 0.0; mask the infra ones out with `valid`)."""
        return [float(t.reward or 0.0) for t in self.trajectories]

    @property
    def valid(self) -> list[bool]:
        """Per sample: False when its infrastructure failed (``infra`` set): not the policy's outcome."""
        return [t.infra is None for t in self.trajectories]

    def staleness(self) -> list[int]:
        """Per sampled token of every trajectory: dispatched_version - token version."""
        return [self.dispatched_version - v for t in self.trajectories for v, m in zip(t.versions, t.trainable) if m]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy."""
        return {
            "group_id": self.group_id,
            "task": copy.deepcopy(self.task),
            "trajectories": [t.to_dict() for t in self.trajectories],
            "dispatched_version": self.dispatched_version,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Group":
        """Inverse of `to_dict`."""
        return cls(
            group_id=int(data["group_id"]),
            task=copy.deepcopy(dict(data["task"])),
            trajectories=[Trajectory.from_dict(t) for t in data["trajectories"]],
            dispatched_version=int(data.get("dispatched_version", 0)),
        )


def outcome_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """How finished episodes ended, as step metrics: ``malformed_episodes`` and ``malformed/<reason>``
    for each reason seen, ``length_episodes`` (a turn hit max_tokens), ``context_episodes``
    (max_model_len), and `infra_metrics`."""
    done = [t for t in trajs if t.done]
    reasons = Counter(t.malformed or "unknown" for t in done if t.finish == "malformed")
    out = {"malformed_episodes": float(sum(reasons.values())),
           "length_episodes": float(sum(t.finish == "length" for t in done)),
           "context_episodes": float(sum(t.finish == "context" for t in done))}
    out.update({f"malformed/{r}": float(n) for r, n in sorted(reasons.items())})
    out.update(infra_metrics(done))
    return out


def infra_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``infra_episodes`` (episodes whose infrastructure failed, `Trajectory.infra`), ``infra/<kind>`` for
    each kind seen, and ``infra_rate`` (their share of ``trajs``; 0.0 for none)."""
    kinds = Counter(t.infra for t in trajs if t.infra is not None)
    n = sum(kinds.values())
    out = {"infra_episodes": float(n), "infra_rate": n / len(trajs) if trajs else 0.0}
    out.update({f"infra/{k}": float(c) for k, c in sorted(kinds.items())})
    return out
