"""The agentic generative reward model (GRM) for non-verifiable tasks (SPEC §3.4).

The judge is a model run as an agent in `GRMJudgeEnv`, a `ToolEnvironment` whose tools read the
candidates and record a judgement. The harness enforces the protocol:

    1. ``read_candidate(id)``                      every candidate's final response / artifacts;
    2. ``write_rubric(criteria=[{name, weight}])``  criteria with positive weights (once);
    3. ``score(candidate, scores={criterion: s})``  every candidate on every criterion, s in [0, 10];
    4. ``scorepad(scores={candidate: total})``      ends the episode; the ONLY thing rewards read.

A call out of order (a rubric before every candidate was read, a score before the rubric or for an
unread candidate, a repeated rubric or score) is refused with an error observation and not recorded,
so the recorded steps are always in protocol order. The scorepad call always ends the episode; the
registered verifier ``grm.judgement`` (`judgement_check`) then decides whether the judgement is
valid: every candidate read, a rubric, every (candidate, criterion) scored, the scorepad names
exactly the candidates, and each total equals Σ_c w_c · s_c within ``total_tol`` (default 0.01).
An episode that ends otherwise (plain-text answer, turn limit, malformed model output) is invalid.
An invalid judgement is retried (a fresh episode) up to ``max_retries`` times, then counted as a
tie. Text the judge writes (content, reasoning, tool arguments other than the scorepad) never
reaches a reward.

Tournament (``tournament_rewards``): pairs of the K-group's candidates are compared (all pairs, or
``rounds`` rounds of the circle-method round robin). For a pair (i, j) with lengths ℓ_i, ℓ_j and the
length limit L = σ·ℓ0 (SPEC §3.4; σ = 1.5 default, ours), the length guard decides first, before
any judge call:

    ℓ_i > L ≥ ℓ_j  ->  s_ij = 0        (i loses automatically)
    ℓ_i, ℓ_j > L   ->  s_ij = 1/2      (tie)
    otherwise      ->  the judge: s_ij = 1 if total_i - total_j > tol, 0 if < -tol, else 1/2

A candidate's reward is its win rate r_i = (1/|P_i|) Σ_{j∈P_i} s_ij over the comparisons P_i it
took part in (1/2 when it had none, e.g. a bye in a single round with odd K). r_i ∈ [0, 1].

Order bias: with ``both_orders=False`` (default) each pair is shown once, in an order drawn from
``random.Random(seed)``; with ``both_orders=True`` it is shown in both orders (two judgements,
each retried on its own) and s_ij is the mean of the two outcomes (so s_ij ∈ {0, ¼, ½, ¾, 1}).
A judge that always prefers whichever candidate is labelled A then gives every pair ½.

ℓ0 (`estimate_l0`) is the initial verbosity of the cold-start model: the median response length of
its samples of a family (ours: the median, robust to a few runaway generations), in the same unit
as `Candidate.length`: for rollouts, the response tokens that `trajectory_candidate` counts (use it
on the cold-start trajectories too); a candidate without a length is measured in
whitespace-separated words.

Backends (`JudgeBackend`): `PolicyJudge` runs the judge episodes with `run_episode` for any
episode policy (a scripted program, `OpenAIPolicy` for an OpenAI-compatible URL); `EngineJudge`
runs them as `AgentLoop` trajectories on a steppable engine (`EmbeddedEngine` over any local
checkpoint): the same XTML rendering, parsing and tool dispatch as RL rollouts, all judgements of a
batch decoded together. `GRMJudge` adapts a backend to the synth `Judge` protocol (one candidate,
score = total / (10 Σ_c w_c)); `GroupGRM` is the RL loop's group scorer (``k3post.rl.GroupScorer``):
a finished group's trajectories -> `trajectory_candidate` -> `tournament_rewards`.

Shape legend: K candidates in one group.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.episode import Policy, run_episode
from k3post.envs.task import DOMAINS, FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec
from k3post.errors import JudgeUnavailableError, infra_kind

if TYPE_CHECKING:
    from k3post.rollout.engine import SamplingParams, SteppableEngine
    from k3post.rollout.trajectory import Group, Trajectory
    from k3post.synth.verify import JudgeResult
    from k3post.xtml import XTML

__all__ = [
    "SCORE_MAX",
    "TOTAL_TOL",
    "JUDGE_VERIFIER",
    "Candidate",
    "Comparison",
    "EngineJudge",
    "GRMJudge",
    "GRMJudgeEnv",
    "GroupGRM",
    "JudgeBackend",
    "JudgementOutcome",
    "PolicyJudge",
    "TournamentResult",
    "TournamentStats",
    "estimate_l0",
    "judge_task",
    "judge_transport_failure",
    "judgement_check",
    "judgement_reason",
    "length_guard",
    "pairwise_preference",
    "round_robin_pairs",
    "run_judgements",
    "tournament_rewards",
    "trajectory_candidate",
    "verify_judgement",
    "win_rates",
]

SCORE_MAX = 10.0
"""Per-criterion scores lie in [0, SCORE_MAX] (ours)."""

TOTAL_TOL = 0.01
"""Default absolute tolerance of a scorepad total against Σ weight · score (ours)."""

JUDGE_VERIFIER = "grm.judgement"
"""Verifier name of judge tasks (`judgement_check` on the final judge-env state)."""

LABELS = "ABCDEFGH"

log = logging.getLogger(__name__)


# =========================================================================== pure math


def length_guard(len_i: float, len_j: float, limit: float | None) -> float | None:
    """The guard's outcome s_ij for candidate i against j, or None when the judge must decide.

    ``limit`` is L = σ·ℓ0 (None disables the guard). ℓ_i > L ≥ ℓ_j: 0.0; ℓ_j > L ≥ ℓ_i: 1.0;
    both over: 0.5; neither: None. A length equal to L is not over.
    """
    if limit is None:
        return None
    over_i, over_j = len_i > limit, len_j > limit
    if over_i and over_j:
        return 0.5
    if over_i:
        return 0.0
    if over_j:
        return 1.0
    return None


def pairwise_preference(total_a: float, total_b: float, tol: float = TOTAL_TOL) -> float:
    """Outcome for the candidate labelled A from scorepad totals: 1 if a - b > tol, 0 if b - a > tol, else 0.5.

    Totals within ``tol`` tie: the scorepad is only checked to that tolerance.
    """
    d = float(total_a) - float(total_b)
    return 1.0 if d > tol else 0.0 if d < -tol else 0.5


def win_rates(num_candidates: int, outcomes: Sequence[tuple[int, int, float]]) -> list[float]:
    """r_i = mean of s_ij over the comparisons i took part in (0.5 when none).

    ``outcomes`` holds ``(i, j, s_ij)`` with s_ij ∈ [0, 1] the outcome for i; j gets 1 - s_ij.
    Returns ``rewards_K``.
    """
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")
    got_K = [0.0] * num_candidates
    n_K = [0] * num_candidates
    for i, j, s in outcomes:
        if not (0 <= i < num_candidates and 0 <= j < num_candidates) or i == j:
            raise ValueError(f"comparison ({i}, {j}) is not a pair of distinct candidates 0..{num_candidates - 1}")
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"outcome of ({i}, {j}) must be in [0, 1], got {s!r}")
        got_K[i] += s
        got_K[j] += 1.0 - s
        n_K[i] += 1
        n_K[j] += 1
    return [g / n if n else 0.5 for g, n in zip(got_K, n_K)]


def round_robin_pairs(num_candidates: int, rounds: int | None = None, seed: int = 0) -> list[tuple[int, int]]:
    """Pairs of the circle-method round robin, ``i < j`` in each pair.

    K candidates (plus one bye when K is odd: K' = K + 1) sit in an order shuffled by
    ``random.Random(seed)``; round r pairs seat k with seat K'-1-k, then seats 1..K'-1 rotate by
    one. Every candidate plays at most once per round, and K'-1 rounds play every pair exactly
    once. ``rounds=None`` plays all K'-1 rounds (all K(K-1)/2 pairs).
    """
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")
    seats: list[int | None] = list(range(num_candidates))
    random.Random(seed).shuffle(seats)
    if len(seats) % 2:
        seats.append(None)
    n_rounds = len(seats) - 1
    if rounds is not None:
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= n_rounds:
            raise ValueError(f"rounds must be an int in 1..{n_rounds} for {num_candidates} candidates, got {rounds!r}")
        n_rounds = rounds
    pairs = []
    for _ in range(n_rounds):
        for k in range(len(seats) // 2):
            a, b = seats[k], seats[len(seats) - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        seats = seats[:1] + seats[-1:] + seats[1:-1]
    return pairs


def estimate_l0(lengths: Sequence[float]) -> float:
    """ℓ0: the median of the cold-start model's response lengths for one family (see the module doc)."""
    vals = [float(x) for x in lengths]
    if not vals:
        raise ValueError("estimate_l0 needs at least one length")
    if any(not v >= 0 for v in vals):
        raise ValueError(f"lengths must be >= 0, got {[v for v in vals if not v >= 0][:3]}")
    return float(statistics.median(vals))


# =========================================================================== the judge environment


@dataclass(frozen=True)
class Candidate:
    """One candidate of a K-group: its final response, optional artifacts, and its length.

    Attributes:
        text: the final response (what ``read_candidate`` shows first).
        artifacts: named artifacts (file name -> content) also shown by ``read_candidate``.
        length: size for the length guard, in ℓ0's unit (tokens from the rollout); None: the
            number of whitespace-separated words of ``text``.
    """

    text: str
    artifacts: Mapping[str, str] = field(default_factory=dict)
    length: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ValueError(f"Candidate.text must be a string, got {type(self.text).__name__}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(self.artifacts).items()):
            raise ValueError("Candidate.artifacts must map names to strings")
        object.__setattr__(self, "artifacts", dict(self.artifacts))
        if self.length is not None and (isinstance(self.length, bool) or not self.length >= 0):
            raise ValueError(f"Candidate.length must be a number >= 0 or None, got {self.length!r}")

    @property
    def size(self) -> float:
        """``length``, or the word count of ``text``."""
        return float(self.length) if self.length is not None else float(len(self.text.split()))


def _as_candidate(c: Candidate | str) -> Candidate:
    if isinstance(c, Candidate):
        return c
    if isinstance(c, str):
        return Candidate(c)
    raise ValueError(f"a candidate must be a Candidate or a string, got {type(c).__name__}")


_SYSTEM = (
    "You are a judge. Compare the candidate answers to the request below by following this protocol "
    "with your tools; a judgement that skips a step is discarded.\n"
    "1. read_candidate: read every candidate.\n"
    "2. write_rubric: the criteria that matter for this request, each with a positive weight.\n"
    f"3. score: score every candidate on every criterion, from 0 to {SCORE_MAX:g}.\n"
    "4. scorepad: record each candidate's total = sum over criteria of weight * score. "
    "Only the scorepad counts; anything else you write is ignored."
)


def judge_task(
    prompt: str,
    candidates: Sequence[Candidate | str],
    *,
    task_id: str = "grm",
    domain: str = "general",
    total_tol: float = TOTAL_TOL,
) -> Task:
    """The judge's task: the request the candidates answered, and the candidates (hidden).

    The candidates are labelled A, B, ... in the given order; their contents live in the task
    metadata and reach the judge only through ``read_candidate``.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("judge_task needs the request the candidates answered (a non-empty string)")
    cands = [_as_candidate(c) for c in candidates]
    if not 1 <= len(cands) <= len(LABELS):
        raise ValueError(f"a judgement compares 1..{len(LABELS)} candidates, got {len(cands)}")
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if not total_tol >= 0:
        raise ValueError(f"total_tol must be >= 0, got {total_tol!r}")
    labels = list(LABELS[: len(cands)])
    user = f"Request given to the candidates:\n{prompt}\n\nCandidates: {', '.join(labels)}."
    meta = {
        "labels": labels,
        "candidates": {lab: {"response": c.text, "artifacts": dict(c.artifacts)} for lab, c in zip(labels, cands)},
        "total_tol": float(total_tol),
    }
    return Task(task_id, domain, "grm", ({"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}),
                JUDGE_VERIFIER, metadata=meta)


def _labels(ctx: ToolContext) -> list[str]:
    assert ctx.task is not None
    return list(ctx.task.metadata["labels"])


def _log(ctx: ToolContext, *step: Any) -> None:
    ctx.state["log"].append(list(step))


def _read_candidate(ctx: ToolContext, id: str) -> dict[str, Any]:  # noqa: A002 - the tool's argument name
    labels = _labels(ctx)
    if id not in labels:
        raise ValueError(f"unknown candidate {id!r}; the candidates are {', '.join(labels)}")
    assert ctx.task is not None
    cand = ctx.task.metadata["candidates"][id]
    if id not in ctx.state["read"]:
        ctx.state["read"].append(id)
    _log(ctx, "read", id)
    return {"candidate": id, "response": cand["response"], "artifacts": cand["artifacts"]}


def _write_rubric(ctx: ToolContext, criteria: list[dict[str, Any]]) -> str:
    unread = [lab for lab in _labels(ctx) if lab not in ctx.state["read"]]
    if unread:
        raise ValueError(f"protocol step 1 first: read every candidate before the rubric (not read: {', '.join(unread)})")
    if ctx.state["rubric"] is not None:
        raise ValueError("the rubric is already written; score the candidates against it")
    names = [c["name"] for c in criteria]
    if len(set(names)) != len(names):
        raise ValueError(f"criterion names must be distinct, got {names}")
    rubric = [{"name": c["name"], "weight": float(c["weight"])} for c in criteria]
    ctx.state["rubric"] = rubric
    _log(ctx, "rubric", names)
    listed = ", ".join(f"{c['name']} (weight {c['weight']:g})" for c in rubric)
    return f"Rubric recorded: {listed}."


def _score(ctx: ToolContext, candidate: str, scores: dict[str, float]) -> str:
    labels = _labels(ctx)
    if candidate not in labels:
        raise ValueError(f"unknown candidate {candidate!r}; the candidates are {', '.join(labels)}")
    if candidate not in ctx.state["read"]:
        raise ValueError(f"read candidate {candidate} before scoring it")
    rubric = ctx.state["rubric"]
    if rubric is None:
        raise ValueError("protocol step 2 first: write the rubric before scoring")
    names = [c["name"] for c in rubric]
    unknown = [k for k in scores if k not in names]
    if unknown:
        raise ValueError(f"not rubric criteria: {unknown}; the rubric has {names}")
    have = ctx.state["scores"].setdefault(candidate, {})
    again = [k for k in scores if k in have]
    if again:
        raise ValueError(f"candidate {candidate} is already scored on {again}")
    have.update({k: float(v) for k, v in scores.items()})
    _log(ctx, "score", candidate, sorted(scores))
    left = [f"{lab}:{n}" for lab in labels for n in names if n not in ctx.state["scores"].get(lab, {})]
    return "Scores recorded." + (f" Still to score: {', '.join(left)}." if left else " Every candidate is scored; record the scorepad.")


def _scorepad(ctx: ToolContext, scores: dict[str, float]) -> str:
    _log(ctx, "scorepad", sorted(scores))
    return "Scorepad recorded."


_READ = ToolSpec(
    "read_candidate",
    "Read one candidate: its final response and any artifacts.",
    {"type": "object", "properties": {"id": {"type": "string", "description": "candidate label, e.g. A"}},
     "required": ["id"], "additionalProperties": False},
    read_only=True,
    handler=_read_candidate,
)
_RUBRIC = ToolSpec(
    "write_rubric",
    "Write the rubric once, after reading every candidate: criteria with positive weights.",
    {"type": "object", "properties": {"criteria": {
        "type": "array", "minItems": 1, "maxItems": 10,
        "items": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1},
                                                   "weight": {"type": "number", "exclusiveMinimum": 0}},
                  "required": ["name", "weight"]}}},
     "required": ["criteria"], "additionalProperties": False},
    handler=_write_rubric,
)
_SCORE = ToolSpec(
    "score",
    f"Score one candidate on one or more rubric criteria, each from 0 to {SCORE_MAX:g}.",
    {"type": "object", "properties": {
        "candidate": {"type": "string"},
        "scores": {"type": "object", "minProperties": 1,
                   "additionalProperties": {"type": "number", "minimum": 0, "maximum": SCORE_MAX}}},
     "required": ["candidate", "scores"], "additionalProperties": False},
    handler=_score,
)
_SCOREPAD = ToolSpec(
    "scorepad",
    "Record the final totals (sum over criteria of weight * score) of every candidate. Ends the judgement.",
    {"type": "object", "properties": {"scores": {"type": "object", "additionalProperties": {"type": "number"}}},
     "required": ["scores"], "additionalProperties": False},
    handler=_scorepad,
)


def _initial_state(task: Task) -> dict[str, Any]:
    return {"read": [], "rubric": None, "scores": {}, "log": []}


class GRMJudgeEnv(ToolEnvironment):
    """The judge's environment: tools ``read_candidate``, ``write_rubric``, ``score``, ``scorepad``.

    The state records what was read, the rubric, the per-criterion scores and the log of accepted
    steps in order; ``scorepad`` is the submit tool (its arguments are the submission). A plain-text
    answer ends the episode without a scorepad (an invalid judgement). Verified by `judgement_check`.
    """

    def __init__(self, limits: EpisodeLimits | None = None) -> None:
        """Args: limits: per-episode limits (default 12 turns: the protocol needs 1 to 4)."""
        super().__init__(
            [_READ, _RUBRIC, _SCORE, _SCOREPAD],
            initial_state=_initial_state,
            submit_tool="scorepad",
            end_on_text=True,
            limits=limits or EpisodeLimits(max_turns=12),
        )


def judgement_check(
    state: Mapping[str, Any], submission: Any, labels: Sequence[str], tol: float = TOTAL_TOL
) -> tuple[str, str] | None:
    """None when the judgement is valid, else ``(reason, detail)``; checks in protocol order.

    Reasons: ``no_scorepad`` (the episode ended without one), ``unread``, ``no_rubric``,
    ``unscored``, ``scorepad_candidates`` (the scorepad does not name exactly the candidates),
    ``inconsistent_total`` (|total - Σ_c w_c s_c| > tol).
    """
    if not isinstance(submission, Mapping) or not isinstance(submission.get("scores"), Mapping):
        return "no_scorepad", "the judgement ended without a scorepad call"
    unread = [lab for lab in labels if lab not in state["read"]]
    if unread:
        return "unread", f"candidates not read: {', '.join(unread)}"
    rubric = state["rubric"]
    if not rubric:
        return "no_rubric", "no rubric was written"
    missing = [f"{lab}:{c['name']}" for lab in labels for c in rubric if c["name"] not in state["scores"].get(lab, {})]
    if missing:
        return "unscored", f"not scored: {', '.join(missing)}"
    pad = submission["scores"]
    if sorted(pad) != sorted(labels):
        return "scorepad_candidates", f"scorepad names {sorted(pad)}, the candidates are {list(labels)}"
    for lab in labels:
        want = sum(c["weight"] * state["scores"][lab][c["name"]] for c in rubric)
        if not abs(float(pad[lab]) - want) <= tol:  # NaN / inf totals fail too
            return "inconsistent_total", f"scorepad total of {lab} is {pad[lab]:g}, the weighted scores sum to {want:g}"
    return None


@register_verifier(JUDGE_VERIFIER)
def verify_judgement(task: Task, final: FinalState) -> Verdict:
    """Reward 1 for a valid judgement, else 0. Components: ``valid``; when valid ``total.<label>``
    (the scorepad's totals) and ``max_total`` (SCORE_MAX · Σ weights). Diagnostics start with the
    reason (``valid`` or a `judgement_check` reason) and a colon."""
    labels = list(task.metadata["labels"])
    if final.truncated:
        return Verdict(0.0, {"valid": 0.0}, f"truncated: the judgement hit {final.truncation} without a scorepad")
    bad = judgement_check(final.state, final.submission, labels, float(task.metadata["total_tol"]))
    if bad is not None:
        return Verdict(0.0, {"valid": 0.0}, f"{bad[0]}: {bad[1]}")
    pad = final.submission["scores"]
    comps = {"valid": 1.0, **{f"total.{lab}": float(pad[lab]) for lab in labels}}
    comps["max_total"] = SCORE_MAX * sum(c["weight"] for c in final.state["rubric"])
    return Verdict(1.0, comps, "valid: " + ", ".join(f"{lab}={float(pad[lab]):g}" for lab in labels))


def judgement_reason(verdict: Verdict) -> str:
    """The reason category of a judge verdict (``valid`` or why it is invalid)."""
    return verdict.diagnostics.split(":", 1)[0]


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
    as `JudgeUnavailableError`: the RL loop then gives the group no reward (`k3post.rl.group_rewards`).
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


@dataclass
class Comparison:
    """One pair of the tournament.

    Attributes:
        i, j: candidate indices.
        score_i: s_ij, the outcome for i (j gets 1 - score_i).
        decided_by: ``judge``, ``guard`` (exactly one over σ·ℓ0) or ``guard_tie`` (both over).
        presentations: per judgement, ``[first, second]`` candidate indices as shown (labels A, B).
        outcomes: per presentation, the outcome for i (0.5 for a forfeit).
        verdicts: per presentation, the valid verdict (`Verdict.to_dict`) or None (forfeit).
    """

    i: int
    j: int
    score_i: float
    decided_by: str
    presentations: list[list[int]] = field(default_factory=list)
    outcomes: list[float] = field(default_factory=list)
    verdicts: list[dict[str, Any] | None] = field(default_factory=list)


@dataclass
class TournamentStats:
    """Counters of one tournament.

    Attributes:
        comparisons: pairs compared (guarded ones included).
        judgements: judge episodes run (retries included).
        invalid: judge episodes whose judgement was invalid.
        retried: re-runs after an invalid judgement.
        forfeits: presentations counted as a tie after 1 + max_retries invalid judgements.
        ties: comparisons with s_ij = 0.5 (a judged tie, forfeits, both over the guard).
        guard_losses: comparisons decided by the guard (exactly one candidate over σ·ℓ0).
        guard_ties: comparisons where both were over.
        invalid_reasons: reason -> count over invalid judgements.
    """

    comparisons: int = 0
    judgements: int = 0
    invalid: int = 0
    retried: int = 0
    forfeits: int = 0
    ties: int = 0
    guard_losses: int = 0
    guard_ties: int = 0
    invalid_reasons: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = asdict(self)
        d["invalid_reasons"] = dict(self.invalid_reasons)
        return d

    def add(self, other: "TournamentStats") -> "TournamentStats":
        """Add ``other``'s counters into these (returns self)."""
        for f in fields(self):
            if f.name != "invalid_reasons":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.invalid_reasons.update(other.invalid_reasons)
        return self


@dataclass
class TournamentResult:
    """``rewards_K`` (win rates in [0, 1]), the comparisons and the counters."""

    rewards_K: list[float]
    comparisons: list[Comparison]
    stats: TournamentStats


def tournament_rewards(
    candidates: Sequence[Candidate | str],
    judge: JudgeBackend,
    *,
    prompt: str,
    sigma: float = 1.5,
    l0: float | None = None,
    rounds: int | None = None,
    both_orders: bool = False,
    max_retries: int = 1,
    seed: int = 0,
    domain: str = "general",
    total_tol: float = TOTAL_TOL,
) -> TournamentResult:
    """Win-rate rewards of a K-group of candidates answering ``prompt`` (see the module doc).

    Args:
        candidates: the K candidates (strings or `Candidate`).
        judge: the judge backend.
        prompt: the request the candidates answered (shown to the judge).
        sigma / l0: the length guard limit σ·ℓ0; ``l0=None`` disables the guard.
        rounds: None: all pairs; else that many circle-method rounds (`round_robin_pairs`).
        both_orders: show each judged pair in both orders (else one order drawn with ``seed``).
        max_retries: re-runs of an invalid judgement before it counts as a tie.
        seed: seeds the seating of the round robin and the presentation order.
        domain / total_tol: of the judge tasks (`judge_task`).
    """
    cands = [_as_candidate(c) for c in candidates]
    if not cands:
        raise ValueError("tournament_rewards needs at least one candidate")
    if l0 is not None and (isinstance(l0, bool) or not l0 > 0):
        raise ValueError(f"l0 must be a positive number or None, got {l0!r}")
    if isinstance(sigma, bool) or not sigma > 0:
        raise ValueError(f"sigma must be a positive number, got {sigma!r}")
    if not isinstance(judge, JudgeBackend):
        raise ValueError(f"judge must be a JudgeBackend (with run(tasks)), got {type(judge).__name__}")
    limit = None if l0 is None else sigma * l0
    rng = random.Random(seed)
    stats = TournamentStats()
    comps: list[Comparison] = []
    tasks: list[Task] = []
    slots: list[tuple[Comparison, int]] = []  # (comparison, index of its first candidate in the task)
    for i, j in round_robin_pairs(len(cands), rounds, seed):
        stats.comparisons += 1
        guard = length_guard(cands[i].size, cands[j].size, limit)
        if guard is not None:
            comps.append(Comparison(i, j, guard, "guard_tie" if guard == 0.5 else "guard"))
            continue
        comp = Comparison(i, j, 0.5, "judge")
        comps.append(comp)
        orders = [[i, j], [j, i]] if both_orders else [[i, j] if rng.random() < 0.5 else [j, i]]
        for first, second in orders:
            comp.presentations.append([first, second])
            tasks.append(judge_task(prompt, [cands[first], cands[second]], task_id=f"grm-{i}-{j}-{first}",
                                    domain=domain, total_tol=total_tol))
            slots.append((comp, first))
    for (comp, first), res in zip(slots, run_judgements(judge, tasks, max_retries)):
        stats.judgements += res.attempts
        stats.invalid += len(res.invalid_reasons)
        stats.retried += res.attempts - 1
        stats.invalid_reasons.update(res.invalid_reasons)
        if res.verdict is None:
            stats.forfeits += 1
            s_first = 0.5
        else:
            c = res.verdict.components
            s_first = pairwise_preference(c["total.A"], c["total.B"], total_tol)
        comp.outcomes.append(s_first if first == comp.i else 1.0 - s_first)
        comp.verdicts.append(None if res.verdict is None else res.verdict.to_dict())
    for comp in comps:
        if comp.decided_by == "judge":
            comp.score_i = sum(comp.outcomes) / len(comp.outcomes)
        stats.ties += comp.score_i == 0.5
        stats.guard_losses += comp.decided_by == "guard"
        stats.guard_ties += comp.decided_by == "guard_tie"
    rewards_K = win_rates(len(cands), [(c.i, c.j, c.score_i) for c in comps])
    return TournamentResult(rewards_K, comps, stats)


# =========================================================================== synth Judge adapter


class GRMJudge:
    """The synth `Judge` protocol over a GRM backend: one candidate, scored against the rubric.

    The sample's final assistant response is the only candidate of a judge task whose request is
    the sample's system / user prompt; score = total / max_total = Σ_c w_c s_c / (SCORE_MAX Σ_c w_c)
    ∈ [0, 1]. A judgement still invalid after ``max_retries`` retries is ``uncertain`` (score 0):
    a human decides.
    """

    def __init__(self, backend: JudgeBackend, *, max_retries: int = 1, total_tol: float = TOTAL_TOL) -> None:
        if not isinstance(backend, JudgeBackend):
            raise ValueError(f"backend must be a JudgeBackend (with run(tasks)), got {type(backend).__name__}")
        self.backend = backend
        self.max_retries = max_retries
        self.total_tol = total_tol

    def judge(self, sample: Mapping[str, Any]) -> "JudgeResult":
        """Score ``sample`` (a synthesized record with ``task`` and ``messages``)."""
        from k3post.envs.families.common import prompt_text
        from k3post.synth.verify import JudgeResult, _final_response

        task = Task.from_dict(sample["task"])
        jt = judge_task(prompt_text(task), [_final_response(sample.get("messages") or [])], task_id=f"grm-{task.id}",
                        domain=task.domain, total_tol=self.total_tol)
        (res,) = run_judgements(self.backend, [jt], self.max_retries)
        if res.verdict is None:
            return JudgeResult(0.0, True, f"GRM judgement invalid in {res.attempts} attempts: {', '.join(res.invalid_reasons)}")
        c = res.verdict.components
        score = c["total.A"] / c["max_total"]
        return JudgeResult(min(1.0, max(0.0, score)), False, f"GRM total {c['total.A']:g} of {c['max_total']:g}")


# =========================================================================== RL group scorer


def trajectory_candidate(traj: "Trajectory", xtml: "XTML", mode: str = "think") -> Candidate:
    """The candidate of a finished trajectory: its last assistant turn's response, and its length.

    The last turn is the last run of sampled tokens; it is parsed with `XTML.parse` (a turn that does
    not parse gives an empty response). ``length`` is that turn's sampled tokens after its think
    channel (after the first ``<|close|>`` in think mode; the whole turn in instruct mode), i.e. the
    response's tokens as generated, ``<|end_of_msg|>`` included. Measure ℓ0 with this function on the
    cold-start model's trajectories so both are in the same unit.
    """
    from k3post.xtml import XTMLParseError

    end = len(traj.trainable)
    while end > 0 and not traj.trainable[end - 1]:
        end -= 1
    start = end
    while start > 0 and traj.trainable[start - 1]:
        start -= 1
    turn = traj.token_ids[start:end]
    try:
        text = xtml.parse(turn, mode=mode, partial=not turn or turn[-1] != xtml.eom_id, after_prefix=True)["content"]
    except XTMLParseError:
        text = ""
    response = turn[turn.index(xtml.close_id) + 1 :] if mode == "think" and xtml.close_id in turn else turn
    return Candidate(text, length=len(response))


class GroupGRM:
    """The RL loop's ``GroupScorer`` for non-verifiable families: a finished `Group` -> win rates.

    Each trajectory becomes a `trajectory_candidate`; the request shown to the judge is the task's
    system / user prompt; ℓ0 comes from ``l0[family]`` (no entry: no length guard). Every call's
    `TournamentResult` is kept in ``last`` and its counters are summed in ``stats``.
    """

    def __init__(
        self,
        judge: JudgeBackend,
        xtml: "XTML",
        *,
        l0: Mapping[str, float] | None = None,
        sigma: float = 1.5,
        mode: str = "think",
        rounds: int | None = None,
        both_orders: bool = False,
        max_retries: int = 1,
        seed: int = 0,
    ) -> None:
        if not isinstance(judge, JudgeBackend):
            raise ValueError(f"judge must be a JudgeBackend (with run(tasks)), got {type(judge).__name__}")
        self.judge = judge
        self.xtml = xtml
        self.l0 = dict(l0 or {})
        self.sigma = sigma
        self.mode = mode
        self.kw: dict[str, Any] = {"rounds": rounds, "both_orders": both_orders, "max_retries": max_retries}
        self.seed = seed
        self.last: TournamentResult | None = None
        self.stats = TournamentStats()

    def __call__(self, group: "Group") -> list[float]:
        """``rewards_K`` of the group's trajectories (seeded by ``seed`` and the group id)."""
        from k3post.envs.families.common import prompt_text

        task = Task.from_dict(group.task)
        cands = [trajectory_candidate(t, self.xtml, self.mode) for t in group.trajectories]
        res = tournament_rewards(cands, self.judge, prompt=prompt_text(task), sigma=self.sigma, l0=self.l0.get(task.family),
                                 seed=self.seed + group.group_id, domain=task.domain, **self.kw)
        self.last = res
        self.stats.add(res.stats)
        return res.rewards_K

    def close(self) -> None:
        """Release the judge backend (its engine or HTTP client), when it holds any."""
        close = getattr(self.judge, "close", None)
        if callable(close):
            close()
